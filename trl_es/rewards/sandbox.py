"""Run model-written Python in a separate, limited process — never `exec` in the trainer's process.

`run_python(source, timeout_s, memory_mb)` returns `SandboxResult(passed, reason)`: passed is True when the program
exits with status 0 within the limits. It never raises for anything the program does (only for bad arguments).

The program runs as `python -I -S program.py` (standard library only, no site-packages, no environment variables of
the trainer, stdin/stdout/stderr to /dev/null) in a fresh temporary working directory, deleted afterwards. Before the
exec, `_sandbox_launcher.py` sets its limits: address space `memory_mb`, CPU time ⌈timeout_s⌉ + 1 s, files of 16 MB
at most, 64 open files, no core dumps, no new processes or threads (RLIMIT_NPROC), no privilege gain from set-uid
binaries. The trainer kills it after `timeout_s` seconds of wall-clock time, and then kills anything it left running.

As root (the supported setting): the program has no network (a new network namespace: not even loopback; a root
without CAP_SYS_ADMIN, as in a default Docker container, cannot create one) and runs as a throwaway uid/gid picked per
run: it reads only world-readable files, changes only world-writable ones, and can neither read the trainer's
environment (/proc/<pid>/environ) nor signal its processes. Afterwards every process of that uid is killed and its
files at the top of /tmp, /var/tmp and /dev/shm are removed. The interpreter must be readable by that uid: this
Python when it is, else the first of /usr/local/bin/python3, /usr/bin/python3 that is (a pyenv Python under /root
is not).

Without root the isolation is weaker: the program runs as the calling user (it can read and write that user's files,
may read the trainer's /proc/<pid>/environ, and what it leaves in /tmp stays), and it loses the network only where
the kernel lets an unprivileged process create a user namespace; the limits still apply.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_INTERPRETERS = (sys.executable, "/usr/local/bin/python3", "/usr/bin/python3")
_SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass
class SandboxResult:
    passed: bool  # exit status 0 within the limits
    reason: str  # "ok", "timeout", "exit status N", "killed by signal SIGNAME"


def run_python(source: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run `source` as a Python program in the sandbox; passed when it exits with status 0 within the limits."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    if not timeout_s > 0 or memory_mb < 64:
        raise ValueError(f"need timeout_s > 0 and memory_mb >= 64, got {timeout_s} and {memory_mb}")
    return _run(_interpreter(), source, timeout_s, memory_mb)


@functools.cache
def _interpreter() -> str:
    """The first Python that can run a program in the sandbox (as root: one readable by any uid)."""
    for python in dict.fromkeys(_INTERPRETERS):
        if os.path.isfile(python) and _run(python, "import collections, json, math, re", 10.0, 256).passed:
            return python
    raise RuntimeError(
        f"none of {list(dict.fromkeys(_INTERPRETERS))} can run in the sandbox; as root it needs a "
        "Python whose files every uid can read (e.g. the system's /usr/bin/python3)"
    )


def _run(python: str, source: str, timeout_s: float, memory_mb: int) -> SandboxResult:
    root = os.geteuid() == 0
    # secrets, not random: the trainer's seeded RNG must neither be consumed nor make parallel workers share a uid
    uid = 200_000 + secrets.randbelow(1_800_000) if root else os.getuid()
    workdir = tempfile.mkdtemp(prefix="trl_es_sandbox_")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as file:
            file.write(source)
        if root:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "program.py"), uid, uid)
        # reached through the working directory itself, as the throwaway uid may not traverse the temporary
        # directory's parents (a TMPDIR private to root)
        program = "/proc/self/cwd/program.py"
        command = [
            sys.executable,
            "-I",
            "-S",
            _LAUNCHER,
            python,
            program,
            str(memory_mb),
            str(math.ceil(timeout_s) + 1),
            str(uid),
        ]
        process = subprocess.Popen(
            command,
            env={},
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
        try:
            status = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = None
        if root:
            _kill_uid(uid)
            _remove_files_of(uid)
        else:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if status is None:
        return SandboxResult(False, "timeout")
    if status < 0:
        return SandboxResult(False, f"killed by signal {signal.Signals(-status).name}")
    return SandboxResult(status == 0, "ok" if status == 0 else f"exit status {status}")


def _live_processes_of(uid: int) -> list[int]:
    """Pids of the processes whose real uid is `uid`, zombies excepted."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
        except (OSError, ValueError):
            continue  # not a process, or it ended meanwhile
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
            pids.append(int(name))
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` until none is left (gives up after about a second)."""
    for _ in range(100):
        pids = _live_processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _remove_files_of(uid: int) -> None:
    """Delete what `uid` created at the top of the world-writable temporary directories."""
    for directory in _SHARED_TEMP_DIRS:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
