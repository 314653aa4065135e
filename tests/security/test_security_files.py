"""No file the project reads can execute code: a crafted file for each (checkpoint contents, Hyper-ES search state,
model weights, sparse deltas, recipes) and nothing runs. Each payload is first shown to run when unpickled the
unsafe way, so a passing test means the project's path refused it, not that the payload was harmless."""

import json
import os
import pickle
import shutil

import pytest
import torch
from helpers import es_config

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


@pytest.mark.parametrize(
    "name", ["rng_state.pth", *(pytest.param(n, marks=pytest.mark.slow) for n in ("optimizer.pt", "scheduler.pt"))]
)
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


@pytest.fixture(scope="module")
def merge_checkpoint(tmp_path_factory, tiny_model_dir):
    """A Hyper-ES run (one fine-tuned model: the tiny model drifted) with checkpoint-1, trained once."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("merge")
    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.01)
    tuned.save_pretrained(folder / "tuned")
    settings = dict(es_search_space="merge", merge_models=[str(folder / "tuned")], save_strategy="steps")
    args = es_config(folder / "merge", max_steps=1, save_steps=1, **settings)
    dataset = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    ESTrainer(tiny_model_dir, reward, args=args, train_dataset=dataset).train()
    return folder / "merge" / "out" / "checkpoint-1", settings


@pytest.fixture
def merge_run(tmp_path, merge_checkpoint):
    """A copy of the Hyper-ES checkpoint, to tamper with."""
    checkpoint, settings = merge_checkpoint
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    return copy, settings


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
    with pytest.raises(
        SystemExit, match=r"^trl-es es: the recipe is not plain YAML data .*python/object.*nothing ran"
    ):
        main(["es", "--config", str(recipe), "--max_steps", "1"])  # one line, no traceback
    assert not marker.exists()
    recipe.write_text(f"model_name_or_path: [{tiny_model_dir}\n")
    with pytest.raises(SystemExit, match=r"^trl-es es: the recipe is not plain YAML data .*line 2"):
        main(["es", "--config", str(recipe)])


@pytest.fixture
def delta_pair(tmp_path):
    """A base (two tensors) and a valid delta of a tuned version: a.weight by indices, b.bias by mask."""
    from safetensors.torch import load_file

    from trl_es.util.deltas import save_delta

    base = {"a.weight": torch.zeros(64, 4), "b.bias": torch.zeros(16)}
    tuned = {"a.weight": base["a.weight"].clone(), "b.bias": torch.arange(16.0)}
    tuned["a.weight"][0, :2] = 1.0
    masks = {name: tuned[name] != base[name] for name in base}
    path = tmp_path / "delta.safetensors"
    save_delta(str(path), base, tuned, masks, base_model="base")
    assert set(load_file(path)) == {"a.weight.indices", "a.weight.values", "b.bias.mask", "b.bias.values"}
    return base, path


def rewrite(path, edit):
    """Apply `edit(tensors, metadata)` to the delta file at `path`, in place."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as file:
        metadata = dict(file.metadata())
    tensors = load_file(path)
    edit(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


TAMPERINGS = {
    "negative index": (lambda t, m: t["a.weight.indices"].__setitem__(0, -1), "indices of 'a.weight'"),
    "index out of range": (lambda t, m: t["a.weight.indices"].__setitem__(0, 256), "indices of 'a.weight'"),
    "duplicate indices": (lambda t, m: t["a.weight.indices"].__setitem__(1, 0), "duplicate"),
    "float indices": (lambda t, m: t.update({"a.weight.indices": torch.tensor([0.0, 1.0])}), "integer"),
    "short mask": (lambda t, m: t.update({"b.bias.mask": t["b.bias.mask"][:1]}), "mask of 'b.bias'"),
    "too many values": (lambda t, m: t.update({"a.weight.values": torch.ones(3)}), "values of 'a.weight'"),
    "values of another dtype": (
        lambda t, m: t.update({"a.weight.values": torch.ones(2, dtype=torch.float64)}),
        "dtype",
    ),
    "non-finite value": (lambda t, m: t["b.bias.values"].__setitem__(0, float("nan")), "not finite"),
    "unknown tensor": (lambda t, m: t.update({"lm_head.weight.values": torch.ones(1)}), "lm_head.weight"),
    "values without positions": (lambda t, m: t.pop("a.weight.indices"), "a.weight"),
    "missing metadata": (lambda t, m: m.pop("shapes"), "metadata"),
    "unreadable shapes": (lambda t, m: m.update({"shapes": "[not json"}), "metadata"),
    "wrong kept count": (lambda t, m: m.update({"kept": "5"}), "kept"),
}


@pytest.mark.parametrize("tampering", TAMPERINGS)
def test_a_tampered_delta_is_refused_before_anything_is_applied(delta_pair, tampering):
    from trl_es.util.deltas import apply_delta

    base, path = delta_pair
    edit, message = TAMPERINGS[tampering]
    rewrite(path, edit)
    before = {name: t.clone() for name, t in base.items()}
    with pytest.raises(ValueError, match=message):
        apply_delta(base, str(path), force=True)
    assert all(torch.equal(base[name], before[name]) for name in base)


def test_apply_delta_command_reports_a_tampered_delta_in_one_line(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    from trl_es.cli import main

    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        tuned.model.embed_tokens.weight[0, :3] += 0.5
    tuned.save_pretrained(tmp_path / "tuned")
    delta = tmp_path / "delta.safetensors"
    assert main(["sparsify", "--base", tiny_model_dir, "--tuned", str(tmp_path / "tuned"), "--tau", "0.1",
                 "--out", str(delta)]) == 0  # fmt: skip
    rewrite(delta, lambda t, m: t["model.embed_tokens.weight.indices"].__setitem__(0, -5))
    capsys.readouterr()
    code = main(["apply-delta", "--base", tiny_model_dir, "--delta", str(delta), "--out", str(tmp_path / "out")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "delta" in line]  # not the progress bars
    assert code == 1 and len(errors) == 1 and errors[0].startswith("trl-es apply-delta: ")
    assert "model.embed_tokens.weight" in errors[0]
    assert not (tmp_path / "out").exists()
