"""Evaluation through vLLM: completions per second of `trl-es eval --use-vllm` against a plain vLLM `generate` of the
same rows, in one run (goal: ≥ 90% of plain vLLM).

    python benchmarks/eval_throughput.py [--model smollm2] [--task small_sums] [--problems 16] [--n 8] [--tokens 64]

Both sides start an in-process engine with the same settings on the same model and sample n completions of the
same prompts of the task (small sums by default: built here, offline; `--task gsm8k` needs its data) at T = 0.6
with the same token budget; the engine's start is not timed. trl-es sends every
completion as its own request with its own seed (so records, resume and results keep their meaning) and scores
them with the task's reward; plain vLLM sends one request per prompt with `n` samples and scores nothing. A third
side is `--vllm-entropy`: trl-es also scoring the token entropy (teacher forcing in transformers). Each side runs in
a fresh process, alternating (A B C A B C …), and the medians are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


SIDES = ("plain", "trl-es", "trl-es --vllm-entropy")


def plain(model: str, task: str, problems: int, n: int, tokens: int) -> float:
    """Completions per second of `LLM.generate` with `SamplingParams(n=...)` (after the engine started)."""
    from vllm import LLM, SamplingParams

    from trl_es.tasks import get_task
    from trl_es.util.models import resolve_model

    rows = get_task(task).load("test").select(range(problems))
    llm = LLM(model=resolve_model(model), dtype="float32", enforce_eager=True, seed=0)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows
    ]
    params = SamplingParams(n=n, temperature=0.6, max_tokens=tokens, seed=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(output.outputs) for output in outputs) / (time.perf_counter() - start)


def trl_es(model: str, task: str, problems: int, n: int, tokens: int, entropy: bool = False) -> float:
    """Completions per second of the evaluation loop through vLLM: the task's `wall_s`, which starts after the model
    and its engine are loaded and covers generating, scoring (with `entropy`, the token entropy too) and writing the
    records."""
    import tempfile

    from trl_es.evaluation import evaluate

    results = evaluate([model], task, n=n, k=[1], out_dir=tempfile.mkdtemp(), limit=problems,
                       max_completion_length=tokens, temperature=0.6, batch_size=problems, use_vllm=True,
                       vllm_entropy=entropy, progress=lambda _: None)  # fmt: skip
    (scores,) = results["models"].values()
    return problems * n / scores["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="small_sums")
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    options = parser.parse_args()
    sizes = (options.model, options.task, options.problems, options.n, options.tokens)
    if options.side:
        speed = plain(*sizes) if options.side == "plain" else trl_es(*sizes, entropy=options.side != "trl-es")
        print(json.dumps(speed))
        return
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    speeds = {side: [] for side in SIDES}
    for _ in range(options.repeats):
        for side in speeds:
            command = [sys.executable, __file__, "--side", side, "--model", options.model, "--task", options.task,
                       "--problems", str(options.problems), "--n", str(options.n), "--tokens", str(options.tokens)]  # fmt: skip
            process = subprocess.run(command, capture_output=True, text=True, env=env)
            if process.returncode:
                sys.exit(f"{side} failed:\n{process.stderr[-3000:]}")
            speeds[side].append(json.loads(process.stdout.strip().splitlines()[-1]))
            print(f"{side}: {speeds[side][-1]:.1f} completions/s", flush=True)
    plain_speed, ours, scored = (statistics.median(speeds[side]) for side in SIDES)
    print(
        f"\n{options.problems} {options.task} problems × n={options.n}, ≤{options.tokens} tokens, T=0.6, {options.model}"
    )
    print(f"plain vLLM generate                  {plain_speed:8.1f} completions/s")
    print(f"trl-es eval --use-vllm               {ours:8.1f} completions/s   ratio {ours / plain_speed:.2f}")
    print(f"trl-es eval --use-vllm --vllm-entropy {scored:7.1f} completions/s   ratio {scored / plain_speed:.2f}")


if __name__ == "__main__":
    main()
