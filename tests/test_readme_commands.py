"""The README's command blocks run as written: every call of the project's scripts names its interpreter or
launcher (the scripts are not executable), and every file a command names exists in the repository."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("posttrain.py", "pretrain_gpt.py", "preprocess_data.py", "convert_ckpt.py")
LAUNCHERS = ("python", "python3", "torchrun", "bash", ".venv/bin/python")


def _commands(text: str):
    """(line number, command) of every shell command in the README's bash blocks, continuations joined."""
    out, in_block, pending = [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_block = line.strip() in ("```bash", "```sh")
            continue
        if not in_block:
            continue
        code = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if pending:
            pending = (pending[0], pending[1] + " " + code.strip().rstrip("\\"))
        elif code.strip():
            pending = (number, code.strip().rstrip("\\"))
        if pending and not code.endswith("\\"):
            out.append(pending)
            pending = None
    return out


def test_readme_script_calls_name_their_launcher_and_existing_files():
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = _commands(text)
    assert len(commands) > 10
    bad = []
    for number, command in commands:
        words = [w for w in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # env assignments first
        if not words:
            continue
        if words[0] in SCRIPTS or words[0].startswith(tuple(f"./{s}" for s in SCRIPTS)):
            bad.append(f"README.md:{number}: {words[0]} is not executable: start it with python or torchrun")
        for path in re.findall(r"(?:configs|examples|bench)/[\w./-]+\.(?:yaml|sh|py)", command):
            if not os.path.exists(os.path.join(ROOT, path)):
                bad.append(f"README.md:{number}: {path} does not exist")
        if words[0] not in LAUNCHERS and any(s in command for s in SCRIPTS) and not words[0].startswith(("make",)):
            bad.append(f"README.md:{number}: runs a script without a launcher: {command[:80]}")
    assert not bad, "\n".join(bad)


def test_readme_does_not_call_a_different_job_the_same():
    """A config file named beside a command line is described, not claimed to be 'the same' job."""
    text = open(os.path.join(ROOT, "README.md")).read()
    assert not re.search(r"--config \S+\s+# the same, from a file", text)
