"""ES step vs TRL GRPOTrainer step vs plain `generate`: peak RSS and seconds, on SmolLM2-135M fp32 on CPU.

    python benchmarks/step_memory_time.py [--population 8] [--prompts 8] [--generations 2] [--tokens 64]

The ES step is measured with the plain update and with `es_optimizer` under SGD with momentum and AdamW (their
state: one and two fp32 copies of θ), next to GRPOTrainer's AdamW.

Each measurement runs in its own fresh process (so one cannot inherit another's memory). Peak RSS is sampled every
5 ms by a thread during the measured step(s) only, model loading excluded; "above base" subtracts the RSS just
before the step (model loaded). Prints one table; ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import psutil


class PeakRSS:
    """Max resident set size of this process while the block runs, sampled every 5 ms."""

    def __enter__(self):
        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.base = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def reward(completions, **kwargs):
    """Characters in the completion: any reward does for timing, as long as members differ."""
    return [float(len(c[0]["content"])) for c in completions]


def prompts(n):
    from trl_es.tasks import small_sums

    return small_sums("train").select(range(n))


def run_generate(options):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.util.models import smollm2_dir

    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = tokenizer.apply_chat_template(
        list(prompts(options.prompts)["prompt"]), add_generation_prompt=True, tokenize=False
    )
    batch = tokenizer([t for t in texts for _ in range(options.generations)], return_tensors="pt", padding=True)
    with PeakRSS() as rss, torch.no_grad():
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=options.tokens, min_new_tokens=options.tokens, do_sample=True)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak": rss.peak, "base": rss.base}


OPTIMIZERS = {
    "plain": {},
    "sgd-momentum": {"es_optimizer": True, "optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 1e-4},
    "adamw": {"es_optimizer": True, "optim": "adamw_torch", "learning_rate": 1e-5},
}


def run_es(options):
    from trl_es import ESConfig, ESTrainer
    from trl_es.util.models import smollm2_dir

    args = ESConfig(
        **OPTIMIZERS[options.optimizer],
        output_dir="/tmp/bench-es",
        population_size=options.population,
        per_device_train_batch_size=options.prompts,
        num_generations=options.generations,
        max_completion_length=options.tokens,
        max_steps=1,
        generation_kwargs={"min_new_tokens": options.tokens},
        sigma=1e-3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        common_generation_seed=False,  # members sample differently, so rewards spread
    )
    trainer = ESTrainer(smollm2_dir(), reward, args=args, train_dataset=prompts(options.prompts))
    with PeakRSS() as rss:
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    log = next(log for log in trainer.state.log_history if "reward" in log)
    assert log["es/skipped_update"] == 0.0, "the update was skipped: the timing would not include it"
    split = {
        "generate": log["es/time/generate"],
        "reward": log["es/time/reward"],
        "noise (copy θ + perturb)": log["es/time/noise"],
        "update": log["es/time/update"],
    }
    return {"seconds": seconds, "peak": rss.peak, "base": rss.base, "split": split}


def run_grpo(options):
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_es.util.models import smollm2_dir

    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.start)

    args = GRPOConfig(
        output_dir="/tmp/bench-grpo",
        per_device_train_batch_size=options.prompts * options.generations,
        num_generations=options.generations,
        max_completion_length=options.tokens,
        max_steps=2,
        bf16=False,
        generation_kwargs={"min_new_tokens": options.tokens},
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        smollm2_dir(), reward, args=args, train_dataset=prompts(options.prompts), callbacks=[StepTimer()]
    )
    with PeakRSS() as rss:
        trainer.train()
    return {"seconds": step_times[-1], "peak": rss.peak, "base": rss.base}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--only", choices=["generate", "es", "grpo"])
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="plain", help="with --only es")
    options = parser.parse_args()
    if options.only:
        print(json.dumps(globals()[f"run_{options.only}"](options)))
        return
    results = {}
    runs = {"generate": ("generate", "plain"), "grpo": ("grpo", "plain")}
    runs |= {f"es-{name}": ("es", name) for name in OPTIMIZERS}
    for key, (which, optimizer) in runs.items():
        command = [sys.executable, __file__, "--only", which, f"--optimizer={optimizer}"] + [
            f"--{k}={getattr(options, k)}" for k in ("population", "prompts", "generations", "tokens")
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_VERBOSITY": "error"}
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"{which} failed:\n{run.stderr[-3000:]}")
        results[key] = json.loads(run.stdout.strip().splitlines()[-1])

    mb = 2**20
    weights_mb = 134_515_008 * 4 / mb
    print(
        f"SmolLM2-135M fp32, CPU ({os.cpu_count()} cores): {options.prompts} prompts x {options.generations} "
        f"completions x {options.tokens} new tokens; ES population {options.population}\n"
    )
    print(f"{'':28s}{'s/step':>10s}{'peak RSS MB':>14s}{'above base MB':>15s}")
    names = {"generate": "plain generate (1 batch)", "es-plain": "ES step", "es-sgd-momentum": "ES step, SGD momentum",
             "es-adamw": "ES step, AdamW", "grpo": "GRPOTrainer step (AdamW)"}  # fmt: skip
    for key, name in names.items():
        r = results[key]
        print(f"{name:28s}{r['seconds']:10.1f}{r['peak'] / mb:14.0f}{(r['peak'] - r['base']) / mb:15.0f}")
    es, grpo, gen = results["es-plain"], results["grpo"], results["generate"]
    for name in ("sgd-momentum", "adamw"):
        extra = (results[f"es-{name}"]["peak"] - es["peak"]) / mb
        print(f"ES {name} peak / GRPO peak: {results[f'es-{name}']['peak'] / grpo['peak']:.2f} "
              f"(+{extra:.0f} MB over the plain update; θ in fp32 is {weights_mb:.0f} MB)")  # fmt: skip
    print(f"\nES peak / GRPO peak: {es['peak'] / grpo['peak']:.2f}  (target <= 0.60)")
    budget = gen["peak"] + weights_mb * mb
    print(
        f"ES peak / (generate peak + one fp32 copy of the weights, {weights_mb:.0f} MB): {es['peak'] / budget:.2f}"
        "  (target <= 1.10)"
    )
    total = sum(es["split"].values())
    print("\nES step split (s, share of the measured parts):")
    for part, seconds in es["split"].items():
        print(f"  {part:26s}{seconds:8.2f}  {seconds / total:6.1%}")
    print(
        f"  everything but generation: {1 - es['split']['generate'] / total:.1%} of the measured parts, "
        f"{1 - es['split']['generate'] / es['seconds']:.1%} of the step's wall time (target <= 5%)"
    )


if __name__ == "__main__":
    main()
