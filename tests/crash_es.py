"""A run that dies: ES on the regression guard's tiny model, a checkpoint every step (keeping only the newest), killed
with SIGKILL at a chosen moment, then resumed by running it again (tests/test_security_crash.py).

    python tests/crash_es.py MODELS_DIR OUT_DIR SCENARIO [WHEN:FUNCTION:N | after-seconds:S]

SCENARIO is "full" or "merge" (Hyper-ES, whose search state is part of each checkpoint). With a kill point, the N-th
call of FUNCTION kills the process: `before` it runs, `after` it returns, or `torn`: the file it was asked to write is
left half written, then the process dies. Without one, the run resumes from the newest checkpoint if there is one
and writes the final weights' hash to OUT_DIR/hash.txt.
"""

import os
import signal
import sys
import threading
from pathlib import Path

import regression_guard


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

    setattr(module, attribute, patched)


def main():
    models, out, scenario = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if len(sys.argv) > 4:
        arm(sys.argv[4])
    resume = any(p.name.startswith("checkpoint-") for p in (out / scenario / "out").glob("checkpoint-*"))
    extra = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1)
    digest = regression_guard.run(scenario, models, out, resume=True if resume else None, **extra)
    (out / "hash.txt").write_text(digest)


if __name__ == "__main__":
    main()
