"""Atomic saves: a crash, SIGKILL or Ctrl-C never leaves a half-written file or directory where it will be read.

Everything is first written into a staging directory beside its destination, made durable (`fsync` of every file
and directory), then renamed into place: `os.replace` of one file or of a whole new directory is atomic on POSIX
filesystems. Files that join an existing directory (a model saved into a run's output directory) are renamed one by
one with Ctrl-C held back, so the directory holds the old files or the new ones, never a file cut short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading


def fsync_tree(path: str) -> None:
    """Flush every file under `path`, then the directories, to disk."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as file:
                os.fsync(file.fileno())
        fsync_directory(root)


def fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C (SIGINT), whichever thread of the process takes it, is delivered after the block, not inside it.
    Python raises KeyboardInterrupt in the main thread only, so a block in another thread holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: taken.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if taken:  # delivered now, to the handler the block found (KeyboardInterrupt; an outer block's holding)
            signal.raise_signal(signal.SIGINT)


def publish_directory(staging: str, target: str) -> None:
    """Make the complete directory `staging` appear at `target` in one rename (an existing directory `target` is
    replaced; anything else there is a FileExistsError, and stays as it was)."""
    if os.path.lexists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{target} exists and is not a directory: trl-es saves a directory there; move it away")
    fsync_tree(staging)
    replaced = f"{staging}.replaced"
    with interrupts_held():
        if os.path.exists(target):
            os.replace(target, replaced)
        os.replace(staging, target)
        fsync_directory(os.path.dirname(os.path.abspath(target)))
        shutil.rmtree(replaced, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clear_crashed_staging(target: str) -> None:
    """Remove the staging directories of `target` that a process no longer alive left behind (a SIGKILL, or an
    interrupt that came before its own clean-up); a live process's staging is left alone."""
    parent, name = os.path.split(os.path.abspath(target))
    prefix = f".{name}."
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        pid = entry[len(prefix) :].split(".", 1)[0]
        if entry.startswith(prefix) and entry.endswith(".partial") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def staging_directory(prefix: str, parent: str) -> str:
    """A new private-named directory in `parent`, with the permissions `os.makedirs` would give it (the umask's,
    as `save_pretrained`'s folders have: `tempfile` would make it 0700)."""
    staging = tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=parent)
    os.chmod(staging, 0o777 & ~_umask())
    return staging


@contextlib.contextmanager
def atomic_directory(target: str):
    """Yield a staging directory to fill; on success its files appear in `target` (created if missing; existing
    files of the same names replaced), on an exception `target` is left as it was and the staging removed. The
    staging is named after this process, so the next save of `target` clears what a killed one left."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    clear_crashed_staging(target)
    prefix = f".{os.path.basename(os.path.abspath(target))}.{os.getpid()}."
    staging = None
    try:
        with interrupts_held():  # no Ctrl-C between making the staging and owning its clean-up
            staging = staging_directory(prefix, parent)
        yield staging
        if not os.path.isdir(target):
            publish_directory(staging, target)
            return
        fsync_tree(staging)
        with interrupts_held():
            for name in os.listdir(staging):
                os.replace(os.path.join(staging, name), os.path.join(target, name))
        fsync_directory(target)
    finally:
        with interrupts_held():  # a second Ctrl-C does not cut the clean-up short
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` through a durable temporary file and one rename (permissions: the umask's, as `open`
    gives a new file)."""
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=directory)
    try:
        os.chmod(temporary, 0o666 & ~_umask())
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
