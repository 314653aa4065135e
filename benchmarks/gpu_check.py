"""The checks that need a GPU, as one short run (≤ 8 minutes on one H200): bitwise restore in bf16 on CUDA, the ES
step's peak GPU memory against plain `generate`, members per minute of full-rank and low-rank ES against plain
generation, for a ~0.5B and a ~1.5B model shape.

    bash benchmarks/gpu_check.sh download   # here: wheels (TRL, datasets) and SmolLM2's tokenizer into .gpu/
    bash benchmarks/gpu_check.sh            # on the GPU machine (carry .gpu): install them, run this script
    python benchmarks/gpu_check.py --smoke  # the same steps on CPU with tiny shapes, to check the script

No Hub and no downloads there: the models are built from Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (hidden size,
layers, heads, MLP width) with SmolLM2's vocabulary and random bf16 weights — throughput and memory need no
trained weights. Workload per member: `--prompts` prompts × `--tokens` new tokens (forced), greedy, N = 30.

- restore (on the first shape): after 100 members written and restored, and after a step whose reward function
  fails mid-population, a hash of every weight's bytes equals θ's (the exact copy of θ lives in host memory);
- memory: `torch.cuda.max_memory_allocated` during an ES step over the same during a plain generate of the batch
  (goal ≤ 1.10: ES adds only the noise table and an update buffer on the GPU);
- members per minute: ES step (last of 2) full-rank and low-rank (all 30 members in one batched call) against
  plain generate (60 / seconds of one batch) and against plain batched generate (one call of the population's
  rows at θ: the engine limit; low-rank / plain batched is the share of it ES reaches, EGGROLL reports 91%).

vLLM's CUDA path (members written in place, low-rank members as LoRA adapters) is not part of it: vLLM's GPU wheel
is larger than what can be carried to the GPU machine.

Writes `gpu_check.json` and `gpu_check.md` (a table) into `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch


SHAPES = {
    "~0.5B (Qwen2.5-0.5B shape)": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2),
    "~1.5B (Qwen2.5-1.5B shape)": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2),
}  # fmt: skip
SMOKE_SHAPES = {"tiny (smoke)": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1)}  # fmt: skip


def build_model(path: Path, shape: dict, tokenizer_dir: str, dtype: torch.dtype) -> str:
    """A Qwen2 model of `shape` with random weights and the tokenizer's vocabulary, saved with it in `path`."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def fingerprint(model) -> str:
    """A hash of the bytes of every parameter (`weights_hash`): equal only for bitwise-equal weights."""
    from trl_es.es.weights import weights_hash

    return weights_hash(dict(model.named_parameters()))


def prompts(n: int):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"Question {k}: what is {k} plus {k + 1}? Answer:" for k in range(n)]})


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def es_trainer(model_dir: str, options, out: Path, reward=length_reward, **settings):
    from trl_es import ESConfig, ESTrainer

    args = ESConfig(
        output_dir=str(out),
        per_device_train_batch_size=options.prompts,
        population_size=options.population,
        max_completion_length=options.tokens,
        generation_kwargs={"do_sample": False, "min_new_tokens": options.tokens},
        sigma=1e-3,
        max_steps=2,
        use_cpu=options.device == "cpu",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **settings,
    )
    return ESTrainer(model_dir, reward, args=args, train_dataset=prompts(options.prompts))


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def plain_generate(trainer, options, copies: int = 1) -> tuple[float, int]:
    """Seconds and peak GPU bytes of one greedy batch of the prompts (what one member generates), or with `copies`
    of one batch of every prompt `copies` times (the rows of a whole population, at θ: the engine limit)."""
    rows = [row["prompt"] for row in prompts(options.prompts)] * copies
    generation = trainer.generation
    ids = generation.tokenize(rows)
    generation.generate(rows, ids, 1, [0] * len(rows))  # warm-up
    synchronize()
    reset_peak()
    start = time.perf_counter()
    generation.generate(rows, ids, 1, [0] * len(rows))
    synchronize()
    return time.perf_counter() - start, peak_bytes()


class StepClock:
    """Seconds and peak GPU bytes of each training step."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                synchronize()
                reset_peak()
                clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                synchronize()
                clock.seconds, clock.peak = time.perf_counter() - clock.start, peak_bytes()

        self.callback = Callback()


def check_shape(label: str, shape: dict, options, scratch: Path, restore: bool) -> dict:
    dtype = torch.bfloat16 if options.device == "cuda" else torch.float32
    model_dir = build_model(scratch / "model", shape, options.tokenizer, dtype)
    result = {"shape": label}
    for space in ("full", "lowrank"):
        settings = {"es_search_space": space} if space == "lowrank" else {}
        clock = StepClock()
        trainer = es_trainer(model_dir, options, scratch / space, **settings)
        trainer.add_callback(clock.callback)
        if space == "full":
            result["parameters"] = sum(p.numel() for p in trainer.model.parameters())
            result["generate_seconds"], result["generate_peak_bytes"] = plain_generate(trainer, options)
            result["batched_generate_seconds"], _ = plain_generate(trainer, options, options.population)
        trainer.train()
        result[f"{space}_step_seconds"], result[f"{space}_peak_bytes"] = clock.seconds, clock.peak
        if space == "full" and restore:
            result |= restore_checks(trainer, model_dir, options, scratch)
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    n = options.population
    result["members_per_minute"] = {
        "plain generate": 60 / result["generate_seconds"],
        "plain batched generate": 60 * n / result["batched_generate_seconds"],
        "full-rank ES": 60 * n / result["full_step_seconds"],
        "low-rank ES": 60 * n / result["lowrank_step_seconds"],
    }
    if result["generate_peak_bytes"]:
        result["peak_memory_ratio"] = result["full_peak_bytes"] / result["generate_peak_bytes"]
    return result


def restore_checks(trainer, model_dir: str, options, scratch: Path) -> dict:
    """θ bitwise after 100 members and after a step that fails mid-population."""
    weights = trainer.weights
    weights.capture()
    theta = fingerprint(trainer.model)
    for k in range(100):
        weights.member(1000 + k, 1e-2 * (-1) ** k)
    weights.center()
    after_members = fingerprint(trainer.model) == theta

    calls = []

    def failing(completions, **kwargs):
        calls.append(1)
        if len(calls) == options.population // 2:
            raise RuntimeError("injected failure")
        return length_reward(completions)

    broken = es_trainer(model_dir, options, scratch / "failing", reward=failing)
    before = fingerprint(broken.model)
    try:
        broken.train()
        failed = False
    except Exception as error:
        failed = "injected failure" in str(error)
    return {
        "restore_after_100_members": after_members,
        "restore_after_failed_step": failed and fingerprint(broken.model) == before,
    }


def markdown(results: dict) -> str:
    lines = [
        f"GPU check, {results['device']}, torch {results['torch']}, {results['dtype']}, N={results['population']}, "
        f"{results['prompts']} prompts × {results['tokens']} tokens, greedy",
        "",
        "| shape | parameters | plain generate members/min | plain batched | full-rank ES | low-rank ES | low/full | "
        "low-rank / plain batched | ES peak / generate peak | restore bitwise (100 members, failed step) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["shapes"]:
        rate = r["members_per_minute"]
        ratio = f"{r['peak_memory_ratio']:.2f}" if "peak_memory_ratio" in r else "—"
        restored = (
            f"{'yes' if r['restore_after_100_members'] else 'NO'}, {'yes' if r['restore_after_failed_step'] else 'NO'}"
        )
        lines.append(
            f"| {r['shape']} | {r['parameters'] / 1e6:.0f}M | {rate['plain generate']:.1f} "
            f"| {rate['plain batched generate']:.1f} | {rate['full-rank ES']:.1f} | {rate['low-rank ES']:.1f} "
            f"| {rate['low-rank ES'] / rate['full-rank ES']:.2f}× "
            f"| {rate['low-rank ES'] / rate['plain batched generate']:.0%} | {ratio} | {restored} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer directory (default: .gpu/tokenizer, or SmolLM2's)"
    )
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, N=4: checks the script, no numbers")
    options = parser.parse_args()
    options.device = "cpu" if options.smoke or not torch.cuda.is_available() else "cuda"
    if options.smoke:
        options.population, options.tokens = 4, 4
    if options.tokenizer is None:
        local = Path(".gpu/tokenizer")
        if local.is_dir():
            options.tokenizer = str(local)
        else:
            from trl_es.util.models import smollm2_tokenizer_dir

            options.tokenizer = smollm2_tokenizer_dir()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "device": torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or "CPU",
        "torch": torch.__version__,
        "dtype": "bf16" if options.device == "cuda" else "fp32",
        "population": options.population,
        "prompts": options.prompts,
        "tokens": options.tokens,
        "shapes": [],
    }
    for k, (label, shape) in enumerate((SMOKE_SHAPES if options.smoke else SHAPES).items()):
        start = time.perf_counter()
        scratch = Path(tempfile.mkdtemp(prefix=f"gpu-check-{k}-"))
        results["shapes"].append(check_shape(label, shape, options, scratch, restore=k == 0))
        print(f"{label}: {time.perf_counter() - start:.0f} s", json.dumps(results["shapes"][-1]), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
