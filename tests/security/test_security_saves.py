"""Every save is atomic: Ctrl-C or an error while `save_model` writes leaves the output directory as it was — no
config without weights, no weights without a tokenizer — and a crash while a checkpoint is written leaves no
partial `checkpoint-K` (tests/distributed/test_security_crash.py kills real runs at every step of a checkpoint)."""

import fcntl
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import transformers.modeling_utils
from datasets import Dataset
from helpers import es_config

from trl_es import ESTrainer
from trl_es.cli import main as cli
from trl_es.util import atomic


def reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def listing(folder):
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("error", [KeyboardInterrupt, pytest.param(OSError, marks=pytest.mark.slow)])
def test_an_interrupted_save_model_leaves_the_directory_as_it_was(
    tmp_path, tiny_model_dir, prompt_dataset, monkeypatch, error
):
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=1), train_dataset=prompt_dataset)
    trainer.train()
    target = tmp_path / "saved"
    with monkeypatch.context() as patch:  # interrupted while writing the weights, after config.json
        patch.setattr(
            transformers.modeling_utils, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(error("interrupted"))
        )
        with pytest.raises(error):
            trainer.save_model(str(target))
    assert not target.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".saved")]
    trainer.save_model(str(target))
    complete = listing(target)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= complete.keys()
    with monkeypatch.context() as patch:  # a second save interrupted: the first one stays whole
        patch.setattr(
            transformers.modeling_utils, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(error("interrupted"))
        )
        with pytest.raises(error):
            trainer.save_model(str(target))
    assert listing(target) == complete


@pytest.mark.slow  # kept out of the fast suite for time; ~2.5 s
def test_checkpoints_are_published_whole_and_the_staging_folder_is_cleaned(tmp_path, tiny_model_dir, prompt_dataset):
    args = es_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset)
    trainer.train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert {"model.safetensors", "trainer_state.json", "optimizer.pt", "rng_state.pth"} <= set(
        os.listdir(out / "checkpoint-2")
    )
    assert not (out / ".staging").exists() and not (out / ".trl-es.lock").exists()  # nothing left behind


def test_the_next_save_clears_what_a_killed_save_left_of_its_own_target_only(tmp_path, tiny_model_dir, prompt_dataset):
    """A SIGKILL (or a Ctrl-C before its clean-up) leaves `.<target>.<pid>.XXXX.partial` beside the target; the next
    save of that target removes it, and leaves a live process's staging and other targets' alone."""
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=1), train_dataset=prompt_dataset)
    trainer.train()
    dead = _dead_pid()
    left = [tmp_path / f".saved.{dead}.abc.partial", tmp_path / f".saved.{os.getppid()}.def.partial",
            tmp_path / f".other.{dead}.ghi.partial"]  # fmt: skip
    for folder in left:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    trainer.save_model(str(tmp_path / "saved"))
    assert [folder.exists() for folder in left] == [False, True, True]


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid  # reaped: no process has it (until the system reuses it)


def test_a_second_run_into_the_same_output_dir_is_refused_and_writes_nothing(tmp_path, tiny_model_dir, prompt_dataset):
    """Two runs checkpointing into one output_dir (a requeued job while the old one still runs) would delete each
    other's staged files and publish incomplete checkpoints: the second is refused while the first holds the lock."""
    args = es_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".trl-es.lock", "a+") as running:  # the first run, holding the directory
        fcntl.flock(running, fcntl.LOCK_EX)
        running.write("4242"), running.flush()
        trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset)
        with pytest.raises(RuntimeError, match=r"another training run \(process 4242\)"):
            trainer.train()
        assert not [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    trainer.train()  # the first run is over: this one may write
    assert (out / "checkpoint-1" / "model.safetensors").is_file()


class CtrlC:
    """A terminal's Ctrl-C in a process of several threads (a trainer has ~5): `send()` makes a thread started
    beforehand send SIGINT to the process, which that thread takes, not the main one; returns once it was taken."""

    def __init__(self):
        self.asked, self.sent = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.asked.wait()
        os.kill(os.getpid(), signal.SIGINT)
        self.sent.set()

    def send(self):
        self.asked.set()
        self.sent.wait()
        time.sleep(0.05)  # Python runs the handler in the main thread at its next instruction, by this sleep's end


def test_a_ctrl_c_taken_by_another_thread_is_held_until_the_block_ends():
    ctrl_c, reached = CtrlC(), []
    with pytest.raises(KeyboardInterrupt):
        with atomic.interrupts_held():
            ctrl_c.send()
            reached.append("the end of the block")
    assert reached == ["the end of the block"]
    elsewhere = []  # another thread, which Python never interrupts, holds nothing and is refused nothing

    def save_elsewhere():
        with atomic.interrupts_held():
            elsewhere.append("saved")

    thread = threading.Thread(target=save_elsewhere)
    thread.start(), thread.join()
    assert elsewhere == ["saved"]


def test_a_ctrl_c_between_the_renames_of_a_publish_leaves_the_new_directory_in_place(tmp_path, monkeypatch):
    target, staging = tmp_path / "checkpoint-2", tmp_path / ".staging"
    for folder, text in ((target, "old"), (staging, "new")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    ctrl_c, replace = CtrlC(), os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (replace(*a), ctrl_c.send()))  # after the first rename
    with pytest.raises(KeyboardInterrupt):
        atomic.publish_directory(str(staging), str(target))
    assert (target / "model.safetensors").read_text() == "new" and os.listdir(tmp_path) == ["checkpoint-2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A trainer after one step, its threads alive (saving changes nothing of it, so the tests share it)."""
    args = es_config(tmp_path_factory.mktemp("trained"), max_steps=1)
    prompts = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompts)
    trainer.train()
    return trainer


@pytest.mark.parametrize("moment", ["making the staging", "renaming into the directory", "cleaning up a failed save"])
def test_a_ctrl_c_in_a_trainers_guarded_save_waits_for_its_end(tmp_path, trained, monkeypatch, moment):
    """With the trainer's threads alive, a Ctrl-C that another thread takes lands after the guarded part: a save into
    an existing directory replaces every file (never training_args.bin without model.safetensors and es_chain.json),
    and a failed save removes its staging."""
    target = tmp_path / "saved"
    trained.save_model(str(target))
    files = {name: os.stat(target / name).st_ino for name in os.listdir(target)}
    ctrl_c = CtrlC()
    if moment == "making the staging":
        make = atomic.staging_directory
        monkeypatch.setattr(atomic, "staging_directory", lambda *a: (make(*a), ctrl_c.send())[0])
    elif moment == "renaming into the directory":
        replace = os.replace  # Ctrl-C after the first file renamed into the directory
        monkeypatch.setattr(
            os, "replace", lambda a, b: (replace(a, b), os.path.dirname(b) == str(target) and ctrl_c.send())
        )
    else:
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(
            OSError("disk full")))  # fmt: skip
        remove = shutil.rmtree
        monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (ctrl_c.send(), remove(*a, **k)))
    with pytest.raises(KeyboardInterrupt):
        trained.save_model(str(target))
    monkeypatch.undo()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".saved")]  # no staging left behind
    replaced = {name: os.stat(target / name).st_ino != inode for name, inode in files.items()}
    if moment == "renaming into the directory":
        assert all(replaced.values()), replaced  # every file is the new save's
    else:
        assert not any(replaced.values()), replaced  # the directory is as it was


@pytest.mark.slow  # trains a step for replay's chain; ~10 s
def test_no_command_saves_onto_a_file(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    """A save onto a path that is a file moved the file aside to a `….partial.replaced` that nothing removed: the
    commands that save a model or results refuse such a path before saving."""
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=1), train_dataset=prompt_dataset)
    trainer.train()
    trainer.save_model()  # out/es_chain.json, for replay
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert cli(["replay", "--chain", str(tmp_path / "out"), "--out", str(taken)]) == 1
    assert cli(["eval", "--model", tiny_model_dir, "--task", "small_sums", "--out-dir", str(taken)]) == 1
    with pytest.raises(SystemExit, match="2"):  # argparse's error: usage and one line
        cli(["apply-delta", "--base", tiny_model_dir, "--delta", str(tmp_path / "d.safetensors"), "--out", str(taken)])
    errors = capsys.readouterr().err
    assert "Traceback" not in errors and errors.count(str(taken)) == 3
    assert taken.read_text() == "mine" and not list(tmp_path.rglob("*.replaced"))


def test_a_checkpoint_onto_a_file_is_refused_and_the_file_kept(tmp_path, tiny_model_dir, prompt_dataset):
    """A file named like the checkpoint to write (`out/checkpoint-1`) was moved into `.staging/…replaced` and left
    there: the save is refused naming it, and the file stays as it was."""
    args = es_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    taken = tmp_path / "out" / "checkpoint-1"
    taken.parent.mkdir()
    taken.write_text("mine")
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset)
    with pytest.raises(FileExistsError, match="checkpoint-1 exists and is not a directory"):
        trainer.train()
    assert taken.read_text() == "mine" and not list(tmp_path.rglob("*.replaced"))
