"""Seed chains: their size next to the other ways of shipping a fine-tune, and replay time next to training time.

    python benchmarks/chains.py [--steps 4] [--population 8]

Trains the demo's earlier settings (SmolLM2-135M-Instruct, small sums, N=8, σ=3e-3, α=2e-3, greedy, 12 tokens,
8 prompts per step) for `--steps` steps on CPU, then replays the chain from the base model and checks the weights are bitwise the
trained ones. Prints, measured in this run: bytes per step of the chain at N=8 and N=30 (the N=30 records come from
a short run of the same code on a tiny model: a full-ES record does not depend on the model's size), training and
replay seconds and their ratio, and the chain's size beside the full weights, the sparse delta of the same run
(τ = 1e-3) and a rank-8 LoRA adapter on q/v (the size of its file).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def chain_bytes_per_step(folder: str) -> float:
    with open(os.path.join(folder, "es_chain.json"), encoding="utf-8") as file:
        data = json.load(file)
    steps = json.dumps(data["steps"], separators=(",", ":"))
    return len(steps.encode()) / len(data["steps"])


def tiny_chain_step_bytes(population: int, folder: str) -> float:
    """Bytes per step of a chain with `population` members (2 steps of a tiny random Llama)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_es import ESConfig, ESTrainer
    from trl_es.util.models import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = ESConfig(output_dir=os.path.join(folder, "out"), population_size=population, sigma=0.05,
                    learning_rate=0.05, per_device_train_batch_size=4, max_completion_length=4, max_steps=2,
                    save_strategy="no", report_to="none", disable_tqdm=True)  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(8)]})
    trainer = ESTrainer(folder, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                        train_dataset=prompts)  # fmt: skip
    trainer.train()
    trainer.save_model(os.path.join(folder, "saved"))
    return chain_bytes_per_step(os.path.join(folder, "saved"))


def lora_adapter_bytes(base: str, folder: str) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    )
    model.save_pretrained(folder)
    return os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--population", type=int, default=8)
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trl_es import ESConfig, ESTrainer, load_chain
    from trl_es.chains import load_base, replay
    from trl_es.tasks import first_integer_reward, small_sums
    from trl_es.util.deltas import write_model_delta
    from trl_es.util.models import smollm2_dir

    base, work = smollm2_dir(), tempfile.mkdtemp(prefix="chains-bench-")
    args = ESConfig(output_dir=os.path.join(work, "run"), population_size=options.population, sigma=3e-3,
                    learning_rate=2e-3, per_device_train_batch_size=8, max_steps=options.steps,
                    max_completion_length=12, generation_kwargs={"do_sample": False}, seed=0, save_strategy="no",
                    report_to="none", disable_tqdm=True)  # fmt: skip
    trainer = ESTrainer(base, first_integer_reward, args=args, train_dataset=small_sums("train"))
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    saved = os.path.join(work, "saved")
    trainer.save_model(saved)
    start = time.perf_counter()
    replay(load_chain(saved), base, os.path.join(work, "replayed"))
    replay_seconds = time.perf_counter() - start
    chain, model = load_chain(saved), load_base(base, load_chain(saved).header)
    start = time.perf_counter()
    chain.apply(model)
    apply_seconds = time.perf_counter() - start
    replayed = dict(AutoModelForCausalLM.from_pretrained(os.path.join(work, "replayed")).named_parameters())
    bitwise = all(torch.equal(p, replayed[n]) for n, p in trainer.model.named_parameters())
    delta = write_model_delta(trainer.model, saved, 1e-3)
    sizes = {
        "seed chain": os.path.getsize(os.path.join(saved, "es_chain.json")),
        "sparse delta (τ=1e-3)": os.path.getsize(os.path.join(saved, "sparse_delta.safetensors")),
        "LoRA adapter r=8 (q, v)": lora_adapter_bytes(base, os.path.join(work, "lora")),
        "full weights (fp32)": os.path.getsize(os.path.join(saved, "model.safetensors")),
    }
    print(f"SmolLM2-135M-Instruct, {options.steps} ES steps, N={options.population}, CPU")
    print(f"chain bytes per step: N={options.population} {chain_bytes_per_step(saved):.0f}; "
          f"N=30 {tiny_chain_step_bytes(30, os.path.join(work, 'tiny')):.0f}")  # fmt: skip
    print(f"training {train_seconds:.1f} s; replaying the updates {apply_seconds:.1f} s "
          f"({train_seconds / apply_seconds:.0f}x faster), with loading the base and saving {replay_seconds:.1f} s "
          f"({train_seconds / replay_seconds:.0f}x); replay bitwise equal: {bitwise}")  # fmt: skip
    print(f"sparse delta kept {delta['entries kept'] if delta else '-'}")
    print("| artifact | bytes | vs chain |\n|---|---:|---:|")
    for name, size in sizes.items():
        print(f"| {name} | {size:,} | {size / sizes['seed chain']:,.0f}x |")


if __name__ == "__main__":
    main()
