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

import dataclasses
import hashlib
import inspect
import json
import math
import os
import warnings
from typing import TypedDict

import torch
import transformers.optimization
from trl.trainer.utils import get_config_model_id

from ..es.noise import CHUNK, MAX_TABLE_SIZE
from ..es.params import upcast
from ..es.space import SEARCH_SPACES, UpdateRule, names_problem
from ..es.weights import LocalWeights, weights_hash
from ..util.atomic import atomic_write_text
from ..util.compat import import_extra, is_peft_model
from ..util.models import is_adapter_dir, is_hub_repository, quantization_record


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


def _space_class(kind: str):
    """The registered search space of a chain's `kind` (chains of CoPES before it had its own name: "full")."""
    if kind not in SEARCH_SPACES:
        raise ValueError(
            f"this trl-es cannot replay a chain of search space {kind!r} (it knows {sorted(SEARCH_SPACES)})"
        )
    return SEARCH_SPACES[kind]


OPTIMIZER_MODULES = {"torch.optim": torch.optim, "transformers.optimization": transformers.optimization}
"""The modules whose optimizers a chain records, by name, and replay builds: a chain names no other code to run."""


def optimizer_header(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict:
    """What rebuilds `optimizer` over `params`: its module and class name, defaults, and per param group its
    parameter names and options (parameters outside `params`, not trained by ES, are left out). A ValueError for an
    optimizer of another module, which replay could not build."""
    cls = type(optimizer)
    module = next(
        (name for name, found in OPTIMIZER_MODULES.items() if getattr(found, cls.__name__, None) is cls), None
    )
    if module is None:
        raise ValueError(
            f"es_optimizer with {cls.__module__}.{cls.__qualname__}: a seed chain records optimizers of "
            f"{' and '.join(OPTIMIZER_MODULES)} only, and replay could not rebuild this one. Choose one of theirs "
            "(optim='adamw_torch', 'sgd', 'adafactor', …, or optimizer_cls_and_kwargs)"
        )
    names = {id(p): name for name, p in params.items()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "parameters": [names[id(p)] for p in group["params"]
                                                                            if id(p) in names]}
        for group in optimizer.param_groups
    ]  # fmt: skip
    return {"module": module, "class": cls.__name__, "defaults": optimizer.defaults, "groups": groups}


def rebuild_optimizer(header: dict, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer `optimizer_header` describes (a chain without "module", from before it was recorded, names a
    torch.optim class)."""
    module = header.get("module", "torch.optim")
    cls = getattr(OPTIMIZER_MODULES.get(module), header["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"a seed chain can replay optimizers of {' and '.join(OPTIMIZER_MODULES)} only, not "
            f"{module}.{header['class']}"
        )
    groups = [{**{k: v for k, v in g.items() if k != "parameters"}, "params": [params[n] for n in g["parameters"]]}
              for g in header["groups"]]  # fmt: skip
    accepted = inspect.signature(cls).parameters  # defaults may hold derived entries (AdamW's decoupled_weight_decay)
    return cls(groups, **{k: v for k, v in header["defaults"].items() if k in accepted})


def run_header(args, params, space, optimizer) -> dict:
    """What a run's chain header records of its set-up (all but `base`): the ES parameters' dtype and names, the
    noise table, the search space (and optimizer, and anchored decay), the settings."""
    optimizer = {"optimizer": optimizer_header(optimizer, params)} if args.es_optimizer and optimizer else {}
    anchor = {"anchor_decay": space.rule.anchor_decay} if space.rule.anchor_decay else {}
    return {
        "dtype": str(next(iter(params.values())).dtype).removeprefix("torch."),
        "parameters": list(params),
        "noise": {"seed": args.seed, "table_size": args.noise_table_size},
        "space": {**space.chain_header(), **optimizer, **anchor},
        "settings": {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.metadata.get("chain")},
    }


RESUME_FIELDS = {"base": "adapter (peft_config, es_adapter_only), model dtype or quantization",
                 "dtype": "the model's dtype", "parameters": "es_parameter_patterns (the parameters ES moves)",
                 "noise": "seed or noise_table_size",
                 "space": "es_search_space or its settings, or es_anchor_decay"}  # fmt: skip
"""The header parts a resumed run must share with its checkpoint's chain, and the settings that decide them."""

SCHEDULE = ("learning_rate", "lr_scheduler_type")
"""The settings a resumed run cannot change: Trainer's saved scheduler keeps the checkpoint's."""


def check_resume(chain: Chain, expected: dict, checkpoint: str) -> dict:
    """A ValueError when the run resuming `checkpoint` would record other updates than its chain describes (a resumed
    chain must still replay to the run's weights), or change the learning-rate schedule (Trainer keeps the
    checkpoint's): `expected` is this run's `run_header` with "base" its `base_setup`. Checked before anything is
    loaded. Returns the other settings the run changes (recorded in the chain from its next step)."""
    again = (
        f"Resume with the checkpoint's settings, or start a new run from it with model={checkpoint!r} and a new "
        "output_dir"
    )
    for key, settings in RESUME_FIELDS.items():
        recorded, now = chain.header[key], expected[key]
        if key == "space":  # the optimizer is checked with its state (`ChainRecorder.check_optimizer`)
            recorded, now = ({k: v for k, v in part.items() if k != "optimizer"} for part in (recorded, now))
        if key == "base":  # how the base is loaded, as far as the chain records it (older chains: less)
            recorded, now = {k: recorded[k] for k in now if k in recorded}, {k: now[k] for k in now if k in recorded}
        if recorded != now:
            raise ValueError(
                f"resuming {checkpoint} with other {settings} than it was trained with ({differences(recorded, now)}):"
                f" the seed chain would no longer replay to the run's weights. {again}"
            )
    recorded = chain.settings()
    changed = {name: value for name, value in expected["settings"].items() if recorded.get(name, value) != value}
    schedule = {name: changed[name] for name in SCHEDULE if name in changed}
    if schedule:
        raise ValueError(
            f"resuming {checkpoint} with another learning-rate schedule than it was trained with "
            f"({differences({k: recorded[k] for k in schedule}, schedule)}): Trainer keeps the checkpoint's. {again}"
        )
    return changed


def differences(recorded, now, prefix: str = "") -> str:
    """The first few places where `now` differs from `recorded`, as 'key: recorded → now'."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        found = [differences(recorded.get(k), now.get(k), f"{prefix}{k}.") for k in {**recorded, **now}
                 if recorded.get(k) != now.get(k)]  # fmt: skip
        return "; ".join(found[:3])
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) != len(now):
        return f"{prefix.rstrip('.') or 'list'}: {len(recorded)} entries → {len(now)}"
    if isinstance(recorded, list) and isinstance(now, list):
        i = next(i for i, (a, b) in enumerate(zip(recorded, now, strict=True)) if a != b)
        return f"{prefix}{i}: {str(recorded[i])[:60]} → {str(now[i])[:60]}"
    return f"{prefix.rstrip('.') or 'value'}: {str(recorded)[:60]} → {str(now)[:60]}"


def base_setup(args, model, params: dict, new_adapter: bool) -> dict:
    """How the base of a run on `model` (ES parameters `params`; `new_adapter`: ESTrainer added it) is loaded again
    at replay: its adapter (a new one's `peft_config`, or `es_adapter_only` for a PeftModel whose own adapter ES
    trains), dtype and quantization."""
    peft_config = getattr(model, "peft_config", {}).get("default") if new_adapter else None
    if peft_config is not None:  # which base it sits on is the chain's base (its weights: `frozen_hash`)
        peft_config = {
            k: v for k, v in peft_config.to_dict().items() if k not in ("base_model_name_or_path", "revision")
        }
    return {
        "es_adapter_only": args.es_adapter_only or (is_peft_model(model) and not new_adapter),
        "peft_config": _jsonable(peft_config),
        "model_dtype": load_dtype(model, params),
        "quantization": quantization_record(model),
    }


def frozen_hash(model, params: dict) -> str:
    """SHA-256 (`weights_hash`) of `model`'s parameters outside the ES parameters `params`: what ES never moves."""
    trained = {id(p) for p in params.values()}
    return weights_hash({name: p for name, p in model.named_parameters() if id(p) not in trained})


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


def load_dtype(model, params: dict) -> str:
    """The dtype the base was loaded in: that of its floating-point parameters outside the ES parameters `params`
    (which mixed precision upcasts to float32, `ESConfig.bf16`), else the model's."""
    trained = {id(p) for p in params.values()}
    others = (p.dtype for p in model.parameters() if id(p) not in trained and p.dtype.is_floating_point)
    return str(next(others, model.dtype)).removeprefix("torch.")


def _jsonable(value):
    """`value` with sets as sorted lists, for JSON."""
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset, list, tuple)):
        items = [_jsonable(item) for item in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    return value


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

        replay = _space_class(space["kind"]).replayer(space, weights, load_starting_model)
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
            data = json.load(file, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not a readable seed chain (truncated, or nested too deep): {error!r}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is a seed chain of format {found!r}; this trl-es reads {FORMAT!r}")
    content = {key: data.get(key) for key in ("format", "header", "steps", "tip") if key in data}
    if data.get("checksum") != _checksum(content):
        raise ValueError(f"{path} does not match its checksum: it was edited or cut short")
    _check_content(data, path)
    return Chain(data["header"], data["steps"], data.get("tip"))


def _no_duplicates(pairs: list[tuple]) -> dict:
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise json.JSONDecodeError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}", "", 0)
    return dict(pairs)


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not a number a chain may hold", "", 0)


DTYPES = ("float32", "bfloat16", "float16", "float64")


def _check_content(data: dict, path: str) -> None:
    """Every field a replay reads, of the right type and range (`ValueError` naming the first that is not)."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{path}: {what}")

    header, steps = data.get("header"), data.get("steps")
    require(isinstance(header, dict), "the header is missing")
    base, noise, space = header.get("base"), header.get("noise"), header.get("space")
    require(isinstance(base, dict) and isinstance(base.get("model"), str), "header.base.model must be a string")
    is_sha256 = lambda value: isinstance(value, str) and len(value) == 64  # noqa: E731
    require(is_sha256(base.get("sha256")), "header.base.sha256 must be a SHA-256")
    require(base.get("frozen_sha256") is None or is_sha256(base["frozen_sha256"]), "bad header.base.frozen_sha256")
    require(base.get("peft_config") is None or isinstance(base["peft_config"], dict), "bad header.base.peft_config")
    require(base.get("path") is None or isinstance(base["path"], str), "header.base.path must be a string")
    require(header.get("dtype") in DTYPES, f"header.dtype must be one of {DTYPES}")
    require(base.get("model_dtype", "float32") in DTYPES, f"header.base.model_dtype must be one of {DTYPES}")
    require(base.get("quantization") is None or isinstance(base["quantization"], dict), "bad header.base.quantization")
    names = header.get("parameters")
    require(isinstance(names, list) and names and all(isinstance(n, str) for n in names), "bad header.parameters")
    require(isinstance(noise, dict) and _is_int(noise.get("seed")), "header.noise.seed must be an integer")
    size = noise.get("table_size")
    require(
        _is_int(size) and CHUNK <= size <= MAX_TABLE_SIZE,
        f"header.noise.table_size must be in {CHUNK}..{MAX_TABLE_SIZE}",
    )
    require(isinstance(space, dict), "header.space is missing")
    decay = space.get("anchor_decay", 0.0)
    require(type(decay) in (int, float) and 0 <= decay < 1, "header.space.anchor_decay must be a number in [0, 1)")
    problem = _space_class(space.get("kind")).check_chain_header(space, names)
    if problem is None and space.get("optimizer") is not None:
        problem = _optimizer_problem(space["optimizer"], names)
    if problem is None and base.get("peft_config") is not None:
        problem = _adapter_problem(base["peft_config"])
    require(problem is None, problem)
    require(isinstance(steps, list), "steps must be a list")
    previous = None
    for entry in steps:
        require(isinstance(entry, dict) and _is_int(entry.get("step")), f"a step record is malformed: {entry!r:.80}")
        require(previous is None or entry["step"] == previous + 1, f"step {entry['step']} does not follow {previous}")
        require(entry.get("update") is None or isinstance(entry["update"], dict), f"step {entry['step']}: bad update")
        require(_finite_numbers(entry.get("update")), f"step {entry['step']}: a number is not finite or out of range")
        previous = entry["step"]


def _optimizer_problem(optimizer, parameters: list[str]) -> str | None:
    """The first problem of a chain's `space.optimizer` (`optimizer_header`'s) that would stop `rebuild_optimizer`."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("class"), str):
        return "header.space.optimizer must name the optimizer's class"
    if not isinstance(optimizer.get("defaults"), dict):
        return "header.space.optimizer.defaults must be a dict of the optimizer's settings"
    groups = optimizer.get("groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(group, dict) for group in groups):
        return "header.space.optimizer.groups must list the optimizer's parameter groups"
    field = "header.space.optimizer.groups[{}].parameters"
    problems = (names_problem(field.format(i), group.get("parameters"), parameters) for i, group in enumerate(groups))
    return next((problem for problem in problems if problem), None)


def _adapter_problem(config: dict) -> str | None:
    """The first problem of a chain's `base.peft_config` whose ranks (positive integers) or scalings (numbers) are
    not."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not isinstance(alphas, dict):
        return "header.base.peft_config's rank_pattern and alpha_pattern must map module names to numbers"
    if not all(type(rank) is int and rank > 0 for rank in [config.get("r", 8), *ranks.values()]):
        return "header.base.peft_config.r and its rank_pattern must be positive integers"
    if not all(type(alpha) in (int, float) for alpha in [config.get("lora_alpha", 8), *alphas.values()]):
        return "header.base.peft_config.lora_alpha and its alpha_pattern must be numbers"
    return None


def _is_int(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _finite_numbers(value) -> bool:
    """Every number in `value` finite in float64 (ints within 64 bits): what replay turns into floats and seeds."""
    if isinstance(value, dict):
        return all(_finite_numbers(item) for item in value.values())
    if isinstance(value, list):
        return all(_finite_numbers(item) for item in value)
    if type(value) is int:
        return abs(value) < 1 << 64
    if type(value) is float:
        return math.isfinite(value)
    return True


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
