"""Sandbox launcher: `python -I -S _sandbox_launcher.py PYTHON MEMORY_MB CPU_S UID RESULT_FD` (started by sandbox.py).

Isolates the program, then runs `PYTHON -I -S -c HARNESS` in the working directory, where `program.py` waits. Run as
a file, never imported: standard library only, so it starts in milliseconds.

As root, with the kernel's namespaces (CAP_SYS_ADMIN): new IPC, mount, PID and network namespaces. The namespace's
first process (its init) mounts private, size-limited tmpfs over the shared temporary directories and a /proc that
shows only the namespace, then forks the program, which drops to the throwaway uid. When the init ends, the kernel
kills whatever the program left running and frees its IPC objects and temporary files. Without namespaces: a network
namespace where the kernel allows one, and the limits.

The harness reads the run's nonce from stdin (the trainer's pipe) and closes it, runs the program, and writes the
nonce to RESULT_FD (duplicated to descriptor 3) only if the program ran to its end: an exit, a signal or an exception
leaves it unwritten.
"""

import ctypes
import os
import resource
import signal
import sys


CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
TEMPORARY_DIRECTORIES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
TMPFS_OPTIONS = b"size=16m,nr_inodes=1024,mode=1777"
HARNESS = """import os, sys
def run():
    nonce, write = os.read(0, 256), os.write
    os.close(0)
    with open("program.py", encoding="utf-8") as file:
        code = compile(file.read(), "program.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    write(3, nonce)
run()
"""


def main() -> None:
    python, memory_mb, cpu_s, uid, result_fd = sys.argv[1], *map(int, sys.argv[2:6])
    if result_fd != 3:
        os.dup2(result_fd, 3)
        os.close(result_fd)
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    isolated = root and libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET) == 0
    if not isolated:
        # A fresh network namespace has only a loopback device, and it is down. Without root the kernel may refuse the
        # user namespace this needs; the program then keeps the network (sandbox.py's docstring).
        libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET)
        run_program(python, memory_mb, cpu_s, uid, root, libc)
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)  # mounts below stay in this namespace
    status_read, status_write = os.pipe()
    if os.fork() == 0:
        os.close(status_read)
        os.write(status_write, str(namespace_init(python, memory_mb, cpu_s, uid, libc)).encode())
        os._exit(0)
    os.close(status_write)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the trainer, and the namespace with it
    os.wait()
    end_like(int(os.read(status_read, 32) or b"-1"))


def namespace_init(python: str, memory_mb: int, cpu_s: int, uid: int, libc) -> int:
    """The PID namespace's first process: private tmpfs and /proc, then the program; returns its wait status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for directory in TEMPORARY_DIRECTORIES:
        if os.path.isdir(directory):
            libc.mount(b"tmpfs", directory.encode(), b"tmpfs", 0, TMPFS_OPTIONS)
    libc.mount(b"proc", b"/proc", b"proc", 0, None)
    program = os.fork()
    if program == 0:
        run_program(python, memory_mb, cpu_s, uid, True, libc)
    return os.waitpid(program, 0)[1]


def run_program(python: str, memory_mb: int, cpu_s: int, uid: int, root: bool, libc) -> None:
    """Limits, the throwaway uid, then exec the harness (never returns)."""
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
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with its parent (after setuid, which clears it)
    environment = {"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"}
    os.execve(python, [python, "-I", "-S", "-c", HARNESS], environment)


def end_like(status: int) -> None:
    """Exit as the program did: with its exit code, or killed by its signal."""
    if status >= 0 and os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if status >= 0 else 1)


if __name__ == "__main__":
    main()
