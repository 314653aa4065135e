"""Full ES: member i evaluates θ + σ·ε_i over every selected parameter; with groups, cooperative subspaces (CoPES).

Update (Qiu et al. 2025 convention): θ ← θ + α·(1/N)·Σ_i z_i ε_i − α·λ·θ, over the members with a reward. With
`gradient=True` the space writes instead the ES gradient estimate ĝ = 1/(N·σ)·Σ_i z_i ε_i into the parameters'
`.grad` (as −ĝ, the gradient of −R) for an optimizer to apply (`ESConfig.es_optimizer`).
CoPES (`groups`, see `subspaces`): member i perturbs only group g(i) = i mod K (antithetic pairs: pair mod K), with
σ·√K so that the population's total noise per step matches full ES, and group g is updated from its own members:
θ_g ← θ_g + α·(1/N_g)·Σ_{i: g(i)=g} z_i ε_i,g.
"""

from __future__ import annotations

import contextlib

import torch

from .space import Direction, SearchSpace, UpdateRule, directions, names_problem, one_member, register
from .subspaces import PARTITIONS, member_groups, partition_parameters
from .update import update_coefficients


@register
class FullSpace(SearchSpace):
    """Gaussian members written into a weights backend (`trl_es.es.weights`): the trainer's tensors or vLLM's."""

    name = "full"

    def __init__(
        self,
        weights,
        seed: int,
        population_size: int,
        antithetic: bool = False,
        weight_decay: float = 0.0,
        groups: list[list[str]] | None = None,
        gradient: bool = False,
        rule: UpdateRule | None = None,
    ):
        super().__init__(weights, rule)
        self.seed, self.population_size = seed, population_size
        self.antithetic, self.weight_decay, self.groups, self.gradient = antithetic, weight_decay, groups, gradient
        self.batched = weights.batches_members  # an engine's LoRA slots, or several servers: many members a call

    @classmethod
    def from_config(cls, args, model, weights, load_model=None) -> FullSpace:
        decay = 0.0 if args.es_optimizer else args.weight_decay  # the optimizer decays the weights itself
        common = (args.seed, args.population_size, args.antithetic, decay)
        groups = cls._groups(args, weights)
        return cls(weights, *common, groups=groups, gradient=args.es_optimizer, rule=UpdateRule.from_config(args))

    @classmethod
    def _groups(cls, args, weights) -> list[list[str]] | None:
        """The parameter groups members perturb one at a time (CoPES); None: every member perturbs all of θ."""
        return None

    def _ask(self, step: int, sigma: float) -> list[Direction]:
        members = directions(self.seed, step, self.population_size, self.antithetic, sigma)
        if self.groups is None:
            return members
        groups = member_groups(self.population_size, len(self.groups), self.antithetic)
        return [Direction(m.seed, m.sign, g, sigma) for m, g in zip(members, groups, strict=True)]

    def member_scale(self, member: Direction) -> float:
        """The scale of a member's noise: its σ, or σ·√K over K CoPES groups."""
        return member.sigma if self.groups is None else member.sigma * len(self.groups) ** 0.5

    def members_per_call(self, n_local: int) -> int:
        return min(n_local or 1, self.weights.member_slots) if self.batched else 1

    @contextlib.contextmanager
    def evaluating(self, members: list[Direction | None]):
        """One member at a time, written into the weights backend; with a backend that `batches_members` (an
        adapter's members in vLLM's LoRA slots, a member per server), all of `members` at once (`members`)."""
        if self.batched:
            names = lambda m: None if m.group is None else self.groups[m.group]  # noqa: E731
            slots = [
                (0, 0.0, None) if m is None else (m.seed, m.sign * self.member_scale(m), names(m)) for m in members
            ]
            with self.weights.members(slots) as route:
                yield route
            return
        route = one_member(members)
        (member,) = members
        if member is None:
            self.weights.center()
        else:
            names = None if member.group is None else self.groups[member.group]
            self.weights.member(member.seed, member.sign * self.member_scale(member), names)
        yield route

    def _tell(self, members: list[Direction], rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float):
        decay, valid = learning_rate * self.weight_decay, ~torch.isnan(rewards)
        pairs = [(m.seed, m.sign) for m in members]
        parts = [(None, None, list(range(len(members))))] if self.groups is None else [
            (g, names, [i for i, m in enumerate(members) if m.group == g]) for g, names in enumerate(self.groups)
        ]  # fmt: skip
        squared, record = 0.0, {"updates": []}
        for g, names, own in parts:
            n_valid = max(int(valid[own].sum()), 1) if g is not None else int(valid.sum())
            scale = 1 / self.member_scale(members[0]) if self.gradient else learning_rate  # ĝ's 1/(Nσ), or α/N
            coefficients = update_coefficients(fitness[own], [pairs[i] for i in own], scale, n_valid)
            record["updates"].append(_record(g, coefficients, decay))
            if self.gradient:
                squared += self.weights.gradient(coefficients, names) ** 2
            else:
                squared += self.weights.update(coefficients, decay, names) ** 2
        return {"es/gradient_norm" if self.gradient else "es/update_norm": squared**0.5}, record

    def chain_header(self) -> dict:
        return {"kind": self.name, "groups": self.groups}

    @staticmethod
    def check_chain_header(header: dict, parameters: list[str]) -> str | None:
        groups = header.get("groups")
        if groups is None:
            return None
        if not isinstance(groups, list) or not groups:
            return "header.space.groups must be a list of parameter groups"
        problems = (names_problem(f"header.space.groups[{i}]", group, parameters) for i, group in enumerate(groups))
        return next((problem for problem in problems if problem), None)

    @staticmethod
    def replayer(header: dict, weights, load_model=None):
        gradient = bool(header.get("optimizer"))

        def replay(update: dict) -> None:
            for part in update["updates"]:
                names = None if part["group"] is None else header["groups"][part["group"]]
                coefficients = {int(seed): float(c) for seed, c in part["coefficients"]}
                if gradient:
                    weights.gradient(coefficients, names)
                else:
                    weights.update(coefficients, part["decay"], names)

        return replay


@register
class CoPESSpace(FullSpace):
    """CoPES: full ES whose members each perturb one of `copes_groups` parameter groups (see the module docstring)."""

    name = "copes"

    @classmethod
    def check_config(cls, args, refuse) -> None:
        if args.copes_partition not in PARTITIONS:
            refuse("copes_partition", f"choose one of {PARTITIONS}")
        directions = args.population_size // 2 if args.antithetic else args.population_size
        if not 1 <= args.copes_groups <= directions:
            refuse("copes_groups", f"every group needs a member: use 1..{directions} groups for this population")
        if args.fitness_top_k is not None:
            refuse("fitness_top_k", "CoPES updates each group from its own members, and the best K may leave a "
                   "group none: use es_search_space='full' or 'lowrank'")  # fmt: skip

    @classmethod
    def _groups(cls, args, weights) -> list[list[str]]:
        return partition_parameters(list(weights.params), args.copes_groups, args.copes_partition, args.seed)


def _record(group: int | None, coefficients: dict[int, float], decay: float) -> dict:
    """One update as a seed chain keeps it: (seed, coefficient) pairs in the order they were summed."""
    return {"group": group, "coefficients": [[seed, c] for seed, c in coefficients.items()], "decay": decay}
