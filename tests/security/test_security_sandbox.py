"""Attacks on the code reward and its sandbox (real subprocesses, as root: the supported setting).

A code reward pays only when every test assertion ran and passed: a program that leaves early or fakes success scores
0. The sandbox leaves nothing behind on any exit path (IPC objects, files, processes) and keeps the trainer's command
line out of reach. docs/security.md lists what each guard covers and what it does not.
"""

import os
import secrets
import signal
import threading
import time

import pytest

from trl_es.rewards.sandbox import run_python
from trl_es.tasks.mbpp import mbpp, mbpp_reward


# Skipped without root, unless TRL_ES_REQUIRE_ROOT is set (CI's sudo step), where running without root is a failure.
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not os.environ.get("TRL_ES_REQUIRE_ROOT"), reason="the sandbox isolates fully only as root"
)


def test_these_attacks_run_as_root():
    assert os.geteuid() == 0, "TRL_ES_REQUIRE_ROOT is set: run these tests as root (sudo), the sandbox's setting"


EARLY_EXITS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "raise SystemExit": "raise SystemExit",
    "exit()": "exit()",
    "exit in atexit": "import atexit, os\natexit.register(os._exit, 0)\nassert False",
    "exit in finally": "def remove_Occ(s, ch):\n    try:\n        return s\n    finally:\n        import os\n        os._exit(0)",
    "excepthook exits 0": "import os, sys\nsys.excepthook = lambda *exc: os._exit(0)",
    "AssertionError overridden": "import builtins\nbuiltins.AssertionError = type('Passed', (Exception,), {})",
    "fake success marker": "import os\nprint('ALL TESTS PASSED')\nos.write(1, b'ok\\n')\nos._exit(0)",
    "writes to every descriptor": "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'passed')\n"
    "    except OSError: pass\nos._exit(0)",
}


@pytest.mark.parametrize("attack", EARLY_EXITS)
def test_a_program_that_does_not_run_every_assertion_scores_zero(attack):
    task = mbpp("test").select(range(1))  # task 11: remove_Occ, three asserts
    completion = f"```python\n{EARLY_EXITS[attack]}\n```"
    assert mbpp_reward([completion], task["test_list"], task["test_imports"]) == [0.0]


def test_a_program_that_runs_to_its_end_passes_and_one_that_stops_does_not():
    assert run_python("x = 1").passed
    result = run_python("import os\nos._exit(0)")
    assert (result.passed, result.reason) == (False, "stopped before its end")


def read_table(name: str) -> list[str]:
    with open(f"/proc/sysvipc/{name}") as file:
        return file.read().splitlines()[1:]


def test_sysv_shared_memory_and_message_queues_do_not_outlive_the_program():
    program = """import ctypes
libc = ctypes.CDLL(None)
assert libc.shmget(0, 64 * 2**20, 0o1666) >= 0  # IPC_PRIVATE, IPC_CREAT | 0o666
assert libc.msgget(0, 0o1666) >= 0
"""
    before = read_table("shm"), read_table("msg")
    assert run_python(program).passed
    assert (read_table("shm"), read_table("msg")) == before


@pytest.mark.parametrize("parent", ["/tmp", "/run/lock", "/var/tmp"])
def test_files_in_world_writable_subdirectories_are_gone(parent):
    if not os.path.isdir(parent):
        pytest.skip(f"no {parent} here")
    folder = os.path.join(parent, f"trl_es_test_{secrets.token_hex(4)}")
    os.makedirs(folder)
    os.chmod(folder, 0o1777)
    try:
        program = f"""try:
    open({os.path.join(folder, "left")!r}, "w").write("x")
except OSError:
    pass
"""
        assert run_python(program).passed
        assert os.listdir(folder) == []
    finally:
        os.rmdir(folder)


def test_dev_shm_cannot_hold_more_than_the_program_may_allocate():
    program = """written = 0
try:
    for i in range(40):  # 40 files of 15 MB: each under the file-size limit, 600 MB together
        with open(f"/dev/shm/f{i}", "wb") as file:
            file.write(b"x" * 15 * 2**20)
        written += 15
except OSError:
    pass
assert written < 512, written
"""
    assert run_python(program).passed


def test_the_trainer_command_line_and_processes_are_out_of_reach():
    program = f"""import os
def readable(path):
    try:
        open(path, "rb").read()
        return True
    except OSError:
        return False
assert not readable("/proc/{os.getpid()}/cmdline")
assert not readable("/proc/{os.getppid()}/cmdline")
assert len([p for p in os.listdir("/proc") if p.isdigit()]) <= 2  # itself and the sandbox's init
"""
    assert run_python(program).passed


def test_ctrl_c_in_the_trainer_leaves_no_program_running(sandbox_uids):
    # Ctrl-C at a terminal raises KeyboardInterrupt; a suite started in the background inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_python("import time\ntime.sleep(60)", timeout_s=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 10
    time.sleep(0.2)
    assert sandbox_uids.live_processes() == []
