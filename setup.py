"""megalite: a readable Megatron-style GPT pretraining framework."""

from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style GPT pretraining: tensor, pipeline and data parallelism you can read in an afternoon",
    packages=find_packages(include=["megalite", "megalite.*"]),
    python_requires=">=3.11",  # enum.StrEnum
    # torch is deliberately unpinned above: a GPU machine keeps the CUDA build it has (scripts/install.sh
    # installs the CPU wheel only where no torch is present). 2.6 is the oldest release the whole suite
    # passes on (docs/compatibility.md; transformers 5 and megatron-core need it too); megalite.compat
    # adapts to each release from there.
    install_requires=[
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        # the converter writes configs with transformers 5's API (rope_parameters); what it exports also
        # loads in transformers 4.x (docs/checkpoints.md, tests/test_hf_export_compat.py)
        "transformers>=5.0",
        "datasets",
    ],
    extras_require={
        "logging": ["tensorboard", "wandb"],
        "test": ["pytest", "pytest-xdist", "ruff", "megatron-core", "tensorboard", "wandb", "matplotlib"],
    },
    scripts=["pretrain_gpt.py"],
)
