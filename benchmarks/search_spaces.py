"""Search spaces side by side on SmolLM2-135M-Instruct, CPU: members per minute and peak memory of full-rank ES
against the low-rank batched population (EGGROLL), then each strategy's reward curve on the demo task.

    python benchmarks/search_spaces.py [--population 30] [--prompts 8] [--tokens 32] [--curve-steps 6] [--no-curves] [--no-timing]

Throughput: the same population, prompts and completion lengths (every completion exactly `--tokens` tokens), one
fresh process per strategy; the wall time of the last of 2 steps (the first includes one-off allocations) and the
peak RSS of the process. Curves: the demo's earlier settings (small sums, first_integer_reward, N=8, σ=3e-3, α=2e-3,
greedy, 12 tokens, 8 prompts per step) for full ES, an attention-only subset, a new LoRA adapter, CoPES and
low-rank ES; then Hyper-ES merging the full and CoPES results. Prints tables; ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


DEMO = {"sigma": 3e-3, "learning_rate": 2e-3, "max_completion_length": 12, "generation_kwargs": {"do_sample": False}}
CURVES = {
    "full": {},
    "patterns (attention)": {"es_parameter_patterns": [r"self_attn\.(q|k|v|o)_proj"]},
    "lora (r=8, q/v)": {"sigma": 0.05, "learning_rate": 0.02, "peft": True},
    "copes (4 layer groups)": {"es_search_space": "copes", "copes_groups": 4, "antithetic": True},
    "lowrank (r=1, batched)": {"es_search_space": "lowrank"},
}


def length_reward(completions, **kwargs):
    """Characters in the completion: any reward does for timing, as long as members differ."""
    return [float(len(c[0]["content"])) for c in completions]


def worker(spec: dict, out_dir: str) -> None:
    """One strategy in this process: train, then write step time, peak RSS, rewards (and save the model)."""
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.models import smollm2_dir
    from trl_es.tasks import first_integer_reward, small_sums

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start

    settings = dict(spec["settings"])
    peft_config = None
    if settings.pop("peft", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = ESConfig(
        output_dir=out_dir,
        per_device_train_batch_size=spec["prompts"],
        seed=0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **settings,
    )
    reward = first_integer_reward if spec["kind"] == "curve" else length_reward
    clock = StepClock()
    trainer = ESTrainer(
        smollm2_dir(), reward, args=args, train_dataset=small_sums("train"), callbacks=[clock], peft_config=peft_config
    )
    trainer.train()
    trainer.save_model()
    result = {
        "step_seconds": clock.seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rewards": [log["reward"] for log in trainer.state.log_history if "reward" in log],
        "last_step_log": [log for log in trainer.state.log_history if "reward" in log][-1],
    }
    Path(out_dir, "result.json").write_text(json.dumps(result))


def run(spec: dict, out_dir: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", out_dir, "--spec", json.dumps(spec)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(Path(out_dir, "result.json").read_text())


def throughput(options, scratch: str) -> None:
    """Full-rank vs low-rank batched: seconds per step, members per minute, peak RSS."""
    n = options.population
    timing = {
        "population_size": n,
        "max_completion_length": options.tokens,
        "max_steps": 2,
        "sigma": 1e-3,
        "generation_kwargs": {"min_new_tokens": options.tokens},
    }
    spaces = {"full-rank (default)": {}, "low-rank batched (r=1)": {"es_search_space": "lowrank"}}
    results = {
        label: run(
            {"kind": "timing", "prompts": options.prompts, "settings": {**timing, **extra}},
            os.path.join(scratch, f"timing-{k}"),
        )
        for k, (label, extra) in enumerate(spaces.items())
    }
    print(
        f"ES step on SmolLM2-135M fp32, CPU: N={n} members, {options.prompts} prompts × {options.tokens} tokens "
        "each, last of 2 steps"
    )
    print(f"{'':26} {'s/step':>8} {'members/min':>12} {'peak RSS MB':>12}")
    for label, result in results.items():
        print(
            f"{label:26} {result['step_seconds']:8.1f} {60 * n / result['step_seconds']:12.1f} "
            f"{result['peak_rss'] / 2**20:12.0f}"
        )
    full, low = (results[label]["step_seconds"] for label in spaces)
    print(f"low-rank batched / full-rank members per minute: {full / low:.2f}× (target ≥ 3×)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=30, help="members N (ESConfig's default, as the paper)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--curve-steps", type=int, default=6)
    parser.add_argument("--no-curves", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return worker(json.loads(options.spec), options.worker)

    scratch = tempfile.mkdtemp()
    if not options.no_timing:
        throughput(options, scratch)
    if options.no_curves:
        return

    print(f"Reward per step on the demo task (small sums, N=8, greedy, {options.curve_steps} steps; base ≈ 0.05)")
    saved = {}
    for k, (label, extra) in enumerate(CURVES.items()):
        saved[label] = os.path.join(scratch, f"curve-{k}")
        settings = {**DEMO, "population_size": 8, "max_steps": options.curve_steps, **extra}
        print_curve(label, run({"kind": "curve", "prompts": 8, "settings": settings}, saved[label]))
    merge = {
        **DEMO,
        "population_size": 8,
        "max_steps": options.curve_steps,
        "es_search_space": "merge",
        "merge_models": [saved["full"], saved["copes (4 layer groups)"]],
    }
    print_curve(
        "hyper-es (merge full + copes)",
        run({"kind": "curve", "prompts": 8, "settings": merge}, os.path.join(scratch, "curve-merge")),
    )


def print_curve(label: str, result: dict) -> None:
    rewards = " ".join(f"{r:.2f}" for r in result["rewards"])
    print(f"{label:32} {rewards}   ({result['step_seconds']:.0f} s/step)", flush=True)


if __name__ == "__main__":
    main()
