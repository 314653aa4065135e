"""The final weights of every search space × {transformers 1 and 2 processes, vLLM colocate 2 processes (full,
CoPES, low-rank as LoRA adapters)}, of a resumed run and of an agent with a tool environment: one hash per scenario, which every backend and process count
must give (tests/regression_guard.py runs them; vLLM in one process: tests/test_vllm.py).

Two checks. In any environment, the scenarios are compared with each other: 2 processes with 1, vLLM with
transformers, a resumed run with an uninterrupted one, a sampled population in calls of 2 members with one in a
single call (`regression_guard.SAME`). In the recorded environment (torch and transformers versions, CPU
instruction set) they are also compared with tests/data/regression_hashes.json, recorded before the trainer was
split into search spaces and weight backends: a change to the arithmetic, the seeds or the order of operations
changes them. Elsewhere that comparison is reported as a warning (another kernel may round differently). To record
the hashes anew after an intended change: TRL_ES_RECORD_GUARD=1 pytest tests/test_regression_guard.py -k one_process.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import regression_guard  # noqa: E402
import torch
import transformers
from helpers import DATA, accelerate_launch  # noqa: E402


GOLDEN = DATA / "regression_hashes.json"
RECORD = os.environ.get("TRL_ES_RECORD_GUARD") == "1"
ENVIRONMENT = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "cpu": torch.backends.cpu.get_cpu_capability(),
}


def check(hashes: dict[str, str], reference: dict[str, str] | None = None) -> None:
    """`hashes` agree with each other (`SAME`), with `reference` (the 1-process transformers hashes of this
    environment) and, in the recorded environment, with the recorded hashes."""
    for a, b in regression_guard.SAME:
        if a in hashes and b in hashes:
            assert hashes[a] == hashes[b], f"{a} and {b} must end with the same weights"
    if reference is not None:
        assert hashes == {scenario: reference[scenario] for scenario in hashes}
    golden = json.loads(GOLDEN.read_text())
    if golden["environment"] == ENVIRONMENT:
        assert hashes == {scenario: golden["hashes"][scenario] for scenario in hashes}
    else:
        warnings.warn(f"recorded hashes not compared: recorded with {golden['environment']}, this is {ENVIRONMENT}")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("guard-models")
    regression_guard.prepare(folder, tokenizer_dir)
    return folder


@pytest.fixture(scope="module")
def one_process(models, tmp_path_factory) -> dict[str, str]:
    """Every scenario's hash, transformers in this process."""
    out = tmp_path_factory.mktemp("guard-one-process")
    return {s: regression_guard.run(s, models, out) for s in regression_guard.SCENARIOS}


def launched_hashes(out: Path, models: Path, scenarios, num_processes: int, vllm: bool) -> dict[str, str]:
    command = [str(Path(regression_guard.__file__)), str(models), str(out), *(["--vllm"] if vllm else []), *scenarios]
    if num_processes == 1:
        process = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=900)
    else:
        process = accelerate_launch(num_processes, *command)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    ranks = [json.loads((out / f"hashes-rank{r}.json").read_text()) for r in range(num_processes)]
    assert all(rank == ranks[0] for rank in ranks)  # every process ends with the same weights
    return ranks[0]


@pytest.mark.slow  # ~30 s; .ci/matrix runs it in both cells
def test_transformers_one_process(one_process):
    if RECORD:
        GOLDEN.write_text(
            json.dumps({"environment": ENVIRONMENT, "hashes": one_process}, indent=1, sort_keys=True) + "\n"
        )
    check(one_process)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_transformers_two_processes(models, tmp_path, one_process):
    check(launched_hashes(tmp_path, models, regression_guard.SCENARIOS, 2, vllm=False), reference=one_process)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_colocate_two_processes(models, tmp_path, one_process):
    """Two processes, each with its colocated vLLM engine, end on the 1-process transformers weights, bitwise, on
    every rank (one process with vLLM: tests/test_vllm.py)."""
    pytest.importorskip("vllm")
    check(launched_hashes(tmp_path, models, regression_guard.VLLM_SCENARIOS, 2, vllm=True), one_process)
