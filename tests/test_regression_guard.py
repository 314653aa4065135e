"""The final weights of every search space × {transformers, vLLM colocate} × {1, 2 processes} and of a resumed run
are bitwise those recorded in tests/data/regression_hashes.json (tests/regression_guard.py runs them): one hash per
scenario, which every backend and process count must give.

The hashes were recorded before the trainer was split into search spaces and weight backends; any change to the
arithmetic, the seeds or the order of operations changes them. They hold for the recorded environment (torch and
transformers versions, CPU instruction set): elsewhere the tests are skipped, since another kernel may round
differently. To record them anew after an intended change (the 1-process transformers runs write the file):
TRL_ES_RECORD_GUARD=1 pytest tests/test_regression_guard.py -k one_process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers


sys.path.insert(0, os.path.dirname(__file__))
import regression_guard  # noqa: E402
from test_multiprocess import accelerate_launch  # noqa: E402


GOLDEN = Path(__file__).parent / "data" / "regression_hashes.json"
RECORD = os.environ.get("TRL_ES_RECORD_GUARD") == "1"
ENVIRONMENT = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "cpu": torch.backends.cpu.get_cpu_capability(),
}


def check(hashes: dict[str, str], record: bool = False) -> None:
    if record:
        GOLDEN.write_text(json.dumps({"environment": ENVIRONMENT, "hashes": hashes}, indent=1, sort_keys=True) + "\n")
        return
    golden = json.loads(GOLDEN.read_text())
    if golden["environment"] != ENVIRONMENT:
        pytest.skip(f"hashes recorded with {golden['environment']}, this is {ENVIRONMENT}")
    assert hashes == {scenario: golden["hashes"][scenario] for scenario in hashes}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("guard-models")
    regression_guard.prepare(folder, tokenizer_dir)
    return folder


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


def test_transformers_one_process(models, tmp_path):
    check({s: regression_guard.run(s, models, tmp_path) for s in regression_guard.SCENARIOS}, record=RECORD)


@pytest.mark.slow
def test_transformers_two_processes(models, tmp_path):
    check(launched_hashes(tmp_path, models, regression_guard.SCENARIOS, 2, vllm=False))


@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [1, 2])
def test_vllm_colocate(models, tmp_path, num_processes):
    pytest.importorskip("vllm")
    check(launched_hashes(tmp_path, models, regression_guard.VLLM_SCENARIOS, num_processes, vllm=True))
