"""The fitness-signal diagnostic through vLLM: wall time of `trl-es diagnose --use-vllm` against the same command
through transformers, in one run.

    python benchmarks/diagnose_throughput.py [--model smollm2] [--task small_sums_last] [--directions 8] [--tokens 32]

Both sides run the reward objective with the common coupling at one σ on the same directions, prompts and sampling
seeds (T = 0.6), each in a fresh process (vLLM binds the threads of the process that starts it), alternating
(A B A B …); the medians are compared. The time is the whole command's: loading the model and, through vLLM,
starting the engine are included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="small_sums_last")
    parser.add_argument("--directions", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sigma", default="1e-2")
    parser.add_argument("--repeats", type=int, default=1)
    options = parser.parse_args()
    command = [sys.executable, "-m", "trl_es.cli", "diagnose", "--model", options.model, "--task", options.task,
               "--objective", "reward", "--coupling", "common", "--sigma", options.sigma,
               "--directions", str(options.directions), "--prompts", str(options.prompts),
               "--num-generations", str(options.num_generations), "--max-completion-length", str(options.tokens),
               "--temperature", "0.6", "--resamples", "200"]  # fmt: skip
    seconds = {"transformers": [], "vllm": []}
    for _ in range(options.repeats):
        for side in seconds:
            out = tempfile.mkdtemp()
            start = time.perf_counter()
            extra = ["--use-vllm"] if side == "vllm" else []
            process = subprocess.run([*command, *extra, "--out", out], capture_output=True, text=True, env=os.environ)
            if process.returncode:
                sys.exit(f"{side} failed:\n{process.stderr[-3000:]}")
            seconds[side].append(time.perf_counter() - start)
            print(f"{side}: {seconds[side][-1]:.1f} s", flush=True)
    hf, vllm = statistics.median(seconds["transformers"]), statistics.median(seconds["vllm"])
    completions = options.directions * 3 * options.prompts * options.num_generations  # θ, θ + σε, θ − σε
    print(f"\n{options.model} on {options.task}: {options.directions} directions × 3 models × {options.prompts} "
          f"prompts × {options.num_generations} completions ({completions}), ≤{options.tokens} tokens, T=0.6")  # fmt: skip
    print(f"trl-es diagnose (transformers)  {hf:7.1f} s")
    print(f"trl-es diagnose --use-vllm      {vllm:7.1f} s   speed-up {hf / vllm:.2f}×")


if __name__ == "__main__":
    main()
