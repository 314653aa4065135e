"""The models an evaluation loads, and the engine it generates with: transformers, or an in-process vLLM engine with
training's colocate defaults (`ENGINE_DEFAULTS`)."""

from __future__ import annotations

import os
import types

from ..generation import VLLMGeneration
from ..generation.transformers_backend import completion_entropy_sums


def model_name(path: str, taken: set[str]) -> str:
    name = os.path.basename(os.path.normpath(path)) or path
    while name in taken:
        name += "'"
    taken.add(name)
    return name


def load_model(path: str):
    """(model in eval mode, tokenizer with a pad token, EOS ids) of the model at `path` (or 'smollm2')."""
    from ..util.models import eos_token_ids, load_starting_model, load_tokenizer, resolve_model, with_pad_token

    path = resolve_model(path)
    model = load_starting_model(path)
    tokenizer = with_pad_token(load_tokenizer(path, model))
    return model.eval(), tokenizer, eos_token_ids(model, tokenizer)


class ScoredVLLMGeneration(VLLMGeneration):
    """vLLM's completions with their token entropy scored afterwards by the evaluated model in transformers
    (`completion_entropy_sums`, teacher forcing: a forward pass over every completion, which costs more than
    generating it on CPU). Evaluation only: the model here holds the weights vLLM generates with, which a training
    run's members do not."""

    records_entropy = True

    def generate_ids(self, rows, seeds, record_entropy=False, max_new_tokens=None):
        completion_ids, truncated, _ = super().generate_ids(rows, seeds, False, max_new_tokens)
        entropy_sums = completion_entropy_sums(self.model, rows, completion_ids) if record_entropy else None
        return completion_ids, truncated, entropy_sums


def vllm_engine(model):
    """An in-process vLLM engine on `model`'s directory with training's colocate defaults (`ENGINE_DEFAULTS`, the
    ESConfig fields' defaults); it replaces this process's earlier engine (one per process)."""
    from accelerate import PartialState

    from ..generation.vllm_engine import ENGINE_DEFAULTS, Colocated, require_vllm

    require_vllm()
    settings = types.SimpleNamespace(**ENGINE_DEFAULTS)
    return Colocated(model.name_or_path, settings, PartialState(), next(model.parameters()).dtype)


def check_vllm_options(use_vllm: bool, vllm_entropy: bool) -> None:
    """A ValueError (one line in the CLI) for `vllm_entropy` without `use_vllm`, or `use_vllm` without vLLM
    installed: checked before any model is loaded."""
    from ..generation.vllm_engine import require_vllm

    if vllm_entropy and not use_vllm:
        raise ValueError(
            "--vllm-entropy scores vLLM's completions: add --use-vllm (without it the entropy is always recorded)"
        )
    if not use_vllm:
        return
    try:
        require_vllm()
    except ImportError as error:
        raise ValueError(str(error)) from error
