"""What each method of `trl-es study` trains with: ES's calibrated settings (on transformers, and on vLLM with
`--es-vllm`), its variants (`--es-variant`), GRPOTrainer's, and the options that change them (`trainer_settings`)."""

from __future__ import annotations


ES_SETTINGS = {"population_size": 8, "sigma": 5e-3, "learning_rate": 5e-3, "per_device_train_batch_size": 8}
"""The demo's calibrated ES settings (trl_es.commands.demo); members generate greedily unless --es-sample."""


ES_VLLM_SETTINGS = {"population_size": 32, "sigma": 1e-2, "learning_rate": 1e-2, "per_device_train_batch_size": 8}
"""ES's defaults with `--es-vllm`, in low-rank members (LoRA slots) unless `--es-space full`: the configuration that
learned fastest per minute in the regime (small_sums_last at T = 0.6) on 2 CPU cores and kept its gains to 110
updates (48 minutes): an engine screen and a σ/α sweep picked N = 32 and σ = 1e-2; the sweep's α = 2e-2 leads at
12 minutes but overshoots and drifts by 48 (docs/study.md)."""


ES_VARIANTS = {
    "prompt-norm": {"scale_rewards": "group"},
    "pass1-sampled": {"do_sample": True, "temperature": 0.6, "per_device_train_batch_size": 4, "num_generations": 4,
                      "fitness_pass_k": 1},
    "pass4-sampled": {"do_sample": True, "temperature": 0.6, "per_device_train_batch_size": 4, "num_generations": 4,
                      "fitness_pass_k": 4},
    "top8": {"fitness_top_k": 8, "learning_rate": 1.6e-2},
    "noise-reuse4": {"noise_reuse": 4},
}  # fmt: skip
"""The ES variants `--es-variant` applies over ES's settings (the `--es-vllm` winner's: docs/study.md screens them
there), before `--es-population`, `--es-sigma` and `--es-learning-rate`: `prompt-norm` z-scores each prompt's
rewards across the members (`scale_rewards="group"`); `pass1-sampled` / `pass4-sampled` let members sample 4
completions of 4 prompts at T = 0.6 (GRPO's 16 completions per step; `do_sample`) with Pass@1 / Pass@4 fitness;
`top8` moves θ with the best 8 of 32 members only, α × 1.6 keeping the step's norm (the top quarter's z-scores
average about 1.27: (1/32)·1.27·√8 against (1/32)·√32); `noise-reuse4` keeps each step's noise directions for 4
steps."""


GRPO_SETTINGS = {"learning_rate": 1e-5, "per_device_train_batch_size": 16, "num_generations": 4, "bf16": False}
"""TRL GRPOTrainer: 4 prompts × 4 completions per step, lr 1e-5 (TRL's default 1e-6 barely moves in minutes)."""


VLLM_MAX_MODEL_LENGTH = 2048
"""The context of a training engine (`--es-vllm`, `--grpo-vllm`): prompts and completions of the tasks fit, and the
KV cache stays small on CPU (the model's own 8192 for SmolLM2 would reserve four times as much)."""


def trainer_settings(kind: str, options) -> dict:
    """The config fields a stage of `kind` ("es" or "grpo") sets besides the common ones: the calibrated settings
    with the command's overrides (ES's population, σ, α and search space; either method's vLLM engine). Fields at
    their default are left out, so that a stage trained before an option existed still resumes."""
    engine = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": VLLM_MAX_MODEL_LENGTH}
    if kind == "grpo":
        return {**GRPO_SETTINGS, **(engine if options.grpo_vllm else {})}
    overrides = {"population_size": options.es_population, "sigma": options.es_sigma,
                 "learning_rate": options.es_learning_rate}  # fmt: skip
    calibrated = ES_VLLM_SETTINGS if options.es_vllm else ES_SETTINGS
    variant = {key: value for key, value in ES_VARIANTS.get(options.es_variant, {}).items() if key != "do_sample"}
    settings = {**calibrated, **variant, **{key: value for key, value in overrides.items() if value is not None}}
    space = options.es_space or ("lowrank" if options.es_vllm else "full")
    if space != "full":
        settings["es_search_space"] = space
    if options.es_anchor_decay:
        settings["es_anchor_decay"] = options.es_anchor_decay
    return {**settings, **(engine if options.es_vllm else {})}


def stage_settings(kind: str, options) -> dict:
    """What a stage of `kind` ("es" or "grpo") trains with, as printed and saved (the engine: `use_vllm`)."""
    if kind == "grpo":
        return {"trainer": "trl.GRPOTrainer", **trainer_settings(kind, options)}
    return {"trainer": "trl_es.ESTrainer", **trainer_settings(kind, options), "do_sample": es_samples(options)}


def es_samples(options) -> bool:
    """Whether ES's members sample (`--es-sample`, or a sampling `--es-variant`) or generate greedily."""
    return options.es_sample or ES_VARIANTS.get(options.es_variant, {}).get("do_sample", False)
