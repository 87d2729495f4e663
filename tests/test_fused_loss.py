"""The fused output-layer loss equals megatron-core's unfused loss, and padded vocabulary rows take no probability.

* The chunked loss (:mod:`mindspeed_pack.model.vocab_cross_entropy`) gives megatron-core's per-token
  losses and every gradient (fp32, rel <= 1e-6) at any chunk size, without full logits, at TP1 and TP2.
* In bf16 its gradients are as close to fp64 as the unfused bf16 path's at 32 or 1024 chunks, at TP1
  and TP2: the output layer's weight gradient is summed over the chunks in fp32, rounded once (issue 40).
* SFT's weighted sum with its gradients formed in the forward (no recomputed logits) gives the per-token
  chunked path's loss and gradients bit for bit in fp32 and bf16 (an incoming gradient of 1), and
  megatron-core's unfused ones within the tolerances above, at TP1 and TP2, with untrained tokens and
  per-sample weights; an end-to-end SFT step gives the same loss and gradient norm either way.
* A Hugging Face model whose vocabulary (250) is padded to 256 rows gives transformers' per-token
  losses and log-probs: the 6 padded rows are out of the softmax (issue 32, items 3 and 9), at TP1 and
  in the vocab-parallel loss at TP2; without the mask the loss is off by about log(256/250) per token.
"""

import pytest
import torch
import transformers

from mindspeed_pack.convert import hf_to_megatron
from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from tests.dist_harness import run_distributed
from tests.model_utils import init_single_process, load_release_checkpoint, spread_weights, tiny_args

S = 96
LENGTHS = (23, 9, 31, 17)  # + 16 pads, a fifth segment
HF_VOCAB, PADDED = 250, 256


def _pack(vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(S, dtype=torch.long)
    labels = torch.full((S,), IGNORE_INDEX)
    seg = torch.zeros(S, dtype=torch.long)
    pos, samples = 0, []
    for k, n in enumerate(LENGTHS, start=1):
        x = torch.randint(3, vocab, (n,), generator=g)
        ids[pos:pos + n], labels[pos + 1:pos + n], seg[pos:pos + n] = x, x[1:], k
        samples.append(x)
        pos += n
    return build_packed_batch(ids[None], labels[None], seg[None]), samples


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _err(a, ref):
    """Relative error in norm, in fp64."""
    return float((a.double() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def model():
    init_single_process()
    torch.manual_seed(0)
    return build_gpt_model(tiny_args(seq_length=S))


def _losses_and_grads(model, batch, chunk, summed=False):
    """(per-token losses, or with ``summed`` the model's masked sum (SFT's path), and the mean loss's gradients)."""
    model.loss_chunk = chunk
    model.zero_grad()
    extra = {"loss_weights": batch.loss_mask} if summed else {}
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch),
                **extra)
    (((out if summed else (out * batch.loss_mask).sum())) / batch.loss_mask.sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 7, S])
def test_chunked_loss_and_gradients_equal_megatron_unfused(model, chunk):
    batch, _ = _pack()
    ref_loss, ref_grads = _losses_and_grads(model, batch, 0)  # megatron-core's output layer + cross-entropy
    loss, grads = _losses_and_grads(model, batch, chunk)
    assert loss.shape == ref_loss.shape == (1, S)
    assert _rel(loss, ref_loss) <= 1e-6
    assert grads.keys() == ref_grads.keys()
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert worst <= 1e-6, worst


def _problem(dtype, tokens=40, hidden=16, vocab=96, seed=2):
    """(hidden, weight, target, token weights): SFT's per-sample weights, a third of the tokens untrained."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=g) * 2 / hidden ** 0.5).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    w = torch.rand(tokens, generator=g) + 0.5
    w[torch.arange(tokens) % 3 == 0] = 0.0
    return x, weight, target, w


def _summed_grads(dtype, chunk, path="summed", scale=1.0, frozen=False):
    """(weighted sum, d/dx, d/dweight) of ``scale`` x the weighted loss sum: ``path`` "per_token" = the chunked
    per-token losses summed by the caller, "unfused" = megatron-core's, "summed" = the sum formed in the forward."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mindspeed_pack.model.vocab_cross_entropy import linear_cross_entropy, linear_cross_entropy_sum

    x, weight, target, w = _problem(dtype)
    x, weight = x.requires_grad_(), weight.requires_grad_(not frozen)
    if path == "per_token":
        total = (linear_cross_entropy(x, weight, target, chunk=chunk) * w).sum()
    elif path == "unfused":
        total = (vocab_parallel_cross_entropy(torch.matmul(x, weight.t())[:, None], target[:, None])[:, 0] * w).sum()
    else:
        total, losses = linear_cross_entropy_sum(x, weight, target, w, chunk=chunk)
        assert not losses.requires_grad and losses.shape == target.shape
    (total * scale).backward()
    return total.detach(), x.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_gradients_formed_in_the_forward_equal_the_per_token_path(dtype, chunk):
    """The forward applies each token's weight where the backward applies its incoming gradient: the same
    numbers, bit for bit, with an incoming gradient of 1; megatron-core's unfused loss within the tolerances."""
    init_single_process()
    per_token, unfused = _summed_grads(dtype, chunk, "per_token"), _summed_grads(dtype, chunk, "unfused")
    summed = _summed_grads(dtype, chunk)
    for a, b in zip(summed, per_token):
        assert torch.equal(a, b), _rel(a.float(), b.float())
    if dtype == torch.float32:
        assert max(_rel(a, b) for a, b in zip(summed, unfused)) <= 1e-6
    # an incoming gradient other than 1 (a loss scale) scales both gradients
    scaled = _summed_grads(dtype, chunk, scale=4.0)
    assert all(torch.equal(a, b * 4.0) for a, b in zip(scaled[1:], summed[1:]))
    # a frozen output layer (LoRA): no weight gradient, the same input gradient
    frozen = _summed_grads(dtype, chunk, frozen=True)
    assert frozen[2] is None and torch.equal(frozen[1], summed[1])


def test_the_sum_takes_the_per_token_path_without_a_gradient():
    """Evaluation (no grad) and an fp16 weight (the loss scale must reach the gradients before they are rounded
    to fp16) sum the per-token path: the same values."""
    from mindspeed_pack.model import vocab_cross_entropy as vce

    init_single_process()
    x, weight, target, w = _problem(torch.float32)
    with torch.no_grad():
        total, losses = vce.linear_cross_entropy_sum(x, weight, target, w, chunk=7)
    assert torch.equal(losses, vce.linear_cross_entropy(x, weight, target, chunk=7))
    assert torch.equal(total, (losses * w).sum())
    assert vce.forms_gradients_in_forward(x.requires_grad_(), weight)
    assert not vce.forms_gradients_in_forward(x, weight.half())


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_models_masked_sum_equals_the_per_token_losses_summed(model, chunk):
    """``loss_weights`` (SFT's path): the model returns the masked sum, on the unfused and the fused path, with the
    per-token path's gradients."""
    batch, _ = _pack()
    ref_loss, ref_grads = _losses_and_grads(model, batch, chunk)
    total, grads = _losses_and_grads(model, batch, chunk, summed=True)
    assert total.dim() == 0 and _rel(total, (ref_loss * batch.loss_mask).sum()) <= 1e-6
    assert max(_rel(grads[n], ref_grads[n]) for n in grads) <= 1e-6
    _, unfused = _losses_and_grads(model, batch, 0)
    assert max(_rel(grads[n], unfused[n]) for n in grads) <= 1e-6


@pytest.mark.parametrize("per_sample", [False, True])
def test_an_sft_step_is_the_same_with_the_gradients_formed_in_the_forward(tmp_path, monkeypatch, per_sample):
    """One SFT step with the fused loss forced (--cross-entropy-chunk-size 16): the same loss and gradient norm
    (rel 1e-6) whether the model forms the gradients in the forward or the stage sums per-token losses; also
    with --per-sample-loss (each sample's tokens weighted 1 / its trained tokens)."""
    import json

    import posttrain
    from mindspeed_pack.training.stages.sft import SFTStage
    from tests.train_utils import tiny_argv, write_copy_task

    data = write_copy_task(str(tmp_path / "copy"), num_packs=8)
    argv = tiny_argv(data, "--cross-entropy-chunk-size", "16", "--lr", "1e-3", "--log-interval", "1",
                     "--attention-dropout", "0.0", "--hidden-dropout", "0.0", *(["--per-sample-loss"] * per_sample))

    def step(name):
        posttrain.main([*argv, "--metrics-file", str(tmp_path / name)])
        with open(tmp_path / name) as f:
            record = [r for r in map(json.loads, f) if r.get("split") == "train"][0]
        return record["lm loss"], record["grad norm"]

    calls = []
    from mindspeed_pack.model import packed_gpt

    summed = packed_gpt.linear_cross_entropy_sum
    monkeypatch.setattr(packed_gpt, "linear_cross_entropy_sum", lambda *a, **k: calls.append(1) or summed(*a, **k))
    in_forward = step("summed.jsonl")
    assert calls, "the SFT step did not take the summed path"
    monkeypatch.delattr(SFTStage, "loss_weights")  # the stage sums the per-token losses itself
    calls.clear()
    per_token = step("per_token.jsonl")
    assert not calls
    assert abs(in_forward[0] - per_token[0]) <= 1e-6 * abs(per_token[0])
    assert abs(in_forward[1] - per_token[1]) <= 1e-6 * abs(per_token[1]), (in_forward, per_token)


def test_only_sft_takes_the_summed_loss():
    """The trainer hands a stage the model's weighted sum only where the stage gives fixed token weights: SFT.
    The stages whose token gradients depend on the forward's values keep the per-token losses."""
    from mindspeed_pack.training.stages import dpo, grpo, kto, orpo, reference, reward_models, score, sft, simpo

    per_token = (dpo.DPOStage, simpo.SimPOStage, orpo.ORPOStage, kto.KTOStage, grpo.GRPOStage,
                 reference.ReferenceScoringStage, score.ScoreStage, reward_models.OutcomeRewardStage,
                 reward_models.ProcessRewardStage)
    assert [c.__name__ for c in per_token if hasattr(c, "loss_weights")] == []
    assert callable(sft.SFTStage.loss_weights)


def test_the_loss_path_is_chosen_by_the_size_of_the_logits():
    """The unfused loss while a micro-batch's fp32 logits fit the 4 GiB budget (measured on an H200: 19% faster at
    Qwen2.5-0.5B with 4096-token packs, 2.3 GiB of logits, at the same peak memory), chunks of 512 MiB beyond it; a
    chunk size given with --cross-entropy-chunk-size (0 included) is kept."""
    from mindspeed_pack.model.vocab_cross_entropy import loss_chunk

    assert loss_chunk(2048, 30522) == 0  # 0.23 GiB
    assert loss_chunk(4096, 151936) == 0  # Qwen2.5 at 4096 tokens: 2.3 GiB
    assert loss_chunk(2 * 4096, 151936) == 883  # two packs per forward: 4.6 GiB, chunks of 0.5 GiB
    assert loss_chunk(32768, 151936 // 8) == 0  # 8 packs' TP8 shard: 2.3 GiB per rank
    assert loss_chunk(2048, 30522, 0) == 0 and loss_chunk(2048, 30522, 64) == 64 and loss_chunk(8192, 151936, 0) == 0


def test_the_model_takes_the_unfused_loss_when_the_logits_fit(model, monkeypatch):
    from mindspeed_pack.model import packed_gpt, vocab_cross_entropy

    calls = []
    fused = packed_gpt.linear_cross_entropy
    monkeypatch.setattr(packed_gpt, "linear_cross_entropy", lambda *a, **k: calls.append(k["chunk"]) or fused(*a, **k))
    batch, _ = _pack()
    unfused, _ = _losses_and_grads(model, batch, 0)
    auto, _ = _losses_and_grads(model, batch, None)  # 96 tokens x 256 rows: within the budget
    assert calls == [] and torch.equal(auto, unfused)
    monkeypatch.setattr(vocab_cross_entropy, "UNFUSED_ELEMENTS", 40 * 256)  # a budget of 40 tokens' logits
    monkeypatch.setattr(vocab_cross_entropy, "CHUNK_ELEMENTS", 40 * 256)  # chunks of 40 tokens
    chunked, _ = _losses_and_grads(model, batch, None)
    assert calls == [40] and _rel(chunked, unfused) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_loss_is_megatron_cores_bit_for_bit(dtype):
    """The unfused loss masks out-of-shard targets with ``where`` (megatron-core's boolean-mask assignments are
    a ``nonzero`` each on a GPU) and is otherwise megatron-core's: the same losses and gradients, bit for bit."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_loss

    from mindspeed_pack.model.vocab_parallel_loss import vocab_parallel_cross_entropy

    init_single_process()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 3, 501, generator=g) * 5).to(dtype)
    target, weight = torch.randint(0, 501, (7, 3), generator=g), torch.randn(7, 3, generator=g)
    results = []
    for loss_fn in (megatron_loss, vocab_parallel_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = loss_fn(x * 1.0, target)  # (both shift fp32 logits in place: a copy of the leaf)
        results.append((loss, *torch.autograd.grad((loss * weight).sum(), x)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_dry_run_shows_the_loss_path(capsys):
    import posttrain
    from tests.model_utils import TINY_FLAGS

    common = ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--data-path", "none",
              "--dry-run"]
    posttrain.main([*TINY_FLAGS, "--seq-length", "2048", *common])
    assert "# loss: megatron-core's unfused output layer + cross-entropy" in capsys.readouterr().out
    flags = [f if f != "256" else "151936" for f in TINY_FLAGS]  # --padded-vocab-size 151936
    posttrain.main([*flags, "--seq-length", "4096", *common])
    assert "# loss: megatron-core's unfused output layer + cross-entropy (the micro-batch's fp32 logits: 2.32 GiB " \
        "per rank, within the unfused loss's 4 GiB budget)" in capsys.readouterr().out
    posttrain.main([*flags, "--seq-length", "8192", *common])
    assert "# loss: output layer + cross-entropy fused, 883 tokens per chunk (the micro-batch's fp32 logits: 4.64 GiB" \
        in capsys.readouterr().out



def test_dry_run_suggests_the_largest_micro_batch_that_fits(monkeypatch):
    """Several packs per forward are one THD sequence (the same losses, fewer host launches per token): --dry-run
    names the largest micro-batch the memory estimate fits and the global batch it needs."""
    from types import SimpleNamespace

    from mindspeed_pack.training import run_plan

    qwen7b = dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
                  kv_channels=None, swiglu=True, add_qkv_bias=True, padded_vocab_size=152064,
                  max_position_embeddings=4096, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=1,
                  expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=2,
                  use_distributed_optimizer=True, bf16=True, fp16=False, optimizer="adam", seq_length=4096,
                  micro_batch_size=1, sequence_parallel=True, num_micro_batches=4, num_experts=None, lora_r=None,
                  tensor_model_parallel_size=4, global_batch_size=8, cross_entropy_chunk_size=None)
    args = SimpleNamespace(**qwen7b)
    totals = {m: run_plan.memory_estimate(run_plan._with_micro_batch(args, m))["total"] for m in (1, 2, 4, 8)}
    assert totals[1] < totals[2] < totals[4] < totals[8]
    # a device between the estimates at 2 and 4 packs: 2 fit, the global batch 8 = 2 x DP 2 x 2 allows it
    gib = (totals[2] + totals[4]) / 2 / run_plan.HEADROOM
    monkeypatch.setattr(run_plan, "device_memory_gib", lambda: (gib, "test"))
    assert run_plan.largest_micro_batch(args, gib) == (2, totals[2])
    line = run_plan._micro_batch_line(args)
    assert line.startswith("micro-batch: up to 2 packs per forward"), line
    assert line.endswith("--micro-batch-size 2 trains the same losses with fewer launches per token (its packs are "
                         "one THD sequence per forward)"), line
    # 8 packs fit a bigger device, but need a global batch of 16 at DP 2
    monkeypatch.setattr(run_plan, "device_memory_gib", lambda: (totals[8] / run_plan.HEADROOM + 1, "test"))
    assert run_plan._micro_batch_line(args).endswith("with --global-batch-size a multiple of 16")
    # already at the largest, or not even one pack fits
    args.micro_batch_size = 8
    assert "--micro-batch-size" not in run_plan._micro_batch_line(args)
    monkeypatch.setattr(run_plan, "device_memory_gib", lambda: (totals[1] / 2, "test"))
    assert run_plan._micro_batch_line(args).startswith("micro-batch: even 1 pack per forward is estimated at")


BF16_TOKENS, BF16_HIDDEN, BF16_VOCAB = 1024, 64, 2048
BF16_SLACK = 1.5  # fused error / unfused error; 3.1x at 32 chunks, 6.6x at 1024 with a bf16 accumulator


def _bf16_loss_and_grads(chunk, dtype=torch.bfloat16, masked=False, summed=False):
    """(per-token loss, input gradient, this TP rank's output-weight gradient) of the mean loss of one fixed
    problem whose inputs are bf16 numbers, computed in ``dtype``; chunk 0 = megatron-core's unfused output
    layer + ``vocab_parallel_cross_entropy``. The input gradient is summed over the vocabulary shards, as
    in the model. ``masked``: the mean over the tokens not a multiple of 4 instead (SFT's masked mean); ``summed``:
    that masked sum formed by :func:`linear_cross_entropy_sum` (the gradients in the forward)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy

    from mindspeed_pack.model.vocab_cross_entropy import linear_cross_entropy, linear_cross_entropy_sum

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(BF16_TOKENS, BF16_HIDDEN, generator=g).bfloat16()
    weight = (torch.randn(BF16_VOCAB, BF16_HIDDEN, generator=g) * 2 / BF16_HIDDEN ** 0.5).bfloat16()
    target = torch.randint(0, BF16_VOCAB, (BF16_TOKENS,), generator=g)
    rows = BF16_VOCAB // ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * rows
    hidden = hidden.to(dtype).clone().requires_grad_()
    weight = weight[start:start + rows].to(dtype).clone().requires_grad_()
    x = copy_to_tensor_model_parallel_region(hidden, group=ps.get_tensor_model_parallel_group())
    mask = (torch.arange(BF16_TOKENS) % 4 != 0).float()
    mask = mask / mask.sum() if masked or summed else torch.full((BF16_TOKENS,), 1.0 / BF16_TOKENS)
    if summed:
        total, loss = linear_cross_entropy_sum(x, weight, target, mask, vocab_start=start, chunk=chunk,
                                               group=ps.get_tensor_model_parallel_group())
    elif chunk == 0:
        loss = vocab_parallel_cross_entropy(torch.matmul(x, weight.t())[:, None], target[:, None])[:, 0]
    else:
        loss = linear_cross_entropy(x, weight, target, vocab_start=start, chunk=chunk,
                                    group=ps.get_tensor_model_parallel_group())
    if not summed:
        total = (loss * mask).sum() if masked else loss.mean()
    total.backward()
    return loss.detach(), hidden.grad, weight.grad


def _assert_bf16_as_close_as_unfused(fused, unfused, ref):
    for name, f, u, r in zip(("loss", "input gradient", "weight gradient"), fused, unfused, ref):
        fused_err, unfused_err = _err(f, r), _err(u, r)
        assert fused_err <= BF16_SLACK * unfused_err, (name, fused_err, unfused_err)


@pytest.mark.parametrize("chunks", [32, BF16_TOKENS])
def test_bf16_gradients_are_as_close_to_fp64_as_unfused_at_many_chunks(chunks):
    init_single_process()
    ref = _bf16_loss_and_grads(0, torch.float64)
    unfused = _bf16_loss_and_grads(0)
    _assert_bf16_as_close_as_unfused(_bf16_loss_and_grads(BF16_TOKENS // chunks), unfused, ref)


@pytest.mark.parametrize("chunks", [32, BF16_TOKENS])
def test_bf16_gradients_formed_in_the_forward_are_as_close_to_fp64_as_unfused(chunks):
    """SFT's masked mean (a quarter of the tokens untrained), its gradients formed in the forward: as close to fp64
    as the unfused bf16 path's, and the per-token chunked path's bit for bit."""
    init_single_process()
    ref = _bf16_loss_and_grads(0, torch.float64, masked=True)
    summed = _bf16_loss_and_grads(BF16_TOKENS // chunks, summed=True)
    _assert_bf16_as_close_as_unfused(summed, _bf16_loss_and_grads(0, masked=True), ref)
    per_token = _bf16_loss_and_grads(BF16_TOKENS // chunks, masked=True)
    assert all(torch.equal(a, b) for a, b in zip(summed, per_token))


@pytest.fixture(scope="module")
def padded_vocab(tmp_path_factory):
    """A transformers Qwen2 with a 250-row vocabulary, converted to Megatron at 256 rows, TP1 and TP2."""
    root = tmp_path_factory.mktemp("padded_vocab")
    config = transformers.Qwen2Config(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128)
    torch.manual_seed(1)
    hf = spread_weights(transformers.Qwen2ForCausalLM(config)).eval()
    hf.save_pretrained(root / "hf")
    for tp in (1, 2):
        hf_to_megatron(str(root / "hf"), str(root / f"tp{tp}"), tp, 1, padded_vocab_size=PADDED)
    batch, samples = _pack(HF_VOCAB, seed=3)
    with torch.no_grad():
        logp = [torch.log_softmax(hf(x[None]).logits[0].double(), -1) for x in samples]
    ref = torch.cat([-lp[:-1].gather(1, x[1:, None])[:, 0] for lp, x in zip(logp, samples)])  # per trained token
    return {"root": root, "batch": batch, "ref_loss": ref, "ref_logp": torch.cat(logp)}


def _trained(values, batch):
    return values.reshape(-1)[batch.loss_mask.reshape(-1) > 0]


def test_padded_vocabulary_rows_take_no_probability(padded_vocab):
    init_single_process()
    model, args = load_release_checkpoint(str(padded_vocab["root"] / "tp1"))
    assert (args.vocab_size, args.padded_vocab_size, model.real_vocab_size) == (HF_VOCAB, PADDED, HF_VOCAB)
    batch, ref = padded_vocab["batch"], padded_vocab["ref_loss"]
    with torch.no_grad():
        params = packed_seq_params(batch)
        fused = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=params)
        logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=packed_seq_params(batch))[0]
        model.real_vocab_size = None  # negative control: the padded rows in the softmax
        model.loss_chunk = 0
        leaky = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                      packed_seq_params=packed_seq_params(batch))
    assert _rel(_trained(fused, batch).double(), ref) <= 1e-5
    # the logits a stage scores or takes entropies from: padded rows at the lowest value, no probability
    logp = torch.log_softmax(logits.double(), -1)
    assert torch.all(logp[:, HF_VOCAB:].exp() == 0)
    real = sum(LENGTHS)
    assert _rel(logp[:real, :HF_VOCAB], padded_vocab["ref_logp"]) <= 1e-5
    shift = float((_trained(leaky, batch).double() - ref).mean())
    assert shift > 1e-3, shift  # about log(256/250) = 0.024 per token, less where the padded rows score low


def _tp2_losses_and_grads(root, batch):
    """Rank's (fused loss, model gradients fused and unfused, the bf16 problem unfused and at 32 chunks, the model's
    gradients with SFT's masked sum formed in the forward (chunks of 7), the bf16 masked problem unfused and
    summed at 32 chunks)."""
    from mindspeed_pack.runtime.process_groups import initialize_distributed

    initialize_distributed(2, 1)
    model, _ = load_release_checkpoint(str(root / "tp2"))
    assert model.output_layer.weight.shape[0] == PADDED // 2  # rank 1 holds rows 128..255, 250..255 padding
    loss, fused = _losses_and_grads(model, batch, None)
    _, unfused = _losses_and_grads(model, batch, 0)
    _, summed = _losses_and_grads(model, batch, 7, summed=True)
    return (loss, fused, unfused, _bf16_loss_and_grads(0), _bf16_loss_and_grads(BF16_TOKENS // 32), summed,
            _bf16_loss_and_grads(0, masked=True), _bf16_loss_and_grads(BF16_TOKENS // 32, summed=True))


def test_vocab_parallel_loss_and_gradients_at_tp2(padded_vocab):
    """At TP2 the fused loss masks the padded rows, its gradients are the unfused path's (fp32), and in bf16 at
    32 chunks they are as close to fp64 as the unfused path's; so are those of SFT's masked sum formed in the
    forward (the input gradient summed over the shards after the loss, as for the per-token path)."""
    ranks = run_distributed(_tp2_losses_and_grads, 2, padded_vocab["root"], padded_vocab["batch"], timeout=300)
    batch = padded_vocab["batch"]
    assert _rel(_trained(ranks[0][0], batch).double(), padded_vocab["ref_loss"]) <= 1e-5
    for _, fused, unfused, _, _, summed, _, _ in ranks:
        assert fused.keys() == unfused.keys() == summed.keys()
        worst = max(_rel(fused[n], unfused[n]) for n in fused)
        assert worst <= 1e-5, worst
        worst = max(_rel(summed[n], unfused[n]) for n in fused)
        assert worst <= 1e-5, worst
    init_single_process()
    ref = _bf16_loss_and_grads(0, torch.float64)
    # the loss and input gradient are whole on every rank, the weight gradient is split into vocabulary rows
    unfused, fused = ((*ranks[0][k][:2], torch.cat([r[k][2] for r in ranks])) for k in (3, 4))
    _assert_bf16_as_close_as_unfused(fused, unfused, ref)
    ref = _bf16_loss_and_grads(0, torch.float64, masked=True)
    unfused, summed = ((*ranks[0][k][:2], torch.cat([r[k][2] for r in ranks])) for k in (6, 7))
    _assert_bf16_as_close_as_unfused(summed, unfused, ref)
