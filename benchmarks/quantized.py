"""ES on a quantized SmolLM2-135M (bitsandbytes, CPU): peak memory of one step against ES on the fp32 base and against
TRL's GRPOTrainer QLoRA step on the same quantized base; and a few steps of the demo task on it.

    python benchmarks/quantized.py [--bits 8,4] [--population 4] [--prompts 4] [--generations 2] [--tokens 8]
    python benchmarks/quantized.py --learn [--bits 4] [--steps 4]
    python benchmarks/quantized.py --learn --qes [--steps 4]
    python benchmarks/quantized.py --qes [--population 4] [--prompts 4] [--generations 2] [--tokens 8]

Bases: the fp32 SmolLM2 (`smollm2`), and 8-bit (LLM.int8, float32 elsewhere) and 4-bit NF4 (bfloat16 compute and
elsewhere) versions of it, each quantized once and saved into the trl-es cache (loading a saved quantized model
costs less memory than quantizing at load, which peaks above the fp32 model). On a quantized base ES trains a LoRA
adapter (`LORA`: r=8 on every linear layer; the quantized weights never change), as GRPOTrainer's QLoRA does.

Memory: each measurement runs in its own fresh process, the step's peak RSS sampled every 5 ms while `train` runs
(model loading excluded; GRPOTrainer's two steps, the first of which builds AdamW's state). Prints one table and the
ratios, measured in this one run.

QES (`--qes`, and two rows of the 8-bit table): ES on the int8 weights of the 8-bit base itself (es_search_space='qes',
no adapter, no copy of θ) beside inference alone on the same base (one `generate` of the step's prompts ×
completions), and the ratio of their peaks.

Learning (`--learn`): the demo's task (small sums, `first_integer_reward`, 12 new tokens, 8 greedy prompts per
step, N=8), held-out greedy accuracy on the 64 test problems before and after `--steps` steps: ES on the LoRA
adapter of each quantized base beside the demo's full ES on the fp32 base, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(__file__))
from step_memory_time import PeakRSS, prompts, reward  # noqa: E402


LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
ES_LORA = {"sigma": 1e-2, "learning_rate": 1e-2}
"""σ and α for the adapter: a LoRA update moves the output less than the same step in the full weights."""
QES = {"es_search_space": "qes", "sigma": 1.5, "learning_rate": 0.5, "noise_table_size": 1 << 22}
"""QES on the int8 weights: σ in quantization steps (examples/search_spaces/qes.yaml)."""


def quantized_dir(bits: int) -> str:
    """SmolLM2-135M quantized to `bits` by bitsandbytes and saved (once) in the trl-es cache; "0": the fp32 one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.util.models import cache_root, cached_dir, smollm2_dir

    if not bits:
        return smollm2_dir()

    def save(folder):
        config, dtype = quantization(bits)
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), quantization_config=config, dtype=dtype)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(folder)

    return cached_dir(cache_root() / f"SmolLM2-135M-Instruct-bnb-{bits}bit", "model.safetensors", save)


def quantization(bits: int):
    """(BitsAndBytesConfig, dtype of the unquantized weights) for `bits`."""
    import torch
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True), torch.float32
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return nf4, torch.bfloat16


def weights_mb(model) -> float:
    """The bytes of the model's parameters (quantized ones as stored), in MB."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def es_trainer(options):
    """The ESTrainer of a `run_es` measurement (LoRA on a quantized base, full ES, or QES with `--qes`)."""
    from peft import LoraConfig

    from trl_es import ESConfig, ESTrainer

    _, dtype = quantization(options.bits) if options.bits else (None, None)
    lora = (options.lora or options.bits) and not options.qes
    args = ESConfig(
        **(QES if options.qes else ES_LORA if lora else {"sigma": 1e-3}),
        output_dir="/tmp/bench-quantized-es",
        population_size=options.population,
        per_device_train_batch_size=options.prompts,
        num_generations=options.generations,
        max_completion_length=options.tokens,
        max_steps=1,
        generation_kwargs={"min_new_tokens": options.tokens},
        model_init_kwargs={"dtype": dtype} if dtype else None,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        common_generation_seed=False,  # members sample differently, so rewards spread
    )
    return ESTrainer(
        quantized_dir(options.bits),
        reward,
        args=args,
        train_dataset=prompts(options.prompts),
        peft_config=LoraConfig(**LORA) if lora else None,
    )


def run_es(options):
    trainer = es_trainer(options)
    with PeakRSS() as rss:
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    trained = sum(p.numel() for p in trainer.es_params.values())
    return {
        "seconds": seconds,
        "peak": rss.peak,
        "base": rss.base,
        "weights": weights_mb(trainer.model),
        "trained": trained,
    }


def run_infer(options):
    """Inference alone on the quantized base, in the same process set-up as `run_es` (the QES trainer built, its
    model loaded): one generate call of the step's prompts × completions with the unperturbed weights."""
    from trl_es.es.seeds import completion_seeds

    trainer = es_trainer(options)
    generation, rows = trainer.generation, list(prompts(options.prompts)["prompt"])
    prompt_ids = generation.tokenize(rows)
    with PeakRSS() as rss:
        start = time.perf_counter()
        seeds = completion_seeds(0, len(rows), options.generations)
        generation.generate(rows, prompt_ids, options.generations, seeds)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak": rss.peak, "base": rss.base, "weights": weights_mb(trainer.model), "trained": 0}


def run_grpo(options):
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.start)

    _, dtype = quantization(options.bits)
    args = GRPOConfig(
        output_dir="/tmp/bench-quantized-grpo",
        per_device_train_batch_size=options.prompts * options.generations,
        num_generations=options.generations,
        max_completion_length=options.tokens,
        max_steps=2,
        bf16=False,
        model_init_kwargs={"dtype": dtype},
        generation_kwargs={"min_new_tokens": options.tokens},
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        quantized_dir(options.bits),
        reward,
        args=args,
        train_dataset=prompts(options.prompts),
        peft_config=LoraConfig(**LORA),
        callbacks=[StepTimer()],
    )
    with PeakRSS() as rss:
        trainer.train()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"seconds": step_times[-1], "peak": rss.peak, "base": rss.base, "weights": weights_mb(trainer.model),
            "trained": trained}  # fmt: skip


def run_learn(options):
    from peft import LoraConfig

    from trl_es import ESConfig, ESTrainer
    from trl_es.commands.demo import held_out_accuracy
    from trl_es.tasks import first_integer_reward, small_sums

    _, dtype = quantization(options.bits) if options.bits else (None, None)
    lora = options.bits and not options.qes
    fp32 = {"sigma": 5e-3, "learning_rate": 5e-3}  # the demo's σ and α
    settings = QES if options.qes else ES_LORA if lora else fp32
    args = ESConfig(
        **settings,
        output_dir="/tmp/bench-quantized-learn",
        population_size=8,
        per_device_train_batch_size=8,
        max_steps=options.steps,
        max_completion_length=12,
        generation_kwargs={"do_sample": False},
        model_init_kwargs={"dtype": dtype} if dtype else None,
        seed=4,  # the recipe's: its first step already ranks members
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = ESTrainer(
        quantized_dir(options.bits),
        first_integer_reward,
        args=args,
        train_dataset=small_sums("train"),
        peft_config=LoraConfig(**LORA) if lora else None,
    )
    held_out = small_sums("test")
    before = held_out_accuracy(trainer, held_out)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {"before": before, "after": held_out_accuracy(trainer, held_out), "rewards": rewards, "seconds": seconds}


def measure(options, which: str, bits: int, lora: bool = False, qes: bool = False) -> dict:
    """`run_<which>` in a fresh process."""
    command = [sys.executable, __file__, "--only", which, f"--bits={bits}", *(["--lora"] if lora else [])]
    command += ["--qes"] if qes else []
    command += [f"--{k}={getattr(options, k)}" for k in ("population", "prompts", "generations", "tokens", "steps")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_VERBOSITY": "error"}
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"{which} ({bits} bits) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


QES_RUNS = {"QES step, int8 weights": ("es", 8, False, True), "inference (generate), 8-bit": ("infer", 8, False, True)}
"""The rows of the QES figure: QES on the 8-bit base, and inference alone on it."""


def memory_table(options, bits: list[int]) -> None:
    for b in bits:
        quantized_dir(b)  # prepared outside the measurements
    runs = {} if options.qes else {"ES step, full, fp32": ("es", 0, False), "ES step, LoRA, fp32": ("es", 0, True)}
    for b in [] if options.qes else bits:
        runs |= {f"ES step, LoRA, {b}-bit": ("es", b, True), f"GRPOTrainer QLoRA step, {b}-bit": ("grpo", b, True)}
    runs |= QES_RUNS if 8 in bits else {}
    results = {name: measure(options, *run) for name, run in runs.items()}
    mb = 2**20
    print(
        f"SmolLM2-135M on CPU ({os.cpu_count()} cores), bitsandbytes: {options.prompts} prompts x "
        f"{options.generations} completions x {options.tokens} new tokens; ES population {options.population}; "
        f"LoRA r={LORA['r']} on all linear layers\n"
    )
    print(f"{'':34s}{'weights MB':>11s}{'trained':>12s}{'s/step':>9s}{'peak RSS MB':>13s}{'above base MB':>15s}")
    for name, r in results.items():
        print(f"{name:34s}{r['weights']:11.0f}{r['trained']:12,d}{r['seconds']:9.1f}{r['peak'] / mb:13.0f}"
              f"{(r['peak'] - r['base']) / mb:15.0f}")  # fmt: skip
    print()
    if 8 in bits:
        qes, infer = (results[name]["peak"] for name in QES_RUNS)
        print(f"QES: peak / inference peak on the 8-bit base {qes / infer:.2f}")
    if options.qes:
        return
    full, lora = results["ES step, full, fp32"]["peak"], results["ES step, LoRA, fp32"]["peak"]
    for b in bits:
        es, grpo = results[f"ES step, LoRA, {b}-bit"]["peak"], results[f"GRPOTrainer QLoRA step, {b}-bit"]["peak"]
        print(f"{b}-bit: ES peak / full-ES fp32 peak {es / full:.2f}, / LoRA-ES fp32 peak {es / lora:.2f}, "
              f"/ GRPOTrainer QLoRA peak {es / grpo:.2f}")  # fmt: skip


def learning(options, bits: list[int]) -> None:
    for b in bits:
        quantized_dir(b)
    if options.qes:  # QES beside LoRA ES on the same 8-bit base
        runs = {"LoRA ES, 8-bit base": ("learn", 8), "QES, 8-bit integers": ("learn", 8, False, True)}
    else:
        runs = {"full ES, fp32 (the demo)": ("learn", 0)} | {f"LoRA ES, {b}-bit base": ("learn", b) for b in bits}
    results = {name: measure(options, *run) for name, run in runs.items()}
    print(f"Small sums, {options.steps} ES steps (N=8, 8 greedy prompts per step, 12 new tokens), held-out greedy "
          "accuracy on 64 problems\n")  # fmt: skip
    print(f"{'':28s}{'before':>8s}{'after':>8s}{'s/step':>9s}  mean member reward per step")
    for name, r in results.items():
        per_step = " ".join(f"{x:.3f}" for x in r["rewards"])
        print(f"{name:28s}{r['before']:8.3f}{r['after']:8.3f}{r['seconds'] / options.steps:9.1f}  {per_step}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", default="8,4", help="the quantized bases, of 8 and 4")
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--learn", action="store_true", help="the demo task's learning instead of memory")
    parser.add_argument("--steps", type=int, default=4, help="with --learn: ES steps")
    parser.add_argument("--qes", action="store_true", help="only the QES figure: QES and inference on the 8-bit base")
    parser.add_argument("--only", choices=["es", "grpo", "learn", "infer"], help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.only:
        options.bits = int(options.bits)
        print(json.dumps(globals()[f"run_{options.only}"](options)))
        return
    bits = [8] if options.qes else [int(b) for b in options.bits.split(",")]
    (learning if options.learn else memory_table)(options, bits)


if __name__ == "__main__":
    main()
