"""Shared fixtures: tiny real transformers models built offline, with SmolLM2's real tokenizer."""

import gc
import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per pytest-xdist worker (and per process it launches): with `-n 2` on 2 cores, two workers of 2
    # OpenMP threads each spin on each other's cores and the suite runs ~3× slower than serially.
    os.environ["OMP_NUM_THREADS"] = "1"
# Task data: the first rows of the real benchmark files (tests/data/README.md), so no test needs the Hub.
os.environ["TRL_ES_DATA"] = os.path.join(os.path.dirname(__file__), "data")

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import SandboxUids, build_tiny_model, build_tiny_vlm  # noqa: E402


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case torch was imported before OMP_NUM_THREADS was set


@pytest.fixture(scope="session")
def tokenizer_dir():
    from trl_es.util.models import smollm2_tokenizer_dir

    return smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3-MoE (4 fused experts, top-2) saved with SmolLM2's tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe") / "model", tokenizer_dir, moe=True)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Idefics3 vision-language model saved with its processor (`build_tiny_vlm`)."""
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "model", tokenizer_dir)


@pytest.fixture
def sandbox_uids(monkeypatch) -> SandboxUids:
    """The throwaway uids of this test's sandboxed runs (`.live_processes()`: what they left running)."""
    return SandboxUids(monkeypatch)


@pytest.fixture
def prompt_dataset():
    prompts = [f"Count to {n}:" for n in range(1, 9)]
    return Dataset.from_dict({"prompt": prompts, "target": [str(n) for n in range(1, 9)]})


def pytest_collection_finish(session):
    """Freeze the heap once every test module and what it imports are loaded: the Python objects of torch,
    transformers, TRL and the rest (~700k) then live outside the garbage collector's reach, so each full collection
    (transformers' Trainer runs one as each `train()` starts, ~0.35 s with them) scans only what the tests make."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group into the test ids
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`), the tests of each folder of launched processes and engines run on
    one worker, one after the other: tests/distributed (they share session-scoped launches) and tests/vllm (one child
    process runs every engine). The two groups start first, one per worker (pytest-xdist orders groups by size), and
    the other tests fill in around them."""
    for item in items:
        group = next((part for part in ("distributed", "vllm") if part in item.path.parts), None)
        if group and item.path.name != "test_security_crash.py":  # its forked runs share no launch
            item.add_marker(pytest.mark.xdist_group(group))
