"""GRPOConfig's fields that ES has no use for, accepted by ESConfig so that any GRPO recipe or `GRPOConfig(...)` call
runs unchanged with ES swapped in.

`GRPOOnlyFields` is a dataclass of every field of the installed TRL's GRPOConfig that TrainingArguments lacks, with
GRPOConfig's types and defaults; ESConfig inherits it and declares again those it uses. A field ES has no use for set to another value than
GRPO's default is ignored with one warning listing them all (`IGNORED` says why), or refused with the reason when
ES cannot honour it (`REFUSED`). ESConfig's own fields with GRPO's names — the sampling settings, vLLM's,
`trust_remote_code`, `shuffle_dataset`, `mask_truncated_completions`, `multi_objective_aggregation`, … — keep
GRPO's meaning; `learning_rate`, `num_generations`, `per_device_train_batch_size` and `log_completions` have an ES
meaning (docs/migrating_from_grpo.md).
"""

from __future__ import annotations

import os
import typing
from dataclasses import MISSING, field, fields, make_dataclass

from transformers import TrainingArguments
from trl.trainer.grpo_config import GRPOConfig


NO_LOSS = "ES has no loss, clipping or importance ratio: members are scored by their rewards"
NO_REFERENCE = "ES has no reference model or KL term"
NO_ENTROPY_TERM = "ES adds no entropy bonus to a loss (log_completion_entropy logs the entropy)"
NO_BATCHING = "one ES step generates all its members' completions for the step's prompts"
IGNORED = {
    **dict.fromkeys(
        ["epsilon", "delta", "epsilon_high", "loss_type", "importance_sampling_level",
         "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
         "vespo_lambda_neg", "off_policy_mask_threshold", "router_aux_loss_coef", "cast_lm_head_to_fp32",
         "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
         "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"],
        NO_LOSS,
    ),
    **dict.fromkeys(
        ["beta", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "use_bias_correction_kl"],
        NO_REFERENCE,
    ),
    **dict.fromkeys(
        ["top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
         "entropy_coef_delta", "entropy_target"],
        NO_ENTROPY_TERM,
    ),
    **dict.fromkeys(["generation_batch_size", "steps_per_generation", "num_iterations"], NO_BATCHING),
    "disable_dropout": "ES always generates with dropout off (the model in eval mode)",
    "pad_to_multiple_of": "ES pads each generate call to its longest prompt",
    "vllm_group_port": "ES sends vLLM seeds, never weights, so there is no weight-broadcast group",
    "use_transformers_paged": "deprecated in GRPOConfig too",
}  # fmt: skip
"""GRPOConfig fields ES accepts and ignores, with the reason (any other GRPO-only field: 'not used by ES')."""

REFUSED = {
    "ds3_gather_for_generation": "ES evaluates members on θ gathered whole on every process under ZeRO-3",
    "use_transformers_continuous_batching": "not supported by ESTrainer yet: use use_vllm=True for fast generation",
    "transformers_continuous_batching_config": "not supported by ESTrainer yet: use use_vllm=True",
    "vllm_structured_outputs_regex": "not supported by ESTrainer yet: constrain completions in the reward instead",
    "log_completions_hub_repo": "not supported by ESTrainer yet: use report_to (wandb, trackio) for completions",
}
"""GRPOConfig fields whose non-default values ES cannot honour: refused with the reason."""


def _grpo_only_fields() -> list[tuple]:
    """(name, type, field) of GRPOConfig's fields that TrainingArguments lacks."""
    hints = typing.get_type_hints(GRPOConfig)
    shared = {f.name for f in fields(TrainingArguments)}
    own = []
    for f in fields(GRPOConfig):
        if f.name in shared:
            continue
        reason = REFUSED.get(f.name) or IGNORED.get(f.name, "not used by ES")
        default = {"default": f.default} if f.default is not MISSING else {"default_factory": f.default_factory}
        help_text = f"GRPOConfig's field, accepted for GRPO recipes; {'refused' if f.name in REFUSED else 'ignored'}"
        own.append((f.name, hints[f.name], field(**default, metadata={"help": f"{help_text}: {reason}."})))
    return own


def grpo_only_fields_class(module: str) -> type:
    """The dataclass ESConfig inherits for GRPOConfig's fields beyond TrainingArguments', importable as `module`'s
    `GRPOOnlyFields`: those ESConfig declares itself (the sampling settings, vLLM's, …) are replaced by its own."""
    cls = make_dataclass("GRPOOnlyFields", _grpo_only_fields(), repr=False, eq=False)
    cls.__module__ = module
    return cls


def check_grpo_only_fields(config, names: list[str]) -> list[str]:
    """The GRPO-only fields of `config` set to another value than GRPO's default (to list in one warning); a
    ValueError for a refused one."""
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(GRPOConfig)}
    changed = [
        name for name in names if getattr(config, name) != defaults[name] and not _computed_by_grpo(config, name)
    ]
    for name in changed:
        if name in REFUSED:
            raise ValueError(f"ESConfig.{name}={getattr(config, name)!r} is invalid: {REFUSED[name]}")
    return changed


def _computed_by_grpo(config, name: str) -> bool:
    """Whether a GRPO-only field holds what GRPOConfig's `__post_init__` computes from defaults (a ported GRPOConfig
    carries these values although its user set nothing)."""
    value = getattr(config, name)
    if name == "pad_to_multiple_of":
        return value is None  # "auto", resolved off Neuron
    if name == "steps_per_generation":
        return value == config.gradient_accumulation_steps
    if name == "generation_batch_size":
        steps = config.steps_per_generation or config.gradient_accumulation_steps
        return value == config.per_device_train_batch_size * int(os.environ.get("WORLD_SIZE", 1)) * steps
    return False
