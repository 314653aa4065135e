"""What each evaluated member reports, and the step's metrics computed from it.

Each slot of the population (the centre, a member) is summarised in one row of float64 numbers (`summarize`); the
rows of all processes are summed by one all-reduce (`trl_es.distributed`). Logged metrics are computed from these
rows with the same formulas whatever the number of processes, so 1 process and K processes log the same numbers.
"""

from __future__ import annotations

import math

import torch

from .metrics import js_diversity


def summary_width(n_functions: int, n_prompts: int) -> int:
    """Row width: member reward R; (nansum, count, sum of squares) of the combined reward and of each reward
    function; the completion lengths' sum, min, max, the number of completions and of truncated ones; the sum of
    their token entropies (0 when not recorded); for each of the step's prompts, the share of its completions that
    succeeded (combined reward ≥ `success_threshold`)."""
    return 1 + 3 * (n_functions + 1) + 6 + n_prompts


def summarize(
    member_reward: float,
    rewards: torch.Tensor,
    lengths: list[int],
    truncated: list[bool],
    entropy_sum: float,
    success: torch.Tensor,
) -> torch.Tensor:
    """One slot's row. `rewards` is (completions, 1 + F): the combined reward, then each function's (NaN = none);
    `success` is (prompts,), each prompt's share of successful completions."""
    rewards = rewards.double()
    valid = ~torch.isnan(rewards)
    zeroed = rewards.nan_to_num(0.0)
    moments = torch.stack([zeroed.sum(0), valid.sum(0).double(), zeroed.square().sum(0)], dim=1).flatten()
    lengths_t = torch.tensor(lengths, dtype=torch.float64)
    tail = torch.tensor(
        [lengths_t.sum(), lengths_t.min(), lengths_t.max(), len(lengths), sum(truncated), entropy_sum],
        dtype=torch.float64,
    )
    return torch.cat([torch.tensor([member_reward], dtype=torch.float64), moments, tail, success.double()])


def member_rewards(summaries: torch.Tensor, weights: torch.Tensor, aggregation: str) -> torch.Tensor:
    """R_i of each member's summary row (NaN: no reward). 'sum_then_normalize': the mean over its completions of the
    weighted sum of the reward functions (then fitness shaping normalizes across members). 'normalize_then_sum':
    each function's mean over the member's completions, z-scored across the members with one, then summed with
    `weights` (a function without spread counts 0)."""
    if aggregation == "sum_then_normalize":
        return summaries[:, 0]
    n_functions = weights.numel()
    sums, counts = summaries[:, 4 : 4 + 3 * n_functions : 3], summaries[:, 5 : 5 + 3 * n_functions : 3]
    means = sums / counts  # NaN where a member has no reward from that function
    normalized = (means - means.nanmean(0)) / _nanstd(means).clamp_min(1e-8)
    total = (normalized.nan_to_num(0.0) * weights.double()).sum(1)
    total[torch.isnan(means).all(1)] = math.nan
    return total


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    """Per column, the population standard deviation of the non-NaN values."""
    centered = values - values.nanmean(0)
    return centered.square().nanmean(0).sqrt().nan_to_num(0.0)


def _mean_std(total: float, count: float, squares: float) -> tuple[float, float]:
    """Mean and unbiased standard deviation from Σx, n and Σx² (std 0 below two values; mean NaN for none)."""
    if count == 0:
        return math.nan, 0.0
    mean = total / count
    if count < 2:
        return mean, 0.0
    return mean, math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def population_metrics(
    summaries: torch.Tensor, function_names: list[str], entropy: bool = False, diversity_prompts: int | None = None
) -> dict[str, float]:
    """GRPOTrainer-named metrics (reward, reward_std, rewards/<f>/mean|std, completions/*) over the members' rows,
    and the spread of the member rewards R_i (es/population_reward_min|max|std); with `entropy`, also the mean token
    entropy of their completions (`completions/mean_token_entropy`, nats); with `diversity_prompts` (the step's
    number of prompts), their JS diversity (`es/population_diversity`)."""
    metrics = {}
    rewards = summaries[:, 0][~torch.isnan(summaries[:, 0])]
    if rewards.numel():
        metrics["es/population_reward_min"] = rewards.min().item()
        metrics["es/population_reward_max"] = rewards.max().item()
        metrics["es/population_reward_std"] = rewards.std(unbiased=False).item()
    if diversity_prompts is not None:
        metrics["es/population_diversity"] = population_diversity(summaries, diversity_prompts)
    for k, key in enumerate([None, *function_names]):
        total, count, squares = (float(summaries[:, 1 + 3 * k + j].sum()) for j in range(3))
        mean, std = _mean_std(total, count, squares)
        prefix = "reward" if key is None else f"rewards/{key}/"
        metrics[prefix + ("" if key is None else "mean")] = mean
        metrics[prefix + ("_std" if key is None else "std")] = std
    start = 1 + 3 * (len(function_names) + 1)
    length_sum, n_completions = float(summaries[:, start].sum()), float(summaries[:, start + 3].sum())
    metrics["completions/mean_length"] = length_sum / n_completions
    metrics["completions/min_length"] = float(summaries[:, start + 1].min())
    metrics["completions/max_length"] = float(summaries[:, start + 2].max())
    metrics["completions/clipped_ratio"] = float(summaries[:, start + 4].sum()) / n_completions
    if entropy:
        metrics["completions/mean_token_entropy"] = float(summaries[:, start + 5].sum()) / max(length_sum, 1.0)
    return metrics


def population_diversity(summaries: torch.Tensor, n_prompts: int) -> float:
    """Verifier-projected JS diversity (`trl_es.metrics.js_diversity`) of the members' per-prompt success."""
    return js_diversity(summaries[:, summaries.shape[1] - n_prompts :])


class DistanceFromStart:
    """‖θ − θ₀‖/‖θ₀‖ (`es/rel_distance_from_start`), θ₀ the weights when it was made, over every k-th element of θ:
    k keeps about `sample` elements (exact for smaller models)."""

    def __init__(self, params: dict[str, torch.Tensor], sample: int = 1 << 20):
        self.params = params
        self.stride = max(1, sum(p.numel() for p in params.values()) // sample)
        self.start = [p.detach().view(-1)[:: self.stride].to("cpu", torch.float32, copy=True) for p in params.values()]

    def __call__(self) -> float:
        diff = norm = 0.0
        for p, start in zip(self.params.values(), self.start, strict=True):
            now = p.detach().view(-1)[:: self.stride].float().cpu()
            diff += float((now - start).square().sum())
            norm += float(start.square().sum())
        return (diff / norm) ** 0.5 if norm else 0.0
