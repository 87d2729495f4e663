"""Tiny models and single-process megatron initialisation shared by the tests."""
import os
import types

TINY = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
    num_query_groups=2, add_qkv_bias=True, disable_bias_linear=True, swiglu=True, normalization="RMSNorm",
    norm_epsilon=1e-6, padded_vocab_size=256, seq_length=128, untie_embeddings_and_output_weights=True,
    rotary_base=1000000, attention_backend="local",
)

TINY_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --add-qkv-bias --disable-bias-linear --swiglu --normalization RMSNorm "
    "--norm-epsilon 1e-6 --rotary-base 1000000 --untie-embeddings-and-output-weights --padded-vocab-size 256 "
    # explicit, so the tests do not depend on which defaults the parser has (Megatron-LM's differ)
    "--position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 --lr-decay-style cosine "
    "--log-interval 1 --eval-iters 0"
).split()


def tiny_args(**overrides):
    return types.SimpleNamespace(**{**TINY, **overrides})


def init_single_process(seed=1234):
    """World of one gloo process with megatron's groups (idempotent)."""
    from tests.dist_harness import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from mindspeed_pack.runtime.process_groups import initialize_distributed

    initialize_distributed(1, 1, seed)


def write_converted_tiny_qwen2(root, tp=1, seed=0, tokenizer=None, **config):
    """A random transformers Qwen2 of the TINY shape (``config``: other config.json values), saved with the
    files of the ``tokenizer`` directory if given, then converted to a Megatron release checkpoint at
    TP=``tp``; returns the checkpoint directory. Weights (norms and biases too) are drawn far from
    megatron's initialisation, so a load that does not stick shows."""
    import shutil
    from pathlib import Path

    import torch
    import transformers

    from mindspeed_pack.convert import hf_to_megatron

    root = Path(root)
    config = transformers.Qwen2Config(**{**dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=128), **config})
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf")
    if tokenizer:
        for f in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, f), root / "hf" / f)
    hf_to_megatron(str(root / "hf"), str(root / "mg"), tp, 1, padded_vocab_size=256)
    return str(root / "mg")


def save_word_tokenizer(path, words, added=()):
    """A word-level HF fast tokenizer of ``words`` (ids in order; the first pads, the second ends) plus the
    special tokens ``added``, saved in ``path``; returns ``path``."""
    import tokenizers
    import transformers

    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                                  unk_token=words[0]))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token=words[0],
                                                     eos_token=words[1])
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    tokenizer.save_pretrained(str(path))
    return str(path)


def load_release_checkpoint(ckpt_dir: str):
    """This rank's model built from a converted (release) checkpoint's args, its weights loaded, eval mode."""
    import argparse

    import torch
    from megatron.core import parallel_state as ps

    from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file
    from mindspeed_pack.model.gpt import build_gpt_model

    pp = ps.get_pipeline_model_parallel_world_size()
    path = checkpoint_file(ckpt_dir, RELEASE, ps.get_tensor_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_rank(), pp)
    record = torch.load(path, weights_only=True)
    args = argparse.Namespace(**record["args"])
    model = build_gpt_model(args, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    missing, unexpected = model.load_state_dict(record["model"], strict=False)
    # megatron's local linears report a None `_extra_state`; every real tensor must match
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise AssertionError(f"{path}: missing {missing}, unexpected {unexpected}")
    return model.eval(), args


def forward_pipeline(model, args, tokens, position_ids, **kwargs):
    """Logits (gathered over TP) or per-token loss on the last stage; None elsewhere."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if ps.get_pipeline_model_parallel_world_size() == 1:
        out = model(tokens, position_ids, None, **kwargs)
    elif ps.is_pipeline_first_stage():
        hidden = model(tokens, position_ids, None, **kwargs)
        dist.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    else:
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
        out = model(None, position_ids, None, **kwargs)
    if "labels" not in kwargs:
        out = gather_from_tensor_model_parallel_region(out)
    return out


def converted_model_pair(converted: str, seq_length: int):
    """(megatron GPTModel with the converted weights at TP1, the transformers model they came from)."""
    import torch
    import transformers

    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.model.gpt import build_gpt_model

    init_single_process()
    args = tiny_args(seq_length=seq_length, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    mg = build_gpt_model(args)
    load_weights(args, converted, mg)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(os.path.join(os.path.dirname(converted), "hf"),
                                                       torch_dtype=torch.float32, attn_implementation="eager")
    return mg, hf


def assert_same_gradients(mg, hf, rel: float = 1e-4) -> None:
    """The gradients held by the megatron model equal those of the transformers model: the tensors
    that map one to one, and the global norm (fused QKV / gate-up only reorder elements)."""
    import torch

    g_mg = {n: p.grad.detach() for n, p in mg.named_parameters()}
    g_hf = {n: p.grad.detach() for n, p in hf.named_parameters()}
    for mine, theirs in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("output_layer.weight", "lm_head.weight"), ("decoder.final_layernorm.weight", "model.norm.weight")):
        err = float((g_mg[mine] - g_hf[theirs]).abs().max() / g_hf[theirs].abs().max())
        assert err <= rel, (mine, err)
    norm_mg = torch.sqrt(sum((g.double() ** 2).sum() for g in g_mg.values()))
    norm_hf = torch.sqrt(sum((g.double() ** 2).sum() for g in g_hf.values()))
    assert abs(float(norm_mg / norm_hf) - 1) <= rel


def spread_weights(model):
    """Fill a transformers model's weights far from any initialisation (norms near 1, the rest random), so a
    converted tensor in the wrong place shows in the logits; returns the model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def count_open_shards(monkeypatch) -> list:
    """Spy on the converter's safetensors reader: the list returned gets, at every tensor read, how many shards read
    from are still open (a reader that lets each shard go once read keeps it small)."""
    import weakref

    from mindspeed_pack.convert import hf_io

    read_from, counts = set(), []
    real_open = hf_io.safe_open

    class Spy:
        def __init__(self, path, framework):
            self._handle, self._path = real_open(path, framework=framework), path
            weakref.finalize(self, read_from.discard, path)

        def keys(self):
            return self._handle.keys()

        def get_slice(self, name):
            return self._handle.get_slice(name)

        def get_tensor(self, name):
            read_from.add(self._path)
            counts.append(len(read_from))
            return self._handle.get_tensor(name)

    monkeypatch.setattr(hf_io, "safe_open", Spy)
    return counts
