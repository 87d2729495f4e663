"""The 7B job's precision and parallel flags run, exactly, on the CPU: bf16/fp16, the
distributed optimizer, sequence parallelism, and weights-only loads that keep the weights.

Tolerances: fp32 comparisons are held to 1e-6 relative. bf16 keeps 8 mantissa bits
(eps 2**-8 = 3.9e-3 relative per rounding): a bf16 loss computed two ways (packed vs alone,
TP2/PP2 vs TP1, whose reductions round in other orders) may differ by a few roundings of
the logits, so bf16 losses are held to ``BF16_REL`` = 1e-2 relative.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mindspeed_pack.convert.megatron_layout import RELEASE
from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2
from tests.train_utils import run_posttrain, sft_trainer, train_losses, write_copy_task

BF16_REL = 1e-2
FP32_REL = 1e-6
BASE = ["--seq-length", "128", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--neat-pack",
        "--no-shuffle", "--log-interval", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_copy_task(str(tmp_path_factory.mktemp("data") / "copy"), num_packs=24)


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _weights(ckpt: str, iteration) -> dict:
    name = RELEASE if iteration == RELEASE else f"iter_{iteration:07d}"
    path = os.path.join(ckpt, name, "mp_rank_00", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


# ------------------------------------------------------------------ weights-only loads under bf16
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("converted"))


def _assert_equal_weights(saved: dict, reference: dict) -> None:
    assert saved.keys() == reference.keys()
    for name, ref in reference.items():
        assert saved[name].dtype == torch.bfloat16, f"{name} saved as {saved[name].dtype}: --bf16 was not applied"
        diff = (saved[name].float() - ref.to(torch.bfloat16).float()).abs().max().item()
        assert diff == 0.0, f"{name} moved by {diff} in a step at lr 0: the fp32 master copy was not refreshed"


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_bf16_weights_only_loads_keep_the_checkpoint(tmp_path, data, converted, optimizer):
    """--bf16 --finetune from a converted checkpoint, then --no-load-optim: one step at lr 0 moves nothing."""
    nproc, extra = (1, []) if optimizer == "plain" else (2, ["--use-distributed-optimizer"])
    common = BASE + ["--data-path", data, "--bf16", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0",
                     "--global-batch-size", "2", *extra]
    run_posttrain(common + ["--train-iters", "1", "--finetune", "--load", converted, "--save", str(tmp_path / "ft")],
                  nproc=nproc)
    _assert_equal_weights(_weights(str(tmp_path / "ft"), 1), _weights(converted, RELEASE))
    if optimizer == "distributed":
        return  # the --no-load-optim path is the same call for every optimizer kind; spare CI a launch
    run_posttrain(common + ["--train-iters", "2", "--no-load-optim", "--load", str(tmp_path / "ft"),
                            "--save", str(tmp_path / "nlo")], nproc=nproc)
    _assert_equal_weights(_weights(str(tmp_path / "nlo"), 2), _weights(converted, RELEASE))


# ------------------------------------------------------------------ bf16 exactness and parallel layouts
def test_bf16_packed_loss_equals_unpacked():
    from megatron.core.transformer.module import Float16Module

    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process, tiny_args
    from tests.test_packed_exactness import _loss_sum, _pack, _samples

    init_single_process()
    torch.manual_seed(0)
    model = build_gpt_model(tiny_args(seq_length=96, bf16=True))
    model = Float16Module(model.config, model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for lengths in ([10, 25, 7, 30], [50, 40], [1, 2, 90]):
        samples = _samples(lengths)
        with torch.no_grad():
            loss, n = _loss_sum(model, *_pack(samples))
            alone = [_loss_sum(model, ids[None], labels[None], torch.ones_like(ids)[None]) for ids, labels in samples]
        packed = (loss / n).item()
        unpacked = (sum(l for l, _ in alone) / sum(c for _, c in alone)).item()
        assert abs(packed - unpacked) <= BF16_REL * unpacked, (lengths, packed, unpacked)


@pytest.fixture(scope="module")
def bf16_tp1(tmp_path_factory, data):
    _, records = run_posttrain(BASE + ["--data-path", data, "--bf16", "--train-iters", "10",
                                       "--micro-batch-size", "2", "--global-batch-size", "2"],
                               metrics=str(tmp_path_factory.mktemp("bf16") / "tp1.jsonl"))
    return train_losses(records)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2-sp", "pp2"])
def test_bf16_tp2_and_pp2_track_tp1(tmp_path, data, bf16_tp1, layout):
    _, records = run_posttrain(BASE + ["--data-path", data, "--bf16", "--train-iters", "10",
                                       "--micro-batch-size", "2", "--global-batch-size", "2", *layout],
                               nproc=2, metrics=str(tmp_path / "par.jsonl"))
    losses = train_losses(records)
    assert len(losses) == len(bf16_tp1) == 10
    assert _rel(losses, bf16_tp1) <= BF16_REL, (losses, bf16_tp1)


# ------------------------------------------------------------------ distributed optimizer (fp32)
def test_distributed_optimizer_matches_plain_and_resumes_exactly(tmp_path, data):
    common = BASE + ["--data-path", data, "--train-iters", "5", "--global-batch-size", "4"]
    _, plain = run_posttrain(common, nproc=2, metrics=str(tmp_path / "plain.jsonl"))
    ckpt = str(tmp_path / "ckpt")
    _, dist = run_posttrain(common + ["--use-distributed-optimizer", "--save", ckpt, "--save-interval", "3"],
                            nproc=2, metrics=str(tmp_path / "dist.jsonl"))
    assert len(dist) == 5
    assert _rel(train_losses(dist), train_losses(plain)) <= FP32_REL
    assert _rel([r["grad norm"] for r in dist], [r["grad norm"] for r in plain]) <= FP32_REL
    # resume from iteration 3: the sharded Adam state and fp32 masters come back exactly
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    _, resumed = run_posttrain(common + ["--use-distributed-optimizer", "--load", ckpt],
                               nproc=2, metrics=str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert [(r["lm loss"], r["grad norm"]) for r in resumed] == [(r["lm loss"], r["grad norm"]) for r in dist[3:]]


# ------------------------------------------------------------------ sequence parallel (fp32)
class _OnePack:
    """A batch source that serves the same pack of several samples for every micro-batch."""

    def __init__(self):
        from tests.test_packed_exactness import _pack, _samples

        self.ids, self.labels, self.seg = _pack(_samples([10, 25, 7, 30, 20]), length=128)

    def micro_batches(self, split, consumed):
        while True:
            yield {"input_ids": self.ids, "labels": self.labels, "segment_ids": self.seg}


def _loss_and_grads(sequence_parallel: bool):
    """Rank's loss and every parameter's reduced gradient after one forward/backward at TP2."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.runtime.process_groups import initialize_distributed
    from mindspeed_pack.training.model_setup import build_model, build_optimizer

    argv = TINY_FLAGS + BASE + ["--data-path", "unused", "--train-iters", "1", "--tensor-model-parallel-size", "2",
                                "--global-batch-size", "2"] + (["--sequence-parallel"] if sequence_parallel else [])
    args = parse_args(argv, world_size=2)
    initialize_distributed(2, 1, args.seed)
    trainer = sft_trainer(args, _OnePack())
    trainer.model = build_model(args)
    trainer.optimizer, trainer.scheduler = build_optimizer(args, trainer.model)
    assert trainer.model[0].config.sequence_parallel == sequence_parallel
    loss_sum, _ = trainer._run_batches("train", 0, forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model[0].named_parameters()}
    return float(loss_sum[0] / loss_sum[1]), grads


def _sp_vs_tp2():
    without = _loss_and_grads(False)
    with_sp = _loss_and_grads(True)
    return without, with_sp


def test_sequence_parallel_equals_tp2_without_it():
    for (loss, grads), (sp_loss, sp_grads) in run_distributed(_sp_vs_tp2, 2, timeout=240):
        assert abs(sp_loss - loss) <= FP32_REL * abs(loss)
        assert sp_grads.keys() == grads.keys()
        for name, g in grads.items():
            scale = g.abs().max().clamp(min=1e-30)
            assert float((sp_grads[name] - g).abs().max() / scale) <= FP32_REL, name
        # the norm weights' gradients were summed over the TP group (each rank saw half the sequence)
        norm = next(n for n in grads if n.endswith("input_layernorm.weight"))
        assert grads[norm].abs().max() > 0


# ------------------------------------------------------------------ fp16 dynamic loss scaling
def test_fp16_overflow_halves_the_loss_scale_and_training_goes_on(tmp_path, data, capsys):
    """--fp16 as in Megatron-LM: an overflowing step is skipped and the scale halves (after
    --hysteresis overflows in a row), then the run trains; the interval's mean loss leaves the
    skipped iterations out, and every log carries the loss scale."""
    import re

    import posttrain
    from tests.data_utils import read_metrics

    metrics = str(tmp_path / "fp16.jsonl")
    capsys.readouterr()
    posttrain.main(TINY_FLAGS + BASE + ["--data-path", data, "--fp16", "--initial-loss-scale", "65536", "--lr", "5e-3",
                                        "--train-iters", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                                        "--log-interval", "4", "--metrics-file", metrics])
    out = capsys.readouterr().out
    steps = read_metrics(metrics)
    scales = [steps[i]["loss scale"] for i in range(1, 17)]
    skipped = [i for i in range(1, 17) if not np.isfinite(steps[i]["grad norm"])]
    assert scales[0] == 65536 and scales[-1] < 65536, scales
    assert 2 <= len(skipped) <= 10 and steps[16]["skipped"] == len(skipped), (skipped, scales)
    trained = [steps[i]["lm loss"] for i in range(1, 17) if i not in skipped]
    assert np.mean(trained[-3:]) < trained[0] - 0.02, trained  # the loss falls
    lines = [line for line in out.splitlines() if re.search(r"iteration +\d+/ +16 \|", line)]
    assert len(lines) == 4
    for n, line in enumerate(lines):
        its = range(4 * n + 1, 4 * n + 5)
        kept = [steps[i]["lm loss"] for i in its if i not in skipped]
        printed = float(re.search(r"lm loss: ([^ ]+) \|", line).group(1))
        want = np.mean(kept) if kept else float("nan")
        assert (np.isnan(printed) and np.isnan(want)) or abs(printed - want) <= 1e-6 * abs(want), (line, kept)
        assert f"loss scale: {steps[4 * n + 4]['loss scale']:.1f} |" in line
        assert f"number of skipped iterations: {sum(i in skipped for i in its):3d} |" in line
