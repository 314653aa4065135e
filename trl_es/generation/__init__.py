"""Generation backends (evaluate the model as it currently is on a batch of prompts, return completions) and the
weights backend each comes with: transformers `generate` on the trainer's own tensors, or vLLM (colocated or
served) whose workers hold the members' weights."""

import dataclasses

import torch
from transformers import GenerationConfig

from ..es.qes import Int8Weights
from ..es.weights import LocalWeights
from ..util.compat import SAMPLING_FIELDS
from ..util.models import text_tokenizer
from .base import Completions, Generation, compute_dtype
from .lowrank_forward import target_modules
from .transformers_backend import TransformersGeneration, TransformersWeights
from .vllm_backend import VLLMGeneration, VLLMWeights
from .vllm_engine import require_vllm
from .vllm_plan import plan_engine, start_engine


def decoding_config(tokenizer, eos_token_ids: list[int], max_new_tokens: int, **decoding) -> GenerationConfig:
    """The one GenerationConfig builder (training and `trl-es eval`): `decoding` holds GRPOConfig's sampling fields
    (do_sample, temperature, top_p, top_k, min_p, repetition_penalty, cache_implementation) and
    `generation_kwargs`' overrides; a greedy config drops the sampling fields (transformers warns about them)."""
    settings = {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos_token_ids,
        **decoding,
    }
    if not settings["do_sample"]:
        settings = {name: value for name, value in settings.items() if name not in SAMPLING_FIELDS}
    return GenerationConfig(**settings, disable_compile=True)


def generation_config(
    args, tokenizer, eos_token_ids: list[int], image_token_id: int | None = None
) -> GenerationConfig:
    """The trainer's GenerationConfig from ESConfig's generation fields, as GRPOTrainer builds it: a vision-language
    model never samples its image token (`image_token_id`), which would have no image features."""
    fields = [f.name for f in dataclasses.fields(args) if f.metadata.get("decoding")]
    decoding = {name: getattr(args, name) for name in fields}
    if image_token_id is not None:
        decoding["suppress_tokens"] = [image_token_id]
    decoding |= args.generation_kwargs or {}  # kwargs override
    return decoding_config(tokenizer, eos_token_ids, args.max_completion_length, **decoding)


def make_backend(model, processing_class, eos_token_ids, args, accelerator, params, facts):
    """(generation backend, weights backend) for ESConfig's `use_vllm` / `vllm_mode`: transformers `generate` and
    `LocalWeights` over `params` (`Int8Weights` over an 8-bit model's integers for QES), or vLLM and `VLLMWeights`
    (the trainer's tensors take the same updates).
    `processing_class`: the tokenizer, or a vision-language model's processor (transformers path only); `facts`: the
    run's `RunFacts`."""
    tokenizer = text_tokenizer(processing_class)
    image_token_id = model.config.image_token_id if facts.vision else None
    config = generation_config(args, tokenizer, eos_token_ids, image_token_id)
    generation_args = (model, processing_class, config, eos_token_ids)
    table = (args.seed, args.noise_table_size)
    if facts.engine == "transformers":
        generation = TransformersGeneration(
            *generation_args, args.chat_template_kwargs, compute_dtype=facts.compute_dtype
        )
        if facts.theta_dtype == torch.int8:  # es_search_space='qes': an 8-bit model's integers, changed in place
            return generation, Int8Weights(params, *table)
        targets = None if facts.lowrank_targets is None else target_modules(model, facts.lowrank_targets)
        weights = TransformersWeights(params, *table, storage_device="cpu", targets=targets, rank=args.lowrank_rank)
        return generation, weights
    local = LocalWeights(params, *table, storage_device="cpu")
    if facts.engine == "vllm-colocate":  # a server runs vLLM in its own environment; the trainer only talks HTTP
        require_vllm()
    plan = plan_engine(model, params, args, facts)  # its refusals come before the engine starts
    engine = start_engine(model, tokenizer, args, accelerator, params, plan, facts)
    generation = VLLMGeneration(engine, *generation_args, args.chat_template_kwargs, args.generation_kwargs)
    return generation, VLLMWeights(local, generation, args, plan)


__all__ = [
    "Completions",
    "Generation",
    "TransformersGeneration",
    "TransformersWeights",
    "VLLMGeneration",
    "VLLMWeights",
    "compute_dtype",
    "generation_config",
    "make_backend",
    "require_vllm",
]
