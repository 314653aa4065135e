"""Sandbox launcher: `python -I -S _sandbox_launcher.py PYTHON PROGRAM MEMORY_MB CPU_S UID` (started by sandbox.py).

Isolates its own process — network namespace, resource limits, throwaway uid when root — then replaces itself with
`PYTHON -I -S PROGRAM`. Run as a file, never imported: standard library only, so it starts in milliseconds.
"""

import ctypes
import os
import resource
import signal
import sys


CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


def main() -> None:
    python, program = sys.argv[1], sys.argv[2]
    memory_mb, cpu_s, uid = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    # A fresh network namespace has only a loopback device, and it is down. Without root the kernel may refuse the
    # user namespace this needs; the program then keeps the network (sandbox.py's docstring).
    libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET)
    for limit, value in (
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_FSIZE, 16 * 2**20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL
    if root:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # Only now: a limit already exceeded at setuid time makes the kernel fail the execve below with EAGAIN.
        resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # set-uid binaries cannot raise privileges
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the trainer
    os.execve(python, [python, "-I", "-S", program], {"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"})


if __name__ == "__main__":
    main()
