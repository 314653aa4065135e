"""Every engine's ES step side by side with the reference ES loop of "Evolution Strategies at Scale" (Qiu et al.
2025), SmolLM2-135M-Instruct on CPU: members per minute, the time split, peak memory, and whether restoring θ after
a member is bitwise.

    python benchmarks/engines.py [--population 8] [--large-population 30] [--prompts 8] [--tokens 32] [--no-vllm]

The peer is a port of the paper's HF loop (`countdown/es_fine-tuning_countdown_iid.py`, one model, no CUDA calls):
each member draws `torch.randn` noise per parameter from a generator seeded (seed + parameter index), adds σ·noise,
generates, subtracts the regenerated noise again; the update regenerates every member's noise once more and adds
α/N·Σ zᵢ·noiseᵢ (z: the z-scored rewards). trl-es runs ESTrainer: transformers `generate`, vLLM colocated (eager,
and compiled with torch.compile: `vllm_enforce_eager=False`; "members reloaded" is the eager row with the members
copied into vLLM by a whole-model reload, as before they were written in place), and the low-rank batched population
(EGGROLL), on transformers (forward hooks) and in vLLM (one LoRA adapter per member, all in one generate call);
ES on a rank-16 LoRA adapter over every linear layer, with transformers and with vLLM (the adapter's members in vLLM's
LoRA slots, the whole population in one call); full- and low-rank again at `--large-population`. "plain … generate" rows are the engine limit: one generate call of
the same rows at θ with no ES at all; each trl-es row is also given as a share of it (EGGROLL reports 91% for its
batched population), and for the LoRA rows the share of the step the adapters add.

The same workload for all: the first `--prompts` Countdown problems, greedy, every completion exactly `--tokens`
tokens (`min_new_tokens`), fp32. Each row runs 2 steps in a fresh process and times the last one; "restore bitwise"
perturbs and restores one member after training and compares every weight with θ. Ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peer(spec: dict) -> dict:
    """The reference loop (module docstring), 2 iterations; the last one timed part by part."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.tasks import countdown, countdown_reward
    from trl_es.util.models import smollm2_dir

    n, sigma, alpha, tokens = spec["population"], spec["sigma"], 5e-4, spec["tokens"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    rows = countdown("train").select(range(spec["prompts"])).to_list()
    numbers, target = [row["numbers"] for row in rows], [row["target"] for row in rows]
    inputs = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True, padding_side="left")
    params = list(model.parameters())

    def noise(seed: int, index: int, param: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(seed + index))
        return torch.randn(param.shape, generator=generator, dtype=param.dtype)

    def add_noise(seed: int, scale: float) -> None:
        for index, param in enumerate(params):
            param.data.add_(scale * noise(seed, index, param))

    def reward() -> float:
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(countdown_reward(texts, numbers, target)) / len(texts)

    np.random.seed(33)
    for _ in range(2):
        split = dict.fromkeys(("generate", "perturb + restore", "update"), 0.0)
        start = time.perf_counter()
        seeds = np.random.randint(0, 2**30, size=n, dtype=np.int64).tolist()
        rewards = []
        for seed in seeds:
            timer = time.perf_counter()
            add_noise(seed, sigma)
            split["perturb + restore"] += time.perf_counter() - timer
            timer = time.perf_counter()
            rewards.append(reward())
            split["generate"] += time.perf_counter() - timer
            timer = time.perf_counter()
            add_noise(seed, -sigma)
            split["perturb + restore"] += time.perf_counter() - timer
        timer = time.perf_counter()
        rewards = np.array(rewards, dtype=np.float32)
        z = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        for index, param in enumerate(params):
            update = torch.zeros_like(param)
            for seed, z_i in zip(seeds, z, strict=True):
                update.add_(noise(seed, index, param).mul_(float(z_i)))
            param.data.add_(alpha * update / n)
        split["update"] = time.perf_counter() - timer
        step_seconds = time.perf_counter() - start
    theta = [p.detach().clone() for p in params]
    add_noise(seeds[0], sigma)
    add_noise(seeds[0], -sigma)
    bitwise = all(torch.equal(p, t) for p, t in zip(params, theta, strict=True))
    return {"step_seconds": step_seconds, "split": split, "restore_bitwise": bitwise}


def trl_es(spec: dict, out_dir: str) -> dict:
    """ESTrainer with `spec["settings"]`, 2 steps; the last one timed, its split read from the step's log."""
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import countdown, countdown_reward
    from trl_es.util.models import smollm2_dir

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start

    if spec.get("reload_members"):  # vLLM as before in-place members: each one copied in by a whole-model reload
        from trl_es.generation.vllm_worker import ESWorkerExtension

        ESWorkerExtension._es_find_views = lambda self, model, working: None
    n, tokens = spec["population"], spec["tokens"]
    args = ESConfig(
        output_dir=out_dir,
        per_device_train_batch_size=spec["prompts"],
        population_size=n,
        sigma=spec["sigma"],
        max_steps=2,
        max_completion_length=tokens,
        generation_kwargs={"do_sample": False, "min_new_tokens": tokens},
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **spec["settings"],
    )
    clock = StepClock()
    adapter = {}
    if spec.get("lora_rank"):  # ES on a new LoRA adapter over every linear layer (TRL's PEFT recipes' "all-linear")
        from peft import LoraConfig

        adapter["peft_config"] = LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"],
                                            target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    trainer = ESTrainer(
        smollm2_dir(), countdown_reward, args=args, train_dataset=countdown("train"), callbacks=[clock], **adapter
    )
    trainer.train()
    log = [record for record in trainer.state.log_history if "reward" in record][-1]
    split = {
        "generate": log["es/time/generate"],
        "perturb + restore": log["es/time/noise"],
        "update": log["es/time/update"],
    }
    weights, space = trainer.weights, trainer.space
    weights.capture()
    before = weights.fingerprint()
    member = space.ask(3)[0]
    with space.evaluating([member]):
        pass
    weights.center()
    return {"step_seconds": clock.seconds, "split": split, "restore_bitwise": weights.fingerprint() == before}


def plain(spec: dict) -> dict:
    """The engine limit: one generate call of the step's rows (every prompt once per member) at θ, no ES at all,
    through vLLM (`use_vllm` in the settings; prefix caching off, since members' rows share no prefix) or
    transformers. The second of 2 calls is timed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.generation import TransformersGeneration, decoding_config
    from trl_es.tasks import countdown
    from trl_es.util.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    eos, tokens = [tokenizer.eos_token_id], spec["tokens"]
    config = decoding_config(tokenizer, eos, tokens, do_sample=False, min_new_tokens=tokens)
    generation = TransformersGeneration(model, tokenizer, config, eos)
    prompts = [row["prompt"] for row in countdown("train").select(range(spec["prompts"]))]
    rows = generation.tokenize(prompts) * spec["population"]
    if spec["settings"].get("use_vllm"):
        from vllm import LLM, SamplingParams

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as the trainer's colocated engine
        llm = LLM(model=smollm2_dir(), dtype="float32", enforce_eager=True, max_model_len=512,
                  max_num_batched_tokens=4096, enable_prefix_caching=False)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
        call = lambda: llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)  # noqa: E731
    else:
        call = lambda: generation.generate_ids(rows, [0] * len(rows))  # noqa: E731
    call()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    split = {"generate": seconds, "perturb + restore": 0.0, "update": 0.0}
    return {"step_seconds": seconds, "split": split, "restore_bitwise": None}


def worker(spec: dict, out_dir: str) -> None:
    engines = {"peer": peer, "plain": plain}
    result = engines[spec["engine"]](spec) if spec["engine"] in engines else trl_es(spec, out_dir)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out_dir, "result.json").write_text(json.dumps(result))


def run(spec: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", out_dir, "--spec", json.dumps(spec)]
    process = subprocess.run(command, capture_output=True, text=True)
    if process.returncode:
        sys.exit(f"{spec['label']} failed:\n{process.stderr[-3000:]}")
    return json.loads(Path(out_dir, "result.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--large-population", type=int, default=30, help="full- and low-rank again at this N")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--only", help="run only the rows whose label matches this regex (and the peer's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return worker(json.loads(options.spec), options.worker)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache for vLLM on CPU
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")

    small, large = options.population, options.large_population
    vllm, lowrank = {"use_vllm": True, "vllm_max_model_length": 512}, {"es_search_space": "lowrank"}
    adapter = {"lora_rank": 16}  # ES on a rank-16 LoRA adapter (a spec key, not an ESConfig field)
    rows = [
        ("peer: Qiu et al. loop", "peer", small, {}),
        ("trl-es transformers", "trl-es", small, {}),
        ("trl-es vLLM (eager)", "trl-es", small, vllm),
        ("  same, members reloaded", "trl-es", small, vllm, True),
        ("trl-es vLLM (compiled)", "trl-es", small, {**vllm, "vllm_enforce_eager": False}),
        ("trl-es low-rank", "trl-es", small, lowrank),
        ("trl-es vLLM low-rank (LoRA)", "trl-es", small, {**vllm, **lowrank}),
        ("trl-es LoRA adapter", "trl-es", small, adapter),
        ("trl-es vLLM LoRA adapter (slots)", "trl-es", small, {**vllm, **adapter}),
        ("plain transformers generate", "plain", small, {}),
        ("plain vLLM generate", "plain", small, vllm),
        ("trl-es transformers", "trl-es", large, {}),
        ("trl-es vLLM (eager)", "trl-es", large, vllm),
        ("trl-es low-rank", "trl-es", large, lowrank),
        ("  same, 8 members per call", "trl-es", large, {**lowrank, "lowrank_members_per_call": 8}),
        ("trl-es vLLM low-rank (LoRA)", "trl-es", large, {**vllm, **lowrank}),
        ("trl-es LoRA adapter", "trl-es", large, adapter),
        ("trl-es vLLM LoRA adapter (slots)", "trl-es", large, {**vllm, **adapter}),
        ("plain transformers generate", "plain", large, {}),
        ("plain vLLM generate", "plain", large, vllm),
    ]
    if options.no_vllm:
        rows = [row for row in rows if "use_vllm" not in row[3]]
    if options.only:
        rows = [row for row in rows if row[1] == "peer" or re.search(options.only, row[0])]
    common = {"prompts": options.prompts, "tokens": options.tokens, "sigma": 1e-3}
    scratch = tempfile.mkdtemp()
    print(
        f"ES step on SmolLM2-135M fp32, CPU ({os.cpu_count()} cores): {options.prompts} Countdown prompts × "
        f"{options.tokens} tokens, greedy, last of 2 steps; seconds per step split into generate / perturb + restore "
        "/ update"
    )
    header = f"{'':28} {'N':>3} {'s/step':>7} {'members/min':>12} {'vs peer':>8} {'generate':>9} {'perturb':>8}"
    print(f"{header} {'update':>7} {'peak RSS MB':>12} {'restore bitwise':>16}")
    peer_rate, results = None, {}
    for k, (label, engine, n, settings, *reload) in enumerate(rows):
        settings = dict(settings)
        spec = {"label": label, "engine": engine, "population": n, "lora_rank": settings.pop("lora_rank", None),
                "settings": settings, **common}  # fmt: skip
        spec["reload_members"] = bool(reload)
        result = results[label.strip(), n] = run(spec, os.path.join(scratch, f"row-{k}"))
        rate = result["rate"] = 60 * n / result["step_seconds"]
        peer_rate = peer_rate or rate
        split, restored = result["split"], {True: "yes", False: "no", None: "-"}[result["restore_bitwise"]]
        print(
            f"{label:28} {n:3} {result['step_seconds']:7.1f} {rate:12.1f} {rate / peer_rate:7.2f}× "
            f"{split['generate']:9.1f} {split['perturb + restore']:8.2f} {split['update']:7.2f} "
            f"{result['peak_rss'] / 2**20:12.0f} {restored:>16}",
            flush=True,
        )
    print("\nEngine limit: members per minute ÷ those of one plain generate call of the same rows at θ")
    for (label, n), result in results.items():
        backend = "vLLM" if "vLLM" in label else "transformers"
        limit = results.get((f"plain {backend} generate", n))
        if label.startswith("trl-es") and limit:
            share = ""
            if "LoRA" in label:  # what the adapters add to a generate call
                extra = result["split"]["generate"] - limit["step_seconds"]
                share = f"; the LoRA kernels' share of the step ≈ {max(extra, 0) / result['step_seconds']:.0%}"
            print(f"  {label:28} N={n:<3} {result['rate'] / limit['rate']:5.0%} of plain {backend}{share}")


if __name__ == "__main__":
    main()
