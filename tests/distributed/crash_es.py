"""Runs that die: ES on the regression guard's tiny model, a checkpoint every step (keeping only the newest), killed
with SIGKILL at chosen moments and resumed (tests/distributed/test_security_crash.py).

    python tests/distributed/crash_es.py MODELS_DIR OUT_DIR SCENARIO [WHEN:FUNCTION:N | after-seconds:S] ...

SCENARIO is "full" or "merge" (Hyper-ES, whose search state is part of each checkpoint). Every run is a process of
its own, forked from this one once the libraries are imported (so a run does not pay for the imports): first an
uninterrupted reference, then for each kill point a run killed there and one that resumes from the newest
checkpoint the killed run left. At a kill point the N-th call of FUNCTION kills the process: `before` it runs,
`after` it returns, or `torn`: the file it was asked to write is left half written, then the process dies. Writes
OUT_DIR/results.json: the reference's hash and, per kill point, the exit codes and the resumed run's hash.
"""

import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

import regression_guard

import trl_es.training.trainer  # noqa: F401  (imported once, before the runs are forked)


PATCHABLE = {
    "save_file": ("safetensors.torch", "save_file"),  # the model's weights
    "torch_save": ("torch", "save"),  # optimizer, scheduler, RNG states
    "replace": ("os", "replace"),  # publishing a checkpoint
    "rmtree": ("shutil", "rmtree"),  # rotating old checkpoints away
    "json_dump": ("json", "dump"),  # the Hyper-ES search state
}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm(spec: str) -> None:
    """Kill this process at the moment `spec` names."""
    when, name, n = spec.split(":")
    if when == "after-seconds":
        threading.Timer(float(name), die).start()
        return
    module_name, attribute = PATCHABLE[name]
    module = __import__(module_name, fromlist=[attribute])
    original, calls = getattr(module, attribute), [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(n):
            if when == "before":
                die()
            if when == "torn":
                target = args[1] if name in ("save_file", "torch_save") else None
                if isinstance(target, (str, os.PathLike)):
                    with open(target, "wb") as file:
                        file.write(b"\0" * 100)  # a file cut short
                die()
            result = original(*args, **kwargs)
            die()
            return result
        return original(*args, **kwargs)

    for loaded in list(sys.modules.values()):  # every name the function is bound to (`from … import` included)
        for name_in_module, value in list(getattr(loaded, "__dict__", {}).items()):
            if value is original:
                setattr(loaded, name_in_module, patched)


def train(models: Path, out: Path, scenario: str, kill: str | None = None) -> tuple[int, str | None]:
    """One run in a forked process, killed at `kill` if given, resumed from the newest checkpoint in `out` if there
    is one; its exit code (-9 when killed) and the final weights' hash (None unless it finished)."""
    pid = os.fork()
    if pid == 0:
        try:
            if kill:
                arm(kill)
            resume = any((out / scenario / "out").glob("checkpoint-*"))
            extra = dict(max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
            digest = regression_guard.run(scenario, models, out, resume=True if resume else None, **extra)
            (out / "hash.txt").write_text(digest)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return code, (out / "hash.txt").read_text() if code == 0 else None


def main():
    models, out, scenario, kills = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    results = {"reference": train(models, out / "reference", scenario)[1], "trials": []}
    for k, kill in enumerate(kills):
        trial = out / f"trial-{k}"
        crashed, _ = train(models, trial, scenario, kill)
        resumed, digest = train(models, trial, scenario)
        results["trials"].append({"kill": kill, "crashed": crashed, "resumed": resumed, "hash": digest})
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
