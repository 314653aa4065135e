"""Each search space's reward curve on the demo task, SmolLM2-135M-Instruct on CPU.

    python benchmarks/search_spaces.py [--curve-steps 6]

The demo's earlier settings (small sums, first_integer_reward, N=8, σ=3e-3, α=2e-3, greedy, 12 tokens, 8 prompts
per step) for full ES, an attention-only subset, a new LoRA adapter, CoPES and low-rank ES, each in a fresh process;
then Hyper-ES merging the full and CoPES results. Members per minute of full- and low-rank ES: benchmarks/engines.py.
"""

from __future__ import annotations

import argparse
import json
import os
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


def worker(spec: dict, out_dir: str) -> None:
    """One strategy in this process: train, then write step time, rewards (and save the model)."""
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import first_integer_reward, small_sums
    from trl_es.util.models import smollm2_dir

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
    clock = StepClock()
    trainer = ESTrainer(
        smollm2_dir(),
        first_integer_reward,
        args=args,
        train_dataset=small_sums("train"),
        callbacks=[clock],
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model()
    result = {
        "step_seconds": clock.seconds,
        "rewards": [log["reward"] for log in trainer.state.log_history if "reward" in log],
    }
    Path(out_dir, "result.json").write_text(json.dumps(result))


def run(spec: dict, out_dir: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", out_dir, "--spec", json.dumps(spec)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(Path(out_dir, "result.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve-steps", type=int, default=6)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return worker(json.loads(options.spec), options.worker)

    scratch = tempfile.mkdtemp()
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
