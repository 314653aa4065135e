"""The sandbox for model-written Python (real subprocesses, no mocks) and the MBPP task that relies on it.

Each hostile program must fail AND its damage must not have happened. These tests check the isolation the sandbox
gives when the trainer runs as root, its supported setting; without root the isolation is weaker by design (see
sandbox.py) and the file, environment and /tmp tests fail.
"""

import json
import os
import secrets
import socket
import tempfile
import time

import pytest

from trl_es.rewards.sandbox import SandboxResult, run_python
from trl_es.tasks.data import local_data
from trl_es.tasks.mbpp import extract_program, mbpp, mbpp_reward, mbpp_verify


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("assert sum([1, 2]) == 3\nprint('output is discarded')", SandboxResult(True, "ok")),
        ("assert sum([1, 2]) == 4", SandboxResult(False, "exit status 1")),
        ("def f(:\n    pass", SandboxResult(False, "exit status 1")),
        ("import sys\nsys.exit(7)", SandboxResult(False, "exit status 7")),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", SandboxResult(False, "killed by signal SIGTERM")),
    ],
)
def test_exit_status_decides(source, expected):
    assert run_python(source) == expected


def test_bad_arguments_raise():
    with pytest.raises(TypeError):
        run_python(b"pass")
    with pytest.raises(ValueError):
        run_python("pass", timeout_s=0)


def test_infinite_loop_is_killed_at_the_timeout(sandbox_uids):
    start = time.monotonic()
    assert run_python("while True:\n    pass", timeout_s=1.0) == SandboxResult(False, "timeout")
    assert time.monotonic() - start < 5  # killed at 1 s (loose for loaded machines; the loop never ends)
    assert run_python("import time\ntime.sleep(600)", timeout_s=0.5) == SandboxResult(False, "timeout")
    assert sandbox_uids.live_processes() == []


def test_fork_bomb_fails_and_leaves_no_process(sandbox_uids):
    processes = len(list(filter(str.isdigit, os.listdir("/proc"))))
    fork = "import os\ntry:\n    os.fork()\nexcept BlockingIOError:\n    raise SystemExit(3)"
    assert run_python(fork) == SandboxResult(False, "exit status 3")
    bomb = "import os, time\nwhile True:\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(600)"
    assert not run_python(bomb, timeout_s=1.0).passed
    threads = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()"
    assert not run_python(threads).passed
    assert len(sandbox_uids.uids) == 3 and sandbox_uids.live_processes() == []
    assert len(list(filter(str.isdigit, os.listdir("/proc")))) < processes + 20  # leeway for unrelated processes


def test_files_cannot_be_deleted(tmp_path):
    private = tmp_path / "private"  # under pytest's root-only directory
    # a world-readable directory, like a checkout (outside the temporary directories, which the program sees empty)
    public = tempfile.mkdtemp(prefix="trl_es_test_", dir="/")
    os.chmod(public, 0o755)
    try:
        for directory in (str(private), public):
            os.makedirs(f"{directory}/tree")
            for path in (f"{directory}/file.txt", f"{directory}/tree/inner.txt"):
                with open(path, "w") as file:
                    file.write("keep")
                os.chmod(path, 0o644)
            program = (
                f"import os, shutil\nos.remove({directory + '/file.txt'!r})\nshutil.rmtree({directory + '/tree'!r})"
            )
            assert not run_python(program).passed
            reads = f"assert open({directory + '/file.txt'!r}).read() == 'keep'"
            assert run_python(reads).passed == (directory == public)  # the public file was within reach
            for path in (f"{directory}/file.txt", f"{directory}/tree/inner.txt"):
                with open(path) as file:
                    assert file.read() == "keep"
    finally:
        for path in (f"{public}/tree/inner.txt", f"{public}/file.txt"):
            os.remove(path)
        os.rmdir(f"{public}/tree")
        os.rmdir(public)


def test_huge_allocation_fails_and_the_trainer_carries_on():
    assert run_python("x = bytearray(50 * 2**30)\nx[-1] = 1") == SandboxResult(False, "exit status 1")
    assert run_python("x = bytearray(2**20)").passed


def test_no_network():
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        tcp.settimeout(0.3)
        udp.settimeout(0.3)
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), 2).sendall(b'x')"
        assert not run_python(connect).passed
        send = f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', {udp.getsockname()})"
        assert not run_python(send).passed
        with pytest.raises(TimeoutError):
            tcp.accept()
        with pytest.raises(TimeoutError):
            udp.recv(1)
    assert not run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), 2)").passed


def test_trainer_environment_is_out_of_reach(monkeypatch):
    monkeypatch.setenv("TRL_ES_SECRET", "hunter2")
    program = """import os, sys
def read(path):
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return None
assert b"PATH=" in read("/proc/self/environ")  # the check itself works
leaks = [os.environ.get("TRL_ES_SECRET"), read(f"/proc/{os.getppid()}/environ"), read("/proc/1/environ")]
sys.exit(3 if not any(leaks) else 0)
"""
    assert run_python(program) == SandboxResult(False, "exit status 3")


def test_huge_file_is_refused():
    program = """import errno, sys
try:
    with open("big", "wb") as file:
        file.write(b"x" * 64 * 2**20)
except OSError as error:
    sys.exit(3 if error.errno == errno.EFBIG else 4)
"""
    assert run_python(program) == SandboxResult(False, "exit status 3")


def test_working_directory_is_writable_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    program = """import os
with open("out.txt", "w") as file:
    file.write("hello")
assert open("out.txt").read() == "hello" and sorted(os.listdir(".")) == ["out.txt", "program.py"]
assert os.environ["HOME"] == os.getcwd()
"""
    assert run_python(program).passed
    assert list(tmp_path.iterdir()) == []


def test_files_left_in_shared_temporary_directories_are_removed():
    paths = [f"/tmp/trl_es_test_{secrets.token_hex(4)}", f"/dev/shm/trl_es_test_{secrets.token_hex(4)}"]
    program = f"import os\nopen({paths[0]!r}, 'w').write('x')\nos.makedirs({paths[1] + '/sub'!r})"
    assert run_python(program).passed
    assert not any(os.path.exists(path) for path in paths)


def raw_mbpp() -> list[dict]:
    """The rows of the local sanitized-mbpp.json (conftest points TRL_ES_DATA at tests/data: the first rows)."""
    with open(local_data("mbpp/sanitized-mbpp.json", hub_id="")) as file:
        return json.load(file)


def test_mbpp_loader():
    test = mbpp("test")
    assert len(test) == 30 and test.column_names == ["prompt", "task_id", "test_list", "test_imports"]
    first = test[0]
    assert first["task_id"] == 11 and first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"] == (
        "You are an expert Python programmer, and here is your task: Write a python function to remove first and last "
        'occurrence of a given character from the string. Your code should pass these tests:\n\nassert remove_Occ("he'
        'llo","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\nassert remove_Occ("PHP","P") == "H"\n\nWrite '
        "the complete code in one ```python code block."
    )
    assert mbpp("test", conversational=False)[0]["prompt"] == first["prompt"][0]["content"]
    for split, (first_id, last_id) in {
        "test": (11, 510),
        "prompt": (1, 10),
        "validation": (511, 600),
        "train": (601, 974),
    }.items():
        expected = [row["task_id"] for row in raw_mbpp() if first_id <= row["task_id"] <= last_id]
        assert mbpp(split)["task_id"] == expected
    with pytest.raises(ValueError, match="'train'"):
        mbpp("dev")


def test_reference_solutions_score_one_and_wrong_ones_zero():
    reference = {row["task_id"]: row["code"] for row in raw_mbpp()}
    tasks = mbpp("test").select(range(30))
    completions = [
        [{"role": "assistant", "content": f"Sure.\n```python\n{reference[task_id]}\n```\nDone."}]
        for task_id in tasks["task_id"]
    ]
    assert mbpp_reward(completions, tasks["test_list"], tasks["test_imports"]) == [1.0] * 30
    tests, imports = tasks["test_list"][:1], tasks["test_imports"][:1]  # task 11: remove_Occ
    wrong = "```python\ndef remove_Occ(s, ch):\n    return s\n```"
    right = f"```\n{reference[11]}\n```"
    assert mbpp_reward([wrong], tests, imports) == [0.0]
    assert mbpp_verify([right], tests, imports) == [True]
    for no_program in (reference[11], f"```python\n{reference[11]}", ""):  # no (closed) fence
        assert mbpp_reward([no_program], tests, imports) == [0.0]
    assert mbpp_reward([f"{wrong}\nfixed:\n{right}"], tests, imports) == [1.0]  # the last block counts


def test_extract_program():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_program("```\nz = 3\n```") == "z = 3\n"
    assert extract_program("x = 1") is None
