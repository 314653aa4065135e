"""Where training starts: a model id or directory, a Trainer checkpoint (e.g. GRPOTrainer's `checkpoint-N`), or a
PEFT adapter (a GRPO LoRA output or checkpoint) on its base model."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from trl.trainer.utils import create_model_from_path, get_config_model_id


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def load_starting_model(path: str, adapter_only: bool = False, **model_init_kwargs):
    """The model to train from `path`. A PEFT adapter is loaded onto its base (`base_model_name_or_path` in its
    config) and merged into it, or, with `adapter_only`, kept as a PeftModel whose adapter weights alone are
    trainable (so ES perturbs only them). Clear errors for a directory without weights or an adapter whose base
    cannot be loaded."""
    if os.path.isdir(path) and is_adapter_dir(path):
        return _load_adapter(path, adapter_only, model_init_kwargs)
    if adapter_only:
        raise ValueError(f"es_adapter_only=True needs a PEFT adapter directory; {path!r} has no adapter_config.json")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise FileNotFoundError(
            f"{path!r} holds no model weights (none of {', '.join(WEIGHT_FILES)}) and no PEFT adapter: a "
            "Trainer checkpoint without its model files cannot be trained from"
        )
    return create_model_from_path(path, **model_init_kwargs)


def _load_adapter(path: str, adapter_only: bool, model_init_kwargs: dict):
    try:
        from peft import PeftConfig, PeftModel
    except ImportError as error:
        raise ImportError(f"{path!r} is a PEFT adapter; install peft: pip install 'trl-es[peft]'") from error
    base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
    try:
        base = create_model_from_path(base_path, **model_init_kwargs)
    except OSError as error:
        raise FileNotFoundError(
            f"the adapter {path!r} needs its base model {base_path!r} (base_model_name_or_path in its "
            f"adapter_config.json), which cannot be loaded: {error}"
        ) from error
    model = PeftModel.from_pretrained(base, path, is_trainable=adapter_only)
    if adapter_only:
        return model
    return model.merge_and_unload().requires_grad_(True)  # PEFT froze the base; merged, every weight is trainable


def load_tokenizer(path: str | None, model) -> PreTrainedTokenizerBase:
    """The tokenizer (left padding, for generation) from `path` when it holds one — a checkpoint or adapter carries
    its own tokenizer and chat template — else from the model's own id."""
    if path is None or not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        path = get_config_model_id(model.config)
    return AutoTokenizer.from_pretrained(path, padding_side="left", truncation_side="left")


def eos_token_ids(model, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends a completion: the model's generation-config EOS ids and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]
