"""The offline model cache is made once among concurrent processes (pytest-xdist's workers, launched ranks) and a
killed conversion leaves nothing that passes for a made cache."""

import multiprocessing
import time

import pytest

from trl_es.util.models import cached_dir


def _make_cache(target, log):
    def save(folder):
        with open(log, "a") as file:
            file.write("saved\n")
        folder.mkdir()
        time.sleep(0.5)  # long enough that the other process asks while this one converts
        (folder / "done.json").write_text("{}")

    return cached_dir(target, "done.json", save)


def test_concurrent_processes_convert_once_and_both_get_the_cache(tmp_path):
    target, log = tmp_path / "cache" / "model", tmp_path / "log"
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_make_cache, args=(target, log)) for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    assert [process.exitcode for process in processes] == [0, 0]
    assert log.read_text() == "saved\n"
    assert (target / "done.json").is_file()


def test_a_killed_conversion_is_redone(tmp_path):
    target, log = tmp_path / "model", tmp_path / "log"

    def crash(folder):
        folder.mkdir()
        (folder / "half.bin").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_dir(target, "done.json", crash)
    assert not target.exists()
    assert _make_cache(target, log) == str(target)
    assert not (target / "half.bin").exists() and (target / "done.json").is_file()
