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

import torch

from .atomic import atomic_write_text
from .compat import import_extra
from .es.full import FullSpace
from .es.lowrank import LowRankSpace
from .es.weights import LocalWeights
from .sparse import weights_hash


FORMAT = "trl-es-chain/1"
FILE = "es_chain.json"


def _checksum(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _space_class(kind: str):
    if kind == "merge":
        from .es.merge import MergeSpace

        return MergeSpace
    spaces = {"full": FullSpace, "lowrank": LowRankSpace}
    if kind not in spaces:
        raise ValueError(f"this trl-es cannot replay a chain of search space {kind!r} (it knows full, lowrank, merge)")
    return spaces[kind]


class Chain:
    """A run's header (`base`, `noise`, `parameters`, `space`, …) and, per ES step, its update (None: skipped)."""

    def __init__(self, header: dict, steps: list[dict] | None = None):
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
        noise = self.header["noise"]
        weights = LocalWeights(params, noise["seed"], noise["table_size"], storage_device="cpu")
        weights.capture()
        replay = _space_class(self.header["space"]["kind"]).replayer(self.header["space"], weights)
        with torch.no_grad():
            for entry in self.steps:
                if steps is not None and entry["step"] >= steps:
                    break
                if entry["update"] is not None:
                    weights.capture()
                    replay(entry["update"])
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
