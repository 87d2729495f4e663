"""Context parallelism, piece by piece: the CP view of a batch and the CP attention.

The end-to-end guarantee (CP2 trains exactly as CP1, also with TP2 and PP2, and resumes
exactly) is in ``tests/test_context_parallel_training.py``.
"""
import pytest
import torch

from mindspeed_pack.packing.context_parallel import (
    attention_pairs,
    context_parallel_view,
    pad_segments,
    padding_multiple,
    split_for_rank,
    zigzag_index,
)
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from tests.dist_harness import run_distributed
from tests.test_packed_attention import dense_reference

N = IGNORE_INDEX


def _pack():
    """Samples of 5 and 1 tokens and 2 tokens, then 5 pads (longer than a CP2 chunk)."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 20, 30, 31, 0, 0, 0, 0, 0]])
    labels = torch.tensor([[N, 11, 12, 13, 14, N, N, 31, N, N, N, N, N]])
    seg = torch.tensor([[1, 1, 1, 1, 1, 2, 3, 3, 0, 0, 0, 0, 0]])
    return build_packed_batch(ids, labels, seg)


def test_padding_multiple_is_two_cp_times_tp_under_sequence_parallel():
    assert padding_multiple(2) == 4
    assert padding_multiple(4, tp_size=2) == 8
    assert padding_multiple(2, tp_size=2, sequence_parallel=True) == 8


def test_pad_segments_keeps_real_lengths_and_pads_each_segment():
    p = pad_segments(_pack(), 4)
    assert p.cu_seqlens.tolist() == [0, 5, 6, 8, 13]  # real lengths 5, 1, 2, 5
    assert p.cu_seqlens_padded.tolist() == [0, 8, 12, 16, 24]
    assert p.tokens[0, :12].tolist() == [10, 11, 12, 13, 14, 0, 0, 0, 20, 0, 0, 0]
    # labels were shifted before padding: nothing trained on a pad, and no target crosses a sample
    assert p.loss_mask[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 12]
    assert p.target[0, [0, 1, 2, 3, 12]].tolist() == [11, 12, 13, 14, 31]
    assert p.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert p.max_seqlen == 8 and p.num_pad_tokens == 5 + 11
    fixed = pad_segments(_pack(), 4, total=32)
    assert fixed.cu_seqlens_padded.tolist() == [0, 8, 12, 16, 24, 32] and fixed.tokens.shape == (1, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        pad_segments(_pack(), 4, total=30)


def test_zigzag_gives_rank_r_chunks_r_and_mirror():
    cu = torch.tensor([0, 8, 12])
    assert zigzag_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    every = torch.cat([zigzag_index(cu, 2, r) for r in range(2)]).sort().values
    assert every.tolist() == list(range(12))
    with pytest.raises(ValueError, match="multiples of 2 x CP"):
        zigzag_index(torch.tensor([0, 6]), 2, 0)


class _CpGroup:
    """What megatron-core asks of a context-parallel group: its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_is_megatron_cores_own_split(cp):
    """Every rank holds the rows, and the positions, that megatron-core's own context-parallel code assigns it: its
    THD RoPE's split of a packed batch (``_get_thd_freqs_on_this_cp_rank``, which Transformer Engine's layout
    matches) and its split of one sequence (``get_batch_on_this_cp_rank``) applied to each segment. A rank holding
    its two chunks in the other order is consistent with itself on CPU but rotated wrongly by megatron-core's RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.utils import get_batch_on_this_cp_rank

    from mindspeed_pack.packing.context_parallel import segment_positions
    from tests.model_utils import init_single_process

    init_single_process()  # megatron-core reads a group's size only once torch.distributed is initialised
    lengths = [2 * cp * n for n in (1, 3, 7, 2, 5)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    rows = torch.arange(int(cu[-1]))
    for rank in range(cp):
        local = [torch.empty(n // cp) for n in lengths]  # this rank's share of each segment
        by_rope = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp, x, rows, int(cu[i])) for i, x in enumerate(local)])
        positions = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp, x, torch.arange(max(lengths))) for x in local])
        by_sequence = torch.cat([get_batch_on_this_cp_rank({"tokens": rows[None, int(cu[i]):int(cu[i + 1])].clone()},
                                                           _CpGroup(cp, rank))["tokens"][0] for i in range(len(lengths))])
        assert zigzag_index(cu, cp, rank).tolist() == by_rope.tolist() == by_sequence.tolist(), rank
        assert segment_positions(cu.numpy(), cp, rank).tolist() == positions.tolist(), rank


def test_split_covers_every_token_once_and_counts_samples_once():
    p = pad_segments(_pack(), 4)
    parts = [split_for_rank(p, 2, r) for r in range(2)]
    assert sum(int(x.loss_mask.sum()) for x in parts) == int(p.loss_mask.sum())
    assert [x.num_samples for x in parts] == [3, 0]
    assert parts[0].tokens.shape == (1, 12) and parts[0].cu_seqlens_padded.tolist() == p.cu_seqlens_padded.tolist()
    local = context_parallel_view(_pack(), 2, 1, 4)
    assert local.tokens[0].tolist() == parts[1].tokens[0].tolist()


def test_zigzag_balances_causal_work_per_sample():
    cu = torch.tensor([0, 64, 64 + 256])
    pairs = attention_pairs(cu, 4)
    assert int(pairs.max()) == int(pairs.min())  # exactly balanced for every sample
    assert int(pairs.sum()) == 64 * 65 // 2 + 256 * 257 // 2


# ---------------------------------------------------------------------------- attention
def _cp_attention_rank(lengths, heads, groups, cp):
    import torch.distributed as dist

    from mindspeed_pack.model.context_parallel_attention import context_parallel_attention
    from mindspeed_pack.runtime import platform

    platform.enable()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    mult = 2 * cp
    padded = [-(-n // mult) * mult for n in lengths]
    cu = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, n, 8, dtype=torch.float64) for n in (heads, groups, groups))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = dense_reference(*ref_in, cu)
    weight = torch.randn_like(ref)  # a loss that weighs every output differently
    ref_grads = torch.autograd.grad((ref * weight).sum(), ref_in)
    index = zigzag_index(cu, cp, rank)
    local = [x[index].clone().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*local, cu, dist.group.WORLD)
    grads = torch.autograd.grad((out * weight[index]).sum(), local)
    dist.destroy_process_group()
    return {"out": (out - ref[index]).abs().max().item(),
            "grads": [(g - rg[index]).abs().max().item() for g, rg in zip(grads, ref_grads)]}


@pytest.mark.parametrize("lengths,heads,groups", [([5, 1, 2, 13], 4, 2), ([1], 2, 2), ([40, 3, 17, 4], 6, 1)],
                         ids=["mixed-gqa", "one-token", "mqa"])
def test_cp2_attention_equals_dense_segment_causal(lengths, heads, groups):
    for res in run_distributed(_cp_attention_rank, 2, lengths, heads, groups, 2):
        assert res["out"] < 1e-12
        assert max(res["grads"]) < 1e-12  # q, and k/v after the reduce-scatter back to their owners


def test_step_views_pad_every_micro_batch_to_one_length_for_pipelines():
    from mindspeed_pack.packing.context_parallel import step_views

    short = build_packed_batch(torch.tensor([[1, 2, 3, 0]]), torch.tensor([[N, 2, 3, N]]),
                               torch.tensor([[1, 1, 1, 0]]))
    views, longest = step_views([_pack(), short], 2, 0, 4, same_length=True)
    assert longest == 24 and [v.tokens.shape[1] for v in views] == [12, 12]
    views, longest = step_views([_pack(), short], 2, 0, 4, same_length=False)
    assert longest == 24 and [v.tokens.shape[1] for v in views] == [12, 4]


def _parse_cp(*extra, capsys):
    """posttrain's arguments at CP 2 on 2 ranks; (args, None) or (None, the parser's error)."""
    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    try:
        return parse_args([*TINY_FLAGS, "--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2",
                           "--data-path", "x", "--context-parallel-size", "2", *extra], world_size=2), None
    except SystemExit:
        return None, capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    # megatron-core hands Transformer Engine the hierarchical CP groups for a2a+p2p, which are made only from
    # Megatron-LM's --hierarchical-context-parallel-sizes: without them TE got no CP group (None) and ran its
    # attention as if unsplit, each rank on its own share. It was accepted.
    (["--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p: Transformer Engine's hierarchical CP (all-to-all "
     "inside, ring across) needs megatron-core's hierarchical CP groups"),
    # MindSpeed-LLM's other --context-parallel-algo values: named, with what runs here (it was argparse's
    # 'invalid choice'); --ulysses-degree-in-cp (hybrid_cp_algo's) was an unknown argument
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"],
     "--context-parallel-algo hybrid_cp_algo: MindSpeed's Ulysses-inside-ring CP is not built here"),
    (["--context-parallel-algo", "adaptive_cp_algo"],
     "--context-parallel-algo adaptive_cp_algo: MindSpeed's adaptive CP"),
    (["--context-parallel-algo", "hybrid_adaptive_cp_algo"],
     "--context-parallel-algo hybrid_adaptive_cp_algo: MindSpeed's adaptive CP"),
    (["--ulysses-degree-in-cp", "2"], "--ulysses-degree-in-cp 2 goes with MindSpeed's --context-parallel-algo "
     "hybrid_cp_algo"),
])
def test_cp_algorithms_not_built_here_are_refused_by_name(extra, message, capsys):
    args, error = _parse_cp(*extra, capsys=capsys)
    assert args is None and message in error, error


@pytest.mark.parametrize("extra, comm", [([], "p2p"), (["--context-parallel-algo", "megatron_cp_algo"], "p2p"),
                                         (["--context-parallel-algo", "ulysses_cp_algo"], "a2a"),
                                         (["--cp-comm-type", "all_gather"], "all_gather")])
def test_cp_algorithms_built_here_set_transformer_engines_comm_type(extra, comm, capsys):
    args, error = _parse_cp(*extra, capsys=capsys)
    assert error is None and args.cp_comm_type == comm
