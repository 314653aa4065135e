"""The arguments of the ES worker's calls (`trl_es.generation.vllm_worker`): each call takes one JSON object, whose
fields are checked here before the worker acts on any (a server's `/collective_rpc` is reachable by anyone who can
reach the server)."""

from __future__ import annotations

import json
import math
import os

from ..es.noise import MAX_TABLE_SIZE, MIN_TABLE_SIZE


MAX_COEFFICIENTS = 1 << 16
"""Most (seed, coefficient) pairs one update may carry: the population size bounds them."""


def _is_int(value) -> bool:
    return type(value) is int


def _is_finite(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _is_names(value) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _is_module(value) -> bool:
    """[HF linear module, LoRA A's name, LoRA B's name, scaling]: one adapted layer (`es_adapter_init`)."""
    return isinstance(value, list) and len(value) == 4 and _is_names(value[:3]) and _is_finite(value[3])


def _is_coefficients(value) -> bool:
    pairs = isinstance(value, list) and len(value) <= MAX_COEFFICIENTS
    return pairs and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_finite(p[1]) for p in value)


FIELDS = {
    "seed": _is_int,
    "noise_table_size": lambda v: _is_int(v) and MIN_TABLE_SIZE <= v <= MAX_TABLE_SIZE,
    "dtype": lambda v: v in ("float32", "bfloat16", "float16"),
    "names": lambda v: v is None or (_is_names(v) and len(v) > 0),
    "path": lambda v: v is None or (isinstance(v, str) and os.path.isdir(v)),
    "scale": _is_finite,
    "decay": lambda v: _is_finite(v) and v >= 0,
    "coefficients": _is_coefficients,
    "rank": lambda v: _is_int(v) and 1 <= v <= 512,
    "slots": lambda v: _is_int(v) and 1 <= v <= MAX_COEFFICIENTS,
    "members": _is_coefficients,  # [[seed, scale], ...]: scale = σ·sign, 0 for the centre
    "member_names": lambda v: isinstance(v, list) and all(n is None or _is_names(n) for n in v),
    "modules": lambda v: isinstance(v, list) and all(_is_module(m) for m in v),
}
"""What each payload field must be; the worker checks every call's arguments before acting on any."""


def parse_payload(payload: str, *required: str) -> dict:
    """The JSON `payload` with its fields checked (`FIELDS`); a ValueError names the first unknown, missing or bad
    field, before anything changes."""
    try:
        args = json.loads(payload)
    except (TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"the ES worker takes one JSON object of arguments: {error}") from error
    if not isinstance(args, dict):
        raise ValueError("the ES worker takes one JSON object of arguments")
    for key in [*required, *args]:
        if key not in FIELDS or key not in args and key in required or not FIELDS[key](args.get(key)):
            raise ValueError(f"the ES worker refuses argument {key!r}={str(args.get(key))[:80]}")
    return args
