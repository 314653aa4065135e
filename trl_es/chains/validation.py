"""The checks a chain file passes before replay reads it (`check_content`): every field of the type and range replay
needs, the search space, optimizer and adapter headers sound; JSON read without duplicate keys or non-numbers. A
crafted file is a ValueError naming the field, never a crash."""

from __future__ import annotations

import json
import math

from ..es.noise import MAX_TABLE_SIZE, MIN_TABLE_SIZE
from ..es.space import SEARCH_SPACES, names_problem


def space_class(kind: str):
    """The registered search space of a chain's `kind` (chains of CoPES before it had its own name: "full")."""
    if kind not in SEARCH_SPACES:
        raise ValueError(
            f"this trl-es cannot replay a chain of search space {kind!r} (it knows {sorted(SEARCH_SPACES)})"
        )
    return SEARCH_SPACES[kind]


def no_duplicates(pairs: list[tuple]) -> dict:
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise json.JSONDecodeError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}", "", 0)
    return dict(pairs)


def no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not a number a chain may hold", "", 0)


DTYPES = ("float32", "bfloat16", "float16", "float64")
THETA_DTYPES = (*DTYPES, "int8")
"""The dtypes of the ES parameters a chain may record: the floating-point ones, and int8 (es_search_space='qes')."""


def check_content(data: dict, path: str) -> None:
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
    require(header.get("dtype") in THETA_DTYPES, f"header.dtype must be one of {THETA_DTYPES}")
    require(base.get("model_dtype", "float32") in DTYPES, f"header.base.model_dtype must be one of {DTYPES}")
    require(base.get("quantization") is None or isinstance(base["quantization"], dict), "bad header.base.quantization")
    names = header.get("parameters")
    require(isinstance(names, list) and names and all(isinstance(n, str) for n in names), "bad header.parameters")
    require(isinstance(noise, dict) and _is_int(noise.get("seed")), "header.noise.seed must be an integer")
    size = noise.get("table_size")
    require(
        _is_int(size) and MIN_TABLE_SIZE <= size <= MAX_TABLE_SIZE,
        f"header.noise.table_size must be in {MIN_TABLE_SIZE}..{MAX_TABLE_SIZE}",
    )
    require(isinstance(space, dict), "header.space is missing")
    decay = space.get("anchor_decay", 0.0)
    require(type(decay) in (int, float) and 0 <= decay < 1, "header.space.anchor_decay must be a number in [0, 1)")
    problem = space_class(space.get("kind")).check_chain_header(space, names)
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
