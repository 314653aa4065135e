"""No file the project reads can execute code: a crafted file for each (checkpoint contents, Hyper-ES search state,
model weights, sparse deltas, recipes) and nothing runs. Each payload is first shown to run when unpickled the
unsafe way, so a passing test means the project's path refused it, not that the payload was harmless."""

import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import es_config

from trl_es import ESTrainer


class Payload:
    """Unpickled, it writes the file `marker`: the stand-in for any code an attacker would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def payload_file(path, marker, with_torch=True):
    """Write a pickle that runs the payload when loaded with pickle or torch.load(weights_only=False)."""
    if with_torch:
        torch.save(Payload(str(marker)), path)
    else:
        with open(path, "wb") as file:
            pickle.dump(Payload(str(marker)), file)


def test_the_payload_is_real(tmp_path):
    marker = tmp_path / "marker"
    payload_file(tmp_path / "p.pt", marker)
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert marker.exists()


def reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.fixture
def checkpoint(tmp_path, tiny_model_dir, prompt_dataset):
    """A 1-step run's checkpoint-1."""
    args = es_config(tmp_path / "run", max_steps=1, save_strategy="steps", save_steps=1)
    ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset).train()
    return tmp_path / "run" / "out" / "checkpoint-1"


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_trainer_checkpoint_files_do_not_execute(tmp_path, tiny_model_dir, prompt_dataset, checkpoint, name):
    marker = tmp_path / "marker"
    payload_file(checkpoint / name, marker)
    trainer = ESTrainer(
        tiny_model_dir, reward, args=es_config(tmp_path / "run", max_steps=2), train_dataset=prompt_dataset
    )
    with pytest.raises(pickle.UnpicklingError):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()


def test_model_weights_as_a_pickle_do_not_execute(tmp_path, tiny_model_dir, prompt_dataset):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    os.remove(model / "model.safetensors")
    marker = tmp_path / "marker"
    payload_file(model / "pytorch_model.bin", marker)
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error; what matters is that nothing ran
        ESTrainer(str(model), reward, args=es_config(tmp_path), train_dataset=prompt_dataset)
    assert not marker.exists()


@pytest.fixture
def merge_run(tmp_path, tiny_model_dir, prompt_dataset):
    """A Hyper-ES run (one fine-tuned model: the tiny model drifted) with checkpoint-1."""
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.01)
    tuned.save_pretrained(tmp_path / "tuned")
    settings = dict(es_search_space="merge", merge_models=[str(tmp_path / "tuned")], save_strategy="steps")
    args = es_config(tmp_path / "merge", max_steps=1, save_steps=1, **settings)
    ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset).train()
    return tmp_path / "merge" / "out" / "checkpoint-1", settings


def resume_merge(tmp_path, tiny_model_dir, prompt_dataset, checkpoint, settings):
    args = es_config(tmp_path / "merge", max_steps=2, **settings)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=prompt_dataset)
    trainer.train(resume_from_checkpoint=str(checkpoint))


def test_a_pickled_hyper_es_state_is_refused_unread(tmp_path, tiny_model_dir, prompt_dataset, merge_run):
    checkpoint, settings = merge_run
    os.remove(checkpoint / "merge_search.json")
    marker = tmp_path / "marker"
    # the format trl-es once wrote: torch.save({"cma": pickle.dumps(state)}), which loads under weights_only=True
    torch.save({"cma": pickle.dumps(Payload(str(marker)))}, checkpoint / "merge_search.pt")
    with pytest.raises(ValueError, match="not loaded"):
        resume_merge(tmp_path, tiny_model_dir, prompt_dataset, checkpoint, settings)
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda state: "not json {", "not a readable Hyper-ES search state"),
        (lambda state: {**state, "format": "pickle"}, "not a CMA-ES search state"),
        (lambda state: {**state, "history": [["1e999"]]}, "finite rewards"),
        (lambda state: {**state, "history": [[float("nan")]]}, "finite rewards"),
        (lambda state: {**state, "settings": {**state["settings"], "shape": [9, 9]}}, "coefficients"),
        (lambda state: {**state, "settings": {"__class__": "os.system"}}, "settings must have the keys"),
    ],
)
def test_a_tampered_hyper_es_state_is_refused(tmp_path, tiny_model_dir, prompt_dataset, merge_run, edit, message):
    checkpoint, settings = merge_run
    path = checkpoint / "merge_search.json"
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ValueError, match=message):
        resume_merge(tmp_path, tiny_model_dir, prompt_dataset, checkpoint, settings)


def test_a_sparse_delta_that_is_a_pickle_does_not_execute(tmp_path, tiny_model_dir):
    from trl_es.cli import main

    marker = tmp_path / "marker"
    payload_file(tmp_path / "delta.safetensors", marker)
    code = main(["apply-delta", "--base", tiny_model_dir, "--delta", str(tmp_path / "delta.safetensors"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code != 0 and not marker.exists() and not (tmp_path / "out").exists()


def test_a_recipe_cannot_construct_python_objects(tmp_path, tiny_model_dir):
    from trl_es.cli import main

    marker = tmp_path / "marker"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\n"
        f"output_dir: !!python/object/apply:builtins.exec [\"open({str(marker)!r}, 'w').write('x')\"]\n"
    )
    with pytest.raises(Exception):  # noqa: B017 - PyYAML's safe loader refuses the tag
        main(["es", "--config", str(recipe), "--max_steps", "1"])
    assert not marker.exists()
