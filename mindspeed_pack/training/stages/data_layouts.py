"""What a stage's data must hold, as its preprocessing sidecar records it: checked when the stage sets up, and
by ``--dry-run`` before anything is built (a run that would stop at its start is refused by the dry run too)."""
from __future__ import annotations

import os

from mindspeed_pack.datasets.packed_documents import DataError, data_prefixes, dataset_paths, read_meta

_PAIRS = ("pairs", "preference pairs", "its sidecar records no pairing",
          "preprocess with --handler-name AlpacaStylePairwiseHandler or SharegptStylePairwiseHandler (--pack "
          "--neat-pack: packs of whole pairs; without --pack: each pair its own document)")
# --stage -> (the sidecar layout's key, what it is, what its absence says, how to get it)
REQUIRED = {
    "dpo": _PAIRS, "simpo": _PAIRS, "orpo": _PAIRS, "orm": _PAIRS,
    "kto": ("kto_labels", "KTO couples", "its sidecar names no KTO labels",
            "preprocess with --handler-name AlpacaStyleKTOHandler or SharegptStyleKTOHandler (--pack --neat-pack: "
            "packs of whole couples; without --pack: each couple its own document)"),
    "prm": ("step_tags", "step tags", "its sidecar records none",
            "preprocess process reward rows with --handler-name AlpacaStyleProcessRewardHandler"),
}


# the sidecar layout's key -> (what, what SFT would do with it, the stages that train on it)
NOT_FOR_SFT = {
    "pairs": ("preference pairs", "the chosen and the rejected answers alike", "dpo, simpo, orpo or orm"),
    "kto_labels": ("KTO couples", "the undesirable answers and the KL partners (other rows' answers) alike", "kto"),
    "step_tags": ("process reward steps", "the step tags' labels as next tokens", "prm"),
}


def check(stage: str, prefix: str, meta) -> None:
    """DataError when ``prefix`` (its sidecar ``meta``) lacks what ``--stage stage`` trains on, or (SFT) holds
    another stage's data, whose labels SFT would train as answers."""
    layout = (meta or {}).get("layout") or {}
    need = REQUIRED.get(stage)
    if need and not layout.get(need[0]):
        raise DataError(f"--stage {stage}: {prefix!r} holds no {need[1]} ({need[2]}): {need[3]}")
    if stage == "sft":
        for key, (what, trained, stages) in NOT_FOR_SFT.items():
            if layout.get(key):
                raise DataError(f"--stage sft: {prefix!r} holds {what} (its sidecar's {key}): SFT would train "
                                f"{trained}; pass --stage {stages}, or preprocess the data for SFT (an instruction "
                                "handler)")


def check_data_paths(args, required: bool = False) -> None:
    """:func:`check`, and the flags against what preprocessing recorded (``--seq-length``, ``--neat-pack``,
    ``--prompt-type``: :func:`~mindspeed_pack.datasets.sidecar_checks.check_data`, which the run's data setup
    applies), for every prefix of ``--data-path`` (its weights skipped) and of the per-split paths that is there
    (a dry run may check a job's flags before its data exists). ``required`` (a run, before its model is built):
    a prefix that is not there is refused now, not after minutes of building the model and reading its weights."""
    from mindspeed_pack.datasets.packed_documents import PackedDocuments
    from mindspeed_pack.datasets.sidecar_checks import check_data

    if required and getattr(args, "rollout_path", None):  # --stage score/grpo: found before the model is built too
        from mindspeed_pack.data.errors import PreprocessError
        from mindspeed_pack.data.readers import resolve_input_files

        try:
            resolve_input_files(args.rollout_path, "--rollout-path")
        except PreprocessError as exc:
            raise DataError(str(exc)) from None
    for path in data_prefixes(args):
        meta = read_meta(path)
        if required:
            PackedDocuments(path)  # its DataError names the missing files
        if meta is not None or os.path.isfile(dataset_paths(path)["input_ids"] + ".bin"):
            check(args.stage, path, meta)
            if all(os.path.isfile(p + ".bin") for p in dataset_paths(path).values()):
                check_data(PackedDocuments(path), args)
