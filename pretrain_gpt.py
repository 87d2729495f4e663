"""Pretraining on plain documents (Megatron-LM's pretrain_gpt.py), the same loop as posttrain.py.

The usage and code are in :mod:`mindspeed_pack.training.pretrain` (also installed as ``mindspeed-pretrain``).
"""
# the script's code lives in the package (console script mindspeed-pretrain); tests import main from here
from mindspeed_pack.training.pretrain import cli, main, pretrain_args  # noqa: F401

if __name__ == "__main__":
    cli()
