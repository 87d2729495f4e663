"""pretrain_gpt.py: GPTDataset samples become packed rows whose documents are isolated exactly."""
import numpy as np
import pytest
import torch

import pretrain_gpt
from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.datasets.pretrain_dataset import GPTBatchSource, build_tokenizer, row_from_sample
from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.training.batches import packed_seq_params, to_packed_batch
from mindspeed_pack.training.stages.sft import loss_func
from tests.data_utils import random_documents, read_metrics, rel_err, write_pretrain_documents
from tests.model_utils import TINY_FLAGS, init_single_process

EOD = 2
S = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pretrain")
    a = write_pretrain_documents(str(d / "A_text_document"), random_documents(120, EOD, seed=1, max_len=40))
    b = write_pretrain_documents(str(d / "B_text_document"), random_documents(60, EOD, seed=2, max_len=40))
    return a, b


def argv(*extra):
    return [*TINY_FLAGS, "--seq-length", str(S), "--micro-batch-size", "2", "--global-batch-size", "4",
            "--eod-id", str(EOD), "--lr", "1e-3", *extra]


def pretrain_args(*extra):
    return parse_args(argv(*extra), world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)


def first_batch(corpus, *flags):
    init_single_process()
    args = pretrain_args("--data-path", corpus[0], "--train-iters", "2", *flags)
    source = GPTBatchSource()
    source.setup(args, {"train": 8, "valid": 0})
    return args, next(source.micro_batches("train", 0))


def summed_loss(model, mb, args):
    batch = to_packed_batch(mb, args)
    with torch.no_grad():
        out = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                    packed_seq_params=packed_seq_params(batch))
    loss, count, _ = loss_func(batch, False, out)
    return float(loss), int(count)


def test_row_of_documents_equals_documents_alone(corpus):
    args, mb = first_batch(corpus, "--reset-attention-mask", "--reset-position-ids")
    assert mb["segment_ids"] is not None and int(mb["segment_ids"].max()) >= 3  # several documents per row
    torch.manual_seed(0)
    model = build_gpt_model(args)
    model.eval()
    packed_sum, packed_count = summed_loss(model, mb, args)

    alone_sum, alone_count = 0.0, 0
    for ids, seg in zip(mb["input_ids"], mb["segment_ids"]):
        for k in seg.unique().tolist():
            doc = ids[seg == k]
            one = {"input_ids": doc[None], "labels": doc[None].clone(), "segment_ids": torch.ones_like(doc)[None]}
            s, c = summed_loss(model, one, args)
            alone_sum, alone_count = alone_sum + s, alone_count + c
    assert packed_count == alone_count
    assert rel_err(packed_sum / packed_count, alone_sum / alone_count) <= 1e-5

    leaky = dict(mb, segment_ids=None)  # negative control: the same row without isolation
    leaky_sum, leaky_count = summed_loss(model, leaky, args)
    assert rel_err(leaky_sum / leaky_count, alone_sum / alone_count) > 1e-4


def test_document_end_never_predicts_next_document(corpus):
    args, mb = first_batch(corpus, "--reset-attention-mask")
    batch = to_packed_batch(mb, args)
    tokens, mask = batch.tokens[0], batch.loss_mask[0]
    eod_pos = torch.nonzero(tokens == EOD).squeeze(1)
    assert len(eod_pos) > 2
    assert mask[eod_pos].sum() == 0  # an EOD closes its segment: no target after it
    # predicting EOD itself is trained (a content token followed by EOD in the same document)
    before_eod = eod_pos[eod_pos % S > 0] - 1
    assert mask[before_eod].sum() == len(before_eod)
    assert bool((batch.target[0][before_eod] == EOD).all())


@pytest.mark.parametrize("isolate", [False, True])
def test_eod_mask_loss_removes_exactly_the_targets_after_eod(corpus, isolate):
    flags = ["--reset-attention-mask"] if isolate else []
    args, mb = first_batch(corpus, *flags)
    args_masked, mb_masked = first_batch(corpus, *flags, "--eod-mask-loss")
    assert torch.equal(mb["input_ids"], mb_masked["input_ids"])
    plain = to_packed_batch(mb, args).loss_mask[0]
    masked = to_packed_batch(mb_masked, args_masked).loss_mask[0]
    tokens = mb["input_ids"].reshape(-1)
    last_of_row = torch.arange(tokens.numel()) % S == S - 1
    removed = (plain == 1) & (masked == 0)
    assert not bool(((masked == 1) & (plain == 0)).any())
    if isolate:  # the segment shift already dropped them
        assert not bool(removed.any())
    else:
        expected = (tokens == EOD) & ~last_of_row
        assert int(expected.sum()) > 2
        assert torch.equal(removed, expected)


def test_row_from_sample_handles_padding():
    # a short validation sample as GPTDataset returns it: padding -> token 0, loss_mask 0 on padded labels
    sample = {"tokens": torch.tensor([5, 6, EOD, 7, 0, 0]), "loss_mask": torch.tensor([1., 1., 1., 0., 0., 0.])}
    row = row_from_sample(sample, EOD, isolate=True, eod_mask_loss=True)
    assert row["segment_ids"].tolist() == [1, 1, 1, 2, 0, 0]
    assert row["labels"].tolist() == [5, 6, EOD, 7, -100, -100]
    assert row["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1]


def test_tokenizer_eos_is_the_eod(toy_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    args = parse_args([*TINY_FLAGS, "--seq-length", "32", "--train-iters", "1", "--data-path", "x",
                       "--tokenizer-name-or-path", str(toy_tokenizer_dir)], world_size=1,
                      extra_args_provider=pretrain_gpt.pretrain_args)
    t = build_tokenizer(args)
    assert t.eod == tok.eos_token_id and t.vocab_size == len(tok)


def test_eod_and_vocabulary_come_from_the_preprocessing_sidecar(tmp_path, corpus):
    import json
    import shutil

    from mindspeed_pack.datasets.packed_dataset import DataError
    from mindspeed_pack.datasets.pretrain_dataset import resolve_pretrain_vocab_size

    prefix = str(tmp_path / "P_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(corpus[0] + ext, prefix + ext)
    with open(str(tmp_path / "P_text_meta.json"), "w") as f:
        json.dump({"cache_key": {"tokenizer": {"vocab_size": 200, "eos_id": EOD}},  # as preprocess_data.py writes
                   "layout": {"kind": "text_documents", "eod_id": EOD, "append_eod": True}}, f)
    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    base = [*flags, "--seq-length", "32", "--train-iters", "1", "--data-path", prefix]
    args = parse_args(base, world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)
    resolve_pretrain_vocab_size(args)
    assert (args.vocab_size, args.padded_vocab_size) == (200, 256)
    assert build_tokenizer(args).eod == EOD
    args = parse_args(base + ["--eod-id", "5"], world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)
    with pytest.raises(DataError, match="--eod-id 5, but preprocessing ended the documents with 2"):
        build_tokenizer(args)
    # a vocabulary too small for the recorded EOD names where the id came from (it named an --eod-id never given)
    args = parse_args([*base, "--padded-vocab-size", "2"], world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)
    with pytest.raises(DataError, match=r"^the end-of-document id preprocessing recorded \(_text_meta.json\), 2, is "
                                        r"outside the vocabulary \[0, 2\)"):
        build_tokenizer(args)


def test_pretrain_gpt_blend_eval_and_exact_resume(tmp_path, corpus):
    """The whole script: a 0.3/0.7 blend, a validation split, and a resume from iteration 2."""
    a, b = corpus
    common = ["--data-path", "0.3", a, "0.7", b, "--split", "90,10,0", "--train-iters", "4",
              "--eval-interval", "2", "--eval-iters", "1", "--reset-attention-mask", "--reset-position-ids",
              "--eod-mask-loss", "--data-cache-path", str(tmp_path / "cache")]
    full = str(tmp_path / "full.jsonl")
    trainer = pretrain_gpt.main(argv(*common, "--metrics-file", full))
    ref, ref_valid = read_metrics(full), read_metrics(full, "valid")
    assert sorted(ref) == [1, 2, 3, 4] and sorted(ref_valid) == [2, 4]
    assert all(np.isfinite(r["lm loss"]) for r in ref.values())
    assert trainer.source.splits["train"].weights == pytest.approx([0.3, 0.7])

    ckpt = str(tmp_path / "ckpt")
    pretrain_gpt.main(argv(*common, "--metrics-file", str(tmp_path / "first.jsonl"), "--save", ckpt,
                           "--exit-interval", "2"))
    resumed = str(tmp_path / "resumed.jsonl")
    pretrain_gpt.main(argv(*common, "--metrics-file", resumed, "--load", ckpt))
    got = read_metrics(resumed)
    assert sorted(got) == [3, 4]
    for it in (3, 4):
        assert rel_err(got[it]["lm loss"], ref[it]["lm loss"]) <= 1e-6
    assert rel_err(read_metrics(resumed, "valid")[4]["lm loss"], ref_valid[4]["lm loss"]) <= 1e-6


def test_raw_files_are_tokenised_into_documents_in_one_command(tmp_path, toy_tokenizer_dir, capsys):
    """pretrain_gpt.py --data-path corpus.jsonl (MindSpeed-LLM's pretrain scripts pass --handler-name
    GeneralPretrainHandler): the documents preprocess_data.py writes, cached, trained with the same losses as
    the two commands; Megatron-LM's --json-keys names the text field."""
    import json

    from mindspeed_pack.data import toy
    from mindspeed_pack.datasets.preprocess import main as preprocess_main

    raw = tmp_path / "corpus.jsonl"
    raw.write_text("".join(json.dumps({"content": r["text"]}) + "\n" for r in toy.generate_pretrain_text(80, seed=3)))
    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    run = [*flags, "--seq-length", str(S), "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
           "--train-iters", "3", "--reset-attention-mask", "--reset-position-ids", "--tokenizer-name-or-path",
           str(toy_tokenizer_dir), "--make-vocab-size-divisible-by", "64"]
    assert preprocess_main(["--input", str(raw), "--output-prefix", str(tmp_path / "two" / "c"), "--handler-name",
                            "GeneralPretrainHandler", "--json-keys", "content", "--append-eod",
                            "--tokenizer-name-or-path", str(toy_tokenizer_dir)]) == 0
    two = str(tmp_path / "two.jsonl")
    pretrain_gpt.main([*run, "--data-path", str(tmp_path / "two" / "c_text_document"), "--metrics-file", two])
    one = str(tmp_path / "one.jsonl")
    trainer = pretrain_gpt.main([*run, "--data-path", str(raw), "--handler-name", "GeneralPretrainHandler",
                                 "--json-keys", "content", "--append-eod", "--workers", "2", "--metrics-file", one])
    assert trainer.args.data_path[0].endswith("_text_document") and trainer.args.raw_data_path == [str(raw)]
    got, want = read_metrics(one), read_metrics(two)
    assert sorted(got) == [1, 2, 3] and all(got[i]["lm loss"] == want[i]["lm loss"] for i in got)
    for bad, message in ((["--json-keys", "content", "text"], "one field per run here"),
                         (["--json-keys", "content", "--handler-name", "AlpacaStyleInstructionHandler",
                           "--prompt-type", "qwen"], "AlpacaStyleInstructionHandler takes --map-keys")):
        capsys.readouterr()
        assert preprocess_main(["--input", str(raw), "--output-prefix", str(tmp_path / "bad" / "c"),
                                "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--handler-name",
                                "GeneralPretrainHandler", *bad]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an instruction handler writes packs: posttrain.py's
        parse_args([*run, "--data-path", str(raw), "--handler-name", "AlpacaStyleInstructionHandler"],
                   extra_args_provider=pretrain_gpt.pretrain_args)


@pytest.mark.parametrize("flag, why", [
    (["--padded-samples"], "GPTDataset cuts the documents into rows over as many epochs as the iterations need"),
    (["--sequence-packing-scheduler", "dp_balanced"], "every row of pretrain_gpt.py is --seq-length tokens"),
    (["--neat-pack"], "--reset-attention-mask --reset-position-ids isolate them at each EOD"),
])
def test_posttrain_packing_flags_are_refused_not_ignored(corpus, capsys, flag, why):
    """--padded-samples and --sequence-packing-scheduler dp_balanced did nothing to GPTDataset's rows, and --neat-pack
    silently meant --reset-attention-mask --reset-position-ids; MindSpeed-LLM's pretrain scripts pass none of them."""
    with pytest.raises(SystemExit):
        pretrain_args("--data-path", corpus[0], "--train-iters", "2", *flag)
    err = capsys.readouterr().err
    assert f"error: {' '.join(flag)} is posttrain.py's, not pretrain_gpt.py's: " in err and why in err, err


def _raw_corpus(path, seed):
    import json

    from mindspeed_pack.data import toy

    path.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in toy.generate_pretrain_text(60, seed=seed)))
    return str(path)


def test_a_weighted_blend_of_raw_files_trains_as_the_blend_of_their_documents(tmp_path, toy_tokenizer_dir):
    """pretrain_gpt.py --data-path 0.3 a.jsonl 0.7 b.jsonl took the weight for a packed prefix; each file is now
    tokenised into its own cached documents and blended with the weights: the losses of the two commands."""
    from mindspeed_pack.datasets.preprocess import main as preprocess_main

    a, b = _raw_corpus(tmp_path / "a.jsonl", 3), _raw_corpus(tmp_path / "b.jsonl", 4)
    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    run = [*flags, "--seq-length", str(S), "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
           "--train-iters", "3", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
           "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--make-vocab-size-divisible-by", "64"]
    for name, raw in (("a", a), ("b", b)):
        assert preprocess_main(["--input", raw, "--output-prefix", str(tmp_path / "two" / name), "--handler-name",
                                "GeneralPretrainHandler", "--append-eod", "--tokenizer-name-or-path",
                                str(toy_tokenizer_dir)]) == 0
    two = str(tmp_path / "two.jsonl")
    pretrain_gpt.main([*run, "--data-path", "0.3", str(tmp_path / "two" / "a_text_document"), "0.7",
                       str(tmp_path / "two" / "b_text_document"), "--metrics-file", two])
    one = str(tmp_path / "one.jsonl")
    trainer = pretrain_gpt.main([*run, "--data-path", "0.3", a, "0.7", b, "--append-eod", "--metrics-file", one])
    assert trainer.args.data_path[0::2] == ["0.3", "0.7"] and all(p.endswith("_text_document")
                                                                  for p in trainer.args.data_path[1::2])
    assert trainer.args.raw_data_path == ["0.3", a, "0.7", b]
    assert trainer.source.splits["train"].weights == pytest.approx([0.3, 0.7])
    got, want = read_metrics(one), read_metrics(two)
    assert sorted(got) == [1, 2, 3] and all(got[i]["lm loss"] == want[i]["lm loss"] for i in got)


def test_raw_files_without_append_eod_are_refused_before_they_are_tokenised(tmp_path, toy_tokenizer_dir):
    """--reset-attention-mask on raw files without --append-eod was refused only after tokenising them, saying to
    re-run preprocess_data.py: in the one-command form the flag belongs to this command, checked first."""
    from mindspeed_pack.datasets.packed_documents import DataError

    raw, cache = _raw_corpus(tmp_path / "a.jsonl", 3), tmp_path / "cache"
    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    for data in ([raw], ["1.0", raw]):
        with pytest.raises(DataError, match="^--reset-attention-mask finds documents at their EOD, and the raw "
                                            "--data-path files would be tokenised without one: add --append-eod to "
                                            "this command$"):
            pretrain_gpt.main([*flags, "--seq-length", str(S), "--train-iters", "1", "--reset-attention-mask",
                               "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--data-cache-path", str(cache),
                               "--data-path", *data, "--dry-run"])
    with pytest.raises(DataError, match="^--reset-position-ids finds documents at their EOD"):  # it was silent
        pretrain_gpt.main([*flags, "--seq-length", str(S), "--train-iters", "1", "--reset-position-ids",
                           "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--data-cache-path", str(cache),
                           "--data-path", raw, "--dry-run"])
    assert not cache.exists()


def test_reset_position_ids_alone_restarts_positions_at_eod_and_attends_across(corpus):
    """Megatron-LM's --reset-position-ids without --reset-attention-mask: positions restart after each EOD while a
    row stays one causal sequence (it was a no-op here, with a warning: positions ran 0..s-1)."""
    args, mb = first_batch(corpus, "--reset-position-ids")
    batch = to_packed_batch(mb, args)
    tokens, positions = batch.tokens.reshape(-1), batch.position_ids.reshape(-1)
    assert batch.cu_seqlens.tolist() == [i * S for i in range(len(batch.cu_seqlens))]  # one sequence per row
    want = []
    for row in mb["input_ids"]:
        p = 0
        for t in row.tolist():
            want.append(p)
            p = 0 if t == EOD else p + 1
    assert positions.tolist() == want and sum(v == 0 for v in want) > len(mb["input_ids"])  # restarts happened
    _, plain = first_batch(corpus)
    assert to_packed_batch(plain, args).position_ids.reshape(-1).tolist() == list(range(S)) * len(plain["input_ids"])
    assert torch.equal(tokens, to_packed_batch(plain, args).tokens.reshape(-1))


def test_one_part_of_a_fine_tuning_pack_is_refused_as_documents(tmp_path, corpus):
    """GPTDataset would read a pack's input_ids as documents: prompts trained, a pair's answers run together."""
    import shutil

    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.datasets.pretrain_dataset import check_prefix_files

    part = str(tmp_path / "dpo_packed_input_ids_document")
    for ext in (".bin", ".idx"):
        shutil.copy(corpus[0] + ext, part + ext)
    check_prefix_files([part, corpus[1]])  # no labels, no sidecar beside it: a name alone proves nothing
    (tmp_path / "dpo_packed_meta.json").write_text("{}")
    with pytest.raises(DataError, match="one part of the fine-tuning dataset .*dpo'.*posttrain.py --data-path "):
        check_prefix_files([corpus[1], part])


def _setup_within(args, num_samples, seconds=60):
    """GPTBatchSource.setup in a daemon thread: megatron-core's epoch count never ends on an empty split."""
    import threading

    result = {}

    def target():
        try:
            source = GPTBatchSource()
            source.setup(args, num_samples)
            result["source"] = source
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "building the datasets did not finish (an empty split loops forever)"
    return result


def test_megatron_default_split_on_a_small_corpus_builds_instead_of_hanging(tmp_path, corpus):
    """--split 949,50,1 (Megatron-LM's usual) on 120 + 60 documents: the test split holds none of either; it is
    not built, and the end of training evaluates no test data (megatron-core's GPTDataset counted 0-token epochs
    forever)."""
    init_single_process()
    args = pretrain_args("--data-path", "0.3", corpus[0], "0.7", corpus[1], "--split", "949,50,1",
                         "--train-iters", "2", "--data-cache-path", str(tmp_path / "cache"))
    result = _setup_within(args, {"train": 8, "valid": 4, "test": 4})
    assert "error" not in result, result.get("error")
    splits = result["source"].splits
    assert splits["test"] is None and len(splits["train"]) >= 8 and len(splits["valid"]) >= 4


def test_an_empty_split_that_is_read_is_refused_with_the_counts(tmp_path):
    """Five documents at --split 949,50,1: no validation document, yet validation samples are asked for."""
    init_single_process()
    small = write_pretrain_documents(str(tmp_path / "S_text_document"), random_documents(5, EOD, seed=3))
    args = pretrain_args("--data-path", small, "--split", "949,50,1", "--train-iters", "2",
                         "--data-cache-path", str(tmp_path / "cache"))
    result = _setup_within(args, {"train": 8, "valid": 4})
    assert "the valid split holds no document" in str(result.get("error")) and "(5 documents)" in str(result["error"])


def test_an_unweighted_blend_shorter_than_the_run_is_refused_before_training(tmp_path, corpus):
    """`--data-path A B` (no weights) is one epoch of each in megatron-core: a run reading more stopped when it got
    there ('train data exhausted'), its steps unsaved; now refused at setup with the counts."""
    init_single_process()
    args = pretrain_args("--data-path", corpus[0], corpus[1], "--split", "90,10,0", "--train-iters", "2",
                         "--data-cache-path", str(tmp_path / "cache"))
    with pytest.raises(Exception, match=r"the train split holds \d+ samples .* this run reads 100000") as err:
        GPTBatchSource().setup(args, {"train": 100000, "valid": 4})
    epoch = int(str(err.value).split("the train split holds ")[1].split()[0])
    source = GPTBatchSource()
    source.setup(args, {"train": epoch, "valid": 4})  # one epoch: as before, every sample read
    assert len(source.splits["train"]) == epoch
    weighted = pretrain_args("--data-path", "1", corpus[0], "1", corpus[1], "--split", "90,10,0", "--train-iters",
                             "2", "--data-cache-path", str(tmp_path / "cache"))
    source = GPTBatchSource()
    source.setup(weighted, {"train": epoch + 4, "valid": 4})  # weights draw as many epochs as needed
    assert len(source.splits["train"]) >= epoch + 4


def test_a_missing_document_prefix_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """A typo in pretrain_gpt.py's --data-path was found by GPTDataset's setup, after the model was built."""
    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.training import pretrain

    def built(*_, **__):
        raise AssertionError("the run was started")

    monkeypatch.setattr(pretrain, "run", built)
    with pytest.raises(DataError, match=r"data prefix .*typo_text_document.*: missing .*typo_text_document\.bin"):
        pretrain_gpt.main([*TINY_FLAGS, "--seq-length", "64", "--train-iters", "1", "--eod-id", "1", "--vocab-size",
                           "200", "--data-path", "0.5", str(tmp_path / "typo_text_document"), "0.5",
                           str(tmp_path / "other_text_document")])


def _ranged_documents(prefix, low, seed, n=80):
    """Documents whose tokens lie in [low, low + 80) (EOD aside): a sample's tokens tell which corpus it came from."""
    docs = [np.where(d == EOD, EOD, d % 80 + low).astype(np.int32) for d in random_documents(n, EOD, seed=seed,
                                                                                              max_len=40)]
    return write_pretrain_documents(prefix, docs)


@pytest.fixture(scope="module")
def ranged(tmp_path_factory):
    """Three corpora of disjoint token ranges: A [3, 83), B [90, 170), C [170, 250)."""
    d = tmp_path_factory.mktemp("ranged")
    return {name: _ranged_documents(str(d / f"{name}_text_document"), low, seed)
            for name, low, seed in (("A", 3, 1), ("B", 90, 2), ("C", 170, 3))}


def _corpora_of(tokens) -> set:
    tokens = tokens[tokens != EOD]
    return {name for name, low in (("A", 3), ("B", 90), ("C", 170)) if bool(((tokens >= low) & (tokens < low + 80)).any())}


def _tokens(source, split) -> np.ndarray:
    return np.concatenate([mb["input_ids"].numpy().ravel() for mb in source.micro_batches(split, 0)])


def test_per_split_data_paths_read_each_split_from_its_own_blend(tmp_path, ranged):
    """Megatron-LM's --train-data-path/--valid-data-path (megatron-core's blend_per_split): pretrain_gpt.py refused
    them; each split now reads its own prefix or weighted blend, whole, and nothing of the others'."""
    init_single_process()
    cache = ["--data-cache-path", str(tmp_path / "cache"), "--train-iters", "2"]
    args = pretrain_args("--train-data-path", ranged["A"], "--valid-data-path", ranged["B"], *cache)
    source = GPTBatchSource()
    source.setup(args, {"train": 16, "valid": 8})
    assert _corpora_of(_tokens(source, "train")) == {"A"} and _corpora_of(_tokens(source, "valid")) == {"B"}
    assert source.splits["test"] is None
    # one prefix for a split is megatron-core's GPTDataset of it whole: the samples --data-path A --split 100,0,0 reads
    whole = GPTBatchSource()
    whole.setup(pretrain_args("--data-path", ranged["A"], "--split", "100,0,0", *cache), {"train": 16})
    assert torch.equal(next(whole.micro_batches("train", 0))["input_ids"],
                       next(source.micro_batches("train", 0))["input_ids"])

    args = pretrain_args("--train-data-path", "0.5", ranged["A"], "0.5", ranged["C"], "--valid-data-path",
                         ranged["B"], "--test-data-path", "1", ranged["C"], *cache)
    source = GPTBatchSource()
    source.setup(args, {"train": 40, "valid": 8, "test": 4})
    assert source.splits["train"].weights == pytest.approx([0.5, 0.5])
    assert _corpora_of(_tokens(source, "train")) == {"A", "C"}
    assert _corpora_of(_tokens(source, "valid")) == {"B"} and _corpora_of(_tokens(source, "test")) == {"C"}


def test_pretrain_gpt_trains_on_train_data_path_and_evaluates_on_valid_data_path(tmp_path, ranged, monkeypatch,
                                                                                  caplog):
    """The whole script with per-split data: every training row comes from --train-data-path's blend and every
    validation row from --valid-data-path; the checkpoint records the training blend for a resume's check, which a
    copy of the data in another directory passes."""
    seen = {"train": [], "valid": []}
    original = GPTBatchSource.micro_batches

    def spy(self, split, consumed):
        for mb in original(self, split, consumed):
            seen.setdefault(split, []).append(mb["input_ids"].numpy().ravel())
            yield mb

    monkeypatch.setattr(GPTBatchSource, "micro_batches", spy)
    metrics = str(tmp_path / "m.jsonl")
    trainer = pretrain_gpt.main(argv("--train-data-path", "0.3", ranged["A"], "0.7", ranged["C"], "--valid-data-path",
                                     ranged["B"], "--train-iters", "3", "--exit-interval", "2", "--eval-interval",
                                     "2", "--eval-iters", "1", "--reset-attention-mask", "--data-cache-path",
                                     str(tmp_path / "cache"), "--metrics-file", metrics, "--save",
                                     str(tmp_path / "ckpt")))
    assert sorted(read_metrics(metrics)) == [1, 2] and sorted(read_metrics(metrics, "valid")) == [2]
    assert _corpora_of(np.concatenate(seen["train"])) == {"A", "C"}
    assert _corpora_of(np.concatenate(seen["valid"])) == {"B"}
    assert trainer.source.splits["train"].weights == pytest.approx([0.3, 0.7])
    state = torch.load(str(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"),
                       weights_only=False)
    assert state["data_order"]["train_data_path"] == ["0.3", ranged["A"], "0.7", ranged["C"]]
    # the job moved with its data copied to another disk: the same data, resumed without the other-data warning
    import shutil

    moved = {}
    for name in "ABC":
        for ext in (".bin", ".idx"):
            shutil.copy(ranged[name] + ext, str(tmp_path / f"moved_{name}_text_document{ext}"))
        moved[name] = str(tmp_path / f"moved_{name}_text_document")
    resumed = str(tmp_path / "resumed.jsonl")
    with caplog.at_level("INFO", logger="mindspeed_pack.checkpoint.save_load"):
        pretrain_gpt.main(argv("--train-data-path", "0.3", moved["A"], "0.7", moved["C"], "--valid-data-path",
                               moved["B"], "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                               "--reset-attention-mask", "--data-cache-path",
                               str(tmp_path / "cache"), "--metrics-file", resumed, "--load", str(tmp_path / "ckpt")))
    assert sorted(read_metrics(resumed)) == [3]
    assert "other data" not in caplog.text and f"the data moved (--train-data-path 0.3 {moved['A']} 0.7 " in caplog.text


def test_data_path_with_per_split_paths_is_refused(ranged, capsys, tmp_path, monkeypatch):
    """Megatron-LM asserts: --data-path is divided by --split, the per-split paths are used whole."""
    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.training import pretrain

    with pytest.raises(SystemExit):
        pretrain_args("--data-path", ranged["A"], "--train-data-path", ranged["B"], "--train-iters", "2")
    assert "give --data-path (divided by --split) or --train-data-path/--valid-data-path/--test-data-path, not " \
           "both" in capsys.readouterr().err

    def built(*_, **__):
        raise AssertionError("the run was started")

    monkeypatch.setattr(pretrain, "run", built)
    with pytest.raises(DataError, match=r"data prefix .*typo_text_document.*: missing .*typo_text_document\.bin"):
        pretrain_gpt.main(argv("--train-data-path", ranged["A"], "--valid-data-path", "0.5", ranged["B"], "0.5",
                               str(tmp_path / "typo_text_document"), "--train-iters", "1"))
    with pytest.raises(DataError, match=r"^--valid-data-path/--test-data-path without --train-data-path"):
        pretrain_gpt.main(argv("--valid-data-path", ranged["B"], "--train-iters", "1"))
    with pytest.raises(DataError, match=r"^--train-data-path 0.5 .* give prefixes, or weight-prefix pairs"):
        pretrain_gpt.main(argv("--train-data-path", "0.5", ranged["A"], ranged["C"], "--train-iters", "1"))


def test_raw_files_as_per_split_paths_train_as_their_documents(tmp_path, toy_tokenizer_dir, capsys):
    """--train-data-path 0.3 a.jsonl 0.7 b.jsonl --valid-data-path c.jsonl: each split's raw files are tokenised as
    --data-path's are (a blend's files each into its own documents), with the losses of the two commands."""
    from mindspeed_pack.datasets.preprocess import main as preprocess_main

    a, b, c = (_raw_corpus(tmp_path / f"{n}.jsonl", seed) for n, seed in (("a", 3), ("b", 4), ("c", 5)))
    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    run = [*flags, "--seq-length", str(S), "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
           "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--reset-attention-mask",
           "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--make-vocab-size-divisible-by", "64"]
    for name, raw in (("a", a), ("b", b), ("c", c)):
        assert preprocess_main(["--input", raw, "--output-prefix", str(tmp_path / "two" / name), "--handler-name",
                                "GeneralPretrainHandler", "--append-eod", "--tokenizer-name-or-path",
                                str(toy_tokenizer_dir)]) == 0
    two = str(tmp_path / "two.jsonl")
    docs = {n: str(tmp_path / "two" / f"{n}_text_document") for n in "abc"}
    pretrain_gpt.main([*run, "--train-data-path", "0.3", docs["a"], "0.7", docs["b"], "--valid-data-path", docs["c"],
                       "--metrics-file", two])
    one = str(tmp_path / "one.jsonl")
    trainer = pretrain_gpt.main([*run, "--train-data-path", "0.3", a, "0.7", b, "--valid-data-path", c,
                                 "--append-eod", "--metrics-file", one])
    assert trainer.args.raw_train_data_path == ["0.3", a, "0.7", b] and trainer.args.raw_valid_data_path == [c]
    assert all(p.endswith("_text_document") for p in (*trainer.args.train_data_path[1::2],
                                                      *trainer.args.valid_data_path))
    for split in ("train", "valid"):
        got, want = read_metrics(one, split), read_metrics(two, split)
        assert got and sorted(got) == sorted(want) and all(got[i]["lm loss"] == want[i]["lm loss"] for i in got)
    capsys.readouterr()
    pretrain_gpt.main([*run, "--train-data-path", "0.3", a, "0.7", b, "--valid-data-path", c, "--append-eod",
                       "--dry-run"])
    plan = capsys.readouterr().out
    assert f"train-data-path: ['0.3', {a}, '0.7', {b}]" in plan  # what was given, not the cache
    assert f"# data: train: 0.3 {a} -> documents " in plan and f"; valid: {c} -> documents " in plan


@pytest.mark.parametrize("cache", [True, False])
def test_documents_rewritten_at_the_same_prefix_are_not_read_through_the_old_cached_index(tmp_path, cache):
    """preprocess_data.py run again into the same --output-prefix (a corrected or larger corpus): megatron-core keyed
    its cached sample indices on the prefix's path, not its content, so pretrain_gpt.py read the new documents through
    the old run's indices: here an IndexError in megatron-core (samples cut at the old lengths); a corpus that grew by
    appending documents trained on the old ones only, without a word. The documents' content is now in the key."""
    init_single_process()
    prefix = str(tmp_path / "P_text_document")
    flags = ["--data-path", prefix, "--split", "90,10,0", "--train-iters", "2"]
    if cache:
        flags += ["--data-cache-path", str(tmp_path / "cache")]

    def samples():
        source = GPTBatchSource()
        source.setup(pretrain_args(*flags), {"train": 40, "valid": 4})
        return _tokens(source, "train")

    write_pretrain_documents(prefix, random_documents(120, EOD, seed=1, max_len=40))
    samples()  # caches the sample indices of the 120 documents
    new = random_documents(180, EOD, seed=7, max_len=40)  # other documents, more of them
    write_pretrain_documents(prefix, new)
    got = samples()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fresh_prefix = write_pretrain_documents(str(fresh / "P_text_document"), new)
    flags[1] = fresh_prefix
    if cache:
        flags[-1] = str(fresh / "cache")
    assert np.array_equal(got, samples())


def test_learned_positions_fewer_than_the_sequence_are_refused_by_name(capsys):
    """Megatron-LM's default learned absolute positions with --max-position-embeddings below --seq-length: the
    first step failed in the embedding with torch's bare 'IndexError: index out of range in self'; Megatron-LM
    asserts it in its argument checks. RoPE has no table and keeps taking it."""
    flags = [f if f != "rope" else "learned_absolute" for f in argv("--data-path", "x", "--train-iters", "1")]
    with pytest.raises(SystemExit):
        parse_args([*flags, "--max-position-embeddings", "32"], world_size=1,
                   extra_args_provider=pretrain_gpt.pretrain_args)
    assert (f"--max-position-embeddings 32 is below --seq-length {S}: learned absolute position embeddings have "
            f"no row for positions 32..{S - 1}") in capsys.readouterr().err
    assert parse_args([*flags, "--max-position-embeddings", str(S)], world_size=1,
                      extra_args_provider=pretrain_gpt.pretrain_args).max_position_embeddings == S
    assert pretrain_args("--data-path", "x", "--train-iters", "1", "--max-position-embeddings", "32").seq_length == S


def test_use_checkpoint_args_takes_the_sequence_length_megatron_lm_takes(tmp_path, corpus, capsys):
    """Megatron-LM's --use-checkpoint-args sets --seq-length from the checkpoint when it is not given (a resume
    command of --load, the data and the schedule): here 'missing required arguments: --seq-length'. Without the
    flag it stays required, as there; given, the run's value holds."""
    ckpt = str(tmp_path / "ckpt")
    pretrain_gpt.main(argv("--data-path", corpus[0], "--train-iters", "1", "--save", ckpt))
    resume = argv("--data-path", corpus[0], "--train-iters", "2", "--load", ckpt)
    at = resume.index("--seq-length")
    del resume[at:at + 2]
    args = parse_args([*resume, "--use-checkpoint-args"], world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)
    assert args.seq_length == S and args.flag_sources["seq_length"][1] == "checkpoint"
    assert parse_args([*resume, "--use-checkpoint-args", "--seq-length", "32"], world_size=1,
                      extra_args_provider=pretrain_gpt.pretrain_args).seq_length == 32
    with pytest.raises(SystemExit):
        parse_args(resume, world_size=1, extra_args_provider=pretrain_gpt.pretrain_args)
    assert "missing required arguments: --seq-length" in capsys.readouterr().err


def test_a_missing_document_prefix_is_named_when_the_vocabulary_would_come_from_its_sidecar(tmp_path):
    """Without a tokenizer or vocabulary flag the vocabulary comes from the prefix's _text_meta.json; a prefix that
    is not there (Megatron-LM's name for --json-keys content, P_content_document, where preprocess_data.py wrote
    P_text_document) stopped with 'cannot tell the vocabulary size', not with the missing files."""
    from mindspeed_pack.datasets.packed_documents import DataError

    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    with pytest.raises(DataError, match=r"data prefix .*P_content_document.*: missing .*P_content_document\.bin"):
        pretrain_gpt.main([*flags, "--seq-length", "64", "--train-iters", "1", "--data-path",
                           str(tmp_path / "P_content_document")])
    write_pretrain_documents(str(tmp_path / "P_text_document"), random_documents(4, EOD))
    with pytest.raises(DataError, match=r"P_content_document\.idx; .*P_text_document is there: preprocess_data.py "
                                        r"names the documents _text_document whatever --json-keys reads"):
        pretrain_gpt.main([*flags, "--seq-length", "64", "--train-iters", "1", "--data-path",
                           str(tmp_path / "P_content_document")])


def test_megatron_lms_hugging_face_tokenizer_flags_are_pretrained_from_hf(tmp_path, toy_tokenizer_dir, capsys):
    """Megatron-LM's scripts name a Hugging Face tokenizer --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR:
    preprocess_data.py answered 'invalid choice', pretrain_gpt.py 'only PretrainedFromHF is supported'. Both now read
    it as PretrainedFromHF DIR: the same documents, the same cache entry, the same run."""
    import json

    from mindspeed_pack.data import toy
    from mindspeed_pack.datasets.preprocess import main as preprocess_main

    raw = tmp_path / "corpus.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in toy.generate_pretrain_text(20, seed=4)))
    common = ["--input", str(raw), "--json-keys", "text", "--append-eod"]
    outputs = {}
    for name, flags in (("hf", ["--tokenizer-name-or-path", str(toy_tokenizer_dir)]),
                        ("megatron", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                      str(toy_tokenizer_dir)])):
        assert preprocess_main([*common, "--output-prefix", str(tmp_path / name / "c"), *flags]) == 0
        outputs[name] = [(tmp_path / name / f"c_text_document{ext}").read_bytes() for ext in (".bin", ".idx")]
        meta = json.loads((tmp_path / name / "c_text_meta.json").read_text())
        assert meta["cache_key"]["arguments"]["tokenizer_type"] == "PretrainedFromHF"
    assert outputs["hf"] == outputs["megatron"]

    flags = [f for f in TINY_FLAGS if f not in ("--padded-vocab-size", "256")]
    args = parse_args([*flags, "--seq-length", str(S), "--train-iters", "1", "--data-path",
                       str(tmp_path / "hf" / "c_text_document"), "--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", str(toy_tokenizer_dir)], world_size=1,
                      extra_args_provider=pretrain_gpt.pretrain_args)
    assert (args.tokenizer_type, args.tokenizer_name_or_path, args.tokenizer_model) == (
        "PretrainedFromHF", str(toy_tokenizer_dir), None)
    assert build_tokenizer(args).eod == meta["layout"]["eod_id"]
    assert preprocess_main([*common, "--output-prefix", str(tmp_path / "bad" / "c"), "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", str(toy_tokenizer_dir),
                            "--tokenizer-name-or-path", str(tmp_path)]) == 2
    assert "name two tokenizers: pass one" in capsys.readouterr().err


@pytest.mark.parametrize("weight", ["0", "-0.5"])
def test_a_blend_weight_that_is_not_positive_is_refused_by_name(corpus, weight):
    """'--data-path 1 A 0 B' (a corpus switched off by its weight) failed after the model was built with
    megatron-core's bare AssertionError in BlendedDataset."""
    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.datasets.pretrain_dataset import all_prefixes

    args = pretrain_args("--data-path", "1", corpus[0], weight, corpus[1], "--train-iters", "1")
    with pytest.raises(DataError, match=rf"--data-path 1 .*: the weight of {corpus[1]} is {weight}: blend weights "
                                        r"must be > 0 \(leave a prefix out to read none of it\)"):
        all_prefixes(args)
