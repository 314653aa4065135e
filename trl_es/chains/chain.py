"""Seed chains: a whole ES run as a few kilobytes that rebuild the trained model bitwise.

Every ES update is a pure function of θ, the noise table's seed and the step's (member seed, coefficient) pairs —
the coefficients already hold fitness shaping and α_t/N. A chain records those numbers per step, plus what the
search space needs (CoPES groups, low-rank targets, merge settings) and the fingerprint of the weights training
started from, so anyone with that starting model can replay the run, or any prefix of it:

    trl-es replay --base M --chain es_chain.json --out DIR [--steps K]

    chain = trl_es.load_chain("out/es_chain.json")      # or a Hub repository holding es_chain.json
    chain.apply(model, steps=K)                          # model: the base, loaded as for training

`ESTrainer` writes `es_chain.json` next to the weights in `save_model` and in every checkpoint; a resumed run
continues its checkpoint's chain. The file is JSON with a SHA-256 checksum over its content: loading executes
nothing, and a truncated or edited chain, an unknown format or a search space this version cannot replay is an
error before anything is written. Replay is bitwise on the device type and dtype training used (docs/chains.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import TypedDict

import torch
from trl.trainer.utils import get_config_model_id

from ..es.params import upcast
from ..es.space import UpdateRule
from ..es.weights import LocalWeights, weights_hash
from ..util.atomic import atomic_write_text
from ..util.compat import import_extra
from ..util.models import is_adapter_dir, is_hub_repository
from .header import base_setup, frozen_hash, rebuild_optimizer, run_header
from .validation import check_content, no_constant, no_duplicates, space_class


FORMAT = "trl-es-chain/1"
FILE = "es_chain.json"


class Base(TypedDict):
    """The weights training started from: where they came from, and their SHA-256 (`weights_hash`)."""

    model: str  # a Hub id where the model came from one ('smollm2' for the built-in SmolLM2), else its path
    path: str | None  # where it was on the training machine: a hint for replaying there
    revision: str | None
    sha256: str
    frozen_sha256: str  # of the parameters ES leaves as they are (absent from older chains), checked on resume
    es_adapter_only: bool  # the base is a PeftModel whose adapter ES trains (loaded unmerged at replay)
    peft_config: dict | None  # a new adapter ESTrainer added (peft_config), rebuilt seeded at replay
    model_dtype: str  # the dtype the base was loaded in (absent from older chains: the ES parameters' `dtype`)
    quantization: dict | None  # how transformers quantized the base (its quantization_config), loaded so at replay


class Header(TypedDict):
    """A chain's header: everything replay needs beyond the base model and the steps' updates."""

    base: Base
    dtype: str  # of the ES parameters, e.g. "float32"
    parameters: list[str]  # the ES parameters' names, in order
    noise: dict  # {"seed", "table_size"}: the noise table's
    space: dict  # the search space's `chain_header()` (`kind` = its registered name), plus "optimizer" with one and
    # "anchor_decay" (λ of θ ← θ − λ·(θ − θ₀) after each update, θ₀ the base) with es_anchor_decay
    settings: dict  # ESConfig's fields marked `chain` at the start, for the reader (replay needs none of them)


class StepRecord(TypedDict, total=False):
    """One ES step: its global step (0-based) and the search space's update record (`tell`'s; None: skipped), with
    "learning_rates" (one per param group) when an optimizer applied it; the first step of a run resumed with other
    settings than the header's (σ, population, shaping, …) has them in "settings", from that step on."""

    step: int
    update: dict | None
    settings: dict


def _checksum(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def new_chain(args, model, params, space, optimizer, model_source: str, new_adapter: bool) -> Chain:
    """The seed chain of a run starting from `model`'s weights now (the start of training): `params` are the ES
    parameters, `space` the search space, `optimizer` Trainer's (recorded with `es_optimizer` only). `model_source`
    is where replay loads the base from (a PeftModel given in memory: the directory its adapter was saved to)."""
    path = os.path.abspath(model_source) if os.path.isdir(model_source) else None
    named = get_config_model_id(model.config)
    hub_id = named if is_hub_repository(named) and not is_adapter_dir(model_source) else None
    base = Base(
        model=hub_id if path and hub_id else model_source,
        path=path,
        revision=(args.model_init_kwargs or {}).get("revision"),
        sha256=weights_hash(dict(model.named_parameters())),
        frozen_sha256=frozen_hash(model, params),
        **base_setup(args, model, params, new_adapter),
    )
    return Chain(Header(base=base, **run_header(args, params, space, optimizer)))


class Tip(TypedDict, total=False):
    """What a saved chain was saved with (`Chain.save`): the SHA-256 of the ES parameters after its last step and,
    in a checkpoint of an `es_optimizer` run, of its `optimizer.pt`. A resume checks that they belong together."""

    weights_sha256: str
    optimizer_sha256: str


class Chain:
    """A run's `Header` and, per ES step, its `StepRecord`; `tip`, what the saved weights were when it was saved."""

    def __init__(self, header: Header, steps: list[StepRecord] | None = None, tip: Tip | None = None):
        self.header, self.steps, self.tip = header, steps or [], tip

    def span(self) -> tuple[int, int]:
        """(first, last): the chain rebuilds the weights after any number of steps from first to last."""
        first = self.steps[0]["step"] if self.steps else 0
        return first, first + len(self.steps)

    def record(self, step: int, update: dict | None, settings: dict | None = None) -> None:
        """The update of ES step `step` (global step, 0-based), in order; `settings`: those this step changes."""
        if self.steps and step != self.steps[-1]["step"] + 1:
            raise ValueError(f"chain step {step} does not follow step {self.steps[-1]['step']}")
        self.steps.append({"step": step, "update": update, **({"settings": settings} if settings else {})})

    def settings(self) -> dict:
        """The settings of the chain's last step: the header's, changed by the steps that changed them."""
        settings = dict(self.header["settings"])
        for entry in self.steps:
            settings |= entry.get("settings", {})
        return settings

    def content(self) -> dict:
        return {"format": FORMAT, "header": self.header, "steps": self.steps, "tip": self.tip}

    def save(self, folder: str, tip: Tip | None = None) -> str:
        """Write `folder/es_chain.json` (atomically), with the `tip` of the weights saved beside it, and return its
        path."""
        self.tip = tip
        content = self.content()
        path = os.path.join(folder, FILE)
        atomic_write_text(path, json.dumps({**content, "checksum": _checksum(content)}, separators=(",", ":")))
        return path

    def apply(self, model: torch.nn.Module, steps: int | None = None, force: bool = False) -> torch.nn.Module:
        """Replay the chain's updates of steps < `steps` (default: all) on `model`, which must hold the chain's base
        weights (checked by SHA-256 unless `force`), each followed, as in training, by the optimizer's step and the
        anchored decay toward the base, when the run had them; a replay of every step must end on the chain's tip
        (checked likewise). The model's parameters change in place; it is returned."""
        named = dict(model.named_parameters())
        if weights_hash(named) != self.header["base"]["sha256"]:
            message = (
                f"the base weights differ from the ones the chain starts from ({self.header['base']['model']!r}, "
                f"SHA-256 {self.header['base']['sha256'][:12]}…)"
            )
            if not force:
                raise ValueError(f"{message}: pass force=True (--force) to replay anyway")
            warnings.warn(f"{message}; replaying anyway (force): the result is not the trained model", stacklevel=2)
        missing = [name for name in self.header["parameters"] if name not in named]
        if missing:
            raise ValueError(f"the model lacks the chain's parameters {missing[:3]}")
        params = {name: named[name] for name in self.header["parameters"]}
        noise, space = self.header["noise"], self.header["space"]
        weights = LocalWeights(params, noise["seed"], noise["table_size"], storage_device="cpu")
        weights.capture()
        from ..util.models import load_starting_model

        replay = space_class(space["kind"]).replayer(space, weights, load_starting_model)
        rule = UpdateRule(anchor_decay=space.get("anchor_decay", 0.0))  # what follows each update, as in training
        if space.get("optimizer"):
            rule.use_optimizer(rebuild_optimizer(space["optimizer"], params))
        rule.hold_anchor(params)  # θ₀: the chain's base
        with torch.no_grad():
            for entry in self.steps:
                if steps is not None and entry["step"] >= steps:
                    break
                if entry["update"] is not None:
                    weights.capture()
                    try:
                        replay(entry["update"])
                        rates = entry["update"]["learning_rates"] if rule.optimizer is not None else None
                        rule.after_update(params, rates)  # the optimizer's step as training took it, the decay
                    except (KeyError, IndexError, TypeError) as error:
                        raise ValueError(
                            f"the update of chain step {entry['step']} is malformed ({error!r})"
                        ) from error
        weights.release()
        if steps is None or steps >= self.span()[1]:
            self._check_tip(params, force)
        return model

    def _check_tip(self, params: dict[str, torch.Tensor], force: bool) -> None:
        """A ValueError (a warning with `force`) unless `params`, replayed through every step, are the weights the
        chain was saved with: never a silent wrong model."""
        tip = (self.tip or {}).get("weights_sha256")
        if tip is None or weights_hash(params) == tip:
            return
        first, last = self.span()
        message = (
            f"replaying its steps {first}..{last - 1} gave other weights than its tip (SHA-256 {tip[:12]}…, the "
            "weights saved with it)"
        )
        if not force:
            raise ValueError(
                f"{message}: the chain is another run's or was edited, or replay ran on another device type than "
                "training; pass force=True (--force) to keep them anyway"
            )
        warnings.warn(f"{message}; kept anyway (force): the result is not the trained model", stacklevel=3)


def load_chain(source: str) -> Chain:
    """The chain in `source`: a file, a folder holding es_chain.json, or a Hub repository id holding one. A local path
    that exists is never taken for a Hub id. Checked before use: the checksum over its content, the format version,
    the search space, and every field's type and range (a crafted file is a ValueError, never a crash)."""
    if os.path.isdir(source):
        path = os.path.join(source, FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{source} holds no {FILE}: it is not a run directory or a checkpoint with a chain"
            )
    elif os.path.isfile(source):
        path = source
    elif is_hub_repository(source):  # (an existing path was handled above)
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(source, FILE)
    else:
        raise FileNotFoundError(f"no seed chain at {source!r}: give es_chain.json, a folder holding it or a Hub id")
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not a readable seed chain (truncated, or nested too deep): {error!r}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is a seed chain of format {found!r}; this trl-es reads {FORMAT!r}")
    content = {key: data.get(key) for key in ("format", "header", "steps", "tip") if key in data}
    if data.get("checksum") != _checksum(content):
        raise ValueError(f"{path} does not match its checksum: it was edited or cut short")
    check_content(data, path)
    return Chain(data["header"], data["steps"], data.get("tip"))


def load_base(path: str, header: dict) -> torch.nn.Module:
    """The chain's starting model from `path`, loaded as training loaded it: in the base's dtype, quantized as it
    was, as a trainable adapter for an adapter-only run, with the new adapter (seeded as in training) for a
    `peft_config` run."""
    from ..util.models import add_adapter, load_starting_model, quantization_config_from, resolve_model

    path = resolve_model(path)
    base = header["base"]
    kwargs = {"dtype": getattr(torch, base.get("model_dtype", header["dtype"])), "revision": base.get("revision")}
    if base.get("quantization") is not None:
        kwargs["quantization_config"] = quantization_config_from(base["quantization"])
    with warnings.catch_warnings():  # a base saved quantized holds the same config: transformers says it uses its own
        warnings.filterwarnings("ignore", message=".*already has a `quantization_config`")
        model = load_starting_model(
            path, base["es_adapter_only"], **{k: v for k, v in kwargs.items() if v is not None}
        )
    if base["peft_config"] is not None:
        get_peft_config = import_extra("peft", "peft", "replaying a chain of new adapters").get_peft_config
        try:
            config = get_peft_config(base["peft_config"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the chain's header.base.peft_config is not one peft can build: {error!r}") from error
        model = add_adapter(model, config, header["noise"]["seed"])
    if header["dtype"] == "float32":  # a mixed-precision run trained a float32 θ over a half-precision base
        trained = set(header["parameters"])
        upcast({name: p for name, p in model.named_parameters() if name in trained})
    return model


def replay(chain: Chain, base: str, out: str, steps: int | None = None, force: bool = False) -> None:
    """Rebuild the model after `steps` steps (default: all) from `base` into the new directory `out`: a normal HF
    model directory (an adapter directory for adapter runs) with the base's tokenizer (a vision-language model's
    processor), written atomically."""
    from ..util.atomic import atomic_directory
    from ..util.models import load_processing_class

    if os.path.lexists(out):  # a dangling symlink too
        raise ValueError(f"--out {out} already exists; choose a new directory")
    first, last = chain.span()
    if steps is not None and not first <= steps <= last:
        raise ValueError(f"--steps {steps} is outside this chain, which holds the weights after {first}..{last} steps")
    model = load_base(base, chain.header)
    processing_class = load_processing_class(base if os.path.isdir(base) else None, model)  # refused before replay
    chain.apply(model, steps, force)
    with atomic_directory(out) as staging:
        model.save_pretrained(staging)
        processing_class.save_pretrained(staging)
