"""Learning per CPU-minute on the demo task: ES settings against TRL's GRPOTrainer at the same wall-clock budget.

    python benchmarks/learning.py [--minutes 5] [--seeds 0,1,2] [--settings grpo,base,momentum,...] [--grpo-lr 1e-5]

Every run starts from SmolLM2-135M-Instruct, trains on small sums (`first_integer_reward`, greedy rollouts for ES,
12 new tokens) until `--minutes` of wall clock have passed (the step running at the deadline finishes), then scores
the held-out check the demo prints (`trl_es.demo.held_out_accuracy`: 64 problems, greedy). Each run is a fresh
process, one at a time, so every setting gets the same machine. GRPO is the reference: TRL's GRPOTrainer with 4
prompts × 4 completions per step. Prints, per setting, the held-out accuracy of each seed, their mean and spread,
and the steps done; writes results.json. Only numbers measured in this run are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


BASE = {"population_size": 8, "sigma": 3e-3, "learning_rate": 2e-3, "per_device_train_batch_size": 8}
"""What every ES setting overrides: the demo's settings until this benchmark found larger-steps (now the demo's)."""
SETTINGS = {
    "base": {},  # plain update
    "momentum": {"es_optimizer": True, "optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 2e-3 * 3e-3},
    "adamw": {"es_optimizer": True, "optim": "adamw_torch", "learning_rate": 7e-4},
    "antithetic": {"antithetic": True},
    "larger-steps": {"sigma": 5e-3, "learning_rate": 5e-3},
    "fewer-prompts": {"per_device_train_batch_size": 4},
    "lowrank-n32": {"es_search_space": "lowrank", "population_size": 32, "sigma": 3e-3, "learning_rate": 4e-3},
}
"""ES settings (overrides of BASE). momentum: SGD(0.9) on ĝ with lr = α·σ, BASE's step size at the start.
adamw: Adam moves each weight by about lr per step; BASE's plain update moves one by α/√N ≈ 7e-4 (rms)."""


def run(kind: str, name: str, seed: int, minutes: float, grpo_lr: float) -> dict:
    """One budgeted run in this process: held-out accuracy after it, steps done, seconds."""
    from trl_es.demo import held_out_accuracy
    from trl_es.models import smollm2_dir
    from trl_es.study import GRPO_SETTINGS, Deadline
    from trl_es.tasks import first_integer_reward, small_sums

    deadline, train, held_out = Deadline(minutes * 60), small_sums("train"), small_sums("test")
    common = dict(output_dir=f"/tmp/learning-{kind}-{name}-{seed}", max_steps=10_000, max_completion_length=12,
                  seed=seed, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1)  # fmt: skip
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, **{**GRPO_SETTINGS, "learning_rate": grpo_lr})
        trainer = GRPOTrainer(smollm2_dir(), first_integer_reward, args=args, train_dataset=train,
                              callbacks=[deadline])  # fmt: skip
        score = None
    else:
        from trl_es import ESConfig, ESTrainer

        args = ESConfig(**common, **{**BASE, **SETTINGS[name]}, generation_kwargs={"do_sample": False})
        trainer = ESTrainer(smollm2_dir(), first_integer_reward, args=args, train_dataset=train,
                            callbacks=[deadline])  # fmt: skip
        score = trainer
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if score is None:  # GRPOTrainer: score its weights with the same held-out check, through ESTrainer's rollout
        from trl_es import ESConfig, ESTrainer

        score = ESTrainer(trainer.model, first_integer_reward, train_dataset=train, processing_class=trainer.processing_class,
                          args=ESConfig(output_dir="/tmp/learning-score", max_completion_length=12,
                                        generation_kwargs={"do_sample": False}, report_to="none"))  # fmt: skip
    return {"held_out": held_out_accuracy(score, held_out), "steps": trainer.state.global_step, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=",".join(["grpo", *SETTINGS]), help="grpo: the reference")
    parser.add_argument("--grpo-lr", type=float, default=1e-5)
    parser.add_argument("--out", default="outputs/learning")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "NAME", "SEED"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        kind, name, seed = options.one
        print(json.dumps(run(kind, name, int(seed), options.minutes, options.grpo_lr)))
        return
    os.makedirs(options.out, exist_ok=True)
    plan = [("grpo", f"grpo lr={options.grpo_lr:g}") if name == "grpo" else ("es", name)
            for name in options.settings.split(",")]  # fmt: skip
    results = {}
    for kind, name in plan:
        for seed in [int(s) for s in options.seeds.split(",")]:
            command = [sys.executable, __file__, "--one", kind, name.split(" ")[0], str(seed),
                       "--minutes", str(options.minutes), "--grpo-lr", str(options.grpo_lr)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{kind} {name} seed {seed} failed:\n{done.stderr[-3000:]}")
            results.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = results[name][-1]
            print(f"{name} seed {seed}: held-out {row['held_out']:.3f} after {row['steps']} steps, "
                  f"{row['seconds']:.0f} s", flush=True)  # fmt: skip
    with open(os.path.join(options.out, "results.json"), "w") as file:
        json.dump({"minutes": options.minutes, "results": results}, file, indent=1)
    print(
        f"\n| setting ({options.minutes:g} min each) | held-out per seed | mean | spread | steps |\n|---|---|---:|---:|---:|"
    )
    for name, rows in results.items():
        scores = [row["held_out"] for row in rows]
        spread = statistics.pstdev(scores) if len(scores) > 1 else 0.0
        print(f"| {name} | {', '.join(f'{s:.3f}' for s in scores)} | {statistics.mean(scores):.3f} | {spread:.3f} "
              f"| {statistics.mean(row['steps'] for row in rows):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
