"""The search-space protocol: what a member is, how the model evaluates it, and how the step's fitness moves θ.

evosax's ask/tell shape. One ES step of the trainer reads

    members = space.ask(step)                                  # the step's N members
    with space.evaluating([member], rows_per_member): generate # for each of this process's members
    ... all-reduce the rewards, shape them into fitness z ...
    metrics = space.tell(members, rewards, fitness, α_t)       # the update; metrics["es/update_norm"] = ‖Δθ‖

Implementations: `FullSpace` (full ES, and CoPES with parameter groups), `LowRankSpace` (EGGROLL),
`MergeSpace` (Hyper-ES). A new search space is one new class; the trainer's step does not change.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from .seeds import member_seed


@dataclass(frozen=True)
class Direction:
    """A member's noise: sign·ε(seed), over CoPES group `group` (None: every parameter)."""

    seed: int
    sign: int = 1
    group: int | None = None


def directions(seed: int, step: int, population_size: int, antithetic: bool) -> list[Direction]:
    """Member i's direction at step `step`: ε(seed(t, i)), or ±ε(seed(t, k)) for antithetic pair k = i // 2."""
    if antithetic:
        return [Direction(member_seed(seed, step, i // 2), 1 if i % 2 == 0 else -1) for i in range(population_size)]
    return [Direction(member_seed(seed, step, i)) for i in range(population_size)]


class SearchSpace:
    """Base class of the search spaces (see the module docstring)."""

    @classmethod
    def from_config(cls, args, model: torch.nn.Module, weights) -> SearchSpace:
        """The space ESConfig `args` describes, over `model` and its weights backend (`trl_es.es.weights`)."""
        raise NotImplementedError

    def ask(self, step: int) -> list:
        """The step's members, in order; each is a value only this space reads."""
        raise NotImplementedError

    def members_per_call(self, n_local: int) -> int:
        """How many of this process's `n_local` members one generate call evaluates together."""
        return 1

    def evaluating(self, members: list, rows_per_member: int) -> contextlib.AbstractContextManager:
        """A context in which a generate call over `len(members)` blocks of `rows_per_member` rows gives block j
        member `members[j]`'s completions (None: the unperturbed centre θ)."""
        raise NotImplementedError

    def tell(self, members: list, rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float) -> dict:
        """Move θ with the members' shaped `fitness` (and raw `rewards`, NaN for none); the step's metrics, with
        `es/update_norm` = ‖Δθ‖₂. Sets `last_update`: what `replay` needs to apply the same update again."""
        raise NotImplementedError

    def chain_header(self) -> dict:
        """What replaying this space's updates needs beyond the base weights and the noise table (a seed chain's
        header, `trl_es.chains`), JSON-able."""
        raise NotImplementedError

    @staticmethod
    def replayer(header: dict, weights):
        """A function applying a recorded update (a `last_update`) to `weights` (a `LocalWeights` holding the
        chain's base, θ of each step captured before its update) bitwise as `tell` did; `header` is
        `chain_header()`'s. Made once per replay, before the first step."""
        raise NotImplementedError

    def save_state(self, folder: str) -> None:
        """Write the space's own state beyond the weights into a checkpoint folder (none by default)."""

    def load_state(self, folder: str) -> None:
        """Read what `save_state` wrote."""


def optimizer_header(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict:
    """What rebuilds `optimizer` over `params` (a torch.optim class): its class name, defaults, and per param group
    its parameter names and options. Parameters outside `params` (not trained by ES) are left out."""
    names = {id(p): name for name, p in params.items()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "parameters": [names[id(p)] for p in group["params"]
                                                                            if id(p) in names]}
        for group in optimizer.param_groups
    ]  # fmt: skip
    return {"class": type(optimizer).__name__, "defaults": optimizer.defaults, "groups": groups}


def rebuild_optimizer(header: dict, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer `optimizer_header` describes; only torch.optim classes (a chain names no code to import)."""
    cls = getattr(torch.optim, header["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"a seed chain can replay torch.optim optimizers only, not {header['class']!r}")
    groups = [{**{k: v for k, v in g.items() if k != "parameters"}, "params": [params[n] for n in g["parameters"]]}
              for g in header["groups"]]  # fmt: skip
    accepted = inspect.signature(cls).parameters  # defaults may hold derived entries (AdamW's decoupled_weight_decay)
    return cls(groups, **{k: v for k, v in header["defaults"].items() if k in accepted})


def step_optimizer(optimizer: torch.optim.Optimizer, learning_rates: list[float]) -> None:
    """One optimizer step on the gradients written, at the recorded learning rate of each param group."""
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
