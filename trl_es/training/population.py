"""A step's population on this process, and the summary row that carries each member's results to every process.

Each slot of the population (the centre, a member) is summarised in one row of float64 numbers, whose layout,
writing and reading `SummaryLayout` alone owns; the rows of all processes are summed by one all-reduce
(`trl_es.training.distributed`). Logged metrics are computed from these rows with the same formulas whatever the
number of processes, so 1 process and K processes log the same numbers. `Population` evaluates this process's
slots: it forms each member (the search space), generates (the rollout), scores (the reward functions) and writes
the member's row.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..es.fitness import pass_at_k_table, prompt_normalized
from ..es.seeds import completion_seeds, sampling_seed
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

    def row(self, rewards: torch.Tensor, completions, success: torch.Tensor, prompt_tokens: int = 0) -> torch.Tensor:
        """One slot's row. `rewards` is (completions, 1 + F): the combined reward, then each function's (NaN = none),
        completions prompt-major; the member reward R is the combined reward's mean. `completions` (a
        `trl_es.generation.Completions`) gives the lengths, truncations, token entropies and tool calls; `success`
        (prompts,) each prompt's share of successful completions."""
        member_reward = rewards[:, 0].contiguous().nanmean().item()  # a column view would sum in another order
        rewards = rewards.double()
        valid = ~torch.isnan(rewards)
        zeroed = rewards.nan_to_num(0.0)
        moments = torch.stack([zeroed.sum(0), valid.sum(0).double(), zeroed.square().sum(0)], dim=1).flatten()
        lengths = torch.tensor(completions.lengths, dtype=torch.float64)
        terminated = lengths[~torch.tensor(completions.truncated, dtype=torch.bool)]
        ended = [terminated.sum(), terminated.min(), terminated.max()] if terminated.numel() else [0.0, 0.0, 0.0]
        entropy = sum(completions.entropy_sums) if completions.entropy_sums else 0.0
        tail = torch.tensor(
            [lengths.sum(), lengths.min(), lengths.max(), len(lengths), sum(completions.truncated), entropy, *ended,
             prompt_tokens, sum(completions.tool_calls or ()), sum(completions.tool_failures or ())],
            dtype=torch.float64,
        )  # fmt: skip
        prompt_rewards = rewards[:, 0].view(success.numel(), -1).nanmean(1)
        return torch.cat(
            [torch.tensor([member_reward], dtype=torch.float64), moments, tail, prompt_rewards, success.double()]
        )

    def member_rewards(self, summaries: torch.Tensor, weights: torch.Tensor, aggregation: str) -> torch.Tensor:
        """R_i of each member's row (NaN: no reward). 'sum_then_normalize': the mean over its completions of the
        weighted sum of the reward functions (then fitness shaping normalizes across members). 'normalize_then_sum':
        each function's mean over the member's completions, z-scored across the members with one, then summed with
        `weights` (a function without spread counts 0)."""
        if aggregation == "sum_then_normalize":
            return summaries[:, self.reward]
        sums = torch.stack([summaries[:, self.moments(k + 1)][:, 0] for k in range(weights.numel())], dim=1)
        counts = torch.stack([summaries[:, self.moments(k + 1)][:, 1] for k in range(weights.numel())], dim=1)
        means = sums / counts  # NaN where a member has no reward from that function
        normalized = (means - means.nanmean(0)) / _nanstd(means).clamp_min(1e-8)
        total = (normalized.nan_to_num(0.0) * weights.double()).sum(1)
        total[torch.isnan(means).all(1)] = math.nan
        return total

    def tokens(self, summaries: torch.Tensor) -> int:
        """The prompt and completion tokens the slots saw (a prompt's once per completion)."""
        return int(summaries[:, self.length("prompt_tokens")].sum() + summaries[:, self.length("sum")].sum())

    def metrics(
        self,
        summaries: torch.Tensor,
        function_names: list[str],
        entropy: bool = False,
        diversity: bool = False,
        tools: bool = False,
    ) -> dict[str, float]:
        """GRPOTrainer-named metrics (reward, reward_std, rewards/<f>/mean|std, frac_reward_zero_std, completions/*)
        over the members' rows, and the spread of the member rewards R_i (es/population_reward_min|max|std); with
        `entropy`, also the mean token entropy of their completions (`completions/mean_token_entropy`, nats); with
        `diversity`, their JS diversity (`es/population_diversity`); with `tools`, tools/call_frequency and
        tools/failure_frequency."""
        metrics = {}
        rewards = summaries[:, self.reward][~torch.isnan(summaries[:, self.reward])]
        if rewards.numel():
            metrics["es/population_reward_min"] = rewards.min().item()
            metrics["es/population_reward_max"] = rewards.max().item()
            metrics["es/population_reward_std"] = rewards.std(unbiased=False).item()
        metrics["frac_reward_zero_std"] = self.frac_reward_zero_std(summaries)
        if diversity:
            metrics["es/population_diversity"] = self.diversity(summaries)
        for k, key in enumerate([None, *function_names]):
            columns = self.moments(k)
            total, count, squares = (float(summaries[:, c].sum()) for c in range(columns.start, columns.stop))
            mean, std = _mean_std(total, count, squares)
            prefix = "reward" if key is None else f"rewards/{key}/"
            metrics[prefix + ("" if key is None else "mean")] = mean
            metrics[prefix + ("_std" if key is None else "std")] = std
        column = lambda name: summaries[:, self.length(name)]  # noqa: E731
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
        metrics["completions/min_terminated_length"] = (
            float(column("terminated_min")[ended].min()) if ended.any() else 0.0
        )
        metrics["completions/max_terminated_length"] = (
            float(column("terminated_max")[ended].max()) if ended.any() else 0.0
        )
        if entropy:
            metrics["completions/mean_token_entropy"] = float(column("entropy").sum()) / max(length_sum, 1.0)
        if tools:  # as GRPOTrainer: calls per completion, failures per call
            calls, failures = (
                float(summaries[:, self.tools.start].sum()),
                float(summaries[:, self.tools.start + 1].sum()),
            )
            metrics["tools/call_frequency"] = calls / n_completions
            metrics["tools/failure_frequency"] = failures / calls if calls else 0.0
        return metrics

    def frac_reward_zero_std(self, summaries: torch.Tensor) -> float:
        """GRPOTrainer's `frac_reward_zero_std` for ES: the share of the step's prompts on which every member's mean
        reward is the same (NaN ones left out), so that the prompt cannot rank the members."""
        std = _nanstd(summaries[:, self.prompt_rewards])
        return float(torch.isclose(std, torch.zeros_like(std)).double().mean())

    def diversity(self, summaries: torch.Tensor) -> float:
        """Verifier-projected JS diversity (`trl_es.evaluation.metrics.js_diversity`) of the members' per-prompt
        success."""
        return js_diversity(summaries[:, self.success])


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


class Population:
    """This process's share of a step's population: each slot (None: the unperturbed centre θ; else a member of the
    search space) is formed by `space`, generates through `rollout` (in calls of the space's `members_per_call`
    members, or one when the rollout generates by itself), is scored by `rewards` (`RewardFunctions`) and written
    into its summary row; `processes` exchanges the rows. Keeps the completions table of this process's first member
    for the log (`last_completions`)."""

    def __init__(self, args, space, rollout, rewards, processes, tokenize: Callable):
        self.args, self.space, self.rollout, self.reward_functions = args, space, rollout, rewards
        self.processes, self.tokenize = processes, tokenize
        self.last_completions, self._completions_step = None, None

    def cost(self) -> str:
        """One line, printed when training starts: what one ES step generates, over how many prompts (with
        gradient accumulation, per_device_train_batch_size × gradient_accumulation_steps)."""
        args = self.args
        members = args.population_size + (args.es_baseline == "center")
        prompts = args.per_device_train_batch_size * args.gradient_accumulation_steps
        folded = (
            f" (per_device_train_batch_size={args.per_device_train_batch_size} × gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps})"
            if args.gradient_accumulation_steps > 1
            else ""
        )
        completions = members * prompts * args.num_generations
        local = len(self.processes.slots(members))
        per_call = self.space.members_per_call(local) if self.rollout.batches_members else 1
        calls = f", in generate calls of {per_call} members" if 1 < per_call < local else ""
        return (
            f"trl-es: each ES step generates {completions} completions ({members} members × {prompts} prompts{folded} "
            f"× num_generations={args.num_generations}, each up to {args.max_completion_length} tokens), over "
            f"{self.processes.accelerator.num_processes} process(es){calls}"
        )

    def layout(self, n_prompts: int) -> SummaryLayout:
        return SummaryLayout(len(self.reward_functions.names), n_prompts)

    @staticmethod
    def slot_count(args) -> int:
        """Evaluations per step: the members, and the unperturbed centre θ with `es_baseline="center"`."""
        return args.population_size + (args.es_baseline == "center")

    def metrics(self, members: torch.Tensor, n_prompts: int, tools: bool) -> dict[str, float]:
        """The step's metrics of the members' rows (`SummaryLayout.metrics`), with the logs ESConfig asks for."""
        args = self.args
        entropy, diversity = args.log_completion_entropy, args.log_population_diversity
        return self.layout(n_prompts).metrics(members, self.reward_functions.names, entropy, diversity, tools)

    def evaluate(
        self, rows: list[dict], step: int, members: list, times: dict, **context
    ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """The step's slots — the centre θ first with `es_baseline="center"`, then `members` — evaluated, this
        process its own share, every process's summaries summed by the step's one all-reduce. Returns the members'
        summary rows, their rewards R_i (aggregated as `multi_objective_aggregation` says) and the centre's reward
        (None without the centre). `context` goes to the reward functions (`trainer_state`, `log_metric`); `times`
        gains the seconds spent forming members ("noise"), generating, scoring and exchanging."""
        slots = [None] * (self.args.es_baseline == "center") + members
        summaries = self._evaluate_slots(rows, step, slots, times, **context)
        layout = self.layout(len(rows))
        member_rows = summaries[len(slots) - len(members) :]
        center = summaries[0, layout.reward].item() if len(slots) > len(members) else None
        return member_rows, self.member_rewards(member_rows, layout), center

    def member_rewards(self, member_rows: torch.Tensor, layout: SummaryLayout) -> torch.Tensor:
        """R_i of each member's row: its mean reward (aggregated as `multi_objective_aggregation` says), or, with
        `fitness_pass_k` or `scale_rewards`, the mean over prompts of its per-prompt reward or Pass@k, each prompt
        normalised across the members (`trl_es.es.fitness.prompt_normalized`)."""
        args = self.args
        if args.fitness_pass_k is None and args.scale_rewards == "none":
            weights = self.reward_functions.reward_weights
            return layout.member_rewards(member_rows, weights, args.multi_objective_aggregation)
        if args.fitness_pass_k is None:
            per_prompt = member_rows[:, layout.prompt_rewards]
        else:
            per_prompt = pass_at_k_table(member_rows[:, layout.success], args.num_generations, args.fitness_pass_k)
        return prompt_normalized(per_prompt, args.scale_rewards)

    def _evaluate_slots(self, rows: list[dict], step: int, slots: list, times: dict, **context) -> torch.Tensor:
        """Every slot's summary row (None: the centre), all processes', after the step's one all-reduce."""
        n, args = self.args.num_generations, self.args
        summaries = torch.zeros(len(slots), self.layout(len(rows)).width, dtype=torch.float64)
        first_member, error, prompt_tokens = sum(slot is None for slot in slots), None, None
        times |= {"generate": 0.0, "reward": 0.0}
        try:
            mine = self.processes.slots(len(slots))
            per_call = self.space.members_per_call(len(mine)) if self.rollout.batches_members else 1
            quiet = args.disable_tqdm or not self.processes.accelerator.is_local_main_process
            progress = tqdm(total=len(mine), desc=f"ES step {step + 1}: members", leave=False, disable=quiet)
            for start in range(0, len(mine), per_call):
                part = mine[start : start + per_call]
                seeds = [seed for s in part for seed in self.completion_seeds(step, s - first_member, len(rows))]
                timer = time.perf_counter()
                with self.space.evaluating([slots[s] for s in part]) as route:
                    times["noise"] += time.perf_counter() - timer
                    timer = time.perf_counter()
                    generated = self.rollout(rows, n, seeds, len(part), route, step, args.log_completion_entropy)
                times["generate"] += time.perf_counter() - timer
                timer = time.perf_counter()
                for j, s in enumerate(part):
                    member_completions = generated.select(j * len(rows) * n, (j + 1) * len(rows) * n)
                    if prompt_tokens is None:  # every member meets the same prompts (and environment resets)
                        prompt_tokens = sum(map(len, self.tokenize(member_completions.prompts)))
                    summaries[s], table = self.score(rows, member_completions, prompt_tokens, context)
                    if slots[s] is not None and self._completions_step != step:
                        self.last_completions, self._completions_step = table, step
                times["reward"] += time.perf_counter() - timer
                progress.update(len(part))
            progress.close()
        except Exception as exc:  # reported to the other processes by the all-reduce, then raised
            error = exc
        timer = time.perf_counter()
        summaries = self.processes.exchange(summaries, error, step)
        times["communication"] = time.perf_counter() - timer
        return summaries

    def completion_seeds(self, step: int, member: int, n_prompts: int) -> list[int]:
        """The sampling seeds of member `member`'s completions at `step` (−1: the centre), one per (prompt,
        generation): with `common_generation_seed` every member's are the same (common random numbers)."""
        key = "common" if self.args.common_generation_seed else "center" if member < 0 else member
        return completion_seeds(sampling_seed(self.args.seed, step, key), n_prompts, self.args.num_generations)

    def score(self, rows: list[dict], completions, prompt_tokens: int, context: dict) -> tuple[torch.Tensor, tuple]:
        """One slot's summary row from its completions — each reward function's rewards (cut completions get none
        with `mask_truncated_completions`, as GRPO leaves them out of its loss), their weighted sum, each prompt's
        share of successes (combined reward ≥ `success_threshold`) — and its completions table (prompts,
        completions, each function's rewards, the columns reward functions added with `log_extra`)."""
        extras = defaultdict(list)
        log_extra = lambda column, values: extras[column].extend(values)  # noqa: E731
        per_func = self.reward_functions.score(rows, completions, log_extra=log_extra, **context)
        if self.args.mask_truncated_completions:
            per_func[torch.tensor(completions.truncated, dtype=torch.bool)] = float("nan")
        combined = self.reward_functions.combine(per_func)
        success = (combined >= self.args.success_threshold).double().view(len(rows), -1).mean(1)
        row = self.layout(len(rows)).row(
            torch.cat([combined[:, None], per_func], dim=1), completions, success, prompt_tokens
        )
        table = {name: per_func[:, k].tolist() for k, name in enumerate(self.reward_functions.names)}
        return row, (completions.prompts, completions.completions, table, dict(extras))
