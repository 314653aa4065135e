"""What training starts from: the model as ESTrainer takes it (loaded with `trl_es.util.models`, checked by
`trl_es.training.checks`), its tokenizer, θ's precision, the parameters ES selects among, the run's facts
(`run_facts`), the prompt datasets (an agent run's included); and how the training data is read (`DataMixin`)."""

from __future__ import annotations

import warnings

import torch
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader, SequentialSampler
from transformers.utils import logging
from trl.trainer.utils import disable_dropout_in_model

from ..es.params import HALF_PRECISION, is_fused_experts, upcast
from ..generation.base import compute_dtype
from ..generation.lowrank_forward import lowrank_targets, parameter_adapters
from ..util.compat import is_peft_model
from ..util.facts import RunFacts
from ..util.models import (
    add_adapter,
    eos_token_ids,
    is_quantized_model,
    is_vision_language,
    load_processing_class,
    load_starting_model,
    processor_of,
    resolve_model,
)
from .checks import (
    check_experts,
    check_model_type,
    check_processing_class,
    check_prompt_dataset,
    check_quantized,
    check_vllm_quantized_base,
)


logger = logging.get_logger(__name__)


def prepare_model(model, args, processing_class=None, peft_config=None, quantization_config=None):
    """(model, processing class, EOS ids) for ESTrainer's `model` argument as GRPOTrainer takes it: an id or path
    (loaded with `args.model_init_kwargs` and `quantization_config`), a PreTrainedModel or a PeftModel; `peft_config`
    adds a new adapter. A quantized model must carry the adapter ES trains, or be 8-bit for QES (`check_quantized`).
    The processing class defaults to the model's (a vision-language model's processor, else its tokenizer). Dropout
    off, pad token set (the EOS when the tokenizer has none)."""
    model_path = resolve_model(model) if isinstance(model, str) else None
    if isinstance(model, str):
        init_kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError(
                    "`quantization_config` is given both as ESTrainer's argument and in `args.model_init_kwargs`: "
                    "give it in one place, preferably the trainer argument (as GRPOTrainer)"
                )
            init_kwargs["quantization_config"] = quantization_config
        if init_kwargs.get("quantization_config") is not None:  # a quantized model cannot be moved once loaded
            init_kwargs.setdefault("device_map", {"": args.device})  # and every process holds all of it
        model = load_starting_model(model_path, args.es_adapter_only, **init_kwargs)
    else:
        if args.model_init_kwargs is not None:
            logger.warning("`model_init_kwargs` is ignored: the model is already instantiated.")
        if quantization_config is not None:
            logger.warning("`quantization_config` is ignored: the model is already instantiated.")
    check_model_type(model)
    if peft_config is not None:
        model = add_adapter(model, peft_config, args.seed)
    check_quantized(model, args.es_search_space)
    check_experts(model)
    check_vllm_quantized_base(model, args, loaded=model_path is not None)
    if processing_class is None:
        processing_class = load_processing_class(model_path, model, args.trust_remote_code)
    tokenizer = check_processing_class(processing_class, model)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    disable_dropout_in_model(model)
    return model, processing_class, eos_token_ids(model, tokenizer)


def keep_theta_in_float32(params: dict, mixed_precision: str) -> None:
    """With mixed precision ('bf16', 'fp16': members computed in half precision, as GRPO's), θ and its updates stay
    float32: the ES parameters of a half-precision model are upcast (4 bytes each instead of 2). Without, a
    half-precision θ is trained as it is, and a warning says that updates below its rounding step are lost."""
    if mixed_precision in ("bf16", "fp16"):
        upcast(params)
        return
    half = sorted({str(p.dtype).removeprefix("torch.") for p in params.values() if p.dtype in HALF_PRECISION})
    if half:
        warnings.warn(
            f"the ES parameters are {'/'.join(half)} and bf16/fp16 are off: each update is rounded to their precision "
            "(a change below ~0.4% of a weight is lost). Set bf16=True to compute in bfloat16 with θ kept in float32.",
            stacklevel=3,
        )


def eval_datasets(eval_dataset) -> list:
    """The eval dataset, or each of a dict of them (e.g. a DatasetDict), as a list ([] for None)."""
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def run_facts(model, processing_class, params: dict, args, accelerator, zero_stage: int | None) -> RunFacts:
    """The run's `RunFacts`, from its prepared model, processing class and ES parameters `params` (θ in its training
    dtype), ESConfig `args`, the Accelerator and the ZeRO stage."""
    mixed = accelerator.mixed_precision
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else mixed if mixed != "no" else None
    targets = tuple(lowrank_targets(model, params)) if args.es_search_space == "lowrank" else None
    return RunFacts(
        vision=processor_of(processing_class) is not None,
        quantized=is_quantized_model(model),
        adapter=is_peft_model(model),
        fused_experts=tuple(name for name, p in params.items() if is_fused_experts(p)),
        parameter_adapters=tuple(name for name in parameter_adapters(model) if name in params),
        lowrank_targets=targets,
        theta_dtype=next(iter(params.values())).dtype,
        compute_dtype=compute_dtype(mixed),
        half_precision=half,
        zero_stage=zero_stage,
        num_processes=accelerator.num_processes,
        engine=f"vllm-{args.vllm_mode}" if args.use_vllm else "transformers",
    )


def es_candidates(model, patterns: list[str] | None):
    """The named parameters ES selects among (`select_parameters`): all of the model's, or for a vision-language
    model without `es_parameter_patterns`, its language model's alone — the decoder (`get_decoder()`) and the output
    head (`get_output_embeddings()`) — so the vision tower and the connector projecting its features stay as they
    are unless the patterns select them."""
    if patterns or not is_vision_language(model):
        return list(model.named_parameters())
    base = model.get_base_model() if is_peft_model(model) else model
    language = {id(p) for part in (base.get_decoder(), base.get_output_embeddings()) for p in part.parameters()}
    return [(name, p) for name, p in model.named_parameters() if id(p) in language]


def training_dataset(dataset, args, environment_factory):
    """The training dataset, checked as GRPOTrainer checks it. An environment may own the data: without a dataset,
    one step's prompts of an empty user prompt (which each episode's `reset` fills) drive the run,
    and `max_steps` sets its length; with one, the `prompt` column is optional (an empty user prompt) and the dataset
    must have a row. An iterable dataset is read with `dataloader_num_workers=0`, as GRPOTrainer reads it (each
    worker would read the whole stream)."""
    if isinstance(dataset, IterableDataset) and args.dataloader_num_workers:
        warnings.warn(
            f"dataloader_num_workers={args.dataloader_num_workers} is set to 0 for an iterable train dataset",
            stacklevel=3,
        )
        args.dataloader_num_workers = 0
    if environment_factory is None:
        if dataset is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        check_prompt_dataset(dataset)
        return dataset
    multi = isinstance(environment_factory, dict)
    if dataset is None:
        if multi:
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment. Provide a dataset, or pass a single "
                "environment factory."
            )
        if args.max_steps <= 0:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and returns the prompt from "
                "`reset()`), `max_steps` must be set to a positive value to define the training length. Set it via "
                "`ESConfig(max_steps=...)`."
            )
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps  # one ES step's prompts
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})
    columns = getattr(dataset, "column_names", None) or []
    if "prompt" in columns:
        check_prompt_dataset(dataset)
    if next(iter(dataset), None) is None:
        raise ValueError(
            "`train_dataset` is empty: each episode resets its environment with a row of it. Pass rows, or no "
            "`train_dataset` when the environment owns the data (then set max_steps)."
        )
    if multi and "environment" not in columns:
        raise ValueError(
            f"a `dict` `environment_factory` selects each row's environment by its `environment` column, which the "
            f"train_dataset lacks (columns: {columns})"
        )
    return dataset


class DataMixin:
    """How `ESTrainer` reads its training data (Trainer's hooks): every process reads the same prompts, since the
    population is split across processes, not the data."""

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        """Every process reads the same prompts: the population is split across processes, not the data. So a
        batch is `per_device_train_batch_size` rows whatever the number of processes (an ES step takes
        `gradient_accumulation_steps` batches, `ESTrainer.training_step`). With
        `shuffle_dataset` (as GRPOConfig's) a map-style dataset is read in a seeded random order, an iterable one
        through a seeded shuffle buffer; without it, in dataset order."""
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            dataset = self.train_dataset
            if self.args.shuffle_dataset and hasattr(dataset, "shuffle"):
                dataset = dataset.shuffle(seed=self.args.seed)
            return DataLoader(  # iterated identically on every process (no Accelerate sharding or dispatching)
                dataset,
                batch_size=self._train_batch_size,
                collate_fn=self.data_collator,
                num_workers=self.args.dataloader_num_workers,
            )
        dataloader = super().get_train_dataloader()
        if isinstance(dataloader.batch_sampler, BatchSamplerShard):  # undo Accelerate's per-process sharding
            dataloader.batch_sampler.num_processes, dataloader.batch_sampler.process_index = 1, 0
        return dataloader

    def _get_train_sampler(self, train_dataset=None):
        return (
            super()._get_train_sampler(train_dataset)
            if self.args.shuffle_dataset
            else SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        )
