"""Splitting the population across processes, and the little that crosses the wire (DESIGN §2, "seeds and N scalars").

Every process reads the same prompts and regenerates every member's noise from its seed. The population's
slots (the unperturbed centre when `es_baseline="center"`, then members 0..N−1) are dealt round-robin: process r
evaluates slots r, r+K, r+2K, … Each evaluated slot is summarised in one row of `SUMMARY` float64 numbers; the rows
of all processes are summed with one all-reduce (each row has one non-zero contributor, so the sum is exact), and
every process then applies the identical update. Logged metrics are computed from these rows with the same formulas
whatever the number of processes, so 1 process and K processes log the same numbers.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from .metrics import js_diversity


def local_slots(n_slots: int, process_index: int, num_processes: int) -> list[int]:
    """The slots process `process_index` of `num_processes` evaluates (round-robin; none when index ≥ n_slots)."""
    return list(range(process_index, n_slots, num_processes))


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


def all_reduce_summaries(
    summaries: torch.Tensor, failed: bool, device: torch.device, timeout_s: float
) -> tuple[torch.Tensor, list[int]]:
    """Sum every process's (slots, width) summaries and learn which processes failed, in one all-reduce.

    Returns the summed summaries and the indices of the processes that reported a failure. In one process this is
    the identity. Bytes exchanged per process: 8·(slots·width + K). Waiting longer than `timeout_s` raises a
    RuntimeError (given here because Trainer does not pass `ddp_timeout` to gloo process groups on CPU).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return summaries, [0] if failed else []
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = torch.zeros(world, dtype=torch.float64)
    flags[rank] = float(failed)
    packed = torch.cat([summaries.flatten(), flags]).to(device)
    dist.all_reduce(packed, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    packed = packed.cpu()
    failed_ranks = [r for r in range(world) if packed[summaries.numel() + r] != 0]
    return packed[: summaries.numel()].view_as(summaries), failed_ranks


def _mean_std(total: float, count: float, squares: float) -> tuple[float, float]:
    """Mean and unbiased standard deviation from Σx, n and Σx² (std 0 below two values; mean NaN for none)."""
    if count == 0:
        return math.nan, 0.0
    mean = total / count
    if count < 2:
        return mean, 0.0
    return mean, math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def population_metrics(summaries: torch.Tensor, function_names: list[str], entropy: bool = False) -> dict[str, float]:
    """GRPOTrainer-named metrics (reward, reward_std, rewards/<f>/mean|std, completions/*) over the members' rows;
    with `entropy`, also the mean token entropy of their completions (`completions/mean_token_entropy`, nats)."""
    metrics = {}
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
