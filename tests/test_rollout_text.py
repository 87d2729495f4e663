"""Text rollouts (prompt/response text, or OpenAI messages + a response) are tokenised through the
template path preprocessing uses, recorded as such, and scored like id rollouts; bad rows are named."""
import json
import types

import numpy as np
import pytest
import transformers

import posttrain
from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.datasets.rollouts import load_rollouts
from mindspeed_pack.training.rl_session import RLSession
from tests.chat_corpus import TEMPLATES
from tests.model_utils import TINY_FLAGS
from tests.rollout_utils import write_jsonl

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say the first word.\ncat dog"}]
ROWS = [{"prompt": "Say the first word.\ncat dog", "response": "cat", "reward": 1.0, "group": 0},
        {"messages": MESSAGES, "response": "dog", "reward": 0.0, "group": 0},
        {"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "reward": 0.5, "group": 1},
        {"prompt_ids": [5, 6], "response_ids": [8], "reward": 0.0, "group": 1}]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(toy_tokenizer_dir, tmp_path_factory):
    """The toy tokenizer with Qwen2.5's own chat template (for --prompt-type hf)."""
    out = tmp_path_factory.mktemp("qwen_chat_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
    tok.save_pretrained(str(out))
    return str(out)


def _args(tokenizer, prompt_type):
    return types.SimpleNamespace(tokenizer_name_or_path=tokenizer, prompt_type=prompt_type)


def test_text_rollouts_are_tokenised_by_the_template_and_recorded(chat_tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", ROWS)
    tok = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    qwen, _ = load_rollouts(path, 768, 256, text_args=_args(chat_tokenizer_dir, "qwen"))
    hf, _ = load_rollouts(path, 768, 256, text_args=_args(chat_tokenizer_dir, "hf"))
    assert tok.decode(qwen[0].prompt_ids).endswith("<|im_start|>user\nSay the first word.\ncat dog<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    assert tok.decode(qwen[0].response_ids) == "cat<|im_end|>"
    # --prompt-type hf: exactly transformers' rendering of the messages, the answer up to its end-of-turn token
    full = tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "dog"}], tokenize=False)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert hf[1].prompt_ids.tolist() == tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(np.concatenate([hf[1].prompt_ids, hf[1].response_ids])) == full.rstrip("\n")
    assert hf[1].prompt_ids.tolist() == qwen[1].prompt_ids.tolist()  # the JSON qwen template renders it alike
    for r in qwen[:2]:
        assert r.row["tokenized_from"] == {"prompt_type": "qwen", "tokenizer": chat_tokenizer_dir}
        assert r.row["prompt_ids"] == r.prompt_ids.tolist() and r.row["response"] in ("cat", "dog")
    assert "tokenized_from" not in qwen[2].row and qwen[2].prompt_ids.tolist() == [5, 6, 7]  # ids stay as given


@pytest.mark.parametrize("row,args,message", [
    ({"prompt": "hi", "response": "cat"}, (None, None), "line 1: a text rollout (no 'prompt_ids') is tokenised "
                                                        "with --tokenizer-name-or-path and --prompt-type"),
    ({"prompt": "hi", "response": ["cat"]}, ("tok", "qwen"), "line 2: field 'response' must be a non-empty string"),
    ({"prompt": 7, "response": "cat"}, ("tok", "qwen"), "line 2: field 'prompt' (--map-keys prompt) must be a string"),
    ({"messages": [{"role": "robot", "content": "x"}], "response": "cat"}, ("tok", "qwen"),
     "line 2: message 0 has unknown 'role' 'robot'"),
    ({"messages": "hello", "response": "cat"}, ("tok", "hf"), "line 2: field 'messages' must be a list"),
])
def test_bad_text_rollouts_are_named(chat_tokenizer_dir, tmp_path, row, args, message):
    path = write_jsonl(tmp_path / "r.jsonl", [ROWS[0], {**row, "reward": 1.0, "group": 0}])
    tokenizer, prompt_type = args
    with pytest.raises(DataError) as e:
        load_rollouts(path, 768, 256, text_args=_args(chat_tokenizer_dir if tokenizer else None, prompt_type))
    assert "r.jsonl: " in str(e.value) and message in str(e.value), str(e.value)


def test_text_rollouts_through_the_session_and_score_cli(chat_tokenizer_dir, tmp_path):
    flags = [*TINY_FLAGS, "--padded-vocab-size", "768", "--seq-length", "128", "--max-seqlen-per-dp-cp-rank", "128",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
             "--tokenizer-name-or-path", chat_tokenizer_dir, "--prompt-type", "hf"]
    with RLSession.from_argv(flags) as session:
        logps = session.score(ROWS)
        session.save(str(tmp_path / "ckpt"))
    scored = str(tmp_path / "scored.jsonl")
    posttrain.main(["--stage", "score", "--rollout-path", write_jsonl(tmp_path / "r.jsonl", ROWS), "--score-output",
                    scored, "--load", str(tmp_path / "ckpt"), "--finetune", *flags])
    with open(scored) as f:
        out = [json.loads(line) for line in f]
    assert [r.get("tokenized_from", {}).get("prompt_type") for r in out] == ["hf", "hf", None, None]
    assert [r["response"] for r in out[:2]] == ["cat", "dog"]  # the text stays beside the ids it became
    for row, mine in zip(out, logps):
        assert len(row["old_logprobs"]) == len(row["response_ids"]) == len(mine)
        np.testing.assert_array_equal(row["old_logprobs"], mine)
