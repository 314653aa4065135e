"""Shared fixtures: tiny real transformers models built offline, with SmolLM2's real tokenizer."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Task data: the first rows of the real benchmark files (tests/data/README.md), so no test needs the Hub.
os.environ["TRL_ES_DATA"] = os.path.join(os.path.dirname(__file__), "data")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir():
    from trl_es.models import smollm2_tokenizer_dir

    return smollm2_tokenizer_dir()


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_dir)


@pytest.fixture
def prompt_dataset():
    prompts = [f"Count to {n}:" for n in range(1, 9)]
    return Dataset.from_dict({"prompt": prompts, "target": [str(n) for n in range(1, 9)]})
