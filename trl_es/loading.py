"""What training starts from: the model (an id or directory, a Trainer checkpoint such as GRPOTrainer's
`checkpoint-N`, or a PEFT adapter on its base model), its tokenizer, and the prompt dataset, each checked."""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging
from trl.trainer.utils import create_model_from_path, disable_dropout_in_model, get_config_model_id

from .compat import import_extra, is_peft_model
from .es.seeds import adapter_init_seed
from .models import resolve_model


logger = logging.get_logger(__name__)


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
    trainable (so ES perturbs only them). 'smollm2' is SmolLM2-135M-Instruct offline (`models.resolve_model`).
    Clear errors for a path that does not exist, a directory without weights, an id the Hub cannot provide, or an
    adapter whose base cannot be loaded."""
    path = resolve_model(path)
    if os.path.isdir(path) and is_adapter_dir(path):
        return _load_adapter(path, adapter_only, model_init_kwargs)
    if adapter_only:
        raise ValueError(f"es_adapter_only=True needs a PEFT adapter directory; {path!r} has no adapter_config.json")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise FileNotFoundError(
            f"{path!r} holds no model weights (none of {', '.join(WEIGHT_FILES)}) and no PEFT adapter: a "
            "Trainer checkpoint without its model files cannot be trained from"
        )
    try:
        return create_model_from_path(path, **model_init_kwargs)
    except OSError as error:
        if os.path.exists(path):
            raise
        raise OSError(
            f"model {path!r} is not a local directory, and the Hugging Face Hub could not provide it (offline, or no "
            f"such repository): {str(error).splitlines()[0]} — give a local path, or 'smollm2' for the built-in "
            "SmolLM2-135M-Instruct"
        ) from error


def _load_adapter(path: str, adapter_only: bool, model_init_kwargs: dict):
    peft = import_extra("peft", "peft", f"the PEFT adapter {path!r}")
    PeftConfig, PeftModel = peft.PeftConfig, peft.PeftModel
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


def load_tokenizer(path: str | None, model, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer (left padding, for generation) from `path` when it holds one — a checkpoint or adapter carries
    its own tokenizer and chat template — else from the model's own id."""
    if path is None or not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        path = get_config_model_id(model.config)
    return AutoTokenizer.from_pretrained(
        path, padding_side="left", truncation_side="left", trust_remote_code=trust_remote_code
    )


def eos_token_ids(model, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends a completion: the model's generation-config EOS ids and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def check_model_type(model) -> None:
    """A TypeError unless `model` is what ESTrainer takes: an id or path, a PreTrainedModel or a PeftModel."""
    if not isinstance(model, (str, PreTrainedModel)) and not is_peft_model(model):
        raise TypeError(
            f"`model` must be a model id, a path, a PreTrainedModel or a PeftModel, got {type(model).__name__}"
        )


def prepare_model(model, args, processing_class=None, peft_config=None):
    """(model, tokenizer, EOS ids) for ESTrainer's `model` argument as GRPOTrainer takes it: an id or path (loaded
    with `args.model_init_kwargs`), a PreTrainedModel or a PeftModel; `peft_config` adds a new adapter. Dropout off,
    pad token set (the EOS when the tokenizer has none)."""
    model_path = resolve_model(model) if isinstance(model, str) else None
    if isinstance(model, str):
        init_kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
        model = load_starting_model(model_path, args.es_adapter_only, **init_kwargs)
    elif args.model_init_kwargs is not None:
        logger.warning("`model_init_kwargs` is ignored: the model is already instantiated.")
    check_model_type(model)
    if peft_config is not None:
        model = add_adapter(model, peft_config, args.seed)
    if is_peft_model(model) and args.use_vllm:
        raise ValueError(
            "use_vllm=True loads full models into vLLM, which ES perturbs by HF parameter name: train adapters "
            "(peft_config, es_adapter_only) with use_vllm=False"
        )
    if is_peft_model(model) and args.sparse_delta_tau is not None:
        raise ValueError(
            "ESConfig.sparse_delta_tau needs a full model: a PEFT adapter is already a compact update (train "
            "without es_adapter_only to get a sparse delta of the merged model)"
        )
    if processing_class is None:
        processing_class = load_tokenizer(model_path, model, args.trust_remote_code)
    tokenizer = check_tokenizer(processing_class, model)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    disable_dropout_in_model(model)
    return model, tokenizer, eos_token_ids(model, tokenizer)


def add_adapter(model, peft_config, seed: int):
    """A new adapter, as in GRPOTrainer: ES then perturbs its weights only. Its initial weights are drawn from a seed
    derived from the run's, so a seed chain can rebuild them."""
    if is_peft_model(model):
        raise ValueError(
            "`peft_config` adds a new adapter, but the model already is a PeftModel (an adapter loaded with "
            "es_adapter_only): pass one or the other"
        )
    get_peft_model = import_extra("peft", "peft", "`peft_config`").get_peft_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(adapter_init_seed(seed))
        return get_peft_model(model, peft_config)


def check_tokenizer(tokenizer, model) -> PreTrainedTokenizerBase:
    """The tokenizer, checked against the model, with a pad token (its EOS when it has none)."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError("`processing_class` must be a tokenizer (PreTrainedTokenizerBase); ESTrainer is text-only")
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows: they do not "
            "belong together"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
