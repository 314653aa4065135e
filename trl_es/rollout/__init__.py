"""Generation backends: evaluate the model as it currently is on a batch of prompts, return completions."""

from .transformers_generate import Rollout, TransformersRollout
from .vllm_generate import VLLMRollout, require_vllm


__all__ = ["Rollout", "TransformersRollout", "VLLMRollout", "require_vllm"]
