"""Every refusal of a run's set-up that ESConfig's own fields cannot decide, before what it would waste:
`check_arguments` on ESTrainer's arguments before any model weights load; the model's (`check_quantized`,
`check_experts`, `check_vllm_quantized_base`, `check_processing_class`) as soon as it is prepared; the datasets'
(`check_vision`, `check_eval_dataset`) before the trainer is built; `check_setup` once the processes started, before
any engine starts. ESConfig refuses what its fields alone decide (`ESConfig.__post_init__`), each search space what
it cannot do (`SearchSpace.check_config` / `check_setup`), and a resume what its checkpoint was not trained with
(`trl_es.chains.ChainRecorder.check_resume`)."""

from __future__ import annotations

import os

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.utils import get_config_model_id

from ..es.params import is_int8_weight, is_quantized
from ..generation.vllm_engine import server_urls
from ..rollout import check_agent_arguments
from ..util.atomic import is_within
from ..util.compat import is_peft_model
from ..util.models import (
    is_quantized_model,
    is_vision_language,
    processor_of,
    quantization_name,
    text_tokenizer,
    with_pad_token,
)
from .config import GRPO_ONLY_FIELDS, ESConfig
from .distributed import check_fsdp_launch
from .grpo_fields import check_grpo_only_fields


def check_arguments(
    model, args, optimizers, optimizer_cls_and_kwargs, tools, environment_factory, rollout_func
) -> ESConfig:
    """ESTrainer's arguments, checked before anything loads: the model's type, `args` (the default ESConfig when
    None), the launch, the optimizers and the agent arguments. Returns the ESConfig."""
    check_model_type(model)
    args = check_args(args, model)
    check_fsdp_launch(args)
    check_optimizers(args, optimizers, optimizer_cls_and_kwargs)
    check_agent_arguments(args, tools, environment_factory, rollout_func)
    return args


def check_model_type(model) -> None:
    """A TypeError unless `model` is what ESTrainer takes: an id or path, a PreTrainedModel or a PeftModel."""
    if not isinstance(model, (str, PreTrainedModel)) and not is_peft_model(model):
        raise TypeError(
            f"`model` must be a model id, a path, a PreTrainedModel or a PeftModel, got {type(model).__name__}"
        )


def check_quantized(model, search_space: str = "full") -> None:
    """A ValueError for full ES on a quantized model: ES writes every member θ + σ·ε and every update into the
    weights it trains, which quantized storage cannot hold (bitsandbytes' int8 and 4-bit tensors would be corrupted
    silently). On a quantized base ES trains an adapter, whose weights are floating point, as QLoRA does; or, with
    es_search_space='qes', the integers of an 8-bit model themselves (`check_int8_model`)."""
    if search_space == "qes":
        check_int8_model(model)
        return
    if is_peft_model(model) or not is_quantized_model(model):
        return
    example = next(name for name, p in model.named_parameters() if is_quantized(p))
    raise ValueError(
        f"the model's weights are quantized ({quantization_name(model)}, e.g. {example!r}): ES writes θ + σ·ε and "
        "its updates into the weights it trains, which quantized storage cannot hold. Train an adapter on the "
        "quantized base: peft_config=LoraConfig(...) (`use_peft: true` in a `trl-es es` recipe), or "
        "es_adapter_only=True with an adapter directory; or, on a bitsandbytes 8-bit model, its integers with "
        "es_search_space='qes'"
    )


def check_int8_model(model) -> None:
    """A ValueError unless `model` is what es_search_space='qes' trains: a bitsandbytes 8-bit model (LLM.int8), every
    quantized weight of it int8 integers (`is_int8_weight`), without an adapter."""
    if is_peft_model(model):
        raise ValueError(
            "es_search_space='qes' trains the int8 weights of the base themselves, not an adapter: drop peft_config "
            "(`use_peft`) to train the integers, or train the adapter with es_search_space='full'"
        )
    quantized = [(name, p) for name, p in model.named_parameters() if is_quantized(p)]
    if not quantized:
        raise ValueError(
            "es_search_space='qes' trains the int8 integers of a bitsandbytes 8-bit model, and this model is not "
            "quantized: load it with quantization_config=BitsAndBytesConfig(load_in_8bit=True) (`load_in_8bit: true` "
            "in a recipe), or train its float weights with es_search_space='full'"
        )
    other = next((name for name, p in quantized if not is_int8_weight(p)), None)
    if other is not None:
        raise ValueError(
            f"es_search_space='qes' trains the int8 integers of bitsandbytes' 8-bit layers (LLM.int8), and this "
            f"model is quantized otherwise ({quantization_name(model)}, e.g. {other!r}), which QES cannot step: load "
            "it with BitsAndBytesConfig(load_in_8bit=True), or train an adapter on it (peft_config) with "
            "es_search_space='full'"
        )


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""The config fields that hold a mixture of experts' number of experts (Qwen-MoE's, Mixtral's, DeepSeek's)."""


def check_experts(model) -> None:
    """A ValueError for a mixture of experts whose config routes each token to more experts than a layer has
    (`num_experts_per_tok`): torch would fail inside the first member's forward pass."""
    config = model.config.get_text_config()
    top_k = getattr(config, "num_experts_per_tok", None)
    field = next((name for name in EXPERT_COUNTS if getattr(config, name, None)), None)
    if top_k and field and top_k > getattr(config, field):
        raise ValueError(
            f"the model's config routes each token to num_experts_per_tok={top_k} experts, but its layers have "
            f"{field}={getattr(config, field)}: set num_experts_per_tok to at most {getattr(config, field)} in its "
            "config.json"
        )


def check_vllm_quantized_base(model, args, loaded: bool) -> None:
    """A ValueError for an adapter through vLLM on a quantized base that ESTrainer did not load itself (`loaded`):
    vLLM quantizes the base from its files, not from the trainer's quantized weights, which may have been changed in
    memory (the unquantized base vLLM takes from the trainer, `VLLMWeights.start`)."""
    if not (args.use_vllm and is_peft_model(model) and is_quantized_model(model.get_base_model())) or loaded:
        return
    path = model.get_base_model().name_or_path
    raise ValueError(
        f"use_vllm=True with an adapter on a quantized base given as a loaded model: vLLM quantizes the base from its "
        f"files ({path!r}), not the trainer's weights, which may differ. Pass the model as a path (model={path!r} with "
        "quantization_config, or an adapter directory with es_adapter_only=True) or use_vllm=False"
    )


def check_optimizers(args, optimizers, optimizer_cls_and_kwargs) -> None:
    """A ValueError for Trainer's `optimizers` / `optimizer_cls_and_kwargs` (GRPOTrainer's arguments) that this run
    would not use: only with `es_optimizer` does an optimizer step on the ES gradient estimate, and a scheduler
    must schedule the optimizer it comes with."""
    optimizer, scheduler = optimizers if optimizers is not None else (None, None)
    if (optimizer is not None or scheduler is not None or optimizer_cls_and_kwargs is not None) and not (
        args.es_optimizer
    ):
        given = "`optimizers`" if optimizer is not None or scheduler is not None else "`optimizer_cls_and_kwargs`"
        raise ValueError(
            f"{given} gives Trainer an optimizer, which the plain ES update does not use (it moves θ by "
            "learning_rate and lr_scheduler_type itself): set ESConfig(es_optimizer=True) to have the optimizer step "
            "on the ES gradient estimate"
        )
    if scheduler is not None and optimizer is None:
        raise ValueError(
            "`optimizers` holds a scheduler without its optimizer: the scheduler would set the learning rate of an "
            "optimizer ESTrainer does not step. Pass (optimizer, scheduler), or give the optimizer with "
            "`optimizer_cls_and_kwargs` and the schedule with lr_scheduler_type"
        )
    if scheduler is not None and scheduler.optimizer is not optimizer:
        raise ValueError(
            "`optimizers` holds a scheduler built on another optimizer than the one it holds: it would set the "
            "learning rate of an optimizer ESTrainer does not step. Build the scheduler on the optimizer you pass"
        )


def check_optimizer_parameters(optimizer, params: dict) -> None:
    """A ValueError unless `optimizer` holds every parameter ES trains (it steps on their gradient estimate; one it
    lacks would never move)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in params.items() if id(p) not in held]
    if missing:
        raise ValueError(
            f"the optimizer does not hold {len(missing)} of the {len(params)} parameters ES trains (e.g. "
            f"{missing[0]!r}), which would never move: build it over the trained model's parameters (with "
            "peft_config, the adapter exists only inside ESTrainer: pass optimizer_cls_and_kwargs instead)"
        )


def check_setup(args, facts) -> None:
    """A ValueError for settings this run's set-up cannot honour, known once the model is prepared and the processes
    started (`facts`: the run's `RunFacts`; ESConfig refuses what its fields alone decide; each search space checks
    its own, `check_setup`). Before any engine starts."""
    zero_stage, num_processes = facts.zero_stage, facts.num_processes
    if facts.adapter and facts.engine == "vllm-server":
        raise ValueError(
            "an adapter (peft_config, es_adapter_only) with vllm_mode='server': not supported yet (the server would "
            "need the adapter's weights); use vllm_mode='colocate', whose engine evaluates the adapter's members in "
            "its LoRA slots"
        )
    if facts.adapter and args.use_vllm and args.es_search_space not in ("full", "copes"):
        raise ValueError(
            f"es_search_space={args.es_search_space!r} with an adapter and use_vllm=True: vLLM's LoRA slots hold the "
            "adapter's full-ES members ('full', 'copes'); use one of those, or use_vllm=False"
        )
    if facts.adapter and args.sparse_delta_tau is not None:
        raise ValueError(
            "ESConfig.sparse_delta_tau needs a full model: a PEFT adapter is already a compact update (train "
            "without es_adapter_only to get a sparse delta of the merged model)"
        )
    if facts.parameter_adapters and args.es_search_space == "lowrank":
        raise ValueError(
            f"es_search_space='lowrank' with a PEFT adapter on parameters (LoraConfig.target_parameters, e.g. "
            f"{facts.parameter_adapters[0]!r}): peft builds that adapter's weight delta from its LoRA factors inside "
            "the wrapped module's forward, where low-rank members cannot be added. Use es_search_space='full' or "
            "'copes' with this adapter, or an adapter on modules (target_modules)"
        )
    if args.use_vllm and zero_stage == 3:
        raise ValueError("use_vllm=True needs θ whole on every process: use ZeRO-2 or none (ZeRO-3 partitions it)")
    servers = len(server_urls(args)) if facts.engine == "vllm-server" else num_processes
    if servers < num_processes:
        raise ValueError(
            f"vllm_mode='server' with {num_processes} processes and {servers} server(s): a server holds one member's "
            "weights at a time, so each training process drives servers of its own. Give vllm_server_base_url one "
            "URL per process at least (comma-separated: process r drives every K-th from the r-th), or use fewer "
            "processes, or vllm_mode='colocate'."
        )
    half = facts.half_precision
    if half and zero_stage == 3:
        raise ValueError(
            f"mixed precision ({half}: ESConfig's bf16/fp16 or the accelerate config's mixed_precision) with ZeRO-3: "
            "DeepSpeed would hold θ's partitions in half precision, where ES updates below its rounding step are "
            "lost. Use ZeRO-2 (θ whole on each process, members computed in half precision, θ float32), or ZeRO-3 "
            "with bf16=False and mixed_precision: 'no'"
        )
    if args.es_optimizer and zero_stage == 3:
        raise ValueError("es_optimizer with ZeRO-3: the optimizer would step on partitioned θ; use ZeRO-2 or none")


def check_processing_class(processing_class, model) -> PreTrainedTokenizerBase:
    """The text tokenizer of `processing_class` (a tokenizer, or a vision-language model's processor), checked
    against the model, with a pad token (its EOS when it has none)."""
    if isinstance(processing_class, ProcessorMixin) and not is_vision_language(model):
        raise TypeError(
            f"`processing_class` is a processor ({type(processing_class).__name__}) but {type(model).__name__} is "
            "not a vision-language model (its config has no vision_config): pass its tokenizer"
        )
    if not isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
        raise TypeError(
            "`processing_class` must be a tokenizer (PreTrainedTokenizerBase) or, for a vision-language model, a "
            f"processor (ProcessorMixin); got {type(processing_class).__name__}"
        )
    tokenizer = text_tokenizer(processing_class)
    embedding = model.get_input_embeddings()  # PEFT's embedding wrappers hold the nn.Embedding as base_layer
    rows = getattr(getattr(embedding, "base_layer", embedding), "num_embeddings", None) or embedding.weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows: they do not "
            "belong together"
        )
    return with_pad_token(tokenizer)


def image_column(dataset) -> str | None:
    """The column GRPOTrainer reads a row's images from: 'images' (a list), else 'image' (one); None without."""
    columns = getattr(dataset, "column_names", None) or ()
    return next((name for name in ("images", "image") if name in columns), None)


def check_vision(datasets: list, processing_class, model, args) -> None:
    """A ValueError, before anything is built, for what this run cannot show the model: dataset images (an 'image'
    or 'images' column) need a vision-language model with its processor, else the model would train on the text
    alone; and vLLM shows a vision-language model images in colocate mode with full-rank members only."""
    for dataset in datasets:
        column = image_column(dataset)
        if column is None:
            continue
        if not is_vision_language(model) or processor_of(processing_class) is None:
            what = "a processing class that is a tokenizer" if is_vision_language(model) else "a text-only model"
            raise ValueError(
                f"the dataset has an {column!r} column, which GRPOTrainer shows to a vision-language model through "
                f"its processor, but this run has {what} ({type(model).__name__}): it would train on the text alone. "
                "Use a vision-language model with its processor (the default processing_class), or remove the column"
            )
    if args.use_vllm and is_vision_language(model):
        why = None
        if args.vllm_mode == "server":
            why = "vllm_mode='server' sends token ids over HTTP, without the images"
        elif args.es_search_space == "lowrank":
            why = "es_search_space='lowrank' evaluates members as LoRA adapters, not run with images here"
        elif is_peft_model(model):
            why = "an adapter's members are LoRA adapters, not run with images here"
        if why:
            raise ValueError(
                f"use_vllm=True with a vision-language model ({type(model).__name__}): {why}. Use vllm_mode="
                "'colocate' with full-rank members (es_search_space='full'), or the transformers path (use_vllm=False)"
            )


def check_prompt_dataset(dataset, name: str = "train_dataset") -> None:
    """A clear error unless `dataset` has a 'prompt' column of text or chat messages (checked on its first row)."""
    if dataset is None:
        raise ValueError(f"ESTrainer needs a `{name}` with a 'prompt' column")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"`{name}` has no 'prompt' column (columns: {columns})")
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError(f"`{name}` is empty")
        prompt = dataset[0]["prompt"]
        is_messages = isinstance(prompt, list) and all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt
        )
        if not (isinstance(prompt, str) or (is_messages and prompt)):
            raise ValueError(
                "each 'prompt' must be text or a list of {'role', 'content'} messages; row 0 holds "
                f"{type(prompt).__name__}: {prompt!r:.80}"
            )
        if image_column(dataset) and not is_messages:
            raise ValueError(
                f"`{name}` has an {image_column(dataset)!r} column and text prompts: images go into a conversation, "
                "as in GRPOTrainer. Give the prompts as lists of chat messages (not with the chat template already "
                "applied), and the trainer puts each row's images into its first user message"
            )


def check_eval_dataset(eval_dataset, train_dataset) -> None:
    """The eval dataset (or each of a dict of them, e.g. a DatasetDict) has a 'prompt' column and every column of
    the train dataset: the rewards read both."""
    if isinstance(eval_dataset, dict):
        for part in eval_dataset.values():
            check_eval_dataset(part, train_dataset)
        return
    check_prompt_dataset(eval_dataset, "eval_dataset")
    train_columns = getattr(train_dataset, "column_names", None) or []
    missing = sorted(set(train_columns) - set(getattr(eval_dataset, "column_names", None) or train_columns))
    if missing:
        raise ValueError(
            f"`eval_dataset` lacks column(s) {missing} that `train_dataset` has: the reward functions read the same "
            "columns in both"
        )


def check_args(args, model) -> ESConfig:
    """ESTrainer's `args`: an ESConfig (by default named after the model, as GRPOTrainer's), never a GRPOConfig."""
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return ESConfig(f"{str(name).rstrip('/').split('/')[-1]}-ES")
    if isinstance(args, GRPOConfig):
        raise TypeError(
            "`args` is a GRPOConfig: ESTrainer takes an ESConfig. Convert it with "
            "ESConfig.from_grpo_config(args, population_size=..., sigma=..., learning_rate=...), which keeps its "
            "fields (docs/migrating_from_grpo.md)"
        )
    if not isinstance(args, ESConfig):
        raise TypeError(f"`args` must be an ESConfig, got {type(args).__name__}")
    check_grpo_only_fields(args, GRPO_ONLY_FIELDS)  # a refused field set after the config was built, as scripts do
    check_output_dir(args.output_dir, model)
    return args


def check_output_dir(output_dir: str, model) -> None:
    """A ValueError when the run would write into the directory of the model it starts from (`output_dir` is it or
    holds it, as for model=<run>/checkpoint-K): its saves would overwrite, and its checkpoints rotate away, the
    weights its seed chain replays from."""
    source = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
    if not (source and os.path.isdir(source)):
        return
    if is_within(source, output_dir):
        raise ValueError(
            f"output_dir {output_dir!r} holds the model this run starts from ({source!r}): its saves and checkpoints "
            "would overwrite or rotate away the weights the seed chain replays from. Give the run a new output_dir"
        )
