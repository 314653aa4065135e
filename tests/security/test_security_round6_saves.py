"""Issue 68 (trust, round 6), saves and the commands that read them: a crash while a checkpoint or a model is
published, crafted chain headers, a bfloat16 base's sparse delta, a base without a tokenizer, a MoE routing to more
experts than it has, `trl-es sparsify --out` onto an existing file, the old `trl_es.research.sparse` names."""

import os
import re
import shutil

import pytest
import torch
import transformers.modeling_utils
from helpers import build_tiny_model, es_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import get_last_checkpoint

from trl_es import ESTrainer
from trl_es.chains import Chain
from trl_es.cli import main as cli
from trl_es.es.noise import CHUNK
from trl_es.es.params import upcast
from trl_es.util import atomic
from trl_es.util.deltas import DELTA_FILE, load_delta, write_model_delta


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


def chain_file(folder, space: dict, peft_config: dict | None = None) -> str:
    """A seed chain with a valid checksum and the given `space` header (and adapter), of one skipped step."""
    base = dict(model="tiny", path=None, revision=None, sha256="0" * 64, es_adapter_only=False,
                peft_config=peft_config, model_dtype="float32", quantization=None)  # fmt: skip
    header = dict(base=base, dtype="float32", parameters=["model.norm.weight"],
                  noise={"seed": 0, "table_size": 2 * CHUNK}, space=space, settings={})  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    return Chain(header, [{"step": 0, "update": None}]).save(str(folder))


SGD = {"module": "torch.optim", "class": "SGD", "defaults": {"lr": 1.0}}
CRAFTED = {
    "a low-rank target naming no parameter": (
        {"kind": "lowrank", "rank": 1, "targets": ["model.nowhere.weight"]}, None, "header.space.targets"),
    "an optimizer group naming no parameter": (
        {"kind": "full", "groups": None, "optimizer": {**SGD, "groups": [{"lr": 1.0, "parameters": ["nowhere"]}]}},
        None, r"header.space.optimizer.groups\[0\].parameters"),
    "an optimizer without groups": ({"kind": "full", "groups": None, "optimizer": SGD}, None,
                                    "header.space.optimizer.groups"),
    "a merge without models": ({"kind": "merge", "density": 0.5, "seed": 0, "models": []}, None,
                               "header.space.models"),
    "a non-numeric adapter rank": ({"kind": "full", "groups": None},
                                   {"peft_type": "LORA", "r": "eight", "lora_alpha": 16}, "header.base.peft_config.r"),
}  # fmt: skip


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_chain_header_is_one_line_from_replay(tmp_path, tiny_model_dir, capsys, case):
    """Item 13: each was a traceback from inside the replay (--force gets past the base's SHA-256): now the chain is
    refused as it is loaded, naming the field."""
    space, peft_config, field = CRAFTED[case]
    path = chain_file(tmp_path / "chain", space, peft_config)
    out = tmp_path / "replayed"
    assert cli(["replay", "--chain", path, "--base", tiny_model_dir, "--out", str(out), "--force"]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("trl-es replay: ")
    assert re.search(field, errors[0]) and not out.exists()


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory, tokenizer_dir):
    """The tiny model stored in bfloat16."""
    return build_tiny_model(tmp_path_factory.mktemp("bf16") / "model", tokenizer_dir, dtype=torch.bfloat16)


@pytest.mark.parametrize("trained", ["every parameter", "es_parameter_patterns"])
def test_the_sparse_delta_of_a_bfloat16_base_rebuilds_the_float32_theta_on_that_base(
    tmp_path, bf16_model_dir, trained
):
    """Item 14: with bf16=True θ is float32 over a bfloat16 base (`upcast`, as training does). Its delta named a
    float32 base that apply-delta refused (every parameter), or rounded θ to bfloat16 (some parameters); now applied
    to the stored base it gives θ exactly."""
    model = AutoModelForCausalLM.from_pretrained(bf16_model_dir, dtype=torch.bfloat16)
    named = dict(model.named_parameters())
    es = {name: p for name, p in named.items() if trained == "every parameter" or ".mlp." in name}
    upcast(es)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in es.values():
            p.add_(torch.randn_like(p) * 1e-3)  # most of it below bfloat16's rounding step
    write_model_delta(model, str(tmp_path), tau=0.0)
    applied = tmp_path / "applied"
    assert cli(["apply-delta", "--base", bf16_model_dir, "--delta", str(tmp_path / DELTA_FILE),
                "--out", str(applied)]) == 0  # fmt: skip
    rebuilt = load_file(applied / "model.safetensors")
    assert all(torch.equal(rebuilt[name], p.detach()) for name, p in named.items() if name in rebuilt)
    assert {rebuilt[name].dtype for name in es} == {torch.float32}


@pytest.fixture(scope="module")
def untokenized_moe_dir(tmp_path_factory, tiny_moe_dir):
    """The tiny Qwen3-MoE's weights and config without its tokenizer (transformers makes a one-token tokenizer)."""
    folder = tmp_path_factory.mktemp("untokenized")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_moe_dir, name), folder)
    return str(folder)


def test_a_base_without_tokenizer_files_is_refused_by_replay_in_one_line(tmp_path, untokenized_moe_dir, capsys):
    """Item 15: replay exited 0 after writing a one-token tokenizer into the rebuilt model."""
    path = chain_file(tmp_path / "chain", {"kind": "full", "groups": None})
    out = tmp_path / "replayed"
    assert cli(["replay", "--chain", path, "--base", untokenized_moe_dir, "--out", str(out), "--force"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trl-es replay")]
    assert len(errors) == 1 and f"{untokenized_moe_dir} holds no tokenizer" in errors[0] and not out.exists()


def test_a_base_without_tokenizer_files_is_refused_by_es_trainer(tmp_path, untokenized_moe_dir, prompt_dataset):
    """Item 15: ESTrainer took the one-token tokenizer and died with IndexError."""
    with pytest.raises(ValueError, match="holds no tokenizer .*save the tokenizer"):
        ESTrainer(untokenized_moe_dir, reward, args=es_config(tmp_path), train_dataset=prompt_dataset)


def test_a_moe_routing_to_more_experts_than_it_has_is_refused_at_construction(tmp_path, tiny_moe_dir, prompt_dataset):
    """Item 17: top-5 of 4 experts failed inside torch in the first step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts_per_tok=5 experts, but its layers have num_experts=4"):
        ESTrainer(model, reward, args=es_config(tmp_path), train_dataset=prompt_dataset)


def test_sparsify_replaces_no_file_unless_told_and_never_the_models_own(tmp_path, tiny_model_dir, capsys):
    """Item 17: `--out` onto an existing file replaced it, even the tuned model's own weights."""
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_model_dir, tuned)
    weights, taken = tuned / "model.safetensors", tmp_path / "taken.safetensors"
    original = weights.read_bytes()
    taken.write_text("mine")
    sparsify = ["sparsify", "--base", tiny_model_dir, "--tuned", str(tuned), "--tau", "0.1", "--out"]
    for out, extra in ((weights, ["--overwrite"]), (taken, [])):
        with pytest.raises(SystemExit, match="2"):  # argparse's error: usage and one line
            cli([*sparsify, str(out), *extra])
    errors = capsys.readouterr().err
    assert f"--out {weights} is inside the model {tuned}" in errors and "pass --overwrite" in errors
    assert weights.read_bytes() == original and taken.read_text() == "mine"
    assert cli([*sparsify, str(taken), "--overwrite"]) == 0
    assert load_delta(str(taken))[1]["base_model"] == tiny_model_dir


def test_the_old_sparse_module_still_has_metadata_keys():
    """Item 17: `trl_es.research.sparse` kept its other names for one release, but not METADATA_KEYS."""
    import warnings

    from trl_es.util import deltas

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from trl_es.research import sparse
    assert sparse.METADATA_KEYS is deltas.METADATA_KEYS
