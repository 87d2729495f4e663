"""Build and install mindspeed-pack.

The pybind11 extension ``mindspeed_pack._helpers`` (packing and the training sample index)
is compiled here, at install time, so nothing is ever built at run time.
"""
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# the chat templates live where MindSpeed-LLM keeps them (configs/finetune/templates.json); an installed package
# has no configs/, so each build copies the file into the package (mindspeed_pack.data.templates reads either)
TEMPLATES = os.path.join("configs", "finetune", "templates.json")


class build_py_with_templates(build_py):
    """build_py that also ships configs/finetune/templates.json as mindspeed_pack/data/templates.json."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install reads the checkout's configs/
            target = os.path.join(self.build_lib, "mindspeed_pack", "data", "templates.json")
            self.mkpath(os.path.dirname(target))
            self.copy_file(TEMPLATES, target)


ext_modules = [
    Pybind11Extension(
        "mindspeed_pack._helpers",
        ["mindspeed_pack/csrc/helpers.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

install_requires = [
    # torch is pinned by the installer (scripts/setup_env.sh) so that pip never swaps the
    # CPU build for a CUDA one; any torch >= 2.4 with SDPA GQA support works.
    "torch>=2.4",
    "megatron-core==0.16.1",
    "numpy",
    "pybind11>=2.11",
    "sentencepiece",
    "transformers>=4.45",
    "tokenizers",
    "pyarrow",
    "safetensors",
    "tensorboard",
    "tqdm",
    "pyyaml",  # --config files
    "matplotlib",
]

setup(
    name="mindspeed-pack",
    version="0.1.0",
    description="Exact multi-sample packing for Megatron-Core fine-tuning",
    packages=find_packages(include=["mindspeed_pack", "mindspeed_pack.*"]),
    package_data={"mindspeed_pack": ["csrc/*.cpp", "csrc/*.h"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext, "build_py": build_py_with_templates},
    python_requires=">=3.10",
    install_requires=install_requires,
    extras_require={
        # the range megatron-core 0.16.1 itself is tested with (its "dev" extra)
        "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
        # peft: the LoRA tests load the PEFT export and compare against PEFT's adapters
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "peft"],
    },
    entry_points={
        "console_scripts": [
            "mindspeed-preprocess=mindspeed_pack.datasets.preprocess:main",
            "mindspeed-posttrain=mindspeed_pack.training.posttrain:cli",
            "mindspeed-pretrain=mindspeed_pack.training.pretrain:cli",
            "mindspeed-convert-ckpt=mindspeed_pack.convert.convert:main",
            "mindspeed-compare-runs=mindspeed_pack.tools.compare_runs:main",
            "mindspeed-inspect-pack=mindspeed_pack.tools.inspect_pack:main",
        ]
    },
)
