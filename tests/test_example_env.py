"""The README's example commands run as written in a fresh shell (no activated environment).

``python`` on PATH is a stand-in without torch, as on a machine where everything lives in
``.venv``: the example scripts must find the project's environment themselves
(``scripts/python_env.sh``), and ``$PYTHON`` must still win when set.
"""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUNE = "examples/qwen25/tune_qwen25_7b_4k_full_pack.sh"


@pytest.fixture
def shell_without_torch(tmp_path):
    """Environment of a fresh shell whose ``python``/``python3`` cannot import torch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3", "torchrun"):
        (bin_dir / name).write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR") if k in os.environ}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"  # no VIRTUAL_ENV, no PYTHON
    return env, bin_dir


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="no .venv in this checkout (make setup)")
def test_readme_dry_run_finds_the_project_environment(shell_without_torch):
    env, bin_dir = shell_without_torch
    # README: `DRY_RUN=1 bash examples/qwen25/tune_qwen25_7b_4k_full_pack.sh`, from the repository root
    proc = subprocess.run(["bash", TUNE], cwd=REPO, env={**env, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\ntensor-model-parallel-size: 4\n" in proc.stdout and "\nseq-length: 4096\n" in proc.stdout
    # an explicit $PYTHON is used as given (here: the stand-in without torch, so the run fails)
    proc = subprocess.run(["bash", TUNE], cwd=REPO, env={**env, "DRY_RUN": "1", "PYTHON": str(bin_dir / "python")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr
