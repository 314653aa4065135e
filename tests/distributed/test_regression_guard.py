"""The final weights of every search space × {transformers 1 and 2 processes, vLLM colocate 2 processes (full,
CoPES, low-rank as LoRA adapters)}, of a resumed run and of an agent with a tool environment: one hash per scenario, which every backend and process count
must give (tests/distributed/regression_guard.py; vLLM in one process: tests/vllm/test_vllm.py).

Two checks. In any environment, the scenarios are compared with each other: 2 processes with 1, vLLM with
transformers, a resumed run with an uninterrupted one, a sampled population in calls of 2 members with one in a
single call (`regression_guard.SAME`). In the recorded environment (torch and transformers versions, CPU
instruction set) they are also compared with tests/data/regression_hashes.json, recorded before the trainer was
split into search spaces and weight backends: a change to the arithmetic, the seeds or the order of operations
changes them. Elsewhere that comparison is reported as a warning (another kernel may round differently). To record
the hashes anew after an intended change: TRL_ES_RECORD_GUARD=1 pytest tests/distributed/test_regression_guard.py -k one_process.
"""

import json
import os
import warnings
from pathlib import Path

import pytest
import regression_guard
import torch
import transformers
from helpers import DATA
from multiprocess_es import guard_runs, launch, rank_hashes


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


def hashes(out: Path) -> dict[str, str]:
    return json.loads((out / "hashes-rank0.json").read_text())


@pytest.mark.slow  # .ci/matrix runs it in both cells
def test_transformers_one_process(one_process):
    if RECORD:
        GOLDEN.write_text(
            json.dumps({"environment": ENVIRONMENT, "hashes": hashes(one_process)}, indent=1, sort_keys=True) + "\n"
        )
    check(hashes(one_process))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_transformers_two_processes(two_processes, one_process):
    check(rank_hashes(two_processes), reference=hashes(one_process))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_colocate_two_processes(guard_models, tmp_path, one_process):
    """Two processes, each with its colocated vLLM engine, end on the 1-process transformers weights, bitwise, on
    every rank (one process with vLLM: tests/vllm/test_vllm.py)."""
    pytest.importorskip("vllm")
    process = launch(tmp_path, guard_runs(guard_models, vllm=True, scenarios=regression_guard.VLLM_SCENARIOS))
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    check(rank_hashes(tmp_path), hashes(one_process))
