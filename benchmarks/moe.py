"""A mixture of experts under ES, on a tiny random Qwen3-MoE (2 layers, 4 fused experts, top-2, hidden 64;
SmolLM2's vocabulary), on CPU:

(a) the routers under perturbation: the share of (token, layer) pairs whose top-k expert set changes when θ becomes
    a member θ + σ·ε, at σ = 1e-3, 3e-3, 1e-2, for ε full-rank over every parameter, full-rank over the routers only,
    and the low-rank space's rank-1 members (every Linear, expert and router); with the median gap between the k-th
    and (k+1)-th router logits, which sets how easily a top-k set flips;
(b) the memory of one ES step (full, low-rank) against one GRPOTrainer step (AdamW) on the same model, each in its
    own process (peak RSS above the loaded model), with the state arithmetic behind it.

    OMP_NUM_THREADS=1 python benchmarks/moe.py [--members 8] [--population 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(__file__))

SIGMAS = (1e-3, 3e-3, 1e-2)


def tiny_moe(path: str) -> str:
    """The tiny Qwen3-MoE of the tests (random weights, seed 0), saved with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_es.util.models import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(n: int):
    from trl_es.tasks import small_sums

    return small_sums("train", conversational=False).select(range(n))


def routing(model_dir: str, members: int) -> dict:
    """(a): each perturbation's share of changed top-k sets per σ, and the median k-th/(k+1)-th logit gap."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.es.lowrank import LowRankPopulation, lowrank_targets

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = list(prompts(32)["prompt"])
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    real = batch["attention_mask"].bool().flatten()  # the tokens that are no padding
    routers = [layer.mlp.gate for layer in model.model.layers]
    top_k = routers[0].top_k
    captured = []
    hooks = [r.register_forward_hook(lambda m, args, out: captured.append((out[0], out[2]))) for r in routers]

    def top_k_sets() -> torch.Tensor:
        """(layers, tokens, experts) one-hot of each real token's top-k experts, and the logits of the last pass."""
        captured.clear()
        with torch.no_grad():
            model(**batch)
        chosen = torch.stack([torch.zeros_like(logits).scatter_(1, index, 1.0) for logits, index in captured])
        return chosen[:, real]

    centre = top_k_sets()
    logits = torch.cat([logits[real] for logits, _ in captured]).sort(dim=-1, descending=True).values
    gap = (logits[:, top_k - 1] - logits[:, top_k]).median().item()
    params = dict(model.named_parameters())
    router_names = [n for n in params if n.endswith("mlp.gate.weight")]

    def gaussian(names: list[str], sigma: float, seed: int) -> torch.Tensor:
        """θ + σ·ε over `names` (ε i.i.d. N(0, 1)), then θ back."""
        saved = {n: params[n].detach().clone() for n in names}
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n in names:
                params[n].add_(torch.randn(params[n].shape, generator=generator), alpha=sigma)
        chosen = top_k_sets()
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n])
        return chosen

    def lowrank(sigma: float, seed: int) -> torch.Tensor:
        with LowRankPopulation(lowrank_targets(model, params), [seed], [1], sigma, 1) as route:
            route(0)
            return top_k_sets()

    kinds = {
        "full-rank, every parameter": lambda sigma, seed: gaussian(list(params), sigma, seed),
        "full-rank, routers only": lambda sigma, seed: gaussian(router_names, sigma, seed),
        "low-rank r=1 (Linears, experts, routers)": lowrank,
    }
    shares = {
        kind: [
            sum(float((perturb(sigma, seed) != centre).any(-1).float().mean()) for seed in range(members)) / members
            for sigma in SIGMAS
        ]
        for kind, perturb in kinds.items()
    }
    for hook in hooks:
        hook.remove()
    return {"shares": shares, "gap": gap, "tokens": int(real.sum()), "layers": len(routers), "top_k": top_k}


def reward(completions, **kwargs):
    """Characters in the completion: any reward does for memory, as long as members differ."""
    return [float(len(c)) for c in completions]


def run_es(model_dir: str, space: str, population: int) -> dict:
    from step_memory_time import PeakRSS

    from trl_es import ESConfig, ESTrainer

    args = ESConfig(output_dir=tempfile.mkdtemp(), es_search_space=space, population_size=population,
                    per_device_train_batch_size=8, num_generations=2, max_completion_length=16, max_steps=1,
                    sigma=1e-3, save_strategy="no", report_to="none", disable_tqdm=True,
                    common_generation_seed=False)  # fmt: skip
    trainer = ESTrainer(model_dir, reward, args=args, train_dataset=prompts(8))
    with PeakRSS() as rss:
        trainer.train()
    return {"peak": rss.peak, "base": rss.base, "params": sum(p.numel() for p in trainer.es_params.values())}


def run_grpo(model_dir: str, space: str, population: int) -> dict:
    from step_memory_time import PeakRSS
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_generations=2,
                      max_completion_length=16, max_steps=1, bf16=False, save_strategy="no", report_to="none",
                      disable_tqdm=True)  # fmt: skip
    trainer = GRPOTrainer(model_dir, reward, args=args, train_dataset=prompts(8))
    with PeakRSS() as rss:
        trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"peak": rss.peak, "base": rss.base, "params": trainable}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=8, help="(a): members averaged per σ and perturbation")
    parser.add_argument("--population", type=int, default=8, help="(b): the ES step's population")
    parser.add_argument("--only", choices=["es", "grpo"], help=argparse.SUPPRESS)
    parser.add_argument("--space", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.only:
        print(json.dumps(globals()[f"run_{options.only}"](options.model, options.space, options.population)))
        return
    model_dir = tiny_moe(os.path.join(tempfile.mkdtemp(), "tiny-moe"))

    start = time.perf_counter()
    result = routing(model_dir, options.members)
    print(f"(a) routers under perturbation: tiny Qwen3-MoE with RANDOM weights ({result['layers']} layers, 4 experts, "
          f"top-{result['top_k']}), {result['tokens']} prompt tokens, {options.members} members per cell. A trained "
          "MoE's router logit gaps differ, and with them these shares.")  # fmt: skip
    print(f"median gap between the k-th and (k+1)-th largest router logits (k = {result['top_k']}): "
          f"{result['gap']:.4f}\n")  # fmt: skip
    print("share of (token, layer) pairs whose top-k expert set changes")
    print(f"{'perturbation':44s}" + "".join(f"{f'σ = {s:g}':>12s}" for s in SIGMAS))
    for kind, shares in result["shares"].items():
        print(f"{kind:44s}" + "".join(f"{share:12.2%}" for share in shares))
    print(f"({time.perf_counter() - start:.0f} s)\n")

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_VERBOSITY": "error"}
    runs = {}
    for key, which, space in [("ES step, full", "es", "full"), ("ES step, low-rank", "es", "lowrank"),
                              ("GRPOTrainer step (AdamW)", "grpo", "-")]:  # fmt: skip
        command = [sys.executable, __file__, "--only", which, "--space", space, "--model", model_dir,
                   "--population", str(options.population)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"{key} failed:\n{run.stderr[-3000:]}")
        runs[key] = json.loads(run.stdout.strip().splitlines()[-1])
    mb = 2**20
    params = runs["GRPOTrainer step (AdamW)"]["params"]
    print(f"(b) one step on the tiny MoE ({params / 1e6:.2f} M parameters, fp32, {params * 4 / mb:.1f} MB; 8 prompts "
          f"× 2 completions × 16 tokens; ES population {options.population}), each in its own process")  # fmt: skip
    print(f"{'':28s}{'peak RSS MB':>14s}{'above base MB':>15s}")
    for key, r in runs.items():
        print(f"{key:28s}{r['peak'] / mb:14.0f}{(r['peak'] - r['base']) / mb:15.0f}")
    print(f"state: GRPO's gradients + AdamW's two moments = 3 × 4 B × {params / 1e6:.2f} M = "
          f"{12 * params / mb:.1f} MB; ES's exact copy of θ = 4 B × {params / 1e6:.2f} M = {4 * params / mb:.1f} MB "
          "and its noise table (2**24 floats, 64 MB) whatever the model's size; low-rank generates the whole "
          "population in one batch (here 8× the rows of a full-ES call), which its peak shows")  # fmt: skip


if __name__ == "__main__":
    main()
