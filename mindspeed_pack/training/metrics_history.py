"""A rerun's metrics file: one record per step, the re-run steps replacing the old ones.

A training run that starts at iteration I (a checkpoint's, after a torchrun restart or the same
command by hand; 0 when nothing was saved yet) trains I+1, I+2, ... again, although the run before
it may have logged some of them after its last save. Before the first new record, every record of
an iteration after I is taken out of the file (train, validation and setup records alike, and a
last line cut off by a kill); everything up to I stays as it was. An evaluation (``--skip-train``)
replaces records only as a restart or from a checkpoint's iteration. The rewrite goes through a temporary file and an atomic rename, so a kill at any
moment leaves the old file or the new one, never a shorter one. TensorBoard gets the same
effect from ``SummaryWriter(purge_step=I + 1)``.
"""
from __future__ import annotations

import json
import os
from typing import List

from mindspeed_pack.runtime import stale_files


def replaces_records(start_iteration: int, trains: bool) -> bool:
    """Whether this start runs logged steps again: every training run (whichever way it came back, by torchrun's
    restart or by hand, from a checkpoint or from scratch), an evaluation from a checkpoint or a restart."""
    return trains or start_iteration > 0 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def drop_records_after(path: str, start_iteration: int) -> List[int]:
    """Remove the records of iterations after ``start_iteration`` from ``path`` (atomically); returns
    the train iterations removed (the steps this run re-runs)."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    tail = lines.pop()  # b"" after a complete last line, else a line cut off by a kill
    kept, replaced, changed = [], [], bool(tail)
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            kept.append(line)  # not ours to judge: keep it
            continue
        iteration = record.get("iteration") if isinstance(record, dict) else None
        if isinstance(iteration, int) and iteration > start_iteration:
            changed = True
            if record.get("split", "train") == "train":
                replaced.append(iteration)
            continue
        kept.append(line)
    if changed:
        tmp = stale_files.temporary_for(path, "--metrics-file")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return sorted(set(replaced))
