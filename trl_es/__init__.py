"""trl-es: Evolution Strategies post-training for LLMs, as a TRL extension.

`from trl_es import ESConfig, ESTrainer`; `trl_es.load_chain` reads a run's seed chain. They are imported lazily so
that `trl_es.es` (the algorithm on plain tensors) imports without transformers.
"""

import logging


__version__ = "0.1.0"

__all__ = ["ESConfig", "ESTrainer", "load_chain"]


def _not_the_kernels_notice(record: logging.LogRecord) -> bool:
    """bitsandbytes, which peft imports whenever transformers' Trainer is imported, warns at its import that the
    optional `kernels` package for a faster CPU 4-bit kernel is missing (4-bit models run without it): that line
    alone is dropped, before anything a newcomer asked for. Its other messages pass."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernels_notice)


def __getattr__(name):
    if name == "ESConfig":
        from .training.config import ESConfig

        return ESConfig
    if name == "ESTrainer":
        from .training.trainer import ESTrainer

        return ESTrainer
    if name == "load_chain":
        from .chains import load_chain

        return load_chain
    raise AttributeError(f"module 'trl_es' has no attribute {name!r}")
