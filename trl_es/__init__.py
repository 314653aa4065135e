"""trl-es: Evolution Strategies post-training for LLMs, as a TRL extension.

`from trl_es import ESConfig, ESTrainer`; `trl_es.load_chain` reads a run's seed chain. They are imported lazily so
that `trl_es.es` (the algorithm on plain tensors) imports without transformers.
"""

__version__ = "0.1.0"

__all__ = ["ESConfig", "ESTrainer", "load_chain"]


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
