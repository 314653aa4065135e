"""Fitness: what a member's reward R_i is made of, and how the population's rewards become the weights z_i of the
ES update.

A member's reward on a prompt is its completions' mean reward, or with `fitness_pass_k` = k the unbiased Pass@k of
its completions (`pass_at_k_table`); R_i averages them over the step's prompts, each prompt first normalised across
the population with `scale_rewards` (`prompt_normalized`, the ES counterpart of GRPO's group advantage). The shaping
(`shape_fitness`) turns R into z; with `fitness_top_k` = K only the K best members keep theirs (`keep_top_k`).
"""

from __future__ import annotations

import math

import torch


SHAPINGS = ("zscore", "centered_rank", "none")
SCALE_REWARDS = ("none", "group", "batch")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@K from n samples with c correct: 1 − C(n−c, k)/C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"Pass@{k} needs 1 ≤ K ≤ n samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_table(success: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Pass@k of each (member, prompt) from `success`, the share of its n completions that succeeded (NaN stays
    NaN): c = round(share·n) correct of n."""
    table = torch.full_like(success, math.nan, dtype=torch.float64)
    for index, share in enumerate(success.reshape(-1).tolist()):
        if not math.isnan(share):
            table.view(-1)[index] = pass_at_k(n, round(share * n), k)
    return table


def prompt_normalized(values: torch.Tensor, scale: str, eps: float = 1e-8) -> torch.Tensor:
    """R_i = mean over prompts k of a_ik, a_ik = (v_ik − mean_j v_jk) / s_k, for `values` v (members × prompts, NaN:
    no reward): s_k is the prompt's std across the members ("group", GRPO's scale_rewards default: every prompt
    weighs the same in the ranking, so an easy one no longer decides it), the std of every value of the step
    ("batch"), or 1 ("none"). Stds over the members with a value (ddof 0); a prompt without spread gives a_ik = 0;
    a member with no value on any prompt gets NaN."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale!r}; choose one of {SCALE_REWARDS}")
    values = values.double()
    centered = values - values.nanmean(0)
    if scale == "group":
        centered = centered / (centered.square().nanmean(0).sqrt() + eps)
    elif scale == "batch":
        valid = values[~torch.isnan(values)]
        centered = centered / (valid.std(unbiased=False) + eps)
    rewards = centered.nanmean(1)
    if not torch.isfinite(rewards[~torch.isnan(rewards)]).all():
        raise FloatingPointError(f"the per-prompt normalised rewards {rewards.tolist()} are not finite")
    return rewards


def keep_top_k(fitness: torch.Tensor, rewards: torch.Tensor, k: int) -> torch.Tensor:
    """`fitness` of the k members with the highest `rewards` (NaN: none; ties to the earlier member), 0 for the
    others: only the best k move θ (RandOpt / CoRP's consolidation of the best members)."""
    values = rewards.tolist()
    ranked = sorted((i for i, r in enumerate(values) if not math.isnan(r)), key=lambda i: -values[i])
    kept = torch.zeros_like(fitness)
    kept[ranked[:k]] = fitness[ranked[:k]]
    return kept


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
