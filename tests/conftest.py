"""Shared fixtures: a tiny Qwen-style tokenizer and small generated datasets (all offline, deterministic).

Fixtures other tests may reuse:

* ``toy_tokenizer_dir``: directory of an HF fast tokenizer (``AutoTokenizer.from_pretrained``),
  pad ``<|endoftext|>``, EOS ``<|im_end|>``, plus ``<|im_start|>``.
* ``toy_alpaca_rows`` / ``toy_sharegpt_rows``: generated rows (lists of dicts).
* ``toy_alpaca_jsonl`` / ``toy_sharegpt_jsonl``: those rows written as JSON lines.
* ``run_preprocess``: call ``preprocess_data.py``'s ``main`` in-process with keyword flags,
  returning ``(exit_code, stdout, stderr)``.
* ``read_indexed``: documents of a Megatron indexed dataset prefix, as numpy arrays.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread (before torch is imported; every run the tests start inherits it): the tiny
# models gain nothing from more, and OpenMP threads spinning for a busy core make a step ~10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if torch.cuda.is_available():  # does not initialise CUDA in this process
    # On a GPU machine the suite checks the CPU path as everywhere else (its multi-process tests run gloo
    # ranks side by side, and NCCL refuses two ranks on one GPU): the project is told to leave CUDA alone in
    # every test and every process the tests start. tests/test_cuda.py runs the exactness checks on the GPU,
    # each in a fresh process that sees it.
    os.environ["MINDSPEED_PACK_FORCE_CPU"] = "1"

from mindspeed_pack.data import toy  # noqa: E402

TOY_ALPACA_SAMPLES = 300
TOY_SHAREGPT_SAMPLES = 200


# The longest files (torchrun restarts and multi-node launches: test_elastic.py alone is about half of a
# serial run). They run first, the rest in collection order: under ``make test`` (``-n 2 --dist loadfile
# --no-loadscope-reorder``) the longest file then starts at once on one worker while the other takes the
# rest, instead of starting last and running alone.
LONGEST_FILES = ("test_elastic.py", "test_multinode.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


@pytest.fixture(scope="session")
def toy_tokenizer_dir(tmp_path_factory):
    return toy.build_toy_tokenizer(tmp_path_factory.mktemp("toy_tokenizer"))


@pytest.fixture(scope="session")
def toy_alpaca_rows():
    return toy.generate_alpaca(TOY_ALPACA_SAMPLES, seed=1, with_system=True)


@pytest.fixture(scope="session")
def toy_sharegpt_rows():
    return toy.generate_sharegpt(TOY_SHAREGPT_SAMPLES, seed=2, turns=(1, 3))


@pytest.fixture(scope="session")
def toy_alpaca_jsonl(tmp_path_factory, toy_alpaca_rows):
    return toy.write_dataset(tmp_path_factory.mktemp("alpaca") / "alpaca.jsonl", toy_alpaca_rows)


@pytest.fixture(scope="session")
def toy_sharegpt_jsonl(tmp_path_factory, toy_sharegpt_rows):
    return toy.write_dataset(tmp_path_factory.mktemp("sharegpt") / "sharegpt.jsonl", toy_sharegpt_rows)


def _flag_args(flags: dict) -> list[str]:
    argv = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv


@pytest.fixture
def run_preprocess(capsys, toy_tokenizer_dir):
    """``run_preprocess(input=..., output_prefix=..., pack=True, ...)`` -> (code, stdout, stderr).

    The toy tokenizer is used unless ``tokenizer_name_or_path`` is given.
    """
    from mindspeed_pack.datasets.preprocess import main

    def run(**flags):
        flags.setdefault("tokenizer_name_or_path", toy_tokenizer_dir)
        capsys.readouterr()
        code = main(_flag_args(flags))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def read_indexed():
    """``read_indexed(prefix)`` -> list of int arrays, one per document."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    def read(prefix) -> list[np.ndarray]:
        ds = IndexedDataset(str(prefix))
        return [np.array(ds[i], copy=True) for i in range(len(ds))]  # copies: the mmap closes with ds

    return read
