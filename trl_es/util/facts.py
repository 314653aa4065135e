"""`RunFacts`: what a run is, decided once after its model is prepared and its ES parameters chosen
(`trl_es.training.loading.run_facts`), and read by every layer that acts on it — the set-up's refusals, the
generation and weights backends, the vLLM engine's plan — instead of each working it out again."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunFacts:
    """The facts of one run (frozen: nothing changes them once training is set up)."""

    vision: bool
    """A vision-language model: its processing class is a processor, its prompts may carry images."""
    quantized: bool
    """The base's weights are quantized (bitsandbytes, torchao): ES trains an adapter on it, or with
    es_search_space='qes' the integers of an 8-bit base."""
    adapter: bool
    """θ is a PEFT adapter's weights (the model is a PeftModel: `peft_config` or `es_adapter_only`)."""
    fused_experts: tuple[str, ...]
    """The ES parameters that are a mixture of experts' fused expert tensors (E × … × …)."""
    parameter_adapters: tuple[str, ...]
    """The ES parameters that are LoRA factors of a PEFT adapter on parameters (`LoraConfig.target_parameters`),
    which peft applies inside the wrapped module's forward."""
    lowrank_targets: tuple[str, ...] | None
    """With es_search_space='lowrank', the ES parameters its members perturb (linear weights, fused experts,
    routers); None otherwise."""
    theta_dtype: torch.dtype
    """θ's dtype: float32 under mixed precision (a float32 master over a half-precision model), int8 for QES (an
    8-bit model's integers), else the model's."""
    compute_dtype: torch.dtype | None
    """The dtype members are computed in under mixed precision (bfloat16, float16); None: θ's own."""
    half_precision: str | None
    """The mixed precision asked for ('bf16', 'fp16': ESConfig's fields or the accelerate config's), or None."""
    zero_stage: int | None
    """DeepSpeed's ZeRO stage, None without DeepSpeed."""
    num_processes: int
    """The training processes (each holds θ whole, evaluating its share of the population)."""
    engine: str
    """Where members generate: 'transformers', 'vllm-colocate' or 'vllm-server'."""
