"""A GRPO loop that raises a checkable reward, rollouts sampled from the model itself.

Each round, under one torchrun job (the trainer stays up, ``mindspeed_pack.training.rl_session``):

1. ``session.export_hf(OUT/hf/round_K)``: the current weights as a Hugging Face model, what a
   generation engine (vLLM, SGLang) would reload; rank 0 loads it with transformers and samples
   ``--samples-per-prompt`` responses of ``--response-length`` tokens per prompt (temperature
   ``--temperature``), and greedy responses to report the greedy reward;
2. reward: the task is "repeat the prompt's last token": the fraction of response tokens equal to it;
   one group per prompt, so GRPO normalises the rewards within each prompt's samples;
3. ``session.score(rows)``: the exact ``old_logprobs`` of the sampled ids under the same weights
   (the step's first ratio is exactly 1), then ``session.step(rows)``: GRPO optimizer steps.

A line per round (and ``OUT/rounds.jsonl``): the sampled and greedy mean reward, the step's loss,
clip fraction and KL. Run it with ``examples/rl/run_reward_loop.sh`` (a tiny model on CPU).

    torchrun --nproc-per-node N examples/rl/reward_loop.py MODEL/TRAINING FLAGS \\
        --rl-output-dir OUT --rounds 8 --prompts-per-round 16 --samples-per-prompt 8 --response-length 2
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mindspeed_pack.training.cli import run_cli, setup_logging  # noqa: E402
from mindspeed_pack.training.rl_session import RLSession  # noqa: E402

BOS = 1
FIRST_WORD = 2  # tokens FIRST_WORD .. vocab-1 are the task's words


def script_args(p):
    g = p.add_argument_group("reward loop (examples/rl/reward_loop.py)")
    g.add_argument("--rl-output-dir", required=True, help="HF exports per round and rounds.jsonl go here")
    g.add_argument("--rounds", type=int, default=8)
    g.add_argument("--prompts-per-round", type=int, default=16)
    g.add_argument("--samples-per-prompt", type=int, default=8, help="the GRPO group size")
    g.add_argument("--prompt-length", type=int, default=2)
    g.add_argument("--response-length", type=int, default=2)
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--steps-per-round", type=int, default=2,
                   help="optimizer steps on each round's rollouts (global batches of them, cycling)")
    return p


def make_prompts(n: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` prompts [BOS, w1, ..., w_{length-1}] of random words; the answer is the last word."""
    words = torch.randint(FIRST_WORD, vocab, (n, length - 1), generator=generator)
    return torch.cat([torch.full((n, 1), BOS), words], dim=1)


def reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
    """The fraction of response tokens that repeat the prompt's last token."""
    return float((response == prompt[-1]).float().mean())


@torch.no_grad()
def sample(model, prompts: torch.Tensor, length: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """``length`` tokens after each prompt, greedy (temperature 0) or sampled from the whole vocabulary."""
    ids = prompts
    for _ in range(length):
        logits = model(ids).logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prompts.shape[1]:]


def generate_round(hf_dir: str, args, k: int) -> tuple[list, float]:
    """(rollout rows of round ``k`` sampled from the exported model, its greedy mean reward): rank 0's work."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(args.seed * 1000 + k)
    prompts = make_prompts(args.prompts_per_round, args.prompt_length, args.padded_vocab_size, g)
    greedy = sample(model, prompts, args.response_length, 0.0, g)
    greedy_reward = sum(reward(p, r) for p, r in zip(prompts, greedy)) / len(prompts)
    repeated = prompts.repeat_interleave(args.samples_per_prompt, dim=0)
    responses = sample(model, repeated, args.response_length, args.temperature, g)
    rows = [{"prompt_ids": p.tolist(), "response_ids": r.tolist(), "reward": reward(p, r),
             "group": f"round{k}-prompt{i // args.samples_per_prompt}"}
            for i, (p, r) in enumerate(zip(repeated, responses))]
    return rows, greedy_reward


def main(argv=None):
    setup_logging()
    session = RLSession.from_argv(argv, extra_args_provider=script_args)
    args = session.args
    out = os.path.abspath(args.rl_output_dir)
    history = []
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "rounds.jsonl"), "w").close()
    with session:
        for k in range(args.rounds):
            hf_dir = os.path.join(out, "hf", f"iter_{session.iteration:07d}")
            session.export_hf(hf_dir)
            box = [generate_round(hf_dir, args, k) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            rows, greedy_reward = box[0]
            for row, logps in zip(rows, session.score(rows)):
                row["old_logprobs"] = logps.tolist()
            records = session.step(rows, steps=args.steps_per_round)
            line = {"round": k, "iteration": session.iteration, "sampled reward": sum(r["reward"] for r in rows) / len(rows),
                    "greedy reward": greedy_reward, "lm loss": records[-1]["lm loss"],
                    "clip fraction": records[-1]["clip fraction"], "approx kl": records[-1]["approx kl"],
                    "ratio max (first step)": records[0]["ratio max"]}
            history.append(line)
            if dist.get_rank() == 0:
                print(" reward loop | " + " | ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                                             for k, v in line.items()), flush=True)
                with open(os.path.join(out, "rounds.jsonl"), "a") as f:
                    f.write(json.dumps(line) + "\n")
        if args.save:
            session.save()
    return history


if __name__ == "__main__":
    run_cli("reward_loop.py", main, own_process=True)
