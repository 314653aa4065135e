"""The bitwise regression guard's scenarios: the final weights of short ES runs, hashed, for every search space
(greedy, and sampled where which members share a generate call must not matter).

Each scenario (`run`) trains a tiny Llama (heads of 32 dimensions, so vLLM's CPU attention takes it too; made by
`prepare`) and returns the SHA-256 of its final weights. The harness `multiprocess_es.py` runs them with one or two
processes, with transformers or a colocated vLLM engine; tests/distributed/test_regression_guard.py compares the
hashes with each other and with those recorded in tests/data/regression_hashes.json: a refactoring that changes any
bit of any result fails there.
"""

import hashlib
import os
import sys
from pathlib import Path


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `helpers`

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import NormsOnlySpace, build_tiny_model, dice_trainer, es_config  # noqa: E402  (registers the space)


MODEL = dict(hidden_size=64, intermediate_size=128, initializer_range=0.3, max_position_embeddings=128)
PROMPTS = [f"Count to {n}:" for n in range(1, 9)]
FITNESS_VARIANTS = {
    "sampled": True,
    "population_size": 6,
    "scale_rewards": "group",
    "fitness_pass_k": 2,
    "success_threshold": 4.0,
    "fitness_top_k": 3,
    "noise_reuse": 2,
}
"""Every fitness variant at once: each prompt's Pass@2 of a member's 2 sampled completions, z-scored per prompt,
the best 3 of 6 members moving θ, step 1 reusing step 0's noise directions (so a resume at step 1 must too)."""
SCENARIOS = {
    "full": {},
    "full_variants": {
        "antithetic": True,
        "es_baseline": "center",
        "fitness_shaping": "centered_rank",
        "weight_decay": 0.1,
        "es_parameter_patterns": [r"layers\.0\.", "norm"],
    },
    "copes": {"es_search_space": "copes", "copes_groups": 2},
    "lowrank": {"es_search_space": "lowrank", "lowrank_rank": 2, "population_size": 6},
    "merge": {"es_search_space": "merge", "population_size": 5},
    "resume": {"resumed": True},
    "fitness_variants": FITNESS_VARIANTS,
    "fitness_variants_resume": {**FITNESS_VARIANTS, "resumed": True},
    "full_adamw": {"es_optimizer": True, "optim": "adamw_torch", "learning_rate": 3e-3, "weight_decay": 0.01},
    "full_sampled": {"sampled": True},
    "lowrank_sampled": {"es_search_space": "lowrank", "population_size": 6, "sampled": True},
    "lowrank_sampled_per_call_2": {
        "es_search_space": "lowrank",
        "population_size": 6,
        "sampled": True,
        "lowrank_members_per_call": 2,
    },
    "adapter": {"adapter": True},  # a LoRA adapter ESTrainer adds (peft_config); through vLLM: its LoRA slots
    "registered_space": {"es_search_space": NormsOnlySpace.name},  # a space defined outside trl-es
    "agents": {},  # tests/training/test_agents.py's dice game: tool calls, an environment per episode, its reward
}
SAME = [
    ("full", "resume"),
    ("fitness_variants", "fitness_variants_resume"),
    ("lowrank_sampled", "lowrank_sampled_per_call_2"),
]
"""Scenarios that must end with the same weights in any environment: a resumed run and an uninterrupted one; a
sampled population whatever the number of members per generate call."""
VLLM_SCENARIOS = ("full", "copes")
"""Through a colocated engine per process (2 processes dealing the members: tests/distributed/test_regression_guard.py);
low-rank and adapter members go through a tensor-parallel engine there (its `TP_SCENARIOS`)."""


def reward(completions, **kwargs):
    """Length plus a bonus for a digit 1: enough spread between members of a random tiny model."""
    return [len(c) / 10 + ("1" in c) for c in completions]


def weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def lora_config():
    """The adapter scenario's LoRA: both factors random (B is not zero), so members and updates move the outputs."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def prepare(models: Path, tokenizer_dir: str) -> None:
    """The tiny model (`models/model`) and, for Hyper-ES, two 'fine-tuned' versions of it: seeded drifts."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(models / "model", tokenizer_dir, **MODEL)
    for k in range(2):
        model = AutoModelForCausalLM.from_pretrained(models / "model")
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.05)
        model.save_pretrained(models / f"tuned-{k}")


def run(scenario: str, models: Path, out: Path, resume=None, **extra) -> str:
    """Train the scenario's 2 steps, greedy unless it is `sampled` (`resumed`: stop after step 1, resume from
    checkpoint-1; or from `resume`, as `train` takes it); the weights' hash. `extra` overrides ESConfig fields."""
    from trl_es import ESTrainer

    model_dir = str(models / "model")
    if scenario == "agents":
        trainer = dice_trainer(model_dir, out / scenario, use_cpu=True, **extra)
        trainer.train()
        return weights_sha256(trainer.model)
    overrides = {**SCENARIOS[scenario], **extra}
    if scenario == "merge":
        overrides["merge_models"] = [str(models / f"tuned-{k}") for k in range(2)]
    folder = out / scenario
    adapter = {"peft_config": lora_config()} if overrides.pop("adapter", False) else {}
    greedy = {} if overrides.pop("sampled", False) else {"generation_kwargs": {"do_sample": False}}
    resumed = overrides.pop("resumed", False)
    settings = dict(**greedy, per_device_train_batch_size=8, use_cpu=True, **overrides)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    if resumed:
        first = ESTrainer(
            model_dir,
            reward,
            args=es_config(folder, save_strategy="steps", save_steps=1, max_steps=1, **settings),
            train_dataset=dataset,
        )
        first.train()
        resume = str(folder / "out" / "checkpoint-1")
    trainer = ESTrainer(model_dir, reward, args=es_config(folder, **settings), train_dataset=dataset, **adapter)
    trainer.train(resume_from_checkpoint=resume)
    return weights_sha256(trainer.model)
