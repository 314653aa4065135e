"""What the low-rank population's forward hooks cost: one batched greedy `generate` of N members × P Countdown prompts
with the hooks (`LowRankPopulation`, all members in the batch) against the same call without them, SmolLM2-135M fp32.

    python benchmarks/lowrank_hooks.py [--population 8] [--prompts 8] [--tokens 16]

One process, order A B B A after a warm-up call; prints the mean seconds of each and the hooks' share.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es.es.lowrank import LowRankPopulation, lowrank_targets
from trl_es.tasks import countdown
from trl_es.util.models import smollm2_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    options = parser.parse_args()
    n, tokens = options.population, options.tokens
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    prompts = [row["prompt"] for row in countdown("train").select(range(options.prompts))] * n
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    targets = lowrank_targets(model, dict(model.named_parameters()))
    rows = torch.arange(n).repeat_interleave(options.prompts)

    def generate(hooks: bool) -> float:
        population = LowRankPopulation(targets, list(range(100, 100 + n)), [1] * n, 1e-3, 1)
        population.route(rows)
        with population if hooks else contextlib.nullcontext(), torch.inference_mode():
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            return time.perf_counter() - start

    generate(False)
    seconds = {False: [], True: []}
    for hooks in (False, True, True, False):
        seconds[hooks].append(generate(hooks))
    plain, hooked = (sum(seconds[k]) / 2 for k in (False, True))
    print(f"{n} members × {options.prompts} prompts × {tokens} tokens in one generate call, SmolLM2-135M fp32, CPU")
    print(f"without hooks {plain:.2f} s, with the population's hooks {hooked:.2f} s: hooks +{hooked / plain - 1:.1%}")


if __name__ == "__main__":
    main()
