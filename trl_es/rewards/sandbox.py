"""Run model-written Python in a separate, limited process — never `exec` in the trainer's process.

`run_python(source, timeout_s, memory_mb)` returns `SandboxResult(passed, reason)`: passed is True when the program
ran to its end — it returned from its last statement, within the limits — and the process exited with status 0. A
program that leaves early (`sys.exit(0)`, `os._exit(0)`, `raise SystemExit`, an exit in `atexit` or `finally`, an
exception hook that exits 0) does not pass: a harness writes a per-run nonce to a pipe only after the program's last
statement, and the nonce reaches the program only inside that harness. It never raises for anything the program does
(only for bad arguments).

The program runs under `python -I -S` (standard library only, no site-packages, no environment variables of the
trainer, stdout/stderr to /dev/null) in a fresh temporary working directory, deleted afterwards, with limits: address
space `memory_mb`, CPU time ⌈timeout_s⌉ + 1 s, files of 16 MB at most, 64 open files, no core dumps, no new processes
or threads, no privilege gain from set-uid binaries (`_sandbox_launcher.py`). The trainer kills it after `timeout_s`
seconds of wall-clock time, or when the trainer itself is interrupted (Ctrl-C), and then kills anything it left.

As root with CAP_SYS_ADMIN (the supported setting): the program runs in its own IPC, mount, PID and network
namespaces — no network, not even loopback; its own empty, 16 MB tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock;
a /proc showing only itself, so neither the trainer's command line nor its processes are visible; SysV shared memory
and message queues that vanish with it — and as a throwaway uid/gid picked per run: it reads only world-readable
files, changes only world-writable ones, and can neither read the trainer's environment nor signal its processes.
The interpreter must be readable by that uid: this Python when it is, else the first of /usr/local/bin/python3,
/usr/bin/python3 that is (a pyenv Python under /root is not).

Weaker fallbacks, documented in docs/security.md: root without CAP_SYS_ADMIN (a default Docker container) keeps the
throwaway uid but shares the network, IPC and temporary directories (files the uid left at their top are removed
afterwards); without root the program runs as the calling user and loses the network only where the kernel lets an
unprivileged process create a user namespace; the limits and the nonce still apply.
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
    nonce = secrets.token_hex(16).encode()
    workdir = tempfile.mkdtemp(prefix="trl_es_sandbox_")
    nonce_read, nonce_write = os.pipe()
    result_read, result_write = os.pipe()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as file:
            file.write(source)
        if root:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "program.py"), uid, uid)
        os.write(nonce_write, nonce)
        os.close(nonce_write)
        limits = [str(memory_mb), str(math.ceil(timeout_s) + 1), str(uid), str(result_write)]
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", _LAUNCHER, python, *limits],
            env={},
            cwd=workdir,
            stdin=nonce_read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(result_write,),
            start_new_session=True,
        )
        os.close(result_write)
        try:
            status = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        finally:  # whatever ends the wait (the program, the timeout, Ctrl-C in the trainer): nothing stays running
            process.kill()
            process.wait()
            _clean_up(process.pid, uid, root)
        os.set_blocking(result_read, False)
        try:
            reported = os.read(result_read, 4096)
        except BlockingIOError:
            reported = b""
    finally:
        for fd in (nonce_read, result_read):
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    if status is None:
        return SandboxResult(False, "timeout")
    if status < 0:
        return SandboxResult(False, f"killed by signal {signal.Signals(-status).name}")
    if status != 0:
        return SandboxResult(False, f"exit status {status}")
    return SandboxResult(True, "ok") if reported == nonce else SandboxResult(False, "stopped before its end")


def _clean_up(pid: int, uid: int, root: bool) -> None:
    """Kill what the program left running and remove its files in the shared temporary directories (with
    namespaces both are gone with the namespace already; this covers the fallback)."""
    if root:
        _kill_uid(uid)
        _remove_files_of(uid)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
