"""Random rollouts (prompt and response ids, advantages) for the RL tests."""
import json

import numpy as np
import torch
import torch.nn.functional as F


def random_rollouts(n, seed=0, vocab=256, prompt=(3, 12), response=(2, 20), advantages=True):
    """``n`` rollout rows; a few response tokens masked out (tool output), per-token advantages."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, r = int(rng.integers(*prompt)), int(rng.integers(*response))
        row = {"prompt_ids": rng.integers(1, vocab, p).tolist(), "response_ids": rng.integers(1, vocab, r).tolist(),
               "response_mask": [int(x) for x in rng.random(r) > 0.15]}
        row["response_mask"][0] = 1
        if advantages:
            row["advantages"] = rng.normal(size=r).round(3).tolist()
        rows.append(row)
    return rows


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def hf_logps_entropy(hf, row):
    """Log-prob of every response token and the entropy where it is predicted: transformers, one sample alone,
    no padding (the reference the packed stages are held to)."""
    p = len(row["prompt_ids"])
    ids = torch.tensor(row["prompt_ids"] + row["response_ids"])
    logits = F.log_softmax(hf(ids[None]).logits[0, p - 1:-1].float(), -1)
    return logits.gather(1, ids[p:, None]).squeeze(1), -(logits.exp() * logits).sum(-1)


def per_sample_grpo_loss(hf, rows, mode, *, clip_low, clip_high, kl_coef, entropy_coef, seq_length):
    """The per-sample, unpadded PPO-clip + k3 KL - entropy loss of ``rows`` under ``hf``, aggregated as
    ``--loss-agg mode`` over all of them; written out here, independently of the stage's code."""
    sums, counts = [], []
    for row in rows:
        logp, entropy = hf_logps_entropy(hf, row)
        old, ref, adv = (torch.tensor(row[k], dtype=torch.float32) for k in ("old_logprobs", "ref_logprobs", "advantages"))
        mask = torch.tensor(row["response_mask"], dtype=torch.float32)
        ratio = torch.exp(logp - old)
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        sums.append(((pg + kl_coef * kl - entropy_coef * entropy) * mask).sum())
        counts.append(mask.sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    if mode == "token-mean":
        return sums.sum() / counts.sum()
    if mode == "seq-mean-token-mean":
        return (sums / counts).mean()
    return (sums / seq_length).mean()


def long_tail_rollouts(n, seed=0, vocab=256, long_every=4):
    """``n`` rollout rows, one in ``long_every`` long (70-119 tokens: past 64, a CP group of 2 at N = 64), the rest
    5-50; scalar rewards in groups of four consecutive rows (advantages from the group at load), a few response
    tokens masked out, old and reference log-probs near the tiny models' uniform -log 256 (so ratios clip)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        long = i % long_every == long_every // 2
        p = int(rng.integers(20, 40) if long else rng.integers(3, 12))
        r = int(rng.integers(50, 80) if long else rng.integers(2, 40))
        mask = [int(x) for x in rng.random(r) > 0.15]
        mask[0] = 1
        rows.append({"prompt_ids": rng.integers(1, vocab, p).tolist(),
                     "response_ids": rng.integers(1, vocab, r).tolist(), "response_mask": mask,
                     "old_logprobs": (-5.5 + 0.3 * rng.standard_normal(r)).round(4).tolist(),
                     "ref_logprobs": (-5.5 + 0.3 * rng.standard_normal(r)).round(4).tolist(),
                     "reward": round(float(rng.normal()), 3), "group": i // 4})
    return rows
