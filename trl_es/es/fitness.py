"""Fitness shaping: population rewards R_1..R_N → the weights z_i of the ES update."""

from __future__ import annotations

import torch


SHAPINGS = ("zscore", "centered_rank", "none")


def centered_ranks(rewards: torch.Tensor) -> torch.Tensor:
    """Ranks scaled to [-0.5, 0.5] (Salimans et al. 2017); tied rewards share their average rank."""
    n = rewards.numel()
    greater = (rewards[:, None] > rewards[None, :]).sum(1).double()
    ties = (rewards[:, None] == rewards[None, :]).sum(1).double() - 1
    return (greater + 0.5 * ties) / (n - 1) - 0.5


def shape_fitness(rewards: torch.Tensor, method: str = "zscore", eps: float = 1e-8) -> torch.Tensor | None:
    """Fitness z_i for each member; NaN rewards (members with no valid reward) get z_i = 0.

    - "zscore": z_i = (R_i − mean R) / (std R + eps), std over the population (ddof 0);
    - "centered_rank": centered ranks of R;
    - "none": z_i = R_i.
    Returns None when fewer than two members have a reward or the rewards do not differ: no signal, no update;
    raises FloatingPointError when the fitness is not finite.
    """
    if method not in SHAPINGS:
        raise ValueError(f"unknown fitness shaping {method!r}; choose one of {SHAPINGS}")
    rewards = rewards.double()
    valid = ~torch.isnan(rewards)
    r = rewards[valid]
    if r.numel() < 2 or bool(r.max() == r.min()):
        return None
    if method == "zscore":
        shaped = (r - r.mean()) / (r.std(unbiased=False) + eps)
    elif method == "centered_rank":
        shaped = centered_ranks(r)
    else:
        shaped = r
    if not torch.isfinite(shaped).all():
        raise FloatingPointError(f"the fitness of rewards {r.tolist()} is not finite ({method})")
    fitness = torch.zeros_like(rewards)
    fitness[valid] = shaped
    return fitness
