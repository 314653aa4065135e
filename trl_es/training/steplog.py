"""The one owner of what a run records step by step: each step's metrics until the next log (averaged over the
window, NaN left out, as GRPOTrainer does), the steps whose rewards carried no signal, the loss behind `train_loss`,
and the distance of θ from the weights the run started with."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import torch


def window_means(metrics: dict[str, list[float]]) -> dict[str, float | None]:
    """Each metric's mean over the logging window, NaN values left out (None when nothing is left)."""
    means = {}
    for key, values in metrics.items():
        kept = [value for value in values if not math.isnan(value)]
        means[key] = sum(kept) / len(kept) if kept else None
    return means


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


class StepLog:
    """A run's step records over the ES parameters `params` (module docstring). `start_run` at each `train` call;
    `begin_step` before each step; `add` for what reward functions log (`log_metric`); `record` for the step's own
    metrics; `flush` at each log."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self.window: dict[str, list[float]] = defaultdict(list)
        self.start_run()

    def start_run(self) -> None:
        """A new `train` call: no skipped step, no loss yet; the distance is from the weights of its first step."""
        self.skipped, self.loss_sum, self.loss_steps = 0, 0.0, 0
        self.distance: DistanceFromStart | None = None

    def begin_step(self) -> None:
        if self.distance is None:
            self.distance = DistanceFromStart(self.params)

    def add(self, name: str, value: float) -> None:
        self.window[name].append(value)

    def record(self, metrics: dict[str, float]) -> float:
        """The step's metrics, with its distance from the start (`es/rel_distance_from_start`); returns the step's
        loss, −`reward` (NaN when no completion got a reward)."""
        for name, value in {**metrics, "es/rel_distance_from_start": self.distance()}.items():
            self.add(name, value)
        self.skipped += int(metrics["es/skipped_update"])
        loss = -metrics["reward"]
        if not math.isnan(loss):
            self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
        return loss

    def pending(self) -> dict[str, float | None]:
        """The window's means so far (kept for the next log)."""
        return window_means(self.window)

    def flush(self) -> dict[str, float | None]:
        """The window's means, and a new window."""
        means = self.pending()
        self.window.clear()
        return means

    @property
    def training_loss(self) -> float:
        """`train_loss`: the loss ES minimises, −(mean population reward), averaged over this `train` call's steps
        that had a reward (NaN when none had)."""
        return self.loss_sum / self.loss_steps if self.loss_steps else math.nan

    def warn_skipped(self) -> None:
        """One warning at the end of `train` for its steps whose rewards had no spread (`es/skipped_update`)."""
        if self.skipped:
            warnings.warn(
                f"{self.skipped} ES step(s) of this run left the weights unchanged: the population rewards had no "
                "spread (all equal, or all None), so they carried no signal (es/skipped_update = 1 in their log "
                "records)",
                stacklevel=3,  # the caller of `train`
            )
