"""Qwen3 at TP2 trains exactly as at TP1: the q/k-norm gradients are summed over TP ranks.

Each TP rank holds some of the heads, so its q/k-norm gradient is partial; megatron-core's
``finalize_model_grads`` sums it over the TP group only when the TransformerConfig says
``qk_layernorm``. Without that, the norms drift apart on the two ranks and the losses leave
TP1's. posttrain.py runs with ``--qk-layernorm --kv-channels 24`` (head_dim != hidden/heads)
from a converted random transformers Qwen3.
"""

import pytest
import torch

from mindspeed_pack.convert.megatron_layout import checkpoint_file
from tests.train_utils import run_posttrain, train_losses, write_copy_task

QWEN3_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 24 --qk-layernorm --disable-bias-linear --swiglu --normalization RMSNorm "
    "--norm-epsilon 1e-6 --rotary-base 1000000 --untie-embeddings-and-output-weights --padded-vocab-size 256 "
    "--position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 --lr-decay-style constant "
    "--log-interval 1 --eval-iters 0"
).split()
NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    import transformers

    from mindspeed_pack.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("qwen3_train")
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(root / "hf")
    out = {"root": root, "data": write_copy_task(str(root / "data"), num_packs=24, meta=True)}
    for tp in (1, 2):
        out[tp] = str(root / f"mg_tp{tp}")
        hf_to_megatron(str(root / "hf"), out[tp], tp, 1, padded_vocab_size=256)
    return out


def _train(qwen3, tp):
    save = str(qwen3["root"] / f"trained_tp{tp}")
    _, records = run_posttrain(
        ["--tensor-model-parallel-size", str(tp), "--load", qwen3[tp], "--finetune", "--save", save,
         "--no-save-optim", "--data-path", qwen3["data"], "--seq-length", "128", "--neat-pack",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5", "--lr", "3e-3",
         "--no-shuffle"],
        nproc=tp, metrics=str(qwen3["root"] / f"tp{tp}.jsonl"), model_flags=QWEN3_FLAGS)
    return save, train_losses(records)


def test_qwen3_tp2_keeps_qk_norms_identical_and_matches_tp1(qwen3):
    _, tp1 = _train(qwen3, 1)
    save, tp2 = _train(qwen3, 2)
    ranks = [torch.load(checkpoint_file(save, 5, r, 0, 1), weights_only=True)["model"] for r in range(2)]
    start = torch.load(checkpoint_file(qwen3[2], "release", 0, 0, 1), weights_only=True)["model"]
    for layer in range(2):
        for norm in NORMS:
            name = f"decoder.layers.{layer}.{norm}"
            assert ranks[0][name].shape == (24,)
            assert torch.equal(ranks[0][name], ranks[1][name]), name
            assert not torch.equal(ranks[0][name], start[name]), f"{name} was not trained"
    assert len(tp1) == len(tp2) == 5
    assert max(abs(a - b) / abs(a) for a, b in zip(tp1, tp2)) <= 1e-5, (tp1, tp2)

    # the trained TP2 checkpoint goes back to a Qwen3 transformers loads, with the trained norms
    import transformers

    from mindspeed_pack.convert import megatron_to_hf

    hf = str(qwen3["root"] / "trained_hf")
    megatron_to_hf(save, hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 24
    assert torch.equal(model.model.layers[1].self_attn.k_norm.weight.data,
                       ranks[0]["decoder.layers.1.self_attention.k_layernorm.weight"])
