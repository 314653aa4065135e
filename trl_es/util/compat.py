"""The private names of TRL and transformers that trl-es relies on, in one place, each with the versions it was
checked against and what happens where it differs. Everything else trl-es imports from them is public API.

Checked against transformers 5.16.1 … 5.24.0 and TRL 1.14.2 … 1.16.0 (the supported range, pyproject.toml); the fast
test suite runs on both ends of it (tests/unit/test_compat.py, .ci/matrix).

- `BaseTrainer`: TRL's `_BaseTrainer` (TRL ≥ 1.0), the Trainer subclass GRPOTrainer builds on — it writes TRL's model
  card (tags, the paper's citation). Without it: transformers' `Trainer`, with transformers' model card.
- `subtract_subsequence`: what `trl <command>` removes from its argv before re-launching under accelerate (TRL's
  `trl.cli.commands.training._subtract_subsequence`, private); a small function of our own, so that no version of
  TRL's CLI internals matters.
- `is_peft_model`: peft's own check (`isinstance(model, PeftModel)`), public, instead of transformers'
  `trainer_utils._is_peft_model`; False when peft is not installed.
- `let_transformers_see_gguf()`: on Python 3.10, importlib maps import names to distributions from `top_level.txt`
  only, which the gguf wheel lacks, so transformers 5.16 reads gguf's version as "N/A" and cannot load a GGUF file
  (SmolLM2); it adds the mapping to transformers' `import_utils.PACKAGE_DISTRIBUTION_MAPPING`. Python ≥ 3.11 and
  newer transformers need nothing.
- `sampling_warpers(model, config)`: transformers' sampling warpers for `config` (temperature, top-k, top-p, min-p,
  typical-p, ε/η cutoffs, top-h, in transformers' order), from `GenerationMixin._get_logits_processor` (private, same
  signature in 5.16.1 and 5.19.0) given a config holding only the sampling fields; trl-es samples each row with its
  own generator after them (`generation.transformers_backend.SeededSampler`).
- `parse_response(tokenizer, ids, prefix, tools)`: TRL's `chat_template_utils.parse_response` (public); TRL 1.14
  takes no `tools`, which only types the parsed arguments, so they are passed where it accepts them.
- `tool_suffix_ids(...)`: the tokens a chat template puts after an assistant turn for its tool results, from
  `GRPOTrainer._get_tool_suffix_ids` (private, the same in TRL 1.14.2 and 1.16.0), called on a stand-in holding the
  attributes it reads (`processing_class`, `_tokenizer`, `chat_template`, `chat_template_kwargs`, `_is_vlm`).
- `trainer_takes_quantized(model, integers)`: transformers' Trainer refuses a quantized model without an adapter
  (`validate_quantization_for_training`, reading the public `model.is_quantized`); es_search_space='qes' trains the
  integers of such a model with no gradients, so the flag reads False while Trainer is built.
- `TRAINER_HOOKS`: the Trainer methods ESTrainer overrides or calls, which transformers may rename in any release.
  `check_trainer_hooks()` verifies them (names and parameters) when ESTrainer is imported, so an unsupported
  transformers fails at once with the supported range instead of training wrongly.
- `TRAINER_ATTRIBUTES`: the private attributes of transformers' Trainer and TrainingArguments and of TRL's base
  trainer that ESTrainer reads or sets (`_signature_columns`, `_train_batch_size`, `_created_lr_scheduler`,
  `_tag_names`, `TrainingArguments._VALID_DICT_FIELDS`), checked against the installed sources by
  tests/unit/test_compat.py.
- `PRIVATE_NAMES`: every other private name trl-es reads, of transformers' MoE experts, vLLM, torch and argparse,
  with the module that defines it and what trl-es does with it; tests/unit/test_compat.py finds each in the
  installed source of its module (vLLM's where vLLM is installed).
- `process_group_store()`: torch.distributed's `distributed_c10d._get_default_store` (private; torch 2.6 … 2.15),
  the key-value store the default process group rendezvoused through (it lives in process 0), where processes left
  after a failed all-reduce say they are alive (`trl_es.training.distributed.unanswering`). None where torch has
  no such function or no group is initialized: the error then names no process.

Optional packages come with the extras of pyproject.toml; `import_extra` imports one or names the extra to install.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

from transformers import GenerationConfig, Trainer


try:  # TRL >= 1.0
    from trl.trainer.base_trainer import _BaseTrainer as BaseTrainer
except ImportError:  # pragma: no cover - another TRL layout: transformers' Trainer, transformers' model card
    BaseTrainer = Trainer

SUPPORTED = "transformers>=5.16.1,<6 and trl>=1.14.2,<2"

TRAINER_HOOKS = {
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "_get_train_sampler": ("train_dataset",),
    "_set_signature_columns_if_needed": (),
    "create_optimizer": ("model",),
    "create_scheduler": ("num_training_steps", "optimizer"),
}
"""Trainer methods ESTrainer overrides or calls, with the parameters it passes (transformers 5.16.1–5.24.0)."""

TRAINER_ATTRIBUTES = {
    "_signature_columns": "transformers.Trainer: the dataset columns the model takes (ES: the prompt)",
    "_train_batch_size": "transformers.Trainer: the per-process batch size its dataloader uses",
    "_created_lr_scheduler": "transformers.Trainer: whether it built the scheduler (rebuilt per `train` call)",
    "_tag_names": "TRL's base trainer: the model card's tags",
    "_VALID_DICT_FIELDS": "transformers.TrainingArguments: the fields a JSON string may give as a dict",
}
"""The private attributes of TRL's and transformers' trainers and arguments ESTrainer reads or sets, and what they
are (checked against the installed sources: tests/unit/test_compat.py)."""


PRIVATE_NAMES = {
    ("transformers.integrations.moe", "_apply_gate"): "generation/lowrank_forward.py: the experts' gate",
    ("transformers.integrations.moe", "has_gate"): "generation/lowrank_forward.py: experts with gate and up fused",
    ("transformers.integrations.moe", "is_transposed"): "generation/lowrank_forward.py: experts applied as x·Wᵀ",
    ("vllm.lora.worker_manager", "_adapter_manager"): "generation/vllm_worker_lora.py: the LoRA slots' tensors",
    ("vllm.v1.engine.core_client", "_finalizer"): "generation/vllm_engine.py: detached, trl-es shuts the engine",
    ("vllm.model_executor.layers.linear", "_cpu_skip_gemm_dispatch"): "generation/vllm_worker.py: keep `.weight`",
    ("transformers.configuration_utils", "_name_or_path"): "util/models.py: SmolLM2's Hub id on its offline copy",
    ("transformers.generation.utils", "_get_logits_processor"): "util/compat.py: `sampling_warpers`",
    ("trl.trainer.grpo_trainer", "_get_tool_suffix_ids"): "util/compat.py: `tool_suffix_ids`",
    ("trl.trainer.base_trainer", "_BaseTrainer"): "util/compat.py: `BaseTrainer`, TRL's model card",
    ("torch.distributed.distributed_c10d", "_get_default_store"): "util/compat.py: `process_group_store`",
    ("argparse", "_actions"): "commands/train.py: the options of the `trl-es es` and accelerate parsers",
}
"""(module, private name) → where trl-es reads it and why, outside `TRAINER_HOOKS` and `TRAINER_ATTRIBUTES`."""


def process_group_store():
    """The default process group's store (module docstring), or None."""
    import torch.distributed as dist

    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return get_store() if get_store is not None and dist.is_initialized() else None


def grpo_default(name: str):
    """The installed GRPOConfig's default of field `name` (public dataclass metadata): ESConfig's too for every field
    that keeps GRPO's meaning (tests/unit/test_config.py compares the two field by field)."""
    from dataclasses import MISSING

    from trl.trainer.grpo_config import GRPOConfig

    spec = GRPOConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default is MISSING else spec.default


@contextlib.contextmanager
def trainer_takes_quantized(model, integers: bool):
    """Within, transformers' Trainer takes `model` as it is when ES trains its quantized integers (`integers`:
    es_search_space='qes', no gradients): Trainer's `validate_quantization_for_training` refuses a quantized model
    without an adapter, reading the public flag `model.is_quantized`, which reads False meanwhile."""
    flagged = integers and getattr(model, "is_quantized", False)
    if flagged:
        model.is_quantized = False
    try:
        yield
    finally:
        if flagged:
            model.is_quantized = True


def check_trainer_hooks(trainer_class: type = Trainer) -> None:
    """An ImportError naming the supported versions when `trainer_class` lacks a hook or its parameters changed."""
    for name, parameters in TRAINER_HOOKS.items():
        method = getattr(trainer_class, name, None)
        found = list(inspect.signature(method).parameters)[1:] if method is not None else None
        if found is None or any(parameter not in found for parameter in parameters):
            raise ImportError(
                f"trl-es needs transformers' Trainer.{name}({', '.join(parameters)}), and this transformers has "
                f"{'none' if found is None else found}: install {SUPPORTED}"
            )


SAMPLING_FIELDS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""GenerationConfig's fields that only shape sampling (transformers' "warpers")."""


def sampling_warpers(model, config: GenerationConfig):
    """transformers' own list of sampling warpers for `config`'s sampling fields, in the order `generate` applies
    them (see the module docstring)."""
    only_sampling = GenerationConfig(do_sample=True, **{name: getattr(config, name, None) for name in SAMPLING_FIELDS})
    return model._get_logits_processor(generation_config=only_sampling, device=model.device)


def parse_response(tokenizer, ids: list[int], prefix: list[int] | None = None, tools: list | None = None) -> dict:
    """TRL's parse of a completion into an assistant message (with `tool_calls` when it calls tools)."""
    from trl.chat_template_utils import parse_response as trl_parse_response

    if "tools" in inspect.signature(trl_parse_response).parameters:
        return trl_parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    return trl_parse_response(tokenizer, ids, prefix=prefix)


def parses_responses(tokenizer) -> bool:
    """Whether TRL parses completions with this tokenizer (`parse_response`): it has a response template or a
    response schema, as GRPOTrainer checks; its completions are plain text otherwise."""
    return any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema"))


def tool_suffix_ids(
    processing_class, chat_template: str | None, chat_template_kwargs: dict | None, messages: list[dict]
):
    """The token ids that follow an assistant turn's end for the tool results `messages` (GRPOTrainer's), rendered
    by the tokenizer or a vision-language model's processor."""
    from types import SimpleNamespace

    from transformers import ProcessorMixin
    from trl import GRPOTrainer

    is_vlm = isinstance(processing_class, ProcessorMixin)
    stand_in = SimpleNamespace(
        processing_class=processing_class,
        _tokenizer=processing_class.tokenizer if is_vlm else processing_class,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs or {},
        _is_vlm=is_vlm,
    )
    return GRPOTrainer._get_tool_suffix_ids(stand_in, messages)


def let_transformers_see_gguf() -> None:
    """Register gguf's distribution with transformers where Python 3.10 cannot find it (see the module docstring)."""
    from transformers.utils import import_utils

    mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if isinstance(mapping, dict) and "gguf" not in mapping:
        mapping["gguf"] = ["gguf"]


def subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the elements of `subsequence`, matched in order (the arguments `trl-es es` hands on to the
    processes it launches, without those it gave to `accelerate launch`)."""
    result, position = [], 0
    for item in items:
        if position < len(subsequence) and item == subsequence[position]:
            position += 1
        else:
            result.append(item)
    return result


def is_peft_model(model) -> bool:
    """Whether `model` is a PEFT model (peft's own class check)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def import_extra(module: str, extra: str, feature: str):
    """`module`, imported; when it is missing, an ImportError naming the `trl-es[extra]` that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{feature} needs {module}, which is not installed: pip install 'trl-es[{extra}]'"
        ) from error
