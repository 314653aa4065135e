"""What several test modules share: tiny real models built offline, a small ESConfig, `accelerate launch` with 2 CPU
processes, weight comparisons, the rewards the tiny models are trained on. Imported as `helpers` (tests/ is on the
path; launched scripts get it through PYTHONPATH)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch


def build_tiny_model(path, tokenizer_dir, dtype=torch.float32, seed=0, **config_overrides):
    """A 2-layer Llama with SmolLM2's vocabulary (≈0.8M parameters), saved with the tokenizer as a model dir.
    `config_overrides` replace LlamaConfig fields (vLLM's CPU attention needs heads of ≥32 dimensions)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlamaConfig(**{**values, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def es_config(tmp_path, **overrides):
    """A small, fast ESConfig for the tiny model; `overrides` replace any field."""
    from trl_es import ESConfig

    values = dict(
        output_dir=str(tmp_path / "out"),
        population_size=4,
        sigma=0.02,
        learning_rate=0.02,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        seed=3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return ESConfig(**{**values, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(num_processes: int, *command: str, backend=("--multi_gpu",), cwd=None, env=None):
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *backend,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), **(env or {})}
    return subprocess.run([*launch, *command], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(model, expected):
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def upper_vocab_share(completion_ids, **kwargs):
    """Share of completion tokens from the upper half of the vocabulary (the tiny model's greedy output: none)."""
    return [sum(t >= 24576 for t in ids) / max(len(ids), 1) for ids in completion_ids]


THROWAWAY_UIDS = range(200_000, 2_000_000)


def throwaway_processes() -> list[int]:
    """Live processes whose real uid is in the sandbox's throwaway range."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) in THROWAWAY_UIDS and not fields["State"].strip().startswith("Z"):
            pids.append(int(name))
    return pids
