"""A crash at any moment leaves a resumable run: training killed with SIGKILL while it writes a checkpoint (the
weights, the optimizer/scheduler/RNG states, the Hyper-ES search state, the publishing rename, the rotation of old
checkpoints) or at seeded random times, then resumed with `resume_from_checkpoint=True`, ends bitwise on the weights
of a run that was never interrupted. Each run is a real process (forked by tests/distributed/crash_es.py) killed for real."""

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("crash_es.py")
KILL_POINTS = {
    "full": [
        "torn:save_file:2",  # checkpoint-2's weights cut short
        "before:rmtree:2",  # checkpoint-3 published, while rotating checkpoint-2 away
    ],
    "merge": ["before:json_dump:2"],  # the Hyper-ES search state not yet written (save_total_limit=1)
}
RANDOM_KILLS = {"full": 1, "merge": 0}  # at seeded random times within the run (a forked run takes ~3 s)


@pytest.mark.parametrize("scenario", ["full", "merge"])
def test_killed_runs_resume_to_the_uninterrupted_weights(guard_models, tmp_path, scenario):
    rng = random.Random(f"crash-{scenario}")
    kills = KILL_POINTS[scenario] + [
        f"after-seconds:{rng.uniform(0.5, 2.5):.1f}:0" for _ in range(RANDOM_KILLS[scenario])
    ]
    command = [sys.executable, str(SCRIPT), str(guard_models), str(tmp_path), scenario, *kills]
    process = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["reference"] is not None, process.stderr[-3000:]
    assert [trial["kill"] for trial in results["trials"]] == kills
    for trial in results["trials"]:
        killed = trial["crashed"] == -signal.SIGKILL
        assert killed or trial["crashed"] == 0, (trial, process.stderr[-3000:])
        if not trial["kill"].startswith("after-seconds"):
            assert killed, f"{trial['kill']}: the kill point was never reached"
        assert trial["resumed"] == 0, (trial, process.stderr[-3000:])
        assert trial["hash"] == results["reference"], trial["kill"]
