"""Mixed precision (`bf16=True`) against float32 for ES on SmolLM2-135M-Instruct, CPU: seconds and peak memory per
member, and how much of a member's perturbation σ·ε bfloat16 rounding erases.

    python benchmarks/precision.py [--population 4] [--prompts 8] [--tokens 32] [--repeats 2] [--sigmas 1e-3,3e-3,1e-2]

Speed and memory: ESTrainer, 2 steps of `--population` members on the first `--prompts` Countdown prompts, greedy,
exactly `--tokens` new tokens, with bf16 off (float32) and on (generation under bfloat16 autocast, θ float32); each
run in a fresh process, the two alternating (A B A B …); seconds per member = the last step's generate time ÷ N,
peak RSS of the process. Rounding: for θ = SmolLM2's weights and ε a member's noise (the run's noise table), the
share of weights whose bfloat16 value does not change at all, bf16(θ + σ·ε) = bf16(θ), and the relative error of
the perturbation the bfloat16 model sees, ‖(bf16(θ + σ·ε) − bf16(θ)) − σ·ε‖ / ‖σ·ε‖.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def member_run(bf16: bool, population: int, prompts: int, tokens: int) -> dict:
    """Seconds per member (the last step's generation ÷ N) and the process's peak RSS."""
    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import countdown, countdown_reward
    from trl_es.util.models import smollm2_dir

    args = ESConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=prompts,
        population_size=population,
        max_steps=2,
        max_completion_length=tokens,
        generation_kwargs={"do_sample": False, "min_new_tokens": tokens},
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=bf16,
        use_cpu=True,
    )
    trainer = ESTrainer(smollm2_dir(), countdown_reward, args=args, train_dataset=countdown("train"))
    trainer.train()
    log = [record for record in trainer.state.log_history if "reward" in record][-1]
    return {
        "member_seconds": log["es/time/generate"] / population,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def rounding(sigmas: list[float]) -> dict[float, dict]:
    """Per σ: the share of weights bfloat16 leaves unchanged by σ·ε, and the relative error of the perturbation."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_es.es import NoiseTable, member_noise
    from trl_es.util.models import smollm2_dir

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    table, results = NoiseTable(seed=42, size=1 << 24), {}
    for sigma in sigmas:
        unchanged = count = error = norm = 0.0
        for name, p in model.named_parameters():
            theta = p.detach().view(-1)
            noise = torch.cat([window for _, _, window in member_noise(table, 7, name, theta.numel())])
            seen = (theta + sigma * noise).bfloat16().float() - theta.bfloat16().float()
            unchanged += float((seen == 0).sum())
            count += theta.numel()
            error += float((seen - sigma * noise).double().square().sum())
            norm += float((sigma * noise).double().square().sum())
        results[sigma] = {"unchanged": unchanged / count, "relative_error": (error / norm) ** 0.5}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sigmas", default="1e-3,3e-3,1e-2")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    settings = (options.population, options.prompts, options.tokens)
    if options.worker is not None:
        print(json.dumps(member_run(options.worker == "bf16", *settings)))
        return
    cores = os.cpu_count()
    print(f"ES on SmolLM2-135M, CPU ({cores} cores), N={options.population}, {options.prompts} Countdown prompts × "
          f"{options.tokens} tokens, greedy; {options.repeats} fresh processes each, alternating")  # fmt: skip
    runs = {"float32": [], "bf16": []}
    for _ in range(options.repeats):
        for label in runs:
            command = [sys.executable, __file__, "--worker", label, "--population", str(options.population),
                       "--prompts", str(options.prompts), "--tokens", str(options.tokens)]  # fmt: skip
            start = time.perf_counter()
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[label].append(json.loads(output.strip().splitlines()[-1]))
            print(f"  {label}: {runs[label][-1]} ({time.perf_counter() - start:.0f} s in all)", flush=True)
    print(f"\n{'':10} {'s/member (median)':>18} {'peak RSS MB (median)':>21}")
    medians = {}
    for label, results in runs.items():
        seconds = statistics.median(r["member_seconds"] for r in results)
        rss = statistics.median(r["peak_rss"] for r in results) / 2**20
        medians[label] = (seconds, rss)
        print(f"{label:10} {seconds:18.2f} {rss:21.0f}")
    (f32_s, f32_rss), (bf_s, bf_rss) = medians["float32"], medians["bf16"]
    print(f"bf16 / float32: {bf_s / f32_s:.2f}× the time per member, {bf_rss / f32_rss:.2f}× the peak RSS")
    print("\nbfloat16 rounding of a member's perturbation σ·ε (θ = SmolLM2's weights):")
    print(f"{'σ':>8} {'weights unchanged':>18} {'relative error of σ·ε':>22}")
    for sigma, result in rounding([float(s) for s in options.sigmas.split(",")]).items():
        print(f"{sigma:8.0e} {result['unchanged']:18.1%} {result['relative_error']:22.3f}")


if __name__ == "__main__":
    main()
