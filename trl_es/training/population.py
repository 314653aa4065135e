"""What each evaluated member reports, and the step's metrics computed from it.

Each slot of the population (the centre, a member) is summarised in one row of float64 numbers (`summarize`); the
rows of all processes are summed by one all-reduce (`trl_es.training.distributed`). Logged metrics are computed from these
rows with the same formulas whatever the number of processes, so 1 process and K processes log the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..evaluation.metrics import js_diversity


@dataclass(frozen=True)
class SummaryLayout:
    """The columns of a slot's summary row, for `n_functions` reward functions and `n_prompts` prompts:

    `reward` the member reward R; `moments(k)` the (nansum, count, sum of squares) of the combined reward (k = 0)
    or of reward function k − 1; `lengths` the completion lengths (model-generated tokens): sum, min, max, the
    number of completions and of truncated ones, the sum of their token entropies (0 when not recorded), then the
    sum, min and max over the terminated ones (0 when none), and the prompt tokens (each completion's prompt
    counted once per completion); `tools` the number of tool calls and of failed ones;
    `prompt_rewards` per prompt, the mean combined reward of its completions; `success` per prompt, the share of its
    completions that succeeded (combined reward ≥ `success_threshold`)."""

    n_functions: int
    n_prompts: int
    reward = 0
    LENGTHS = ("sum", "min", "max", "count", "truncated", "entropy", "terminated_sum", "terminated_min",
               "terminated_max", "prompt_tokens")  # fmt: skip

    def moments(self, k: int) -> slice:
        return slice(1 + 3 * k, 4 + 3 * k)

    @property
    def lengths(self) -> slice:
        start = 1 + 3 * (self.n_functions + 1)
        return slice(start, start + len(self.LENGTHS))

    def length(self, name: str) -> int:
        """The column of one of `LENGTHS`."""
        return self.lengths.start + self.LENGTHS.index(name)

    @property
    def tools(self) -> slice:
        return slice(self.lengths.stop, self.lengths.stop + 2)

    @property
    def prompt_rewards(self) -> slice:
        return slice(self.tools.stop, self.tools.stop + self.n_prompts)

    @property
    def success(self) -> slice:
        return slice(self.prompt_rewards.stop, self.width)

    @property
    def width(self) -> int:
        return self.tools.stop + 2 * self.n_prompts


def summarize(
    member_reward: float,
    rewards: torch.Tensor,
    lengths: list[int],
    truncated: list[bool],
    entropy_sum: float,
    success: torch.Tensor,
    tool_calls: int = 0,
    tool_failures: int = 0,
    prompt_tokens: int = 0,
) -> torch.Tensor:
    """One slot's row (`SummaryLayout`). `rewards` is (completions, 1 + F): the combined reward, then each
    function's (NaN = none), completions prompt-major; `success` is (prompts,), each prompt's share of successful
    completions."""
    rewards = rewards.double()
    valid = ~torch.isnan(rewards)
    zeroed = rewards.nan_to_num(0.0)
    moments = torch.stack([zeroed.sum(0), valid.sum(0).double(), zeroed.square().sum(0)], dim=1).flatten()
    lengths_t = torch.tensor(lengths, dtype=torch.float64)
    terminated = lengths_t[~torch.tensor(truncated, dtype=torch.bool)]
    ended = [terminated.sum(), terminated.min(), terminated.max()] if terminated.numel() else [0.0, 0.0, 0.0]
    tail = torch.tensor(
        [lengths_t.sum(), lengths_t.min(), lengths_t.max(), len(lengths), sum(truncated), entropy_sum, *ended,
         prompt_tokens, tool_calls, tool_failures],
        dtype=torch.float64,
    )  # fmt: skip
    prompt_rewards = rewards[:, 0].view(success.numel(), -1).nanmean(1)
    return torch.cat(
        [torch.tensor([member_reward], dtype=torch.float64), moments, tail, prompt_rewards, success.double()]
    )


def member_rewards(summaries: torch.Tensor, weights: torch.Tensor, aggregation: str) -> torch.Tensor:
    """R_i of each member's summary row (NaN: no reward). 'sum_then_normalize': the mean over its completions of the
    weighted sum of the reward functions (then fitness shaping normalizes across members). 'normalize_then_sum':
    each function's mean over the member's completions, z-scored across the members with one, then summed with
    `weights` (a function without spread counts 0)."""
    layout = SummaryLayout(weights.numel(), 0)
    if aggregation == "sum_then_normalize":
        return summaries[:, layout.reward]
    sums = torch.stack([summaries[:, layout.moments(k + 1)][:, 0] for k in range(weights.numel())], dim=1)
    counts = torch.stack([summaries[:, layout.moments(k + 1)][:, 1] for k in range(weights.numel())], dim=1)
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
    summaries: torch.Tensor,
    function_names: list[str],
    n_prompts: int,
    entropy: bool = False,
    diversity: bool = False,
    tools: bool = False,
) -> dict[str, float]:
    """GRPOTrainer-named metrics (reward, reward_std, rewards/<f>/mean|std, frac_reward_zero_std, completions/*)
    over the members' rows on the step's `n_prompts` prompts, and the spread of the member rewards R_i
    (es/population_reward_min|max|std); with `entropy`, also the mean token entropy of their completions
    (`completions/mean_token_entropy`, nats); with `diversity`, their JS diversity (`es/population_diversity`)."""
    metrics, layout = {}, SummaryLayout(len(function_names), n_prompts)
    rewards = summaries[:, layout.reward][~torch.isnan(summaries[:, layout.reward])]
    if rewards.numel():
        metrics["es/population_reward_min"] = rewards.min().item()
        metrics["es/population_reward_max"] = rewards.max().item()
        metrics["es/population_reward_std"] = rewards.std(unbiased=False).item()
    metrics["frac_reward_zero_std"] = frac_reward_zero_std(summaries, len(function_names), n_prompts)
    if diversity:
        metrics["es/population_diversity"] = population_diversity(summaries, n_prompts)
    for k, key in enumerate([None, *function_names]):
        columns = layout.moments(k)
        total, count, squares = (float(summaries[:, c].sum()) for c in range(columns.start, columns.stop))
        mean, std = _mean_std(total, count, squares)
        prefix = "reward" if key is None else f"rewards/{key}/"
        metrics[prefix + ("" if key is None else "mean")] = mean
        metrics[prefix + ("_std" if key is None else "std")] = std
    column = lambda name: summaries[:, layout.length(name)]  # noqa: E731
    length_sum, n_completions = float(column("sum").sum()), float(column("count").sum())
    metrics["completions/mean_length"] = length_sum / n_completions
    metrics["completions/min_length"] = float(column("min").min())
    metrics["completions/max_length"] = float(column("max").max())
    n_truncated = float(column("truncated").sum())
    metrics["completions/clipped_ratio"] = n_truncated / n_completions
    ended = (column("count") - column("truncated")) > 0  # the slots with a terminated completion
    metrics["completions/mean_terminated_length"] = (
        float(column("terminated_sum").sum()) / (n_completions - n_truncated) if ended.any() else 0.0
    )  # as GRPOTrainer: 0 when every completion was cut
    metrics["completions/min_terminated_length"] = float(column("terminated_min")[ended].min()) if ended.any() else 0.0
    metrics["completions/max_terminated_length"] = float(column("terminated_max")[ended].max()) if ended.any() else 0.0
    if entropy:
        metrics["completions/mean_token_entropy"] = float(column("entropy").sum()) / max(length_sum, 1.0)
    if tools:  # as GRPOTrainer: calls per completion, failures per call
        calls, failures = (
            float(summaries[:, layout.tools.start].sum()),
            float(summaries[:, layout.tools.start + 1].sum()),
        )
        metrics["tools/call_frequency"] = calls / n_completions
        metrics["tools/failure_frequency"] = failures / calls if calls else 0.0
    return metrics


def frac_reward_zero_std(summaries: torch.Tensor, n_functions: int, n_prompts: int) -> float:
    """GRPOTrainer's `frac_reward_zero_std` for ES: the share of the step's prompts on which every member's mean
    reward is the same (NaN ones left out), so that the prompt cannot rank the members."""
    rewards = summaries[:, SummaryLayout(n_functions, n_prompts).prompt_rewards]
    std = _nanstd(rewards)
    return float(torch.isclose(std, torch.zeros_like(std)).double().mean())


def population_diversity(summaries: torch.Tensor, n_prompts: int) -> float:
    """Verifier-projected JS diversity (`trl_es.evaluation.metrics.js_diversity`) of the members' per-prompt success."""
    return js_diversity(summaries[:, summaries.shape[1] - n_prompts :])  # the `success` columns, last


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
