"""Preference pairs through preprocessing: a pair is one unit of packing, never cut."""
import json

import numpy as np
import pytest

from mindspeed_pack.data import toy

PAIRS = 120


@pytest.fixture(scope="module")
def pref_rows():
    return toy.generate_preference(PAIRS, seed=3, max_words=30)


def _packs(read_indexed, prefix):
    return [read_indexed(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels")]


@pytest.mark.parametrize("sharegpt", [False, True])
def test_pairs_are_neighbours_in_one_pack(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir, sharegpt):
    from transformers import AutoTokenizer

    rows = toy.generate_preference(PAIRS, seed=3, max_words=30, sharegpt=sharegpt)
    data = toy.write_dataset(tmp_path / "pref.jsonl", rows)
    handler = "SharegptStylePairwiseHandler" if sharegpt else "AlpacaStylePairwiseHandler"
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "p", handler_name=handler,
                                    prompt_type="qwen", seq_length=256, pack=True, neat_pack=True)
    assert code == 0, err
    meta = json.load(open(tmp_path / "p_packed_meta.json"))
    assert meta["statistics"]["pairs"] == PAIRS and len(meta["statistics"]["data_fingerprint"]) == 16
    assert "2k-1 (chosen)" in meta["layout"]["pairs"]
    tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    seen = []
    for ids, seg, labels in zip(*_packs(read_indexed, tmp_path / "p")):
        k = int(seg.max())
        assert k % 2 == 0 and set(np.unique(seg)) - {0} == set(range(1, k + 1))
        for j in range(1, k, 2):
            c, r = seg == j, seg == j + 1
            chosen = tok.decode(ids[c][labels[c] != -100])
            rejected = tok.decode(ids[r][labels[r] != -100])
            prompt_c = ids[c][labels[c] == -100]
            prompt_r = ids[r][labels[r] == -100]
            # same prompt, answers of the same row (the rule: chosen lower case, rejected upper case)
            assert np.array_equal(prompt_c, prompt_r)
            assert chosen.replace("<|im_end|>", "").upper() == rejected.replace("<|im_end|>", "")
            seen.append(chosen)
    assert len(seen) == PAIRS


def test_pair_bad_inputs(tmp_path, run_preprocess, pref_rows):
    rows = [dict(r) for r in pref_rows[:20]]
    rows[3]["rejected"] = rows[3]["chosen"]  # identical: warned, counted
    rows[5]["input"] = " ".join(["apple"] * 200)  # too long for the pair: dropped, counted (never cut)
    data = toy.write_dataset(tmp_path / "pref.jsonl", rows)
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "p", handler_name="AlpacaStylePairwiseHandler",
                                    prompt_type="qwen", seq_length=256, pack=True, neat_pack=True)
    assert code == 0, err
    stats = json.load(open(tmp_path / "p_packed_meta.json"))["statistics"]
    assert stats["skipped"] == {"identical chosen and rejected": 1, "pair longer than --seq-length": 1}
    assert stats["pairs"] == 18 and stats["truncated"] == 0
    assert "1 rows with identical chosen and rejected answers skipped" in err

    del rows[7]["rejected"]  # a malformed row: an error naming file, row and field
    data = toy.write_dataset(tmp_path / "bad.jsonl", rows)
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "b", handler_name="AlpacaStylePairwiseHandler",
                                    prompt_type="qwen", seq_length=256, pack=True, neat_pack=True)
    assert code == 2
    assert "bad.jsonl" in err and "line 8" in err and "'rejected'" in err, err

    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "c", handler_name="AlpacaStylePairwiseHandler",
                                    prompt_type="qwen", seq_length=256, pack=True)
    assert code == 2 and "needs --pack --neat-pack" in err


@pytest.mark.parametrize("sharegpt", [False, True])
def test_pair_history_answers_are_context_not_trained(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir,
                                                       sharegpt):
    """With a history, each side trains exactly its own final answer and end-of-turn token (as --prompt-type hf and
    LLaMA-Factory do); the history's answers are identical untrained context in both samples."""
    from transformers import AutoTokenizer

    history = [["hi there", "hello friend"], ["and then", "then this"]]
    rows = [{"instruction": f"question {i}", "input": "", "history": history[:1 + i % 2],
             "chosen": f"good answer {i}", "rejected": f"bad answer {i}"} for i in range(6)]
    handler = "AlpacaStylePairwiseHandler"
    if sharegpt:
        handler = "SharegptStylePairwiseHandler"
        rows = [{"conversations": [{"from": f, "value": v} for q, a in r["history"] for f, v in (("human", q), ("gpt", a))]
                 + [{"from": "human", "value": r["instruction"]}], "chosen": r["chosen"], "rejected": r["rejected"]}
                for r in rows]
    data = toy.write_dataset(tmp_path / "pref.jsonl", rows)
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "p", handler_name=handler, prompt_type="qwen",
                                  seq_length=512, pack=True, neat_pack=True)
    assert code == 0, err
    tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    trained = []
    for ids, seg, labels in zip(*_packs(read_indexed, tmp_path / "p")):
        for j in range(1, int(seg.max()) + 1):
            s = seg == j
            trained.append(tok.decode(ids[s][labels[s] != -100]))
            assert "<|im_start|>assistant\nhello friend<|im_end|>" in tok.decode(ids[s][labels[s] == -100])
    expected = [f"{kind} answer {i}<|im_end|>" for i in range(6) for kind in ("good", "bad")]
    assert sorted(trained) == sorted(expected)


def test_without_pack_each_pair_is_its_own_document(tmp_path, run_preprocess, read_indexed):
    """Without --pack (dynamic context parallelism plans each pair whole): one document per pair in input order,
    segment 1 the chosen and 2 the rejected answer, the same pairs as the packs hold, one margin a document."""
    rows = [{**r, **({"margin": i + 0.5} if i % 3 else {})} for i, r in
            enumerate(toy.generate_preference(24, seed=3, max_words=30))]
    data = toy.write_dataset(tmp_path / "pref.jsonl", rows)
    common = dict(input=data, handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen", seq_length=256)
    code, _, err = run_preprocess(output_prefix=tmp_path / "u", **common)
    assert code == 0, err
    code, _, err = run_preprocess(output_prefix=tmp_path / "p", pack=True, neat_pack=True, **common)
    assert code == 0, err
    meta = json.load(open(tmp_path / "u_packed_meta.json"))
    assert meta["layout"]["kind"] == "unpacked" and meta["layout"]["neat_pack"]  # segment ids: train with --neat-pack
    import types

    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.datasets.sidecar_checks import check_data

    with pytest.raises(DataError, match="holds preference pairs whose two answers are told apart by segment ids"):
        check_data(types.SimpleNamespace(meta=meta, prefix=str(tmp_path / "u")), types.SimpleNamespace(neat_pack=False))
    assert "segments 1 (chosen) and 2 (rejected)" in meta["layout"]["pairs"]
    assert meta["statistics"]["documents"] == meta["statistics"]["pairs"] == 24
    assert len(meta["statistics"]["data_fingerprint"]) == 16
    docs = []
    for ids, seg, labels in zip(*_packs(read_indexed, tmp_path / "u")):
        k = int(np.argmax(seg == 2))
        assert k > 0 and (seg[:k] == 1).all() and (seg[k:] == 2).all()  # one pair, chosen first
        docs.append((ids[:k].tolist(), ids[k:].tolist()))
    packed = [(ids[seg == j].tolist(), ids[seg == j + 1].tolist())
              for ids, seg, _ in zip(*_packs(read_indexed, tmp_path / "p")) for j in range(1, int(seg.max()), 2)]
    assert sorted(docs) == sorted(packed) and len(docs) == 24
    margins = read_indexed(tmp_path / "u_packed_pair_margins")
    assert [m.tolist() for m in margins] == [[i + 0.5 if i % 3 else 0.0] for i in range(24)]  # input order

    from mindspeed_pack.datasets.online_packing import unit_lengths
    from mindspeed_pack.datasets.packed_documents import PackedDocuments

    lengths = unit_lengths(PackedDocuments(str(tmp_path / "u")))
    assert lengths.tolist() == [[len(c), len(r)] for c, r in docs]


def test_a_prefix_written_again_as_other_data_keeps_no_stale_side_files(tmp_path, run_preprocess, capsys):
    """Pairs then instructions at the same --output-prefix left P_packed_pair_margins behind, named by no sidecar."""
    pairs = toy.write_dataset(tmp_path / "pref.jsonl", toy.generate_preference(8, seed=3, max_words=20))
    sft = toy.write_dataset(tmp_path / "sft.jsonl", toy.generate_alpaca(8, seed=3))
    common = dict(output_prefix=tmp_path / "x", prompt_type="qwen", seq_length=256, pack=True, neat_pack=True)
    assert run_preprocess(input=pairs, handler_name="AlpacaStylePairwiseHandler", **common)[0] == 0
    assert (tmp_path / "x_packed_pair_margins.bin").exists()
    from mindspeed_pack.tools.inspect_pack import main as inspect_main

    capsys.readouterr()
    assert inspect_main([str(tmp_path / "x"), "--index", "0"]) == 0  # the pairs' answers are named
    out = capsys.readouterr().out
    assert "(pair 1, chosen)" in out and "(pair 1, rejected)" in out
    assert run_preprocess(input=sft, handler_name="AlpacaStyleInstructionHandler", **common)[0] == 0
    assert not (tmp_path / "x_packed_pair_margins.bin").exists()
    assert not (tmp_path / "x_packed_pair_margins.idx").exists()


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_ms_swift_pairs_end_the_conversation_with_the_chosen_answer(tmp_path, run_preprocess, read_indexed,
                                                                     prompt_type):
    """ms-swift's RLHF rows (``messages`` ending with the chosen answer, ``rejected_response``) were refused ("column
    'chosen' not found"): they give the same packs as the rows with the chosen answer in its own column."""
    from tests.chat_corpus import TEMPLATES

    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
               {"role": "assistant", "content": "hello friend"}]
    swift = [{"messages": [*history, {"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"good answer {i}"}],
              "rejected_response": f"bad answer {i}"} for i in range(6)]
    explicit = [{"messages": r["messages"][:-1], "chosen": r["messages"][-1]["content"],
                 "rejected": r["rejected_response"]} for r in swift]
    keys = {"messages": "messages", "role": "role", "content": "content"}
    extra = {"chat_template": str(TEMPLATES / "qwen2_5.jinja")} if prompt_type == "hf" else {}
    packs = []
    for name, rows, mapped in (("swift", swift, {**keys, "rejected": "rejected_response"}),
                               ("explicit", explicit, keys)):
        code, _, err = run_preprocess(input=toy.write_dataset(tmp_path / f"{name}.jsonl", rows),
                                      output_prefix=tmp_path / name, handler_name="SharegptStylePairwiseHandler",
                                      prompt_type=prompt_type, seq_length=512, pack=True, neat_pack=True,
                                      map_keys=json.dumps(mapped), **extra)
        assert code == 0, err
        packs.append(_packs(read_indexed, tmp_path / name))
    for a, b in zip(*packs):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert json.load(open(tmp_path / "swift_packed_meta.json"))["statistics"]["pairs"] == 6


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_trl_conversational_pairs_with_an_explicit_prompt(tmp_path, run_preprocess, read_indexed, prompt_type):
    """TRL's conversational pairs (``prompt`` a list of messages, ``chosen``/``rejected`` a list of one assistant
    message each) were refused ("got a list"): they give the same packs as one message per answer. A prompt column
    beside answers that continue it (neither form) is refused, naming the row and what to give."""
    from tests.chat_corpus import TEMPLATES

    prompt = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}]
    trl = [{"prompt": [*prompt, {"role": "user", "content": f"question {i}"}],
            "chosen": [{"role": "assistant", "content": f"good answer {i}"}],
            "rejected": [{"role": "assistant", "content": f"bad answer {i}"}]} for i in range(6)]
    explicit = [{"messages": r["prompt"], "chosen": r["chosen"][0], "rejected": r["rejected"][0]} for r in trl]
    keys = {"role": "role", "content": "content"}
    extra = {"chat_template": str(TEMPLATES / "qwen2_5.jinja")} if prompt_type == "hf" else {}
    common = dict(handler_name="SharegptStylePairwiseHandler", prompt_type=prompt_type, seq_length=512, pack=True,
                  neat_pack=True, **extra)
    packs = []
    for name, rows, mapped in (("trl", trl, {**keys, "messages": "prompt"}),
                               ("explicit", explicit, {**keys, "messages": "messages"})):
        code, _, err = run_preprocess(input=toy.write_dataset(tmp_path / f"{name}.jsonl", rows),
                                      output_prefix=tmp_path / name, map_keys=json.dumps(mapped), **common)
        assert code == 0, err
        packs.append(_packs(read_indexed, tmp_path / name))
    for a, b in zip(*packs):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    split = [{"messages": r["prompt"][:1], "chosen": [*r["prompt"][1:], *r["chosen"]],
              "rejected": [*r["prompt"][1:], *r["rejected"]]} for r in trl]
    code, _, err = run_preprocess(input=toy.write_dataset(tmp_path / "split.jsonl", split),
                                  output_prefix=tmp_path / "split", map_keys=json.dumps({**keys, "messages": "messages"}),
                                  **common)
    assert code == 2 and "line 1: field 'messages' holds 1 messages beside 'chosen' and 'rejected'" in err, err
    assert "give the prompt once" in err


def _conversations(n: int = 6) -> list:
    """(prompt, chosen, rejected) in OpenAI messages: a system message, a history, a single turn, by row."""
    out = []
    for i in range(n):
        prompt = ([{"role": "system", "content": "be brief"}] if i % 2 else []) + (
            [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}] if i % 3 else []
        ) + [{"role": "user", "content": f"question {i}"}]
        out.append((prompt, {"role": "assistant", "content": f"good answer {i}"},
                    {"role": "assistant", "content": f"bad answer {i}"}))
    return out


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_trl_and_hub_pair_rows_give_the_explicit_packs(tmp_path, run_preprocess, read_indexed, prompt_type):
    """TRL's implicit-prompt pairs (chosen/rejected whole conversations), UltraFeedback-binarized rows (a ``prompt``
    text, the conversations, ``messages``, scores) and TRL's explicit ``prompt`` list were refused ("column
    'conversations' not found"): with no --map-keys they give, byte for byte, the explicit form's packs."""
    from tests.chat_corpus import TEMPLATES

    convs = _conversations()
    forms = {
        "explicit": ([{"messages": p, "chosen": c["content"], "rejected": r["content"]} for p, c, r in convs],
                     {"messages": "messages", "role": "role", "content": "content"}),
        "implicit": ([{"chosen": [*p, c], "rejected": [*p, r]} for p, c, r in convs], None),
        "ultrafeedback": ([{"prompt": p[-1]["content"], "chosen": [*p, c], "rejected": [*p, r], "messages": [*p, c],
                            "score_chosen": 8.0, "score_rejected": 3.5, "prompt_id": str(i)}
                           for i, (p, c, r) in enumerate(convs)], None),
        "ultrafeedback_mapped": (None, {"messages": "messages", "role": "role", "content": "content"}),
        "trl_prompt": ([{"prompt": p, "chosen": [c], "rejected": [r]} for p, c, r in convs], None),
    }
    forms["ultrafeedback_mapped"] = (forms["ultrafeedback"][0], forms["ultrafeedback_mapped"][1])
    extra = {"chat_template": str(TEMPLATES / "qwen2_5.jinja")} if prompt_type == "hf" else {}
    packs = {}
    for name, (rows, keys) in forms.items():
        code, _, err = run_preprocess(input=toy.write_dataset(tmp_path / f"{name}.jsonl", rows),
                                      output_prefix=tmp_path / name, handler_name="SharegptStylePairwiseHandler",
                                      prompt_type=prompt_type, seq_length=512, pack=True, neat_pack=True,
                                      **({"map_keys": json.dumps(keys)} if keys else {}), **extra)
        assert code == 0, (name, err)
        packs[name] = [x.tolist() for part in _packs(read_indexed, tmp_path / name) for x in part]
        assert json.load(open(tmp_path / f"{name}_packed_meta.json"))["statistics"]["pairs"] == len(convs)
    assert all(packs[name] == packs["explicit"] for name in forms), [n for n in forms if packs[n] != packs["explicit"]]


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_implicit_pairs_that_are_not_one_prompt_and_two_answers_are_refused(tmp_path, run_preprocess, prompt_type):
    """An implicit-prompt pair must share its prompt and go on with one assistant message a side; anything else
    (answers of several turns, prompts that differ, a side without an answer) is refused naming the row and what
    was found, never trained as a longer or shorter answer. An answer's tool calls are refused as before."""
    from tests.chat_corpus import TEMPLATES

    def user(text):
        return {"role": "user", "content": text}

    def assistant(text, **more):
        return {"role": "assistant", "content": text, **more}

    good = {"chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]}
    cases = (
        ({"chosen": [user("q"), assistant("a"), user("more"), assistant("b")],
          "rejected": [user("q"), assistant("c"), user("more"), assistant("d")]},
         "is 1 messages (user); after it 'chosen' has 3 (assistant, user, assistant) and 'rejected' 3"),
        ({"chosen": [user("q1"), assistant("a")], "rejected": [user("q2"), assistant("b")]},
         "is empty: they differ from their first message; after it 'chosen' has 2 (user, assistant)"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q")]}, "'rejected' 0 (none)"),
        ({"chosen": [user("q"), assistant("a")], "rejected": "b"}, "field 'rejected' must be a conversation"),
        ({"chosen": [user("q"), assistant(None, tool_calls=[{"type": "function", "function": {"name": "f"}}])],
          "rejected": [user("q"), assistant("b")]}, "field 'chosen' (--map-keys chosen) has 'tool_calls'"),
        ({"prompt": "q", "chosen": "a", "rejected": "b"},
         "TRL's standard rows (all text) are --handler-name AlpacaStylePairwiseHandler --map-keys"),
    )
    extra = {"chat_template": str(TEMPLATES / "qwen2_5.jinja")} if prompt_type == "hf" else {}
    for n, (row, needle) in enumerate(cases):
        data = toy.write_dataset(tmp_path / f"bad{n}.jsonl", [good, good, row])
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / f"b{n}",
                                      handler_name="SharegptStylePairwiseHandler", prompt_type=prompt_type,
                                      seq_length=512, pack=True, neat_pack=True, **extra)
        assert code == 2 and f"bad{n}.jsonl: line 3: " in err and needle in err, (n, err)
