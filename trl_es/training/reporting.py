"""What ESTrainer reports: the training metrics of each logging window, and evaluations.

A mixin of `ESTrainer`. Each step's metrics (`_step_metrics`, from `trl_es.training.population`'s summaries) go
to the run's `StepLog` (`trl_es.training.steplog`); `log` — called by Trainer every `logging_steps`, at the end of
training, and by `ESTrainer` before each checkpoint — logs their means over the window, NaN values left out (a
metric with none left logs None), as GRPOTrainer does, so no step's metrics are lost. `evaluate` runs the evaluation loop `trl-es eval`
runs (`trl_es.evaluation.evaluate_batch`), on one eval dataset or on each of a dict of them (`eval_<name>_*`).
"""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import torch
from transformers.integrations import is_trackio_available, is_wandb_available
from transformers.utils import is_rich_available
from trl.trainer.utils import print_prompt_completions_sample, strip_images_from_messages

from ..es.seeds import eval_seed
from ..evaluation import evaluate_batch, summarize_records
from ..generation.base import message_images
from ..tasks import get_task


class ReportingMixin:
    """The step's metrics, `log` and `evaluate` of `ESTrainer` (see the module docstring)."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log record with the window's metrics. A step record has no `loss` or `grad_norm`: ES has no
        gradient, and its per-step loss is −`reward`, logged already. The final summary's `train_loss` is ES's
        (`ESTrainer._training_loss`): −(mean population reward) over the run."""
        logs = {k: v for k, v in logs.items() if k not in ("loss", "grad_norm")}
        if "train_loss" in logs:
            logs["train_loss"] = self.step_log.training_loss
        stepped = bool(self.step_log.window)
        completions = stepped and self.args.log_completions and self.population.last_completions
        logs.update(self.step_log.flush())
        super().log(logs, start_time)
        # After the step's metrics, as GRPOTrainer does: trackers file the table under the `train/global_step`
        # logged last, which is then this step's
        if completions and self.accelerator.is_main_process:
            self._log_completions()

    def _step_metrics(self, members: torch.Tensor, n_prompts: int, center, outcome: dict, times: dict) -> dict:
        """The step's metrics, from the members' all-reduced summaries: the same whatever the number of processes.
        `num_tokens` counts, as GRPOTrainer's, the prompt and completion tokens seen so far, here by every member
        (a prompt's tokens once per completion; an agent episode's first prompt, as its environment reset it)."""
        tools = self.agents is not None and bool(self.agents.tools)
        step = ({} if center is None else {"es/center_reward": center}) | self.population.metrics(
            members, n_prompts, tools
        )
        self.state.num_input_tokens_seen += self.population.layout(n_prompts).tokens(members)
        step |= {"num_tokens": self.state.num_input_tokens_seen, "step_time": times["step"], **outcome}
        return step | {
            f"es/time/{name}": times[name] for name in ("generate", "reward", "noise", "update", "communication")
        }

    def _log_completions(self) -> None:
        """The first member's prompts, completions and rewards of the latest step, as GRPOTrainer logs its own:
        printed (with rich), written to `<output_dir>/completions/completions_<step>.parquet`, and sent as a
        `completions` table to wandb / trackio when `report_to` names them."""
        prompts, completions, rewards, extras = self.population.last_completions
        step = self.state.global_step
        images = [message_images(p) + message_images(c) for p, c in zip(prompts, completions, strict=True)]
        strip = lambda column: list(map(strip_images_from_messages, column))  # noqa: E731 (the pictures, as GRPO)
        table = pd.DataFrame({"step": [step] * len(prompts), "prompt": strip(prompts), "completion": strip(completions),
                              **rewards, **extras})  # fmt: skip
        folder = os.path.join(self.args.output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"completions_{step:05d}.parquet")
        try:
            table.to_parquet(f"{path}.partial")
        except (TypeError, ValueError):  # messages Arrow cannot type as one struct (tool calls): kept as JSON text
            as_text = lambda value: value if isinstance(value, str) else json.dumps(value, default=str)  # noqa: E731
            table.assign(prompt=table["prompt"].map(as_text), completion=table["completion"].map(as_text)).to_parquet(
                f"{path}.partial"
            )
        os.replace(f"{path}.partial", path)
        if self.args.log_unique_prompts:  # prompts are conversations (lists of dicts): compared by their text
            table = table[~table["prompt"].astype(str).duplicated()]
        if is_rich_available():
            print_prompt_completions_sample(
                table["prompt"].tolist(),
                table["completion"].tolist(),
                {name: table[name].tolist() for name in rewards},
                None,
                step,
                self.args.num_completions_to_print,
                {name: table[name].tolist() for name in extras} or None,
            )
        report_to = self.args.report_to or []
        if "wandb" in report_to and is_wandb_available():
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=self._with_images(table, images, wandb))})
        if "trackio" in report_to and is_trackio_available():
            import trackio

            trackio.log({"completions": trackio.Table(dataframe=self._with_images(table, images, trackio))})

    def _with_images(self, table: pd.DataFrame, images: list[list], backend) -> pd.DataFrame:
        """The completions table a tracker logs: with `log_multimodal` and images, an `image` column holding each
        row's images (`images`, by the table's row labels) as the tracker's `Image`s, as GRPOTrainer logs them."""
        if not (self.args.log_multimodal and any(images)):
            return table
        return table.assign(image=[[backend.Image(image) for image in images[row]] for row in table.index])

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Pass@K for K in `eval_k` (and Maj@K with `eval_task`) of the current θ on the eval prompts, with
        `num_generations_eval` completions each; also the mean reward, completion length and token entropy. A dict
        of datasets (or a DatasetDict) is evaluated name by name, as `<prefix>_<name>_<metric>`. Each process takes
        every K-th prompt; the sums are all-reduced. Runs at `eval_steps` with `eval_strategy="steps"`."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("ESTrainer.evaluate needs an `eval_dataset`")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        args, start_time = self.args, time.perf_counter()
        n = args.num_generations_eval or args.num_generations
        task = get_task(args.eval_task) if args.eval_task else None
        extract, same_answer = (task.extract_answer, task.same_answer) if task else (None, None)
        processes, size = self.processes, args.per_device_eval_batch_size
        rows, records = processes.engine_rows(list(dataset)), []
        options = (args.eval_k, extract, args.success_threshold)

        def rewards_of(rows, completions):
            return self.reward_functions.combine(
                self.reward_functions.score(rows, completions, trainer_state=self.state)
            )

        self.weights.start()
        with self._full_parameters():
            for start in range(0, len(rows), size):
                first = processes.engine + start * processes.engines  # the chunk's first problem
                seed = eval_seed(args.seed, self.state.global_step, first)
                key = ("eval", self.state.global_step, first)  # the environments' resets of this chunk
                chunk = rows[start : start + size]
                records.append(
                    evaluate_batch(
                        self.rollout, chunk, n, seed, rewards_of, *options, key=key, same_answer=same_answer
                    )
                )
        summary = summarize_records(records, args.eval_k, extract is not None, processes.reduce)
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in summary.items() if key != "problems"}
        if not self.rollout.records_entropy:
            del metrics[f"{metric_key_prefix}_mean_token_entropy"]
        metrics[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - start_time, 4)
        super().log(metrics)  # not self.log, which would fold pending training metrics into this record
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics
