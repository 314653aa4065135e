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

from .atomic import atomic_write_text
from .compat import import_extra
from .es.space import SEARCH_SPACES, optimizer_header, rebuild_optimizer, step_optimizer
from .es.weights import LocalWeights, weights_hash


FORMAT = "trl-es-chain/1"
FILE = "es_chain.json"


class Base(TypedDict):
    """The weights training started from: where they came from, and their SHA-256 (`weights_hash`)."""

    model: str  # the model id or path training was given
    revision: str | None
    sha256: str
    es_adapter_only: bool  # trained the adapter of a PeftModel only
    peft_config: dict | None  # a new adapter ESTrainer added (peft_config), rebuilt seeded at replay


class Header(TypedDict):
    """A chain's header: everything replay needs beyond the base model and the steps' updates."""

    base: Base
    dtype: str  # of the ES parameters, e.g. "float32"
    parameters: list[str]  # the ES parameters' names, in order
    noise: dict  # {"seed", "table_size"}: the noise table's
    space: dict  # the search space's `chain_header()` (`kind` = its registered name), plus "optimizer" with one
    settings: dict  # `CHAIN_SETTINGS` of ESConfig, for the reader (replay needs none of them)


class StepRecord(TypedDict):
    """One ES step: its global step (0-based) and the search space's update record (`tell`'s; None: skipped), with
    "learning_rates" (one per param group) when an optimizer applied it."""

    step: int
    update: dict | None


CHAIN_SETTINGS = ("population_size", "sigma", "learning_rate", "lr_scheduler_type", "weight_decay", "antithetic",
                  "fitness_shaping", "es_baseline", "es_search_space", "num_generations",
                  "per_device_train_batch_size")  # fmt: skip
"""The ESConfig fields a chain records for the reader (replay needs only the updates)."""


def _checksum(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _space_class(kind: str):
    """The registered search space of a chain's `kind` (chains of CoPES before it had its own name: "full")."""
    if kind not in SEARCH_SPACES:
        raise ValueError(
            f"this trl-es cannot replay a chain of search space {kind!r} (it knows {sorted(SEARCH_SPACES)})"
        )
    return SEARCH_SPACES[kind]


def new_chain(args, model, params, space, optimizer, model_source: str, new_adapter: bool) -> Chain:
    """The seed chain of a run starting from `model`'s weights now (its first step): `params` are the ES
    parameters, `space` the search space, `optimizer` Trainer's (recorded with `es_optimizer` only)."""
    peft_config = getattr(model, "peft_config", {}).get("default") if new_adapter else None
    base = Base(
        model=model_source,
        revision=(args.model_init_kwargs or {}).get("revision"),
        sha256=weights_hash(dict(model.named_parameters())),
        es_adapter_only=args.es_adapter_only,
        peft_config=_jsonable(peft_config.to_dict()) if peft_config is not None else None,
    )
    optimizer = {"optimizer": optimizer_header(optimizer, params)} if args.es_optimizer else {}
    return Chain(Header(
        base=base,
        dtype=str(next(iter(params.values())).dtype).removeprefix("torch."),
        parameters=list(params),
        noise={"seed": args.seed, "table_size": args.noise_table_size},
        space={**space.chain_header(), **optimizer},
        settings={name: getattr(args, name) for name in CHAIN_SETTINGS},
    ))  # fmt: skip


def _jsonable(value):
    """`value` with sets as sorted lists, for JSON."""
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset, list, tuple)):
        items = [_jsonable(item) for item in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    return value


class Chain:
    """A run's `Header` and, per ES step, its `StepRecord`."""

    def __init__(self, header: Header, steps: list[StepRecord] | None = None):
        self.header, self.steps = header, steps or []

    def record(self, step: int, update: dict | None) -> None:
        """The update of ES step `step` (global step, 0-based), in order."""
        if self.steps and step != self.steps[-1]["step"] + 1:
            raise ValueError(f"chain step {step} does not follow step {self.steps[-1]['step']}")
        self.steps.append({"step": step, "update": update})

    def content(self) -> dict:
        return {"format": FORMAT, "header": self.header, "steps": self.steps}

    def save(self, folder: str) -> str:
        """Write `folder/es_chain.json` (atomically) and return its path."""
        content = self.content()
        path = os.path.join(folder, FILE)
        atomic_write_text(path, json.dumps({**content, "checksum": _checksum(content)}, separators=(",", ":")))
        return path

    def apply(self, model: torch.nn.Module, steps: int | None = None, force: bool = False) -> torch.nn.Module:
        """Replay the chain's updates of steps < `steps` (default: all) on `model`, which must hold the chain's base
        weights (checked by SHA-256 unless `force`). The model's parameters change in place; it is returned."""
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
        from .loading import load_starting_model

        replay = _space_class(space["kind"]).replayer(space, weights, load_starting_model)
        optimizer = rebuild_optimizer(space["optimizer"], params) if space.get("optimizer") else None
        with torch.no_grad():
            for entry in self.steps:
                if steps is not None and entry["step"] >= steps:
                    break
                if entry["update"] is not None:
                    weights.capture()
                    replay(entry["update"])
                    if optimizer is not None:  # the optimizer's step, as training took it
                        step_optimizer(optimizer, params, entry["update"]["learning_rates"])
        weights.release()
        return model


def load_chain(source: str) -> Chain:
    """The chain in `source`: a file, a folder holding es_chain.json, or a Hub repository id holding one. Checked
    before use: the checksum over its content, the format version and the search space."""
    path = os.path.join(source, FILE) if os.path.isdir(source) else source
    if not os.path.isfile(path):
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(source, FILE)
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable seed chain (truncated?): {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is a seed chain of format {found!r}; this trl-es reads {FORMAT!r}")
    content = {key: data.get(key) for key in ("format", "header", "steps")}
    if data.get("checksum") != _checksum(content):
        raise ValueError(f"{path} does not match its checksum: it was edited or cut short")
    _space_class(data["header"]["space"]["kind"])
    return Chain(data["header"], data["steps"])


def load_base(path: str, header: dict) -> torch.nn.Module:
    """The chain's starting model from `path`, loaded as training loaded it: in the chain's dtype, as a trainable
    adapter for an adapter-only run, with the new adapter (seeded as in training) for a `peft_config` run."""
    from .loading import add_adapter, load_starting_model
    from .models import smollm2_dir

    path = smollm2_dir() if path == "smollm2" else path
    base = header["base"]
    kwargs = {"dtype": getattr(torch, header["dtype"]), "revision": base.get("revision")}
    model = load_starting_model(path, base["es_adapter_only"], **{k: v for k, v in kwargs.items() if v is not None})
    if base["peft_config"] is not None:
        get_peft_config = import_extra("peft", "peft", "replaying a chain of new adapters").get_peft_config
        model = add_adapter(model, get_peft_config(base["peft_config"]), header["noise"]["seed"])
    return model


def replay(chain: Chain, base: str, out: str, steps: int | None = None, force: bool = False) -> None:
    """Rebuild the model after `steps` steps (default: all) from `base` into the new directory `out`: a normal HF
    model directory (an adapter directory for adapter runs) with the base's tokenizer, written atomically."""
    from .atomic import atomic_directory
    from .loading import load_tokenizer

    if os.path.exists(out):
        raise ValueError(f"--out {out} already exists; choose a new directory")
    model = chain.apply(load_base(base, chain.header), steps, force)
    with atomic_directory(out) as staging:
        model.save_pretrained(staging)
        load_tokenizer(base if os.path.isdir(base) else None, model).save_pretrained(staging)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="trl-es replay", description="Rebuild a trained model from its seed chain.")
    parser.add_argument("--chain", required=True, help="es_chain.json, a folder holding it, or a Hub repository id")
    parser.add_argument("--base", help="the model training started from (default: the one the chain names)")
    parser.add_argument("--out", required=True, help="a new directory for the rebuilt model")
    parser.add_argument("--steps", type=int, help="replay the first STEPS steps only (checkpoint-STEPS's weights)")
    parser.add_argument("--force", action="store_true", help="replay even if the base weights' SHA-256 differs")
    options = parser.parse_args(argv)
    chain = load_chain(options.chain)
    base = options.base or chain.header["base"]["model"]
    replay(chain, base, options.out, options.steps, options.force)
    print(f"Model after {options.steps or len(chain.steps)} steps saved to {options.out}.")
