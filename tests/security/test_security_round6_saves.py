"""Issue 68 (trust, round 6), saves and the commands that read them: a crash while a checkpoint or a model is
published, crafted chain headers, a bfloat16 base's sparse delta, a base without a tokenizer, a MoE routing to more
experts than it has, `trl-es sparsify --out` onto an existing file, the old `trl_es.research.sparse` names."""

import os
import shutil

import pytest
import transformers.modeling_utils
from helpers import es_config
from transformers.trainer_utils import get_last_checkpoint

from trl_es import ESTrainer
from trl_es.util import atomic


def reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


class Crash(BaseException):
    """The process killed at this point: nothing after it runs, no `except Exception` takes it."""


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    """An ESTrainer that has not trained (saving needs no step); each test points its output_dir elsewhere."""
    from datasets import Dataset

    prompts = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    return ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path_factory.mktemp("trainer")), train_dataset=prompts)


def crash_on_rename(monkeypatch, into: str, after: int) -> None:
    """`os.replace` crashes at its rename into the folder `into` that follows the first `after` ones."""
    replace, done = os.replace, []

    def crashing(source, destination):
        if os.path.dirname(os.path.abspath(destination)) == into:
            if len(done) == after:
                raise Crash
            done.append(destination)
        replace(source, destination)

    monkeypatch.setattr(os, "replace", crashing)


def test_a_crash_between_the_renames_publishing_a_checkpoint_leaves_it_findable(tmp_path, trainer, monkeypatch):
    """Item 11: checkpoint-2 written again (a run resumed from checkpoint-1) was moved into `.staging`, which the next
    checkpoint deletes; now it waits beside the run's checkpoints and the next run puts it back."""
    out = tmp_path / "out"
    target, staging = out / "checkpoint-2", out / ".staging" / "checkpoint-2"
    for folder, text in ((target, "old"), (staging, "new")):
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(text)
    monkeypatch.setattr(trainer.args, "output_dir", str(out))
    with monkeypatch.context() as patch:
        crash_on_rename(patch, str(out), after=1)  # the old checkpoint moved aside, the new one not yet in
        with pytest.raises(Crash):
            atomic.publish_directory(str(staging), str(target))
    trainer.lock_output_dir()  # the next run
    trainer.unlock_output_dir()
    assert get_last_checkpoint(str(out)) == str(target)
    assert (target / "trainer_state.json").read_text() == "old"
    assert not [name for name in os.listdir(out) if name.endswith(".replaced")]


def test_a_crash_among_the_renames_of_a_save_model_is_finished_by_the_next_run(tmp_path, trainer, monkeypatch):
    """Item 12: a save_model into an existing directory killed after its first file was renamed in left one save's
    files beside another's; the next run in that directory finishes the save, so every file is the second save's."""
    out = tmp_path / "out"
    monkeypatch.setattr(trainer.args, "output_dir", str(out))
    trainer.save_model()
    first = {name: os.stat(out / name).st_ino for name in os.listdir(out) if name != "README.md"}  # card: after
    with monkeypatch.context() as patch:
        crash_on_rename(patch, str(out), after=1)
        patch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)  # a killed process cleans nothing up
        with pytest.raises(Crash):
            trainer.save_model()
    assert [os.stat(out / name).st_ino != inode for name, inode in first.items()].count(True) == 1  # a mix
    monkeypatch.setattr(atomic, "_alive", lambda pid: False)  # the crashed process (this one) is gone
    trainer.lock_output_dir()
    trainer.unlock_output_dir()
    assert all(os.stat(out / name).st_ino != inode for name, inode in first.items())
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".out.")]


def test_a_save_model_stopped_by_an_error_still_leaves_the_old_save_whole(tmp_path, trainer, monkeypatch):
    """The journal adds no new way to leave a mix: an error before the renames leaves every file as it was."""
    target = tmp_path / "saved"
    trainer.save_model(str(target))
    files = {name: os.stat(target / name).st_ino for name in os.listdir(target)}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", lambda *a, **k: (_ for _ in ()).throw(
        OSError("disk full")))  # fmt: skip
    with pytest.raises(OSError, match="disk full"):
        trainer.save_model(str(target))
    assert {name: os.stat(target / name).st_ino for name in os.listdir(target)} == files
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".saved.")]
