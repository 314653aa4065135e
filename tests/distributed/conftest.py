"""The distributed tests' shared runs: the 1-process reference and ONE 2-process launch of the harness
(`multiprocess_es.py`) that runs every regression-guard scenario, the user script's runs (logged; an adapter on an
8-bit base; bf16; a vision-language model on pictures) and, last, a run whose reward raises on process 1. Several
test modules assert on what these runs wrote."""

import os
from pathlib import Path

import multiprocess_es
import pytest
import regression_guard
from helpers import REPOSITORY, build_tiny_model
from multiprocess_es import guard_runs, launch


QES = {"es_search_space": "qes", "sigma": 6.0, "learning_rate": 2.0, "noise_table_size": 1 << 21}
"""The user script's QES run: σ in quantization steps (large enough to change the greedy tokens of this small
model), the smallest noise table."""


@pytest.fixture(scope="session")
def guard_models(tmp_path_factory, tokenizer_dir) -> Path:
    """The regression guard's tiny model and, for Hyper-ES, two 'fine-tuned' versions of it."""
    folder = tmp_path_factory.mktemp("guard-models")
    regression_guard.prepare(folder, tokenizer_dir)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer_dir) -> str:
    """The user script's tiny model."""
    return build_tiny_model(tmp_path_factory.mktemp("mp") / "model", tokenizer_dir)


def user_runs(guard_models: Path, model_dir: str, vlm_dir: str) -> list[dict]:
    """The user script's runs of both launches: the logged run, a LoRA adapter on the guard's model loaded in 8
    bits (its linears are wide enough for bitsandbytes), QES on that 8-bit model's integers, the logged run computed
    in bfloat16 (bf16), and the tiny vision-language model on a picture per prompt."""
    return [
        {"name": "logged", "model": model_dir},
        {"name": "qlora", "model": str(guard_models / "model"), "quantized": True},
        {"name": "qes", "model": str(guard_models / "model"), "qes": True, "overrides": QES},
        {"name": "bf16", "model": model_dir, "overrides": {"bf16": True}},
        {"name": "vlm", "model": vlm_dir, "vlm": True},
    ]


@pytest.fixture(scope="session")
def one_process(guard_models, model_dir, tiny_vlm_dir, tmp_path_factory) -> Path:
    """The reference, in this process: every guard scenario (OUT/hashes-rank0.json) and the user script's runs."""
    out = tmp_path_factory.mktemp("one-process")
    os.environ.pop("RANK", None)
    runs = [*guard_runs(guard_models), *user_runs(guard_models, model_dir, tiny_vlm_dir)]
    assert multiprocess_es.main(str(out), runs)
    return out


@pytest.fixture(scope="session")
def two_processes(guard_models, model_dir, tiny_vlm_dir, tmp_path_factory) -> Path:
    """One launch with 2 processes (the shipped examples/accelerate/cpu_two_processes.yaml): the guard scenarios no
    other launch runs, the user script's runs, and last the run whose reward raises on process 1 (which ends the
    launch)."""
    out = tmp_path_factory.mktemp("two-processes")
    # Not run twice: the adapter scenario's 2 processes run through vLLM (test_regression_guard.py), full and
    # low-rank's over two machines of one process each (test_multiprocess.py's `killed` launch).
    elsewhere = ("adapter", "full", "lowrank")
    runs = [
        *guard_runs(guard_models, scenarios=[s for s in regression_guard.SCENARIOS if s not in elsewhere]),
        *user_runs(guard_models, model_dir, tiny_vlm_dir),
        {"name": "raise", "model": model_dir, "fault": "raise"},
    ]
    shipped = ("--config_file", str(REPOSITORY / "examples" / "accelerate" / "cpu_two_processes.yaml"))
    process = launch(out, runs, backend=shipped)
    finished = all((out / f"hashes-rank{r}.json").is_file() for r in range(2)) and (out / "raise").is_dir()
    assert process.returncode != 0 and finished, process.stdout[-3000:] + process.stderr[-5000:]  # the last run fails
    return out
