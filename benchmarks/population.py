"""Population size: reward trajectories of ES at N ∈ {8, 16, 32, 64} with the same number of updates (the research's
Table 6 / Figure 5: smaller populations suffice for larger models).

    python benchmarks/population.py [--models smollm2] [--sizes 8,16,32,64] [--steps 10] [--seed 0] [--out D]
    python benchmarks/population.py --report D/results.json

Each (model, N) trains the demo's setting (small sums, `first_integer_reward`, 12 new tokens, 8 prompts per step,
greedy members, σ = α = 5e-3) for `--steps` ES steps in a fresh process, from the same data order, and records the
population's mean reward per step. Trajectories are smoothed as training logs are: a debiased exponential moving
average, s_t = β·s_{t−1} + (1 − β)·r_t divided by 1 − β^t (β = `--smoothing`, 0.99 as the research). Prints, per
model, each N's smoothed reward at the end and the first step from which it stays within `--tolerance` (0.01) of the
largest N's: the population size that already does what the largest does. Writes results.json and a plot
(docs/img/population.png by default).

Cost on 2 CPU cores (SmolLM2-135M): a step costs ~1.5 s per member (8 prompts × 12 tokens), so 10 steps take ~2
min at N=8 and ~16 min at N=64; the default, ~32 minutes. The model-size half of the claim needs several model sizes, which need GPUs
(`--models` takes any model ids or paths).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


SETTINGS = {"sigma": 5e-3, "learning_rate": 5e-3, "per_device_train_batch_size": 8, "max_completion_length": 12}
"""The demo's ES setting; only the population size changes."""


def train(model: str, size: int, steps: int, seed: int, folder: str) -> list[float]:
    """The population's mean reward at each of `steps` ES steps with `size` members (in this process)."""
    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import first_integer_reward, small_sums
    from trl_es.util.models import resolve_model

    args = ESConfig(
        output_dir=folder, population_size=size, max_steps=steps, seed=seed, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, generation_kwargs={"do_sample": False}, **SETTINGS,
    )  # fmt: skip
    trainer = ESTrainer(resolve_model(model), first_integer_reward, args=args, train_dataset=small_sums("train"))
    trainer.train()
    return [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]


def smoothed(values: list[float], beta: float) -> list[float]:
    """Debiased exponential moving average: s_t = β·s_{t−1} + (1 − β)·r_t, reported as s_t / (1 − β^t)."""
    average, out = 0.0, []
    for t, value in enumerate(values, start=1):
        average = beta * average + (1 - beta) * value
        out.append(average / (1 - beta**t))
    return out


def settles(curve: list[float], reference: list[float], tolerance: float) -> int | None:
    """The first step (1-based) from which `curve` stays within `tolerance` of `reference`; None if it never does."""
    for start in range(len(curve)):
        if all(abs(a - b) <= tolerance for a, b in zip(curve[start:], reference[start:], strict=True)):
            return start + 1
    return None


def report(results: dict, beta: float, tolerance: float, plot: str | None) -> None:
    """The table (per model: each N's final smoothed reward and where it settles on the largest N's) and the plot."""
    for model, runs in results["runs"].items():
        sizes = sorted(runs, key=int)
        curves = {size: smoothed(runs[size], beta) for size in sizes}
        largest = curves[sizes[-1]]
        print(f"\n{model}: {len(largest)} steps, smoothing β={beta}, within {tolerance} of N={sizes[-1]}")
        print(f"{'N':>4} {'final reward':>13} {'smoothed':>9} {'settles at step':>16}")
        for size in sizes:
            step = settles(curves[size], largest, tolerance)
            print(f"{size:>4} {runs[size][-1]:>13.3f} {curves[size][-1]:>9.3f} {str(step or 'never'):>16}")
    if plot:
        from trl_es.evaluation.report import pyplot

        plt = pyplot()
        figure, axes = plt.subplots(1, len(results["runs"]), figsize=(6 * len(results["runs"]), 4), squeeze=False)
        for ax, (model, runs) in zip(axes[0], results["runs"].items(), strict=True):
            for size in sorted(runs, key=int):
                steps = range(1, len(runs[size]) + 1)
                (line,) = ax.plot(steps, smoothed(runs[size], beta), label=f"N={size} (smoothed)")
                ax.plot(steps, runs[size], alpha=0.25, color=line.get_color())
            ax.set(title=model, xlabel="ES step (equal updates)", ylabel="population mean reward")
            ax.legend()
        figure.tight_layout()
        figure.savefig(plot, dpi=120)
        print(f"wrote {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="comma-separated model ids or paths")
    parser.add_argument("--sizes", default="8,16,32,64", help="population sizes N")
    parser.add_argument("--steps", type=int, default=10, help="ES steps (updates) per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoothing", type=float, default=0.99, help="β of the debiased moving average")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--out", default="outputs/population")
    parser.add_argument("--plot", default="docs/img/population.png")
    parser.add_argument("--report", help="print the table and plot of an earlier results.json")
    parser.add_argument("--run", nargs=3, metavar=("MODEL", "SIZE", "FILE"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.run:  # one run, in its own process
        model, size, file = options.run
        rewards = train(model, int(size), options.steps, options.seed, os.path.dirname(file))
        with open(file, "w") as out:
            json.dump(rewards, out)
        return
    if options.report:
        with open(options.report) as file:
            report(json.load(file), options.smoothing, options.tolerance, options.plot)
        return
    results = {"settings": {**SETTINGS, "steps": options.steps, "seed": options.seed}, "runs": {}}
    for model in options.models.split(","):
        for size in options.sizes.split(","):
            file = os.path.join(options.out, model.replace("/", "_"), f"N{size}", "rewards.json")
            if not os.path.isfile(file):  # finished runs are kept: an interrupted benchmark resumes
                os.makedirs(os.path.dirname(file), exist_ok=True)
                steps, seed = str(options.steps), str(options.seed)
                command = [sys.executable, __file__, "--run", model, size, file, "--steps", steps, "--seed", seed]
                subprocess.run(command, check=True)
            with open(file) as rewards:
                results["runs"].setdefault(model, {})[size] = json.load(rewards)
            print(f"{model} N={size}: final reward {results['runs'][model][size][-1]:.3f}", flush=True)
    with open(os.path.join(options.out, "results.json"), "w") as out:
        json.dump(results, out, indent=1)
    report(results, options.smoothing, options.tolerance, options.plot)


if __name__ == "__main__":
    main()
