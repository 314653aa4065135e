"""Generation backends: evaluate the model as it currently is on a batch of prompts, return completions."""

from .transformers_generate import Rollout, TransformersRollout

__all__ = ["Rollout", "TransformersRollout"]
