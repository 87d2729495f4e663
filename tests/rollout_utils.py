"""Random rollouts (prompt and response ids, advantages) for the RL tests."""
import json

import numpy as np


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
