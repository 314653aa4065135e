"""What a seed chain's header records of a run (`run_header`, `base_setup`, `frozen_hash`, the optimizer's
`optimizer_header` and its `rebuild_optimizer`), and the comparison a resumed run must pass against its checkpoint's
chain (`check_resume`)."""

from __future__ import annotations

import dataclasses
import inspect

import torch
import transformers.optimization

from ..es.weights import weights_hash
from ..util.compat import is_peft_model
from ..util.models import quantization_record


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


def check_resume(chain, expected: dict, checkpoint: str) -> dict:
    """A ValueError when the run resuming `checkpoint` would record other updates than its `chain` (a `Chain`)
    describes (a resumed chain must still replay to the run's weights), or change the learning-rate schedule (Trainer keeps the
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
