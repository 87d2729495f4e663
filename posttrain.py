"""Post-training on packed data (MindSpeed-LLM's posttrain_gpt.py): SFT, DPO, SimPO, ORPO, KTO, GRPO, reward models.

The usage and code are in :mod:`mindspeed_pack.training.posttrain` (also installed as ``mindspeed-posttrain``).
"""
# the script's code lives in the package (console script mindspeed-posttrain); tests import main from here
from mindspeed_pack.training.posttrain import cli, main, posttrain_args  # noqa: F401

if __name__ == "__main__":
    cli()
