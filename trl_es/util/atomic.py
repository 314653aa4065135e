"""Atomic saves: a crash, SIGKILL or Ctrl-C never leaves a half-written file or directory where it will be read.

Everything is first written into a staging directory beside its destination, made durable (`fsync` of every file
and directory), then renamed into place: `os.replace` of one file or of a whole new directory is atomic on POSIX
filesystems. A directory that replaces another is renamed in after the old one is moved aside (beside it, as
`.<name>.replaced`): a crash between the two renames leaves the old one whole there, and `restore_replaced` puts it
back. Files that join an existing directory (a model saved into a run's output directory) are renamed one by one
with Ctrl-C held back, after their complete staging is renamed to `….publishing`: a crash among those renames is
finished by the next save of that directory (`clear_crashed_staging`), so the directory never stays a mix of two
saves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading


def is_within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies inside it (symlinks resolved): a save there would overwrite what it holds."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


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


REPLACED = ".replaced"
"""The suffix of `.<name>.replaced`, where `publish_directory` moves the directory it replaces, `<name>`."""


def _replaced(target: str) -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}{REPLACED}")


def publish_directory(staging: str, target: str) -> None:
    """Make the complete directory `staging` appear at `target` in one rename (an existing directory `target` is
    replaced; anything else there is a FileExistsError, and stays as it was). The directory replaced is moved aside
    to `.<target>.replaced` first: a crash before the second rename leaves it whole there (`restore_replaced`)."""
    if os.path.lexists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{target} exists and is not a directory: trl-es saves a directory there; move it away")
    fsync_tree(staging)
    replaced = _replaced(target)
    with interrupts_held():
        if os.path.exists(target):
            shutil.rmtree(replaced, ignore_errors=True)  # an earlier crash's, after its directory was published
            os.replace(target, replaced)
        os.replace(staging, target)
        fsync_directory(os.path.dirname(os.path.abspath(target)))
        shutil.rmtree(replaced, ignore_errors=True)


def restore_replaced(parent: str) -> None:
    """Put back each directory of `parent` that a crash left moved aside (`.<name>.replaced`, `publish_directory`)
    where nothing was published in its place; remove it where its successor was."""
    for entry in os.listdir(parent):
        moved = os.path.join(parent, entry)
        if entry.startswith(".") and entry.endswith(REPLACED) and os.path.isdir(moved):
            target = os.path.join(parent, entry[1 : -len(REPLACED)])
            if os.path.lexists(target):
                shutil.rmtree(moved, ignore_errors=True)
            else:
                os.replace(moved, target)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


PUBLISHING = ".publishing"
"""The suffix a complete staging directory takes when its files start moving into an existing directory."""


def clear_crashed_staging(target: str) -> None:
    """Clear what a process no longer alive (a SIGKILL, or an interrupt that came before its own clean-up) left of
    its save of `target`: a staging directory is removed, and a save whose renames into `target` had begun
    (`….publishing`) is finished. A live process's staging is left alone."""
    parent, name = os.path.split(os.path.abspath(target))
    prefix = f".{name}."
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        pid = entry[len(prefix) :].split(".", 1)[0]
        if not (entry.startswith(prefix) and pid.isdigit()) or _alive(int(pid)):
            continue
        if entry.endswith(PUBLISHING) and os.path.isdir(target):
            _move_files(os.path.join(parent, entry), target)
        if entry.endswith((".partial", PUBLISHING)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _move_files(folder: str, target: str) -> None:
    """Rename every file of `folder` into the directory `target` (replacing those of the same names), durably."""
    for name in os.listdir(folder):
        os.replace(os.path.join(folder, name), os.path.join(target, name))
    fsync_directory(target)


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
    staging is named after this process, so the next save of `target` clears what a killed one left, or finishes
    its renames into `target`."""
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
            publishing = staging.removesuffix(".partial") + PUBLISHING
            os.replace(staging, publishing)  # from here, a crash is finished by the next save (clear_crashed_staging)
            staging = None
            fsync_directory(parent)
            _move_files(publishing, target)
            os.rmdir(publishing)
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
