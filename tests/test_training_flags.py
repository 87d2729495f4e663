"""Training flags mean what they mean in Megatron-LM / MindSpeed-LLM (issue 18, one test per point).

Most runs call ``posttrain.main`` or the ``Trainer`` in this process (tiny model, few steps);
only the data-parallel and tensor-parallel comparisons start ``torchrun``.
"""
import glob
import os
import re

import numpy as np
import pytest
import torch

import posttrain
from mindspeed_pack.checkpoint.save_load import CheckpointError
from mindspeed_pack.config import mindspeed_llm_flags
from mindspeed_pack.config.arguments import build_parser, parse_args
from mindspeed_pack.datasets.packed_dataset import DataError, PackedBatchSource, split_ranges
from mindspeed_pack.training.batches import to_packed_batch
from mindspeed_pack.training.trainer import NonFiniteLossError
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS
from tests.train_utils import ROOT, run_posttrain, sft_trainer

EOS, PAD = 2, 0


def argv(data, *extra, metrics=None):
    out = [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--no-shuffle", "--data-path", data]
    if metrics:
        out += ["--metrics-file", metrics]
    return out + list(extra)


def nargv(data, *extra, metrics=None):
    return argv(data, "--neat-pack", *extra, metrics=metrics)


@pytest.fixture(scope="module")
def neat(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("neat") / "copy"), num_packs=24, meta=True)


def write_eos_packs(prefix, neat_pack, num_packs=8, seq_length=128, seed=5, prompt_type="qwen"):
    """Packs whose samples end with EOS (trained), padded with PAD, as preprocess_data.py writes them
    (``neat_pack``: segment ids in attention_mask, else all ones), with the sidecar's layout."""
    return write_packed_instruction_dataset(prefix, num_packs=num_packs, seq_length=seq_length, seed=seed,
                                            neat_pack=neat_pack, eos_id=EOS, pad_id=PAD, prompt_type=prompt_type)


@pytest.fixture(scope="module")
def eos_packs(tmp_path_factory):
    d = tmp_path_factory.mktemp("eos")
    return write_eos_packs(str(d / "neat"), True), write_eos_packs(str(d / "plain"), False)


def first_batch(args_list, split="train"):
    """The first micro-batch's PackedBatch as the trainer builds it (after its sidecar checks)."""
    trainer = sft_trainer(parse_args(args_list), PackedBatchSource())
    trainer.setup()
    try:
        return to_packed_batch(next(trainer.source.micro_batches(split, 0)), trainer.args)
    finally:
        trainer.cleanup()


# 1 ------------------------------------------------------------------------------------------
def test_resume_with_changed_schedule_is_refused_or_follows_the_new_schedule(tmp_path, neat):
    ckpt = str(tmp_path / "ckpt")
    posttrain.main(nargv(neat, "--train-iters", "4", "--save", ckpt, "--exit-interval", "2"))
    new = ["--lr", "5e-3", "--train-iters", "8"]
    with pytest.raises(CheckpointError) as err:
        posttrain.main(nargv(neat, *new, "--load", ckpt, metrics=str(tmp_path / "refused.jsonl")))
    msg = str(err.value)
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" in msg
    assert "--lr: checkpoint 0.001, flags 0.005" in msg
    posttrain.main(nargv(neat, *new, "--load", ckpt, "--override-opt_param-scheduler",
                        metrics=str(tmp_path / "override.jsonl")))
    posttrain.main(nargv(neat, *new, metrics=str(tmp_path / "scratch.jsonl")))
    got, want = read_metrics(str(tmp_path / "override.jsonl")), read_metrics(str(tmp_path / "scratch.jsonl"))
    assert sorted(got) == list(range(3, 9))
    for it in got:
        assert rel_err(got[it]["lr"], want[it]["lr"]) <= 1e-12, (it, got[it]["lr"], want[it]["lr"])
    assert got[5]["lr"] > 1e-3  # the new, higher schedule (the old one had ended at 1e-4)
    posttrain.main(nargv(neat, *new, "--load", ckpt, "--use-checkpoint-opt_param-scheduler",
                        metrics=str(tmp_path / "keep.jsonl")))
    assert read_metrics(str(tmp_path / "keep.jsonl"))[4]["lr"] == pytest.approx(1e-4)  # old schedule's end


# 2 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_inf_gradient_is_skipped_or_stops_naming_the_iteration(neat, policy):
    trainer = sft_trainer(parse_args(nargv(neat, "--train-iters", "4", "--nan-policy", policy)), PackedBatchSource())
    trainer.setup()
    try:
        trainer.train_step()
        trainer.iteration = 1
        name, param = next((n, p) for n, p in trainer.model[0].module.named_parameters() if "linear_fc2" in n)
        handle = param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        before = {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}
        if policy == "stop":
            with pytest.raises(NonFiniteLossError, match=rf"iteration 2 .*{re.escape(name)}"):
                trainer.train_step()
            return
        loss, grad_norm, _, ok = trainer.train_step()
        handle.remove()
        assert np.isfinite(loss) and not ok and trainer.skipped == 1 and not np.isfinite(grad_norm)
        for n, p in trainer.model[0].module.named_parameters():
            assert torch.equal(p.detach(), before[n]), n  # the update was not applied
        loss, grad_norm, _, ok = trainer.train_step()  # and the next step trains again
        assert ok and np.isfinite(grad_norm) and trainer.skipped == 1
    finally:
        trainer.cleanup()


# 3 ------------------------------------------------------------------------------------------
def test_plain_pack_resets_positions_and_isolates_samples_at_eos(tmp_path, eos_packs):
    neat_data, plain_data = eos_packs
    isolated = first_batch(argv(neat_data, "--train-iters", "1", "--neat-pack"))
    plain = first_batch(argv(plain_data, "--train-iters", "1", "--reset-position-ids"))
    assert torch.equal(plain.position_ids, isolated.position_ids)
    assert torch.equal(plain.cu_seqlens, isolated.cu_seqlens)  # megatron-core's THD RoPE reads these
    plain = first_batch(argv(plain_data, "--train-iters", "1", "--reset-attention-mask"))
    assert torch.equal(plain.cu_seqlens, isolated.cu_seqlens) and torch.equal(plain.target, isolated.target)
    assert int(isolated.position_ids.max()) < 40  # positions restart per sample
    posttrain.main(argv(neat_data, "--train-iters", "2", "--neat-pack", metrics=str(tmp_path / "neat.jsonl")))
    posttrain.main(argv(plain_data, "--train-iters", "2", "--reset-attention-mask",
                        metrics=str(tmp_path / "plain.jsonl")))
    a, b = read_metrics(str(tmp_path / "neat.jsonl")), read_metrics(str(tmp_path / "plain.jsonl"))
    for it in (1, 2):
        assert rel_err(b[it]["lm loss"], a[it]["lm loss"]) <= 1e-5


# 4 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sidecar", [True, False], ids=["sidecar", "no-sidecar"])
def test_neat_pack_data_without_neat_pack_is_refused(tmp_path, eos_packs, sidecar):
    data = write_eos_packs(str(tmp_path / "neat"), True, num_packs=4)
    if not sidecar:
        os.remove(f"{data}_packed_meta.json")
    with pytest.raises(DataError, match="pass --neat-pack, which reads them \\(without it samples attend to each "
                                        "other\\)"):
        posttrain.main(argv(data, "--train-iters", "1"))


def test_neat_pack_data_with_reset_attention_mask_is_refused_for_what_the_flag_reads(tmp_path):
    """--reset-attention-mask isolates samples, so 'or samples attend to each other' was wrong: the flag finds plain
    packs' samples at their EOS, and the segment ids of --neat-pack data are --neat-pack's to read."""
    data = write_eos_packs(str(tmp_path / "neat"), True, num_packs=4)
    with pytest.raises(DataError) as refused:
        posttrain.main(argv(data, "--train-iters", "1", "--reset-attention-mask"))
    assert str(refused.value).endswith("pass --neat-pack, which reads them (--reset-attention-mask finds the samples of "
                                       "plain --pack data (at their EOS), not segment ids)"), refused.value
    assert "attend to each other" not in str(refused.value)


# 5 ------------------------------------------------------------------------------------------
def test_split_rounds_as_megatron_core():
    assert split_ranges(25, "98,2,0") == [(0, 24), (24, 25), (25, 25)]
    assert split_ranges(125, "98,2,0") == [(0, 122), (122, 125), (125, 125)]
    assert split_ranges(10, "0,100,0") == [(0, 0), (0, 10), (10, 10)]


# 6 ------------------------------------------------------------------------------------------
def test_warmup_fraction_and_warmup_iters_are_exclusive(neat, capsys):
    with pytest.raises(SystemExit):
        parse_args(nargv(neat, "--train-iters", "4", "--lr-warmup-fraction", "0.5"))  # argv has --lr-warmup-iters 1
    assert "--lr-warmup-fraction and --lr-warmup-iters" in capsys.readouterr().err


def megatron_lr(k, fraction, iters, gbs, lr=1e-3, min_lr=1e-4):
    """Megatron-LM's cosine schedule after ``k`` updates: steps are samples (warmup fractional)."""
    steps, decay = k * gbs, iters * gbs
    warmup = fraction * decay
    if steps <= warmup:
        return lr * steps / warmup
    ratio = (steps - warmup) / (decay - warmup)
    return min_lr + 0.5 * (np.cos(np.pi * ratio) + 1.0) * (lr - min_lr)


@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_lr_warmup_fraction_stays_fractional_as_megatron_counts_it(neat, fraction):
    """0.01 x 50 iterations is half an iteration of warmup at GBS 2 (1 sample): step 1 runs at
    lr 0 and the lr rises from there; 0.05 x 50 = 2.5 iterations, not 2."""
    trainer = sft_trainer(parse_args(nargv(neat, "--train-iters", "50", "--lr-warmup-iters", "0",
                                       "--lr-warmup-fraction", str(fraction))), PackedBatchSource())
    trainer.setup()
    try:
        lrs = [trainer.optimizer.param_groups[0]["lr"]]  # the lr step 1 runs with
        for _ in range(4):
            trainer.train_step()
            lrs.append(trainer.optimizer.param_groups[0]["lr"])  # what iteration k logs
    finally:
        trainer.cleanup()
    assert lrs[0] == 0.0 and lrs[1] > 0.0
    for k, got in enumerate(lrs):
        assert rel_err(got, megatron_lr(k, fraction, 50, 2)) <= 1e-12 if k else got == 0.0, (k, got)
    if fraction == 0.05:
        assert lrs[1] < lrs[2] < lrs[3] == pytest.approx(megatron_lr(3, 0.05, 50, 2))


def hand_lr(steps, *, lr=1e-3, min_lr=1e-4, init=0.0, warmup=0, decay, style="linear", wsd=None,
            wsd_style="exponential"):
    """Megatron-LM's OptimizerParamScheduler.get_lr, written out by hand (steps in samples)."""
    if warmup and steps <= warmup:
        return init + (lr - init) * steps / warmup
    if steps > decay:
        return min_lr
    if style == "WSD":
        start = decay - wsd
        if steps <= start:
            return lr
        r = (steps - start) / wsd
        coeff = {"linear": 1 - r, "cosine": 0.5 * (np.cos(np.pi * r) + 1), "exponential": 2 * 0.5 ** r - 1,
                 "minus_sqrt": 1 - r ** 0.5}[wsd_style]
    else:
        r = (steps - warmup) / (decay - warmup)
        coeff = 0.5 * (np.cos(np.pi * r) + 1) if style == "cosine" else 1 - r
    return min_lr + coeff * (lr - min_lr)


def schedule_of(data, *flags, iters=10):
    """(lr, weight decay) after 0..--train-iters updates of the scheduler these flags build (GBS 2; ``iters`` None:
    the flags say how many)."""
    from types import SimpleNamespace

    from mindspeed_pack.training.schedule import build_scheduler

    length = () if iters is None else ("--train-iters", str(iters))
    args = parse_args(nargv(data, *length, "--lr-warmup-iters", "0", *flags))
    group = {"lr": None, "weight_decay": None}
    scheduler = build_scheduler(args, SimpleNamespace(param_groups=[group]))
    out = [(group["lr"], group["weight_decay"])]
    for _ in range(args.train_iters):
        scheduler.step(args.global_batch_size)
        out.append((group["lr"], group["weight_decay"]))
    return out


@pytest.mark.parametrize("flags,expected", [
    (["--lr-decay-style", "linear", "--lr-warmup-iters", "2", "--lr-warmup-init", "2e-4"],
     dict(init=2e-4, warmup=4, decay=20)),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", "linear", "--lr-warmup-iters",
      "1"], dict(style="WSD", warmup=2, decay=20, wsd=8, wsd_style="linear")),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3", "--lr-decay-iters", "8"],
     dict(style="WSD", decay=16, wsd=6)),
])
def test_megatron_lms_schedule_flags_give_its_learning_rates(neat, flags, expected):
    """--lr-warmup-init and --lr-decay-style WSD (with --lr-wsd-decay-iters/-style) were refused as unknown flags;
    each step's lr is now Megatron-LM's formula, computed by hand."""
    lrs = [lr for lr, _ in schedule_of(neat, *flags)]
    want = [hand_lr(2 * k, **expected) for k in range(11)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    if "--lr-warmup-init" in flags:
        assert lrs[0] == 2e-4  # the first step runs at the warmup's start, not 0


def test_weight_decay_incr_style_raises_the_weight_decay_as_in_megatron_lm(neat, capsys):
    """--weight-decay-incr-style linear/cosine from --start-weight-decay to --end-weight-decay over the run's samples
    (was refused as unknown); constant with start/end, or an increase missing one end, is refused by name."""
    wds = [wd for _, wd in schedule_of(neat, "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0",
                                       "--end-weight-decay", "0.1")]
    assert wds == pytest.approx([0.1 * 0.5 * (np.cos(np.pi * (1 - k / 10)) + 1) for k in range(11)], abs=1e-15)
    assert {wd for _, wd in schedule_of(neat, "--weight-decay", "0.05")} == {0.05}
    for flags, message in ((["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
                           (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"], "give both")):
        with pytest.raises(SystemExit):
            parse_args(nargv(neat, "--train-iters", "4", *flags))
        assert message in capsys.readouterr().err


def test_train_samples_trains_its_iterations_on_megatron_lms_sample_schedule(neat):
    """--train-samples (and --lr-decay-samples, --lr-warmup-samples) were refused as unknown: 21 samples at GBS 2
    are 10 iterations, and the lr decays over the samples given, not over iterations x GBS."""
    args = parse_args(nargv(neat, "--train-samples", "21", "--lr-warmup-iters", "0", "--lr-warmup-samples", "3",
                            "--lr-decay-samples", "19"))
    assert args.train_iters == 10
    lrs = [lr for lr, _ in schedule_of(neat, "--lr-warmup-samples", "3", "--lr-decay-samples", "19",
                                       "--train-samples", "21", iters=None)]
    want = [hand_lr(2 * k, warmup=3, decay=19, style="cosine") for k in range(11)]  # TINY_FLAGS: cosine
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    fraction = [lr for lr, _ in schedule_of(neat, "--lr-warmup-fraction", "0.1", "--train-samples", "21", iters=None)]
    want = [hand_lr(2 * k, warmup=2.1, decay=21, style="cosine") for k in range(11)]
    assert fraction == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_a_wsd_decay_longer_than_the_epochs_iterations_is_refused_before_the_model_is_built(neat):
    """With --train-epochs the decay's iterations are known only from the data: a longer --lr-wsd-decay-iters made
    megatron-core's WSD coefficient run past its range (a traceback at best)."""
    from mindspeed_pack.training.run_plan import resolve_epochs

    args = parse_args(nargv(neat, "--train-epochs", "1", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "1000"),
                      extra_args_provider=posttrain.posttrain_args)
    with pytest.raises(DataError, match=r"--lr-wsd-decay-iters 1000 is longer than the decay \((\d+) iterations"):
        resolve_epochs(args)


@pytest.mark.parametrize("flags,message", [
    (["--train-samples", "20", "--train-iters", "4"], "--train-samples 20 counts samples: --train-iters count"),
    (["--train-samples", "20", "--lr-decay-iters", "4"], "--lr-decay-iters count iterations"),
    (["--train-iters", "4", "--lr-decay-samples", "8"], "--lr-decay-samples size the schedule of --train-samples"),
    (["--train-samples", "1"], "less than one global batch"),
    (["--train-samples", "20", "--lr-warmup-samples", "2", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction and --lr-warmup-samples both given"),
])
def test_sample_and_iteration_flags_are_not_mixed(neat, capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(nargv(neat, "--lr-warmup-iters", "0", *flags))
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--lr-decay-style", "WSD"], "give it"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5"], "must be in [1, --lr-decay-iters"),
    (["--lr-warmup-init", "2e-3"], "--lr-warmup-init 0.002 must be in [0, --lr 0.001]"),
    (["--min-lr", "2e-3"], "--min-lr 0.002 is above --lr 0.001"),  # was megatron-core's bare AssertionError
])
def test_impossible_schedule_flags_are_refused_by_name(neat, capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(nargv(neat, "--train-iters", "4", *flags))
    assert message in capsys.readouterr().err


# 7 ------------------------------------------------------------------------------------------
def test_prompt_type_is_checked_against_the_sidecar(eos_packs):
    _, plain = eos_packs
    with pytest.raises(DataError, match="--prompt-type llama3.*--prompt-type qwen"):
        posttrain.main(argv(plain, "--train-iters", "1", "--prompt-type", "llama3"))


# 8 ------------------------------------------------------------------------------------------
def test_per_sample_loss_on_plain_packs_weights_each_sample(eos_packs):
    neat_data, plain_data = eos_packs
    isolated = first_batch(argv(neat_data, "--train-iters", "1", "--neat-pack", "--per-sample-loss"))
    plain = first_batch(argv(plain_data, "--train-iters", "1", "--per-sample-loss"))
    assert plain.num_samples == isolated.num_samples > 1
    assert torch.allclose(plain.loss_weights, isolated.loss_weights)
    assert float(plain.loss_weights.sum()) == pytest.approx(plain.num_samples)


# 9 ------------------------------------------------------------------------------------------
def test_data_parallel_2_logs_the_same_tokens_and_padding_as_one_process(tmp_path, neat):
    flags = nargv(neat, "--train-iters", "2", "--global-batch-size", "4")
    posttrain.main(flags + ["--metrics-file", str(tmp_path / "dp1.jsonl")])
    _, dp2 = run_posttrain(flags[len(TINY_FLAGS):], nproc=2, metrics=str(tmp_path / "dp2.jsonl"))
    dp1 = read_metrics(str(tmp_path / "dp1.jsonl"))
    for r in dp2:
        for key in ("tokens", "padding ratio", "samples per pack"):
            assert r[key] == pytest.approx(dp1[r["iteration"]][key], rel=1e-12), key


def test_log_interval_prints_the_interval_mean_loss(tmp_path, neat, capsys):
    metrics = str(tmp_path / "m.jsonl")
    capsys.readouterr()
    posttrain.main(nargv(neat, "--train-iters", "4", "--log-interval", "2", metrics=metrics))
    out = capsys.readouterr().out
    printed = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    steps = read_metrics(metrics)
    assert len(printed) == 2
    for line, its in zip(printed, ((1, 2), (3, 4))):
        assert rel_err(line, np.mean([steps[i]["lm loss"] for i in its])) <= 1e-6


def test_log_interval_mean_loss_leaves_skipped_iterations_out(capsys):
    """Megatron-LM averages the interval's loss over the iterations that updated the weights."""
    from types import SimpleNamespace

    from mindspeed_pack.training.metrics import MetricsLogger

    logger = MetricsLogger(SimpleNamespace(train_iters=4, log_interval=4, metrics_file=None, tensorboard_dir=None),
                           enabled=True)
    capsys.readouterr()
    for it, loss, skipped, scale in [(1, 6.0, 0, 8.0), (2, 9.0, 1, 4.0), (3, 4.0, 1, 4.0), (4, 5.0, 2, 2.0)]:
        logger.step({"iteration": it, "lm loss": loss, "skipped": skipped, "loss scale": scale, "lr": 1e-4,
                     "grad norm": 1.0, "tokens": 100, "step time (ms)": 10.0, "consumed samples": 2 * it,
                     "global batch size": 2})
    line = capsys.readouterr().out
    assert "lm loss: 5.000000E+00 |" in line  # (6 + 4) / 2: iterations 2 and 4 were skipped
    assert "loss scale: 2.0 |" in line and "number of skipped iterations:   2 |" in line


def test_plain_pack_padding_is_padding_in_the_metrics(tmp_path, read_indexed):
    """Plain --pack rows (attention_mask all ones) end with untrained pads: the metrics counted them as real tokens
    and logged padding ratio 0."""
    data = write_eos_packs(str(tmp_path / "plain"), neat_pack=False, num_packs=4)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(argv(data, "--train-iters", "1", metrics=metrics))
    ids = read_indexed(f"{data}_packed_input_ids_document")[:2]
    labels = read_indexed(f"{data}_packed_labels_document")[:2]
    pads = 0
    for row, label in zip(ids, labels):
        real = np.flatnonzero((row != PAD) | (label != -100))
        pads += len(row) - (real[-1] + 1)
    step = read_metrics(metrics)[1]
    assert pads > 0 and step["tokens"] == 2 * 128 - pads and step["padding ratio"] == pytest.approx(pads / 256)


def test_megatron_lms_tensorboard_flags_parse_and_take_effect(tmp_path):
    """--tensorboard-log-interval, --tensorboard-queue-size, --log-validation-ppl-to-tensorboard and the
    --log-*-to-tensorboard switches of Megatron-LM's example scripts were refused as unrecognized arguments."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mindspeed_pack.training.metrics import MetricsLogger

    args = build_parser().parse_args([
        "--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "2", "--tensorboard-queue-size", "5",
        "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
        "--log-learning-rate-to-tensorboard", "--log-loss-scale-to-tensorboard", "--log-interval", "1",
        "--train-iters", "4", "--stage", "sft"])
    logger = MetricsLogger(args, enabled=True)
    for it in range(1, 5):
        logger.step({"iteration": it, "split": "train", "lm loss": 2.0, "lr": 1e-4, "grad norm": 1.0, "tokens": 100,
                     "step time (ms)": 10.0, "consumed samples": it, "global batch size": 1, "skipped": 0})
    logger.validation(4, 2.0, tokens=10)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/lm loss")] == [2, 4]
    assert events.Scalars("valid/lm loss PPL")[0].value == pytest.approx(np.exp(2.0), rel=1e-6)


# 10 -----------------------------------------------------------------------------------------
def test_resume_after_halving_the_global_batch_size_continues(tmp_path, neat):
    ckpt = str(tmp_path / "ckpt")
    posttrain.main(nargv(neat, "--train-iters", "6", "--global-batch-size", "4", "--save", ckpt,
                        "--exit-interval", "2"))
    # the schedule counts samples (Megatron-LM): 6 iterations decay over 24 samples at GBS 4, 12 at GBS 2
    with pytest.raises(CheckpointError, match=r"checkpoint 24, flags 12"):
        posttrain.main(nargv(neat, "--train-iters", "6", "--global-batch-size", "2", "--load", ckpt))
    posttrain.main(nargv(neat, "--train-iters", "6", "--global-batch-size", "2", "--load", ckpt,
                        "--use-checkpoint-opt_param-scheduler", metrics=str(tmp_path / "m.jsonl")))
    got = read_metrics(str(tmp_path / "m.jsonl"))
    assert sorted(got) == [3, 4, 5, 6]
    assert [got[i]["consumed samples"] for i in (3, 6)] == [10, 16]
    # ... and the kept schedule goes on by samples: after 16 of its 24 (warmup 4), cosine from 1e-3 to 1e-4
    assert got[6]["lr"] == pytest.approx(1e-4 + 0.5 * (np.cos(np.pi * 12 / 20) + 1) * 9e-4, rel=1e-12)


# 11 -----------------------------------------------------------------------------------------
def test_learned_absolute_trains_from_scratch_at_tp2_as_at_tp1(tmp_path, neat):
    flags = nargv(neat, "--train-iters", "3", "--position-embedding-type", "learned_absolute")[len(TINY_FLAGS):]
    posttrain.main(TINY_FLAGS + flags + ["--metrics-file", str(tmp_path / "tp1.jsonl")])
    tp1 = list(read_metrics(str(tmp_path / "tp1.jsonl")).values())
    _, tp2 = run_posttrain(flags + ["--tensor-model-parallel-size", "2"], nproc=2, metrics=str(tmp_path / "tp2.jsonl"))
    a, b = [r["lm loss"] for r in tp1], [r["lm loss"] for r in tp2]
    assert len(a) == len(b) == 3
    assert max(rel_err(x, y) for x, y in zip(b, a)) <= 1e-4, (a, b)


# 12 -----------------------------------------------------------------------------------------
def test_eval_iters_alone_validates_and_tests_at_the_end(tmp_path, neat, capsys):
    metrics = str(tmp_path / "m.jsonl")
    capsys.readouterr()
    posttrain.main(nargv(neat, "--train-iters", "2", "--eval-iters", "1", "--split", "80,10,10", metrics=metrics))
    out = capsys.readouterr().out
    assert list(read_metrics(metrics, "valid")) == [2] and list(read_metrics(metrics, "test")) == [2]
    assert "validation loss at the end of training for val data" in out
    assert "validation loss at the end of training for test data" in out


# 14 (issue 28) --------------------------------------------------------------------------------
# Megatron-LM's values (megatron/training/arguments.py and its config dataclasses, core 0.16.1)
MEGATRON_DEFAULTS = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
                     "attention_dropout": 0.1, "hidden_dropout": 0.1, "lr_decay_style": "linear",
                     "eval_iters": 100, "log_interval": 100}


def test_omitted_flags_mean_what_they_mean_in_megatron_lm(neat):
    """Only the shape, data and steps are given: the built model, schedule and logger take Megatron-LM's defaults."""
    trainer = sft_trainer(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                  "--padded-vocab-size", "256", "--seq-length", "128", "--global-batch-size", "2",
                                  "--neat-pack", "--train-iters", "1", "--data-path", neat]), PackedBatchSource())
    trainer.setup()
    try:
        args, config = trainer.args, trainer.model[0].config
        assert {k: getattr(args, k) for k in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS
        module = trainer.model[0].module
        assert config.normalization == "LayerNorm"
        assert isinstance(module.decoder.final_layernorm, torch.nn.LayerNorm)  # not RMSNorm
        assert module.position_embedding_type == "learned_absolute" and module.embedding.position_embeddings is not None
        assert config.attention_dropout == config.hidden_dropout == 0.1
        assert trainer.scheduler.lr_decay_style == "linear"
        assert trainer.metrics.log_interval == 100
    finally:
        trainer.cleanup()


# 13 -----------------------------------------------------------------------------------------
ACCEPTED_NO_OPS = {"is_instruction_dataset", "variable_seq_lengths", "use_mcore_models", "attention_mask_type",
                   "dataloader_type", "log_timers_to_tensorboard", "log_batch_size_to_tensorboard",
                   "log_learning_rate_to_tensorboard", "log_loss_scale_to_tensorboard"}


def _training_code() -> str:
    files = [f for f in glob.glob(os.path.join(ROOT, "mindspeed_pack", "**", "*.py"), recursive=True)
             if not f.endswith(("preprocess.py", os.path.join("data", "tokenizer.py")))
             and os.sep + "tools" + os.sep not in f and os.sep + "convert" + os.sep not in f]
    files += [os.path.join(ROOT, f) for f in ("posttrain.py", "pretrain_gpt.py")]
    return "\n".join(open(f).read() for f in files)


def test_help_lists_no_flag_the_code_ignores():
    code = _training_code()
    readme = open(os.path.join(ROOT, "README.md")).read()
    unread = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest == "help":
            continue
        if dest in ACCEPTED_NO_OPS:
            assert "no-op" in (action.help or ""), f"{action.option_strings[0]}: help must say it is a no-op"
            assert action.option_strings[0] in readme, f"{action.option_strings[0]}: document the no-op in README"
            continue
        if action.choices is not None and len(action.choices) == 1:
            continue  # any other value is refused by the parser
        flag = action.option_strings[0]
        if flag in mindspeed_llm_flags.NPU_OPTIMISATIONS:  # accepted, one warning names them (read by name there)
            assert "no effect here" in action.help and flag in readme, f"{flag}: say it has no effect, in README too"
            continue
        if flag in mindspeed_llm_flags.REFUSED:  # refused by name (read by name there)
            assert action.help.startswith("refused") and flag in readme, f"{flag}: say it is refused, in README too"
            continue
        if not re.search(rf"args\.{dest}\b|[\"']{dest}[\"']", code):
            unread.append(action.option_strings[0])
    assert not unread, f"parsed but never read: {unread}"


@pytest.mark.parametrize("flags,message", [
    (["--num-workers", "2"], "--num-workers 2"),
    (["--tokenizer-model", "tok.model"], "--tokenizer-model"),
    (["--tokenizer-type", "Llama2Tokenizer"], "--tokenizer-type Llama2Tokenizer"),
    # Megatron-LM's GPT-2 BPE files: 'unrecognized arguments', with no word of what to pass instead
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"],
     "--tokenizer-type GPT2BPETokenizer: only PretrainedFromHF"),
    (["--vocab-file", "v.json", "--merge-file", "m.txt"],
     "--vocab-file v.json, --merge-file m.txt: Megatron-LM's GPT-2 BPE/WordPiece files are not read; the training "
     "scripts need no tokenizer for data preprocess_data.py wrote"),
    (["--distributed-backend", "nccl"], "--distributed-backend nccl"),
    # values no run can use: refused by name, not a ZeroDivisionError or torch's error after the model is built
    (["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
    (["--lr", "-1"], "--lr -1.0 must be >= 0.0"),
    (["--adam-beta2", "1"], "--adam-beta2 1.0 must be in [0, 1)"),
])
def test_flags_this_project_cannot_honour_are_refused(neat, capsys, flags, message):
    if "nccl" in flags and torch.cuda.is_available():
        pytest.skip("nccl is valid with CUDA")
    with pytest.raises(SystemExit):
        parse_args(nargv(neat, "--train-iters", "1", *flags))
    assert message in capsys.readouterr().err


def test_log_throughput_logs_tflops(tmp_path, neat, capsys):
    capsys.readouterr()
    posttrain.main(nargv(neat, "--train-iters", "1", "--log-throughput", "--distributed-backend", "gloo",
                        metrics=str(tmp_path / "m.jsonl")))
    assert "throughput per GPU (TFLOP/s/GPU):" in capsys.readouterr().out
    assert read_metrics(str(tmp_path / "m.jsonl"))[1]["TFLOP/s/GPU"] > 0


def test_megatron_fallback_warnings_are_one_log_line(neat):
    """Without Transformer Engine and Apex, megatron-core warns six times at import; a run says once which
    fallbacks it uses instead (plain processes, as a user starts them)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    train = subprocess.run([sys.executable, "posttrain.py", *nargv(neat, "--train-iters", "1")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    convert = subprocess.run([sys.executable, "convert_ckpt.py", "--help"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert train.returncode == 0 and convert.returncode == 0, train.stderr[-3000:]
    for proc in (train, convert):
        assert "not installed" not in proc.stderr.replace("kernels: Transformer Engine and Apex not installed", ""), \
            proc.stderr[-3000:]
    from mindspeed_pack.model.te_spec import kernel_fallbacks

    expected = kernel_fallbacks()
    said = [line for line in (train.stdout + train.stderr).splitlines() if "kernels: " in line]
    assert len(said) == (1 if expected else 0) and (not expected or said[0].endswith(expected)), said


def test_full_disk_on_the_metrics_file_is_one_error_line(neat, tmp_path, monkeypatch, capsys):
    """A full disk while logging a step (three tracebacks before): the run stops with one line naming the
    metrics file and the free space; the checkpoint saved before is intact."""
    import errno

    from mindspeed_pack.training import metrics as metrics_module
    from mindspeed_pack.training.cli import run_cli

    class FillsUp:
        def __init__(self, path, *args, **kwargs):
            self.f, self.lines = open(path, *args, **kwargs), 0

        def write(self, text):
            self.lines += 1
            if self.lines > 3:  # the precision record and two steps fit
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def close(self):
            self.f.close()
            raise OSError(errno.ENOSPC, "No space left on device")  # flushing a full disk fails too

    monkeypatch.setattr(metrics_module, "open", FillsUp, raising=False)
    metrics, save = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as stop:
        run_cli("posttrain.py", lambda: posttrain.main(nargv(neat, "--train-iters", "4", "--save", save,
                                                             "--save-interval", "2", metrics=metrics)))
    err = capsys.readouterr().err
    assert stop.value.code == 1
    assert [line for line in err.splitlines() if line.strip()] == [
        f"posttrain.py: error: --metrics-file {metrics}: the disk is full: "
        + err.split("the disk is full: ")[1].split(" are free")[0] + " are free there; free space or choose another "
        "directory, then re-run (iteration 3's record was not written; the checkpoints saved so far are intact)"], err
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"


# flags a user walk found refused in the wrong words, or not at all -------------------------------------------
def test_a_missing_load_directory_is_named_not_the_model_flags_it_would_give(tmp_path, neat, capsys):
    """Without the model flags, --load gives the model's shape: a directory that is not there (a config whose model
    is not downloaded yet, --dry-run included), or holds no model, is the error, not '--num-layers missing'."""
    data = ["--data-path", neat, "--neat-pack", "--seq-length", "128", "--train-iters", "2"]
    missing = str(tmp_path / "qwen-not-downloaded")
    with pytest.raises(SystemExit):
        parse_args(["--load", missing, *data])
    err = capsys.readouterr().err
    assert f"--load {missing} does not exist; the model flags (--num-layers, --hidden-size, --num-attention-heads) " \
           "come from what it holds" in err and "missing required arguments" not in err, err
    with pytest.raises(SystemExit):
        parse_args(["--load", missing, *data, "--dry-run"])
    assert "--dry-run plans from the model's shape: to plan before the model is there, pass --num-layers" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--load", str(tmp_path), *data])
    assert f"--load {tmp_path} holds neither a Hugging Face model (config.json, *.safetensors) nor a Megatron " \
           "checkpoint" in capsys.readouterr().err
    # the model flags given: a dry run plans without the weights (the load itself refuses the missing directory)
    assert parse_args([*TINY_FLAGS, "--load", missing, *data, "--dry-run"]).num_layers == 2


@pytest.mark.parametrize("extra", [["--train-iters", "2"], ["--train-epochs", "1"], ["--train-iters", "2", "--dry-run"]])
def test_a_weighted_blend_is_refused_by_posttrain_before_anything_is_built(neat, capsys, extra):
    """posttrain.py --data-path 0.3 A 0.7 B was refused once the model was built, taken the weight for a prefix under
    --train-epochs, and passed --dry-run: the argument checks refuse it, in the same words on every path."""
    blend = [a for a in nargv(neat) if a != neat]
    blend[blend.index("--data-path") + 1:blend.index("--data-path") + 1] = ["0.3", neat, "0.7", neat]
    with pytest.raises(SystemExit):
        posttrain.main([*blend, *extra])
    err = capsys.readouterr().err
    assert f"error: --data-path 0.3 {neat} 0.7 {neat}: posttrain.py trains on one packed prefix, or on raw files it " \
           "packs together; weighted blends are pretrain_gpt.py's" in err, err
    assert "missing 0.3_packed" not in err
    two = nargv(neat, *extra)
    two.insert(two.index(neat), neat)
    with pytest.raises(DataError, match=f"^--data-path {neat} {neat}: posttrain.py trains on one packed prefix"):
        posttrain.main(two)  # two prefixes unweighted: refused before the model is built too


def test_a_megatron_load_format_is_not_listed_as_the_hugging_face_configs(tmp_path, neat):
    """--load-format resolved to mg for a Megatron --load was listed under 'from the Hugging Face --load directory
    (config.json)' in the resolved configuration: it is derived from --load."""
    from mindspeed_pack.config import resolved_config

    args = parse_args(nargv(neat, "--train-iters", "1", "--load", str(tmp_path / "ckpt"), "--dry-run"))
    assert args.load_format == "mg" and args.flag_sources["load_format"] == ["load-format", "derived"]
    text = resolved_config.text(args, "posttrain.py")
    before = text[:text.index("\nload-format: mg\n")]
    assert before[before.rindex("# --- "):].startswith("# --- derived from the flags above by validation"), text


def test_a_split_paths_blend_is_refused_before_anything_is_built(neat, capsys):
    """--train-data-path 0.5 A 0.5 B passed --dry-run (its weights planned as missing prefixes) and was refused only
    after the model was built; two prefixes alike."""
    flags = [a for a in nargv(neat) if a not in ("--data-path", neat)]
    for paths in (["0.5", neat, "0.5", neat], [neat, neat]):
        with pytest.raises(SystemExit):
            posttrain.main([*flags, "--train-iters", "2", "--train-data-path", *paths, "--dry-run"])
        assert f"error: --train-data-path {' '.join(paths)}: takes one packed prefix" in capsys.readouterr().err


def test_a_metrics_file_that_cannot_be_written_is_one_error_line(neat, tmp_path, capsys):
    """A --metrics-file in a read-only (or file-blocked) directory was a traceback of the logging rank after the
    model was built and loaded; now one error line naming the flag and the path."""
    from mindspeed_pack.training.cli import run_cli

    (tmp_path / "file").write_text("")
    metrics = str(tmp_path / "file" / "m.jsonl")
    with pytest.raises(SystemExit) as stop:
        run_cli("posttrain.py", lambda: posttrain.main(nargv(neat, "--train-iters", "1", metrics=metrics)))
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"posttrain.py: error: --metrics-file {metrics} cannot be written (File exists: "
                      f"{tmp_path / 'file'}): pass a --metrics-file in a directory this job can write"], errors


def test_a_missing_data_prefix_is_refused_before_the_model_is_built(tmp_path, monkeypatch, eos_packs):
    """A typo in --data-path (or --valid-data-path) was reported by the data setup, after the model and optimizer were
    built and a HF --load's weights read: minutes on a GPU cluster to learn of it."""
    from mindspeed_pack.training import posttrain as posttrain_module

    def built(*_, **__):
        raise AssertionError("the run was started")

    monkeypatch.setattr(posttrain_module, "run", built)
    neat, _ = eos_packs
    for flags in (["--data-path", str(tmp_path / "typo")],
                  ["--train-data-path", neat, "--valid-data-path", str(tmp_path / "typo")]):
        with pytest.raises(DataError, match=r"data prefix .*typo.*: missing .*typo_packed_input_ids_document\.bin"):
            posttrain.main([*TINY_FLAGS, "--seq-length", "128", "--train-iters", "1", "--neat-pack", *flags])


def test_a_missing_rollout_path_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """--stage grpo/score with a typo in --rollout-path built the model and read a --load's weights first, then said
    "--input '...' does not exist", naming a flag posttrain.py does not have."""
    from mindspeed_pack.training import posttrain as posttrain_module

    def built(*_, **__):
        raise AssertionError("the run was started")

    monkeypatch.setattr(posttrain_module, "run", built)
    typo = str(tmp_path / "typo.jsonl")
    base = [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--max-seqlen-per-dp-cp-rank", "64", "--train-iters", "1", "--rollout-path", typo]
    for stage in (["--stage", "grpo"], ["--stage", "score", "--score-output", str(tmp_path / "out.jsonl")]):
        with pytest.raises(DataError, match=rf"^--rollout-path '{re.escape(typo)}' does not exist$"):
            posttrain.main([*base, *stage])


def _cli_error(monkeypatch, capsys, argv_, env):
    """``posttrain.py ARGV`` in this process with torchrun's rank variables ``env``: (exit code, error lines)."""
    import sys

    from mindspeed_pack.runtime import error_scope

    monkeypatch.setattr(error_scope, "QUIET_EXIT_DELAY_S", 0)  # the wait that lets rank 0 print under torchrun
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["posttrain.py", *argv_])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        posttrain.cli()
    return exit_.value.code, [line for line in capsys.readouterr().err.splitlines() if "error:" in line]


@pytest.mark.parametrize("extra,message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),  # the parser's refusal
    (["--bf16", "--fp16"], "--bf16 and --fp16 cannot be used together"),  # a check of the combination
    (["--eval-interval", "0"], "--eval-interval 0 must be >= 1"),  # a value out of range
    (["--stage", "dpo", "--dpo-beta", "0"], "--dpo-beta 0.0 must be a finite number > 0"),  # the stage's check
    (["--stage", "orpo", "--pref-ftx", "0.2"], "--pref-ftx 0.2 with --stage orpo"),  # the stage's constructor
])
def test_a_flag_error_is_printed_once_per_job_by_rank_0(neat, monkeypatch, capsys, extra, message):
    """torchrun --nproc-per-node 8 posttrain.py BAD-FLAGS printed the same error line from all 8 ranks,
    interleaved: a refusal of the command line, which every rank parses alike, is printed by rank 0 alone; every
    rank exits 2."""
    flags = nargv(neat, "--train-iters", "1", *extra)
    for env, printed in (({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, False),
                         ({"RANK": "1"}, False),
                         ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, True),
                         ({}, True)):  # plain python: a world of one
        code, errors = _cli_error(monkeypatch, capsys, flags, env)
        assert code == 2, (env, errors)
        assert (len(errors) == 1 and message in errors[0]) if printed else errors == [], (env, errors)


def test_an_error_about_files_is_printed_once_per_node(neat, tmp_path, monkeypatch, capsys):
    """What depends on files is printed by each node's local rank 0 (another node may hold another copy, or none):
    a --config file, a data prefix missing (every rank of a node checks the same path; it was printed by each)."""
    missing = ["--config", str(tmp_path / "none.yaml")]
    for env, printed in (({"RANK": "8", "LOCAL_RANK": "0"}, True), ({"RANK": "9", "LOCAL_RANK": "1"}, False)):
        code, errors = _cli_error(monkeypatch, capsys, nargv(neat, "--train-iters", "1", *missing), env)
        assert code == 2 and len(errors) == int(printed) and all("none.yaml: no such file" in e for e in errors)
    flags = argv(str(tmp_path / "gone"), "--neat-pack", "--train-iters", "1")
    for env, printed in (({"RANK": "8", "LOCAL_RANK": "0"}, True), ({"RANK": "9", "LOCAL_RANK": "1"}, False)):
        code, errors = _cli_error(monkeypatch, capsys, flags, env)
        assert code == 2 and len(errors) == int(printed) and all("gone" in e for e in errors), errors


def test_pretrain_gpt_flag_error_is_printed_by_rank_0_only(neat, monkeypatch, capsys):
    import pretrain_gpt
    from mindspeed_pack.runtime import error_scope

    monkeypatch.setattr(error_scope, "QUIET_EXIT_DELAY_S", 0)
    for env, printed in (({"RANK": "3", "LOCAL_RANK": "3"}, False), ({"RANK": "0"}, True)):
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *TINY_FLAGS, "--no-such-flag"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            pretrain_gpt.cli()
        assert exit_.value.code == 2
        assert ("unrecognized arguments: --no-such-flag" in capsys.readouterr().err) == printed
