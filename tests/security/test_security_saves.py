"""Every save is atomic: Ctrl-C or an error while `save_model` writes leaves the output directory as it was — no
config without weights, no weights without a tokenizer — and a crash while a checkpoint is written leaves no
partial `checkpoint-K` (tests/distributed/test_security_crash.py kills real runs at every step of a checkpoint)."""

import fcntl
import os
import subprocess

import pytest
import transformers.modeling_utils
from helpers import es_config

from trl_es import ESTrainer
from trl_es.cli import main as cli


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


@pytest.mark.slow  # trains a step for replay's chain; ~10 s
def test_no_command_saves_onto_a_file(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    """A save onto a path that is a file moves the file aside to a `….partial.replaced` that nothing removes
    (util/atomic.py, kept so): the commands that save a model or results refuse such a path before saving."""
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
