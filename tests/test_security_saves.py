"""Every save is atomic: Ctrl-C or an error while `save_model` writes leaves the output directory as it was — no
config without weights, no weights without a tokenizer — and a crash while a checkpoint is written leaves no
partial `checkpoint-K` (tests/test_security_crash.py kills real runs at every step of a checkpoint)."""

import os

import pytest
import transformers.modeling_utils
from helpers import es_config

from trl_es import ESTrainer


def reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def listing(folder):
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
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


def test_checkpoints_are_published_whole_and_the_staging_folder_is_cleaned(tmp_path, tiny_model_dir, prompt_dataset):
    args = es_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset)
    trainer.train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert {"model.safetensors", "trainer_state.json", "optimizer.pt", "rng_state.pth"} <= set(
        os.listdir(out / "checkpoint-2")
    )
    assert not (out / ".staging").exists() or os.listdir(out / ".staging") == []
