"""Rollouts: how the completions of the members are produced from a step's rows. One protocol, three
implementations, chosen once per run (`make_rollout`) and used by training and evaluation alike:

- `PlainRollout` (`plain`): one batched `generate` of the generation backend on the rows' prompts;
- `AgentRollout`: multi-turn episodes (`episodes`) of the run's `Agents` (tools and environments, GRPOTrainer's agent
  contracts);
- `RolloutFunction` (`functions`): the user's `rollout_func(prompts, trainer)`, which generates by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..generation import Completions
from .episodes import Agents
from .functions import RolloutFunction
from .plain import PlainRollout


def unrouted(row_members) -> None:
    """The route of a call that forms no member (θ itself, e.g. at evaluation)."""


class Rollout(Protocol):
    """`rollout(rows, n, seeds, n_members, route, key, record_entropy)`: the completions of one generate call,
    `n_members` members × `rows` × `n` generations, member-major, completion r sampled with `seeds[r]`. `route`
    (the search space's, `trl_es.es.space.Route`) forms each row's member; `key` names the context the episodes'
    environments reset in (the training step, or an evaluation batch)."""

    batches_members: bool
    """Whether one call evaluates several members (rows routed to each); False: one member per call."""
    records_entropy: bool
    """Whether `record_entropy=True` gives each completion's summed token entropy."""

    def __call__(
        self,
        rows: list[dict],
        n: int,
        seeds: list[int],
        n_members: int = 1,
        route: Callable = unrouted,
        key=None,
        record_entropy: bool = False,
    ) -> Completions: ...


def check_agent_arguments(args, tools, environment_factory, rollout_func) -> None:
    """A ValueError for agent arguments that cannot go together (before anything is built)."""
    agents = bool(tools) or environment_factory is not None
    if rollout_func is not None and agents:
        raise ValueError(
            "rollout_func generates the completions itself, so the trainer runs no tool loop: pass rollout_func, or "
            "tools / an environment_factory, not both"
        )
    if args.log_completion_entropy and (agents or rollout_func is not None):
        raise ValueError(
            "ESConfig.log_completion_entropy is not recorded for agent episodes (tools, environments, rollout_func)"
        )


class AgentRollout:
    """The `Rollout` of a run with tools or environments: `agents`' episodes played through `generation`."""

    batches_members = True
    records_entropy = False

    def __init__(self, agents: Agents, generation):
        self.agents, self.generation = agents, generation

    def __call__(self, rows, n, seeds, n_members=1, route=None, key=None, record_entropy=False) -> Completions:
        return self.agents.run(rows, n_members, n, seeds, key, route or (lambda members: None), self.generation)


def make_rollout(generation, agents: Agents | None = None, rollout_func=None, trainer=None) -> Rollout:
    """The run's rollout over `generation`: its agents' episodes (tools, environments), the user's `rollout_func`
    (called with `trainer`), or plain generation."""
    if rollout_func is not None:
        return RolloutFunction(rollout_func, trainer, generation)
    if agents is not None:
        return AgentRollout(agents, generation)
    return PlainRollout(generation)


__all__ = [
    "AgentRollout",
    "Agents",
    "PlainRollout",
    "Rollout",
    "RolloutFunction",
    "check_agent_arguments",
    "make_rollout",
    "unrouted",
]
