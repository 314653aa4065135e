"""The final weights of every search space × {transformers 1 and 2 processes, vLLM colocate 2 processes with an
engine each (full, CoPES) or one tensor-parallel engine across both (full through a resume, low-rank and an adapter's
members as LoRA adapters)}, of a resumed run and of an agent with a tool environment: one hash per scenario, which
every backend, process count and engine layout must give (tests/distributed/regression_guard.py; vLLM in one
process: tests/vllm/test_vllm.py).

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
from transformers import AutoModelForCausalLM


GOLDEN = DATA / "regression_hashes.json"
RECORD = os.environ.get("TRL_ES_RECORD_GUARD") == "1"
ENVIRONMENT = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "cpu": torch.backends.cpu.get_cpu_capability(),
}


def check(hashes: dict[str, str], reference: dict[str, str] | None = None) -> None:
    """`hashes` agree with each other (`SAME`), with `reference` (the 1-process transformers hashes of this
    environment) and, in the recorded environment, with the recorded hashes. A key `<scenario>@tp<T>` is the
    scenario through a tensor-parallel vLLM engine: it must end where the scenario does."""
    scenario = lambda key: key.split("@")[0]  # noqa: E731
    for a, b in regression_guard.SAME:
        if a in hashes and b in hashes:
            assert hashes[a] == hashes[b], f"{a} and {b} must end with the same weights"
    if reference is not None:
        assert hashes == {key: reference[scenario(key)] for key in hashes}
    golden = json.loads(GOLDEN.read_text())
    if golden["environment"] == ENVIRONMENT:
        assert hashes == {key: golden["hashes"][scenario(key)] for key in hashes}
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


@pytest.fixture(scope="module")
def vllm_two_processes(guard_models, tmp_path_factory) -> Path:
    """One launch of 2 processes through colocated vLLM engines: the guard's vLLM scenarios with an engine per
    process, then through one engine of 2 tensor-parallel processes (TP_SCENARIOS), then bf16 members under TP."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("vllm-two-processes")
    runs = [
        *guard_runs(guard_models, vllm=True, scenarios=regression_guard.VLLM_SCENARIOS),
        *guard_runs(guard_models, vllm=True, scenarios=TP_SCENARIOS, tp=2),
        {"name": "tp_bf16", "model": str(guard_models / "model"), "tp_members": 2},
    ]
    process = launch(out, runs)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    return out


TP_SCENARIOS = ("resume", "lowrank", "adapter")
"""Through a tensor-parallel engine: full-rank members (the resumed run: step 1, a checkpoint, step 2 resumed), low-
rank members in LoRA slots, and an adapter's members in LoRA slots, each rank writing its shards."""


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_colocate_two_processes(vllm_two_processes, one_process):
    """Two processes, each with its colocated vLLM engine, end on the 1-process transformers weights, bitwise, on
    every rank (one process with vLLM: tests/vllm/test_vllm.py)."""
    check(rank_hashes(vllm_two_processes), hashes(one_process))
    assert set(regression_guard.VLLM_SCENARIOS) < set(rank_hashes(vllm_two_processes))


@pytest.mark.slow
@pytest.mark.vllm
def test_a_tensor_parallel_engine_trains_the_one_process_members(vllm_two_processes, one_process):
    """vllm_tensor_parallel_size=2 over 2 processes: one engine, each process holding half of every split weight
    (q/o/gate/up/down, the vocabulary), ends on the 1-process transformers weights bitwise — full-rank through a
    checkpoint and its resume, low-rank members and an adapter's members in LoRA slots."""
    tensor_parallel = {key: value for key, value in rank_hashes(vllm_two_processes).items() if "@tp2" in key}
    assert sorted(tensor_parallel) == sorted(f"{scenario}@tp2" for scenario in TP_SCENARIOS)
    check(tensor_parallel, hashes(one_process))


@pytest.mark.slow
@pytest.mark.vllm
def test_tensor_parallel_bf16_members_are_the_shards_of_the_float32_members(
    vllm_two_processes, guard_models, tmp_path
):
    """bf16 under TP = 2: on each rank every shard vLLM computes with is the bfloat16 cast of that region of the
    trainer's float32 θ + σ·ε, bitwise, written in place (no reload); the run's chain replays to its weights."""
    from trl_es.chains import load_chain, replay
    from trl_es.es.weights import weights_hash

    run = vllm_two_processes / "tp_bf16"
    ranks = [json.loads((run / f"result-rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert result["in_place"] and result["members_equal"] == [True, True]
        assert "model.layers.0.self_attn.o_proj.weight" in result["sharded"]  # a row-parallel weight: columns
        assert "model.embed_tokens.weight" in result["sharded"]  # the vocabulary split
    assert ranks[0]["weights"] == ranks[1]["weights"]
    replay(load_chain(str(run)), str(guard_models / "model"), str(tmp_path / "replayed"))
    replayed = AutoModelForCausalLM.from_pretrained(tmp_path / "replayed", dtype=torch.float32)
    assert weights_hash(dict(replayed.named_parameters())) == ranks[0]["weights"]
