"""Every scheduler trains the samples preprocessing wrote (issue 28, items 1, 4 and 10).

Data: the toy ShareGPT conversations (1-3 turns each) through ``preprocess_data.py`` with the
``qwen`` template, whose EOS ``<|im_end|>`` also ends the system and user turns. Checked on the
trained numbers and the written tokens:

* plain ``--pack`` records each pack's sample lengths, so ``--reset-attention-mask`` finds
  exactly the samples written (not one per message) and trains as ``--neat-pack`` does;
  data written before that is refused where the EOS does not find the samples;
* ``--sequence-packing-scheduler dp_balanced`` gives the same loss, samples per pack, padding
  ratio and model FLOPs as scheduler ``none`` on the same global batch;
* model FLOPs count real lengths only: ``--pad-to-multiple-of`` pads are not work.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import posttrain
from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.datasets.packed_dataset import DataError, PackedBatchSource
from mindspeed_pack.packing.balance import cost_model
from mindspeed_pack.training.batches import to_packed_batch
from tests.data_utils import read_metrics, rel_err
from tests.model_utils import TINY_FLAGS
from tests.train_utils import sft_trainer

SEQ = 256
VOCAB = ["--padded-vocab-size", "768"]  # the toy tokenizer has 660 ids
DP_BALANCED = ["--sequence-packing-scheduler", "dp_balanced"]


def _preprocess(toy_tokenizer_dir, source, out, *flags, seq=SEQ):
    from mindspeed_pack.datasets.preprocess import main

    assert main(["--input", str(source), "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--output-prefix", str(out),
                 "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen",
                 "--seq-length", str(seq), *flags]) == 0
    return str(out)


def _meta(prefix):
    with open(f"{prefix}_packed_meta.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def data(tmp_path_factory, toy_sharegpt_jsonl, toy_tokenizer_dir):
    out = tmp_path_factory.mktemp("boundaries")
    runs = {"plain": ["--pack"], "neat8": ["--pack", "--neat-pack", "--pad-to-multiple-of", "8"],
            "unpacked": [], "unpacked8": ["--pad-to-multiple-of", "8"]}
    return {name: _preprocess(toy_tokenizer_dir, toy_sharegpt_jsonl, out / name, *flags) for name, flags in runs.items()}


def _train(prefix, tmp_path, name, *flags, gbs=8, mbs=2, iters=2):
    metrics = str(tmp_path / f"{name}.jsonl")
    posttrain.main([*TINY_FLAGS, *VOCAB, "--seq-length", str(SEQ), "--micro-batch-size", str(mbs),
                    "--global-batch-size", str(gbs), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1",
                    "--train-iters", str(iters), "--no-shuffle", "--split", "100,0,0", "--data-path", prefix,
                    "--metrics-file", metrics, *flags])
    return read_metrics(metrics)


def _assert_same_steps(got, want, keys=("lm loss", "samples per pack", "padding ratio", "tokens", "model TFLOPs")):
    assert sorted(got) == sorted(want) and want
    for it in want:
        for key in keys:
            assert rel_err(got[it][key], want[it][key]) <= 1e-6, (it, key, got[it][key], want[it][key])


def _real_figures(unpacked_prefix, docs=None):
    """(tokens, sum of squared lengths) of the samples, from the run without --pad-to-multiple-of."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(f"{unpacked_prefix}_packed_input_ids_document")
    lengths = np.array(ds.sequence_lengths, np.int64)  # a copy: the index is memory-mapped by ds
    lengths = lengths if docs is None else lengths[:docs]
    return int(lengths.sum()), int((lengths * lengths).sum())


# item 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--reset-attention-mask", "--reset-position-ids"], ["--per-sample-loss"]],
                         ids=["reset-flags", "per-sample-loss"])
def test_dp_balanced_on_plain_packs_trains_as_scheduler_none(tmp_path, data, flags):
    none = _train(data["plain"], tmp_path, "none", *flags)
    balanced = _train(data["plain"], tmp_path, "dp", *flags, *DP_BALANCED)
    _assert_same_steps(balanced, none)
    assert all(r["samples per pack"] > 2 for r in none.values())  # the samples were found, not one per pack


def test_plain_packs_trained_as_rows_count_their_samples(tmp_path, data):
    """Plain --pack rows trained whole (no reset flags) still hold the samples preprocessing recorded: samples per
    pack logged 1.00 for them, as if each row were one sample."""
    plain = _train(data["plain"], tmp_path, "rows")
    with_flags = _train(data["plain"], tmp_path, "reset", "--reset-attention-mask", "--reset-position-ids")
    for it in with_flags:
        assert with_flags[it]["samples per pack"] > 2
        assert plain[it]["samples per pack"] == with_flags[it]["samples per pack"]


# items 1 and 4 ---------------------------------------------------------------------------------
def test_dp_balanced_on_padded_packs_counts_real_lengths_as_scheduler_none(tmp_path, data):
    """One global batch of every pack: tokens and model FLOPs are the samples' own, pads left out."""
    packs = _meta(data["neat8"])["statistics"]["packs"]
    runs = {name: _train(data["neat8"], tmp_path, name, "--neat-pack", *extra, gbs=packs, mbs=1, iters=1)
            for name, extra in (("none", []), ("dp", DP_BALANCED))}
    _assert_same_steps(runs["dp"], runs["none"])
    tokens, sum_sq = _real_figures(data["unpacked"])
    args = parse_args([*TINY_FLAGS, *VOCAB, "--seq-length", str(SEQ), "--train-iters", "1", "--data-path", "x"])
    for run in runs.values():
        assert run[1]["tokens"] == tokens
        assert run[1]["model TFLOPs"] == pytest.approx(cost_model(args).flops(tokens, sum_sq) / 1e12, rel=1e-9)


def test_online_packing_of_padded_samples_counts_real_lengths(tmp_path, data):
    docs = 40
    none = _train(data["unpacked8"], tmp_path, "none", gbs=docs, mbs=1, iters=1)
    online = _train(data["unpacked8"], tmp_path, "online", *DP_BALANCED, gbs=docs, mbs=1, iters=1)
    _assert_same_steps(online, none, keys=("lm loss", "tokens", "model TFLOPs"))
    tokens, sum_sq = _real_figures(data["unpacked"], docs)
    args = parse_args([*TINY_FLAGS, *VOCAB, "--seq-length", str(SEQ), "--train-iters", "1", "--data-path", "x"])
    assert online[1]["tokens"] == tokens
    assert online[1]["model TFLOPs"] == pytest.approx(cost_model(args).flops(tokens, sum_sq) / 1e12, rel=1e-9)


# item 10 ---------------------------------------------------------------------------------------
TWO_CONVERSATIONS = [
    {"system": "Answer briefly.", "conversations": [
        {"from": "human", "value": "name a colour"}, {"from": "gpt", "value": "red"},
        {"from": "human", "value": "and another one"}, {"from": "gpt", "value": "blue, or green"}]},
    {"conversations": [
        {"from": "human", "value": "two plus two"}, {"from": "gpt", "value": "four"},
        {"from": "human", "value": "times three"}, {"from": "gpt", "value": "twelve"},
        {"from": "human", "value": "minus one"}, {"from": "gpt", "value": "eleven"}]},
]


@pytest.fixture(scope="module")
def two_samples(tmp_path_factory, toy_tokenizer_dir):
    """The two multi-turn conversations in one pack: plain and --neat-pack."""
    out = tmp_path_factory.mktemp("two")
    source = out / "two.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in TWO_CONVERSATIONS))
    return {name: _preprocess(toy_tokenizer_dir, source, out / name, "--pack", *flags)
            for name, flags in (("plain", []), ("neat", ["--neat-pack"]))}


def _first_batch(prefix, *flags, source=None, pack_costs=False):
    """The first micro-batch as the trainer builds it (or, ``pack_costs``, the sample lengths the
    dp_balanced cost model reads from the first pack)."""
    trainer = sft_trainer(parse_args([*TINY_FLAGS, *VOCAB, "--seq-length", str(SEQ), "--micro-batch-size", "1",
                                  "--global-batch-size", "1", "--train-iters", "1", "--split", "100,0,0",
                                  "--data-path", prefix, *flags]), source or PackedBatchSource())
    trainer.setup()
    try:
        if pack_costs:
            return trainer.source._pack_segments(trainer.source.splits["train"], 0).tolist()
        return to_packed_batch(next(trainer.source.micro_batches("train", 0)), trainer.args)
    finally:
        trainer.cleanup()


def test_plain_pack_records_its_samples_and_trains_them_as_neat_pack(tmp_path, two_samples, read_indexed):
    plain, neat = two_samples["plain"], two_samples["neat"]
    meta = _meta(plain)
    assert meta["statistics"]["samples_written"] == 2 and meta["statistics"]["packs"] == 1
    assert meta["layout"]["sample_lengths"] == os.path.basename(plain) + "_packed_sample_lengths"
    # the written boundaries are the neat pack's segments; the MindSpeed-LLM files are untouched
    (lengths,) = read_indexed(f"{plain}_packed_sample_lengths")
    (segments,) = read_indexed(f"{neat}_packed_attention_mask_document")
    assert lengths.tolist() == [int((segments == k).sum()) for k in (1, 2)]
    assert (read_indexed(f"{plain}_packed_attention_mask_document")[0] == 1).all()
    for key in ("input_ids", "labels"):
        assert np.array_equal(read_indexed(f"{plain}_packed_{key}_document")[0],
                              read_indexed(f"{neat}_packed_{key}_document")[0])
    # training finds exactly 2 samples (the EOS would find one per message), positions as --neat-pack
    isolated = _first_batch(neat, "--neat-pack")
    found = _first_batch(plain, "--reset-attention-mask", "--reset-position-ids")
    assert found.num_samples == isolated.num_samples == 2
    for field in ("cu_seqlens", "position_ids", "target", "loss_mask"):
        assert torch.equal(getattr(found, field), getattr(isolated, field)), field
    # the dp_balanced cost model reads the same samples (it took the pack as one 256-token sample)
    from mindspeed_pack.datasets.online_packing import BalancedBatchSource

    assert _first_batch(plain, "--reset-attention-mask", *DP_BALANCED, source=BalancedBatchSource(),
                        pack_costs=True) == lengths.tolist()
    a = _train(neat, tmp_path, "neat", "--neat-pack", gbs=1, mbs=1)
    b = _train(plain, tmp_path, "plain", "--reset-attention-mask", "--reset-position-ids", gbs=1, mbs=1)
    _assert_same_steps(b, a, keys=("lm loss", "samples per pack", "padding ratio"))


def test_plain_pack_without_recorded_samples_refuses_the_eos_rule_for_chat_turns(tmp_path, two_samples):
    """Data written before the boundaries were recorded: qwen's EOS ends every turn (a system turn
    and 2 per exchange: 5 + 7 pieces), so refuse."""
    old = str(tmp_path / "old")
    for suffix in ("input_ids", "attention_mask", "labels"):
        for ext in (".bin", ".idx"):
            shutil.copy(f"{two_samples['plain']}_packed_{suffix}_document{ext}", f"{old}_packed_{suffix}_document{ext}")
    meta = _meta(two_samples["plain"])
    del meta["layout"]["sample_lengths"]
    with open(f"{old}_packed_meta.json", "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError, match=r"into 12 pieces where preprocessing wrote 2 samples \(the template qwen .*"
                                        r"Re-run preprocess_data.py"):
        _first_batch(old, "--reset-attention-mask")
    _first_batch(old)  # without the flags nothing needs the samples


def test_recorded_sample_lengths_of_other_packs_are_refused(tmp_path, two_samples, read_indexed):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from mindspeed_pack.datasets.packed_dataset import PackedDocuments
    from mindspeed_pack.datasets.validation import validate_packed_documents

    where = os.path.dirname(two_samples["plain"])
    for name in os.listdir(where):
        if name.startswith("plain_packed"):
            shutil.copy(os.path.join(where, name), str(tmp_path / name.replace("plain", "copy", 1)))
    copy = str(tmp_path / "copy")
    meta = _meta(copy)
    meta["layout"]["sample_lengths"] = "copy_packed_sample_lengths"
    with open(f"{copy}_packed_meta.json", "w") as f:
        json.dump(meta, f)
    (lengths,) = read_indexed(f"{copy}_packed_sample_lengths")
    builder = IndexedDatasetBuilder(f"{copy}_packed_sample_lengths.bin", dtype=np.int32)
    # a boundary one token early: the second sample would start on the first one's trained EOS
    builder.add_document(np.array([lengths[0] - 1, lengths[1] + 1], np.int32), [2])
    builder.finalize(f"{copy}_packed_sample_lengths.idx")
    args = parse_args([*TINY_FLAGS, *VOCAB, "--seq-length", str(SEQ), "--train-iters", "1", "--data-path", copy])
    with pytest.raises(DataError, match=r"copy_packed_sample_lengths: pack 0 has a sample starting at position \d+"):
        validate_packed_documents(PackedDocuments(copy), args)
    builder = IndexedDatasetBuilder(f"{copy}_packed_sample_lengths.bin", dtype=np.int32)
    builder.add_document(np.array([lengths[0], SEQ], np.int32), [2])  # more than the pack holds
    builder.finalize(f"{copy}_packed_sample_lengths.idx")
    with pytest.raises(DataError, match=rf"copy_packed_sample_lengths: pack 0 has samples of {lengths[0] + SEQ} "
                                        rf"tokens in all, more than the {SEQ} a pack holds"):
        validate_packed_documents(PackedDocuments(copy), args)


def test_plain_pack_without_recorded_samples_keeps_the_eos_rule_where_it_finds_the_samples(tmp_path, read_indexed):
    """Single-turn samples whose template puts the EOS only at the end: MindSpeed-LLM's rule is exact."""
    from tests.data_utils import write_packed_instruction_dataset

    neat, plain = (write_packed_instruction_dataset(str(tmp_path / name), num_packs=4, seq_length=SEQ, neat_pack=is_neat,
                                                    eos_id=2, pad_id=0, prompt_type="alpaca")
                   for name, is_neat in (("neat", True), ("plain", False)))
    written = sum(int(m.max()) for m in read_indexed(f"{neat}_packed_attention_mask_document"))
    for count in (written, written + 1):
        meta = _meta(plain)
        meta["statistics"] = {"samples_written": count, "packs": 4}
        with open(f"{plain}_packed_meta.json", "w") as f:
            json.dump(meta, f)
        if count == written:
            found = _first_batch(plain, "--reset-attention-mask")
            assert torch.equal(found.cu_seqlens, _first_batch(neat, "--neat-pack").cu_seqlens)
        else:
            with pytest.raises(DataError, match=rf"into {written} pieces where preprocessing wrote {count} samples "
                                                r"\(the template alpaca"):
                _first_batch(plain, "--reset-attention-mask")
