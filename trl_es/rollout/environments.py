"""What the agent episodes need of environments, apart from playing them: Python's, NumPy's and torch's global RNGs
seeded around every environment call (`seeded`), an environment's tools and reward (`environment_methods`,
`environment_reward`), and what an instance holds, compared between instances by the reproducibility check
(`picture`)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import random
import types
from collections.abc import Callable

import numpy as np
import torch


CHECK_ROUNDS = 3
"""The reproducibility check resets each of two instances this many times (a start drawn from 5 values that trl-es
does not seed passes 2·3 − 1 comparisons with probability 5⁻⁵)."""

LARGEST_PICTURED = 10_000
"""Containers, arrays and tensors of more elements than this are compared by their size only."""


@contextlib.contextmanager
def seeded(seed: int):
    """Python's, NumPy's and torch's global RNGs seeded with `seed` inside, their states restored on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextlib.contextmanager
def no_exit(what: str):
    """A `SystemExit` raised inside (model-written code calling `exit()`) becomes a RuntimeError naming `what`: it
    fails that call or step, and never ends the run."""
    try:
        yield
    except SystemExit as error:
        code = "" if error.code is None else repr(error.code)
        raise RuntimeError(f"{what} called exit({code})") from None


def picture(value, depth: int = 6, home: str | None = None):
    """What `value` holds, comparable between instances: plain data as it is, a random generator by its state, an
    array or tensor by its values, another object of the package `home` (the environment's own; any package when
    None) by its attributes (`depth` levels down); anything else (a client of a remote service and its connection, a
    lock, a function) by its type — its ids, keys and sockets differ between instances by design, and the state it
    reaches lives on the server (`reset`'s `seed` reaches it) — and anything larger than `LARGEST_PICTURED` elements
    by its size."""
    kind = type(value).__qualname__
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, random.Random):
        return repr(value.getstate())
    if isinstance(value, np.random.Generator):
        return repr(value.bit_generator.state)
    if isinstance(value, np.random.RandomState):
        name, keys, *rest = value.get_state()
        return (name, keys.tobytes(), repr(rest))
    if isinstance(value, torch.Generator):
        return value.get_state().numpy().tobytes()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        size = (str(value.dtype), tuple(value.shape))
        count = value.size if isinstance(value, np.ndarray) else value.numel()
        return size if count > LARGEST_PICTURED else (*size, picture(value.tolist(), depth, home))
    if depth == 0:
        return kind
    if isinstance(value, (dict, list, tuple, set, frozenset, collections.deque)) and len(value) > LARGEST_PICTURED:
        return (kind, len(value))
    if isinstance(value, dict):
        return (kind, [(picture(k, depth - 1, home), picture(v, depth - 1, home)) for k, v in value.items()])
    if isinstance(value, (list, tuple, collections.deque)):
        return (kind, [picture(v, depth - 1, home) for v in value])
    if isinstance(value, (set, frozenset)):
        return (kind, sorted(repr(picture(v, depth - 1, home)) for v in value))
    attributes = getattr(value, "__dict__", None)
    own = home is None or type(value).__module__.partition(".")[0] == home
    if own and isinstance(attributes, dict) and not isinstance(value, (type, types.ModuleType, types.FunctionType)):
        return (kind, picture(attributes, depth - 1, home))
    return kind


def attribute_pictures(instance) -> dict:
    """`picture` of each of `instance`'s attributes, objects of its own package by their contents (its type's name
    where one cannot be pictured)."""
    pictures, home = {}, type(instance).__module__.partition(".")[0]
    for name, value in getattr(instance, "__dict__", {}).items():
        try:
            pictures[name] = picture(value, home=home)
        except Exception:  # a value whose contents cannot be read: compared by its type
            pictures[name] = type(value).__qualname__
    return pictures


def environment_methods(environment) -> tuple[list[Callable], bool, bool]:
    """(its public methods, bound: the tools), whether it has `reset`, whether it has `get_reward` — listed on the
    class, as TRL does (listing the instance would evaluate its properties)."""
    tools, has_reset, has_reward = [], False, False
    for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction):
        if name == "reset":
            has_reset = True
        elif name == "get_reward":
            has_reward = True
        elif not name.startswith("_"):
            tools.append(getattr(environment, name))
    return tools, has_reset, has_reward


def environment_reward(env_type: type, around: Callable) -> Callable:
    """The reward function of an environment class that owns its reward: `get_reward()` of each completion's
    environment of exactly that class, inside `around(environment)` (its seeded RNGs), None (no reward) for the
    others."""

    if inspect.iscoroutinefunction(env_type.get_reward):

        async def reward_of(environment):
            with around(environment):
                return await environment.get_reward()

        async def get_reward(environments, **kwargs):
            return [await reward_of(e) if type(e) is env_type else None for e in environments]

    else:

        def reward_of(environment):
            with around(environment):
                return environment.get_reward()

        def get_reward(environments, **kwargs):
            return [reward_of(e) if type(e) is env_type else None for e in environments]

    get_reward.__name__ = env_type.__name__
    return get_reward


def appended(message: dict, observation: str):
    """A message's content with an environment's `reset` observation appended (as a text block to content blocks,
    as GRPOTrainer appends it)."""
    content = message["content"]
    return content + [{"type": "text", "text": observation}] if isinstance(content, list) else content + observation
