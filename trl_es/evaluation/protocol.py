"""The research's evaluation protocol and benchmark suites, as `trl-es eval --protocol` and `--suite` take them.

- `PROTOCOLS`: `paper` samples n = 32 completions per problem at temperature 0.6 with up to 2,048 new tokens and
  reports Pass@1/16/32 and Maj@16/32; `paper-hard` the same with 8,192 new tokens (the hard math setting).
- `SUITES`: `easy` (the tasks of the GSM8K-trained comparison), `math` (competition math) and `heldout` (the task
  families no training reward comes from), in the research tables' column order.
- `resolve_protocol`: every value given explicitly wins over the protocol's, which win over `DEFAULTS`.
"""

from __future__ import annotations

from ..tasks import get_task


RESEARCH_K = (1, 16, 32)
"""The K values of the research's Pass@K columns (Maj@K: those above 1)."""
PROTOCOLS = {
    "paper": {"temperature": 0.6, "n": 32, "k": list(RESEARCH_K), "max_completion_length": 2048},
    "paper-hard": {"temperature": 0.6, "n": 32, "k": list(RESEARCH_K), "max_completion_length": 8192},
}
DEFAULTS = {"temperature": 1.0, "n": 8, "k": [1], "max_completion_length": None}
"""Without a protocol: sampling at temperature 1, 8 completions, Pass@1, each task's completion length (None)."""
SUITES = {
    "easy": ["gsm8k", "commonsenseqa", "hotpotqa", "countdown", "gpqa", "mbpp"],
    "math": ["aime24", "aime25", "amc23", "math500"],
    "heldout": ["gpqa", "mbpp", "commonsenseqa", "countdown"],
}


def research_k(n: int) -> list[int]:
    """The research's K values up to n samples per problem."""
    return [k for k in RESEARCH_K if k <= n]


def expand_tasks(tasks: list[str], suites: list[str]) -> list[str]:
    """The tasks named and those of the suites named, in that order, each once (a ValueError for an unknown name)."""
    unknown = [suite for suite in suites if suite not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    names = list(dict.fromkeys([*tasks, *(task for suite in suites for task in SUITES[suite])]))
    if not names:
        raise ValueError("name at least one task (--task) or suite (--suite)")
    for name in names:
        get_task(name)
    return names


def resolve_protocol(protocol: str | None, **given) -> tuple[dict, dict | None]:
    """The evaluation's `n`, `k`, `temperature` and `max_completion_length` (None: each task's): each value in
    `given` that is not None, else the protocol's, else `DEFAULTS`; a protocol's K values are cut to those ≤ n when
    n is given and K is not. Also what results record of the protocol: its name, its values and those overridden
    (None without a protocol)."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    chosen = PROTOCOLS.get(protocol, DEFAULTS)
    given = {key: value for key, value in given.items() if value is not None}
    values = {**chosen, **given}
    if protocol is not None and "n" in given and "k" not in given:
        values["k"] = [k for k in chosen["k"] if k <= values["n"]] or [1]
    if protocol is None:
        return values, None
    overridden = {key: values[key] for key in chosen if values[key] != chosen[key]}
    return values, {"name": protocol, **chosen, "overridden": overridden}
