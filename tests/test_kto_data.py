"""KTO rows through preprocessing: every sample is packed with its KL partner (its own prompt, the previous
row's completion, as TRL's KTOTrainer pairs them), and its label is recorded per segment."""
import json

import numpy as np
import pytest

from mindspeed_pack.data import toy
from tests.chat_corpus import TEMPLATES

ROWS = 24
OPENAI_KEYS = {"messages": "messages", "role": "role", "content": "content", "user": "user", "assistant": "assistant",
               "label": "kto_tag"}


def _rows(shape: str, n: int = ROWS):
    """(rows, labels, completions): every completion ends with its row number, so a pack tells which row it is."""
    rows, labels, completions = [], [], []
    for i, r in enumerate(toy.generate_alpaca(n, seed=5, max_words=12, with_system=True)):
        label, answer = i % 3 != 1, f"{r['output']} row {i}"
        prompt = f"{r['instruction']}\n{r['input']}"
        if shape == "alpaca":
            rows.append({**r, "output": answer, "label": label})
        elif shape == "sharegpt":
            rows.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                           {"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
                         "system": r["system"], "label": label})
        else:  # OpenAI messages, LLaMA-Factory's kto_tag
            rows.append({"messages": [{"role": "system", "content": r["system"]}, {"role": "user", "content": prompt},
                                      {"role": "assistant", "content": answer}], "kto_tag": label})
        labels.append(label)
        completions.append(answer)
    return rows, labels, completions


def _couples(read_indexed, prefix):
    """[(sample ids, sample labels, partner ids, partner labels, recorded label)] over every pack."""
    ids, seg, lab = (read_indexed(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels"))
    kto = read_indexed(f"{prefix}_packed_kto_labels")
    out = []
    for i, s, t, recorded in zip(ids, seg, lab, kto):
        k = int(s.max())
        assert k % 2 == 0 and len(recorded) == k and (recorded[1::2] == -1).all()
        for j in range(1, k, 2):
            a, b = s == j, s == j + 1
            out.append((i[a], t[a], i[b], t[b], int(recorded[j - 1])))
    return out


@pytest.mark.parametrize("shape,fmt,prompt_type", [("alpaca", "jsonl", "qwen"), ("alpaca", "parquet", "qwen"),
                                                   ("alpaca", "csv", "qwen"), ("sharegpt", "jsonl", "qwen"),
                                                   ("openai", "jsonl", "qwen"), ("openai", "jsonl", "hf")])
def test_each_sample_is_packed_with_its_kl_partner(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir,
                                                   shape, fmt, prompt_type, capsys):
    from transformers import AutoTokenizer

    rows, labels, completions = _rows(shape)
    data = toy.write_dataset(tmp_path / f"kto.{fmt}", rows)
    handler = "AlpacaStyleKTOHandler" if shape == "alpaca" else "SharegptStyleKTOHandler"
    extra = {"map_keys": json.dumps(OPENAI_KEYS)} if shape == "openai" else {}
    if prompt_type == "hf":
        extra["chat_template"] = str(TEMPLATES / "qwen2_5.jinja")
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "k", handler_name=handler,
                                    prompt_type=prompt_type, seq_length=512, pack=True, neat_pack=True, **extra)
    assert code == 0, err
    meta = json.load(open(tmp_path / "k_packed_meta.json"))
    stats = meta["statistics"]
    assert (stats["kto_samples"], stats["desirable"], stats["undesirable"]) == (ROWS, labels.count(True),
                                                                               labels.count(False))
    assert len(stats["data_fingerprint"]) == 16 and meta["layout"]["kto_labels"] == "k_packed_kto_labels"
    assert f"KTO samples {ROWS}" in out
    tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    seen = set()
    for sample, sample_labels, partner, partner_labels, recorded in _couples(read_indexed, tmp_path / "k"):
        text = tok.decode(sample[sample_labels != -100])
        row = int(text.split(" row ")[-1].split("<")[0])
        assert text.startswith(completions[row])  # only the final answer is trained
        # the partner: the same prompt (and context), then the previous row's completion, trained as it was
        start = int(np.argmax(sample_labels != -100))
        assert np.array_equal(partner[:start], sample[:start]) and (partner_labels[:start] == -100).all()
        assert tok.decode(partner[partner_labels != -100]).startswith(completions[row - 1])
        assert recorded == int(labels[row])
        seen.add(row)
    assert seen == set(range(ROWS))
    if shape == "alpaca" and fmt == "jsonl":  # inspect_pack names each segment's role and label
        import re

        from mindspeed_pack.tools import inspect_pack

        assert inspect_pack.main([str(tmp_path / "k"), "--index", "0"]) == 0
        shown = re.findall(r"\(couple (\d+), (sample, desirable|sample, undesirable|KL partner)",
                           capsys.readouterr().out)
        recorded = read_indexed(f"{tmp_path / 'k'}_packed_kto_labels")[0]
        want = {1: "sample, desirable", 0: "sample, undesirable", -1: "KL partner"}
        assert [w for _, w in shown] == [want[int(v)] for v in recorded] and shown[-1][0] == str(len(recorded) // 2)


def test_a_couple_too_long_is_dropped_its_completion_still_a_partner(tmp_path, run_preprocess, read_indexed,
                                                                      toy_tokenizer_dir):
    from transformers import AutoTokenizer

    rows, labels, completions = _rows("alpaca", 8)
    rows[3]["input"] = " ".join(["apple"] * 300)  # its couple cannot fit 512 tokens
    data = toy.write_dataset(tmp_path / "kto.jsonl", rows)
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "k", handler_name="AlpacaStyleKTOHandler",
                                  prompt_type="qwen", seq_length=512, pack=True, neat_pack=True)
    assert code == 0, err
    stats = json.load(open(tmp_path / "k_packed_meta.json"))["statistics"]
    reason = "KTO sample with its KL partner longer than --seq-length"
    assert stats["skipped"] == {reason: 1} and stats["kto_samples"] == 7 and "line 4" in stats["first_skipped"][reason]
    tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    partners = {}
    for sample, sample_labels, partner, partner_labels, _ in _couples(read_indexed, tmp_path / "k"):
        row = int(tok.decode(sample[sample_labels != -100]).split(" row ")[-1].split("<")[0])
        partners[row] = tok.decode(partner[partner_labels != -100])
    assert 3 not in partners and partners[4].startswith(completions[3])


def test_kto_bad_inputs(tmp_path, run_preprocess):
    rows, _, _ = _rows("alpaca", 4)
    for bad, needle in (({"label": "maybe"}, "line 3: field 'label' (--map-keys label) must be true (desirable) or "
                                             "false (undesirable), got 'maybe'"),
                        ({"label": 2}, "line 3: field 'label' (--map-keys label) must be true"),
                        ({"label": None}, "line 3: missing field 'label' (--map-keys label): a KTO row needs its "
                                          "label")):
        data = toy.write_dataset(tmp_path / "bad.jsonl", rows[:2] + [{**rows[2], **bad}] + rows[3:])
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "out" / "k",
                                      handler_name="AlpacaStyleKTOHandler", prompt_type="qwen", seq_length=512,
                                      pack=True, neat_pack=True)
        assert code == 2 and f"bad.jsonl: {needle}" in err, err
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    data = toy.write_dataset(tmp_path / "one.jsonl", rows[:1])
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "out" / "k", handler_name="AlpacaStyleKTOHandler",
                                  prompt_type="qwen", seq_length=512, pack=True, neat_pack=True)
    assert code == 2 and "one usable KTO row: its KL partner needs another row's completion" in err, err
    assert not any((tmp_path / "out").iterdir())


def test_without_pack_each_couple_is_its_own_document(tmp_path, run_preprocess, read_indexed):
    """Without --pack (dynamic context parallelism plans each couple whole): one document per KTO couple, the
    sample segment 1 and its KL partner 2, labelled [label, -1], the same couples as the packs hold."""
    rows, labels, _ = _rows("alpaca")
    data = toy.write_dataset(tmp_path / "kto.jsonl", rows)
    common = dict(input=data, handler_name="AlpacaStyleKTOHandler", prompt_type="qwen", seq_length=512)
    code, _, err = run_preprocess(output_prefix=tmp_path / "u", **common)
    assert code == 0, err
    code, _, err = run_preprocess(output_prefix=tmp_path / "p", pack=True, neat_pack=True, **common)
    assert code == 0, err
    meta = json.load(open(tmp_path / "u_packed_meta.json"))
    assert meta["layout"]["kind"] == "unpacked" and "segments 1 (prompt + completion" in meta["layout"]["kto"]
    assert meta["statistics"]["documents"] == meta["statistics"]["kto_samples"] == ROWS
    docs = _couples(read_indexed, tmp_path / "u")
    assert all(int(s.max()) == 2 for s in read_indexed(tmp_path / "u_packed_attention_mask_document"))
    key = [(a.tolist(), b.tolist(), c.tolist(), d.tolist(), e) for a, b, c, d, e in docs]
    packed = [(a.tolist(), b.tolist(), c.tolist(), d.tolist(), e) for a, b, c, d, e in
              _couples(read_indexed, tmp_path / "p")]
    assert sorted(key) == sorted(packed) and len(key) == ROWS
    # input order: the first row's couple is stored last (its partner takes the last completion)
    assert [e for *_, e in key] == [int(x) for x in labels[1:] + labels[:1]]


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_trl_conversational_kto_rows_give_the_explicit_packs(tmp_path, run_preprocess, read_indexed, prompt_type):
    """TRL's conversational KTO rows (``prompt`` a list of messages, ``completion`` a list of one assistant message,
    ``label``) were refused ("column 'conversations' not found"): with no --map-keys they give, byte for byte, the
    packs and labels of the same conversations in OpenAI ``messages``."""
    rows, _, _ = _rows("openai", 8)
    trl = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "label": r["kto_tag"]} for r in rows]
    extra = {"chat_template": str(TEMPLATES / "qwen2_5.jinja")} if prompt_type == "hf" else {}
    packs = []
    for name, data, keys in (("explicit", rows, {"map_keys": json.dumps(OPENAI_KEYS)}), ("trl", trl, {})):
        code, _, err = run_preprocess(input=toy.write_dataset(tmp_path / f"{name}.jsonl", data),
                                      output_prefix=tmp_path / name, handler_name="SharegptStyleKTOHandler",
                                      prompt_type=prompt_type, seq_length=512, pack=True, neat_pack=True, **keys,
                                      **extra)
        assert code == 0, err
        packs.append([x.tolist() for k in ("input_ids_document", "attention_mask_document", "labels_document",
                                           "kto_labels") for x in read_indexed(f"{tmp_path / name}_packed_{k}")])
    assert packs[0] == packs[1]


def test_trl_kto_rows_whose_completion_is_not_one_answer_are_refused(tmp_path, run_preprocess):
    """A completion of several messages (or a prompt given as text) is refused naming the row and what it holds,
    never trained as a longer answer or read as another format."""
    good = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}],
            "label": True}
    cases = (({"completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
              "field 'completion' (--map-keys completion) has 2 messages (assistant, user); a KTO completion is one "
              "assistant message"),
             ({"completion": [{"role": "user", "content": "b"}]},
              "field 'completion' (--map-keys completion) has 1 messages (user)"),
             ({"prompt": "q"}, "field 'prompt' (--map-keys prompt) must be a list of messages, the prompt (TRL's "
                               "conversational KTO rows), got \"q\"; for TRL's standard rows"))
    for n, (bad, needle) in enumerate(cases):
        data = toy.write_dataset(tmp_path / f"bad{n}.jsonl", [good, good, {**good, **bad}])
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / f"k{n}",
                                      handler_name="SharegptStyleKTOHandler", prompt_type="qwen", seq_length=512,
                                      pack=True, neat_pack=True)
        assert code == 2 and f"bad{n}.jsonl: line 3: {needle}" in err, err


def test_llama_factorys_kto_tag_column_is_named_with_the_map_keys_that_reads_it(tmp_path, run_preprocess):
    """LLaMA-Factory names the label kto_tag: the error listed the columns but not the --map-keys to read it."""
    rows, _, _ = _rows("sharegpt", 4)
    data = toy.write_dataset(tmp_path / "kto.jsonl", [{**{k: v for k, v in r.items() if k != "label"},
                                                       "kto_tag": r["label"]} for r in rows])
    common = dict(input=data, output_prefix=tmp_path / "out" / "k", handler_name="SharegptStyleKTOHandler",
                  prompt_type="qwen", seq_length=512, pack=True, neat_pack=True)
    code, _, err = run_preprocess(**common)
    assert code == 2, err
    assert ("kto.jsonl: column 'label' (--map-keys label) not found; columns: conversations, system, kto_tag; pass "
            "--map-keys '{\"label\": \"kto_tag\"}' to read column 'kto_tag' as it") in err, err
    code, _, err = run_preprocess(**common, map_keys='{"label": "kto_tag"}')
    assert code == 0, err
