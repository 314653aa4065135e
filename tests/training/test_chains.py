"""Seed chains: every ES run writes es_chain.json, and replaying it on the starting model gives the trained weights
bitwise (fp32 and bf16; full ES, patterns, CoPES, low-rank, a trained adapter, a new adapter, Hyper-ES; resumed);
`--steps K` gives checkpoint-K; bad input is refused before anything is written."""

import json
import re
import shutil

import pytest
import torch
from datasets import Dataset
from helpers import es_config

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay
from trl_es.cli import main as cli


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def train(folder, model, peft_config=None, **overrides):
    """3 ES steps, then save_model to folder/saved (weights + es_chain.json); the trainer."""
    args = es_config(folder, max_steps=3, **overrides)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS, peft_config=peft_config)
    trainer.train()
    trainer.save_model(str(folder / "saved"))
    return trainer


def load(path, like):
    """The model saved at `path` (a model or adapter directory), in the dtype of `like`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = next(like.parameters()).dtype
    if hasattr(like, "peft_config"):
        base = AutoModelForCausalLM.from_pretrained(like.peft_config["default"].base_model_name_or_path, dtype=dtype)
        return PeftModel.from_pretrained(base, str(path), is_trainable=True)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def same_weights(a, b) -> bool:
    a, b = dict(a.named_parameters()), dict(b.named_parameters())
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def lora_adapter_dir(folder, base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return str(folder)


SETTINGS = {
    "full": {},
    "bf16": {"model_init_kwargs": {"dtype": "bfloat16"}},
    "patterns": {"es_parameter_patterns": [r"layers\.1\.", "norm"], "antithetic": True},
    "copes": {"es_search_space": "copes", "copes_groups": 2, "weight_decay": 0.05},
    "lowrank": {"es_search_space": "lowrank", "lowrank_rank": 2},
    "fitness_variants": {"es_search_space": "lowrank", "scale_rewards": "group", "fitness_top_k": 2, "noise_reuse": 2},
}


@pytest.mark.parametrize(
    "setting", [s if s == "lowrank" else pytest.param(s, marks=pytest.mark.slow) for s in SETTINGS]
)  # the other settings in the full suite
def test_replay_rebuilds_the_trained_weights_bitwise(tmp_path, tiny_model_dir, setting):
    trainer = train(tmp_path, tiny_model_dir, **SETTINGS[setting])
    chain = load_chain(str(tmp_path / "saved"))
    assert [entry["step"] for entry in chain.steps] == [0, 1, 2]
    assert any(entry["update"] is not None for entry in chain.steps)  # (a step without spread records None)
    replay(chain, tiny_model_dir, str(tmp_path / "rebuilt"))
    rebuilt = load(tmp_path / "rebuilt", trainer.model)
    assert same_weights(rebuilt, trainer.model)
    assert not same_weights(load(tiny_model_dir, trainer.model), trainer.model)  # and training did move it


@pytest.mark.slow  # two adapter runs; the fast tests cover every other parameter selection
def test_replay_of_adapters_trained_alone_and_new(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    adapter = lora_adapter_dir(tmp_path / "adapter", tiny_model_dir)
    alone = train(tmp_path / "alone", adapter, es_adapter_only=True, sigma=0.05, learning_rate=0.05)
    replay(load_chain(str(tmp_path / "alone" / "saved")), adapter, str(tmp_path / "alone-rebuilt"))
    assert same_weights(load(tmp_path / "alone-rebuilt", alone.model), alone.model)
    new = train(tmp_path / "new", tiny_model_dir, peft_config=LoraConfig(r=2, target_modules=["q_proj"]), sigma=0.05)
    replay(load_chain(str(tmp_path / "new" / "saved")), tiny_model_dir, str(tmp_path / "new-rebuilt"))
    assert same_weights(load(tmp_path / "new-rebuilt", new.model), new.model)


@pytest.mark.slow  # two adapter runs of a step each
def test_lora_on_the_embedding_and_trainable_tokens_train_and_replay(tmp_path, tiny_model_dir):
    """LoRA on embed_tokens, and trainable_token_indices (embedding rows trained as a delta): ES trains them, and the
    chain replays to them."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    tokens = sorted(set(AutoTokenizer.from_pretrained(tiny_model_dir)("Count to 1:")["input_ids"]))
    configs = {
        "embedding": LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]),
        "tokens": LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=tokens),
    }
    for name, config in configs.items():
        folder = tmp_path / name
        trainer = ESTrainer(tiny_model_dir, reward, args=es_config(folder, max_steps=1, sigma=0.5),
                            train_dataset=PROMPTS, peft_config=config)  # fmt: skip
        embedding = {n: p.detach().clone() for n, p in trainer.es_params.items() if "embed_tokens" in n}
        trainer.train()
        trainer.save_model(str(folder / "saved"))
        assert embedding and all(not torch.equal(p, trainer.es_params[n]) for n, p in embedding.items())
        replay(load_chain(str(folder / "saved")), tiny_model_dir, str(folder / "rebuilt"))
        assert same_weights(load(folder / "rebuilt", trainer.model), trainer.model)


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s
def test_steps_k_is_checkpoint_k_and_a_resumed_run_continues_its_chain(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    full = train(tmp_path / "full", tiny_model_dir, save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    assert len(load_chain(str(checkpoint)).steps) == 2
    replay(load_chain(str(tmp_path / "full" / "saved")), tiny_model_dir, str(tmp_path / "two"), steps=2)
    assert same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "two"),
                        AutoModelForCausalLM.from_pretrained(checkpoint))  # fmt: skip
    args = es_config(tmp_path / "full", max_steps=3)
    resumed = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.chain.steps == full.chain.steps  # the checkpoint's chain, continued
    assert same_weights(resumed.model, full.model)


@pytest.mark.slow  # a CMA-ES run and two replays
def test_hyper_es_chain_replays_with_the_merged_models_and_refuses_others(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)), alpha=0.05)
    tuned.save_pretrained(tmp_path / "tuned")
    trainer = train(tmp_path, tiny_model_dir, es_search_space="merge", merge_models=[str(tmp_path / "tuned")],
                    population_size=4, generation_kwargs={"do_sample": False})  # fmt: skip
    chain = load_chain(str(tmp_path / "saved"))
    replay(chain, tiny_model_dir, str(tmp_path / "rebuilt"))
    assert same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "rebuilt"), trainer.model)
    with torch.no_grad():
        tuned.model.norm.weight.add_(1.0)
    tuned.save_pretrained(tmp_path / "tuned")  # the merge model is not the one the run merged any more
    with pytest.raises(ValueError, match="not the one the run merged"):
        replay(chain, tiny_model_dir, str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("chain-run")
    train(folder, tiny_model_dir)
    return folder / "saved"


def resigned(data: dict) -> str:
    """`data` as a chain file with its checksum recomputed: what a deliberate forger would write."""
    from trl_es.chains.chain import _checksum

    content = {key: data[key] for key in ("format", "header", "steps", "tip") if key in data}
    return json.dumps({**content, "checksum": _checksum(content)})


def edited(tmp_path, saved_run, edit):
    data = json.loads((saved_run / "es_chain.json").read_text())
    path = tmp_path / "es_chain.json"
    path.write_text(edit(data) if callable(edit) else edit)
    return str(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: json.dumps(d)[:-40], "not a readable seed chain"),
        (lambda d: json.dumps({**d, "steps": d["steps"][:1]}), "checksum"),
        (lambda d: json.dumps({**d, "steps": [{**d["steps"][0], "update": None}, *d["steps"][1:]]}), "checksum"),
        (lambda d: json.dumps({**d, "format": "trl-es-chain/99"}), "trl-es-chain/99"),
        ("[1, 2]", "format"),
    ],
    ids=["truncated", "steps-removed", "step-edited", "future-format", "not-a-chain"],
)
def test_a_bad_chain_is_one_clear_error_and_nothing_is_written(tmp_path, saved_run, tiny_model_dir, edit, message):
    path = edited(tmp_path, saved_run, edit)
    with pytest.raises(ValueError, match=message):
        replay(load_chain(path), tiny_model_dir, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_unknown_search_space_and_another_base_are_refused(tmp_path, saved_run, tiny_model_dir):
    def unknown_space(data):
        data["header"]["space"]["kind"] = "diffusion"
        return resigned(data)

    with pytest.raises(ValueError, match="cannot replay a chain of search space 'diffusion'"):
        load_chain(edited(tmp_path, saved_run, unknown_space))
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(other)
    chain = load_chain(str(saved_run))
    with pytest.raises(ValueError, match="base weights differ"):
        replay(chain, str(other), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="replaying anyway"):
        replay(chain, str(other), str(tmp_path / "forced"), force=True)


def test_replay_command(tmp_path, saved_run, tiny_model_dir, capsys):
    assert cli(["replay", "--chain", str(saved_run), "--base", tiny_model_dir, "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model.safetensors").is_file() and (tmp_path / "a" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert cli(["replay", "--chain", str(saved_run), "--base", tiny_model_dir, "--out", str(tmp_path / "a")]) == 1
    assert "already exists" in capsys.readouterr().err


def crafted(field: str):
    """An edit a forger makes to a chain, with the checksum recomputed (the checksum catches accidents only)."""

    def edit(data):
        update = data["steps"][0]["update"]
        if field == "nan":
            update["updates"][0]["coefficients"][0][1] = "NaN"  # then written as a bare NaN literal below
        elif field == "huge":
            update["updates"][0]["coefficients"][0][1] = 10**400
        elif field == "coefficient":  # a valid chain of another run: replay ends on other weights than its tip
            update["updates"][0]["coefficients"][0][1] *= 2
        elif field == "group":
            update["updates"][0]["group"] = 7
        elif field == "no-updates":
            del update["updates"]
        elif field == "null-header":
            data["header"] = None
        elif field == "list-dtype":
            data["header"]["dtype"] = ["float32"]
        elif field == "table":
            data["header"]["noise"]["table_size"] = 2**45
        elif field == "peft":
            data["header"]["base"]["peft_config"] = {"peft_type": "NOT_A_PEFT", "r": 2}
        text = resigned(data)
        if field == "nan":
            text = text.replace('"NaN"', "NaN")
        if field == "duplicate":
            text = text.replace('{"format":', '{"format":"trl-es-chain/1","format":', 1)
        if field == "deep":
            text = "[" * 100_000 + "]" * 100_000
        return text

    return edit


@pytest.mark.parametrize(
    "field, message",
    [
        ("nan", "NaN is not a number"),
        ("huge", "not finite or out of range"),
        ("coefficient", r"replaying its steps 0\.\.2 gave other weights than its tip"),
        ("group", "malformed"),
        ("no-updates", "malformed"),
        ("null-header", "header is missing"),
        ("list-dtype", "header.dtype"),
        ("table", "table_size"),
        ("peft", "peft"),
        ("duplicate", "duplicate key"),
        ("deep", "nested too deep|format"),
    ],
)
def test_a_crafted_chain_is_one_line_of_error_and_exit_1(tmp_path, saved_run, tiny_model_dir, field, message, capsys):
    """Chains with a valid recomputed checksum but impossible values end in one `trl-es replay: ...` line, exit 1,
    nothing written: no FloatingPointError, OverflowError, KeyError, RecursionError or a 16 GiB allocation."""
    path = edited(tmp_path, saved_run, crafted(field))
    out = tmp_path / "out"
    assert cli(["replay", "--chain", path, "--base", tiny_model_dir, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("trl-es")]  # beside transformers' progress bars
    assert "Traceback" not in err and len(error) == 1 and error[0].startswith("trl-es replay: "), err[-2000:]
    assert re.search(message, error[0]), error
    assert not out.exists()


def test_a_local_folder_is_never_a_hub_id_and_steps_out_of_range_write_nothing(tmp_path, saved_run, tiny_model_dir,
                                                                              capsys, monkeypatch):  # fmt: skip
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("asked the Hub"))
    run = tmp_path / "outputs" / "run"
    run.mkdir(parents=True)  # the docs' form, on a folder without es_chain.json
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no es_chain.json"):
        load_chain("outputs/run")
    assert cli(["replay", "--chain", "outputs/run", "--out", str(tmp_path / "x")]) == 1
    assert "holds no es_chain.json" in capsys.readouterr().err
    for steps in ("99", "4", "-1"):  # a 3-step chain holds the weights after 0..3 steps
        assert cli(["replay", "--chain", str(saved_run), "--base", tiny_model_dir, "--out", str(tmp_path / steps),
                    "--steps", steps]) == 1  # fmt: skip
        assert "outside this chain" in capsys.readouterr().err and not (tmp_path / steps).exists()
    assert cli(["replay", "--chain", str(saved_run), "--base", tiny_model_dir, "--out", str(tmp_path / "0"),
                "--steps", "0"]) == 0  # fmt: skip
    assert "after 0 steps" in capsys.readouterr().out
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert cli(["replay", "--chain", str(saved_run), "--base", tiny_model_dir, "--out", str(dangling)]) == 1
    assert "already exists" in capsys.readouterr().err


@pytest.mark.slow  # kept out of the fast suite for time; ~6 s
def test_a_resume_with_other_settings_or_another_runs_chain_is_refused(tmp_path, tiny_model_dir):
    """Resuming with another seed, parameter patterns, noise table or search space would continue the chain under
    the old header; a chain copied in from another run would no longer rebuild the model. Both are refused."""
    args = dict(max_steps=1, save_strategy="steps", save_steps=1)
    first = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path / "a", **args), train_dataset=PROMPTS)
    first.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-1"
    for change in ({"seed": 4}, {"es_parameter_patterns": ["norm"]}, {"noise_table_size": 1 << 21},
                   {"es_search_space": "lowrank"}):  # fmt: skip
        again = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path / "b", max_steps=2, **change),
                          train_dataset=PROMPTS)  # fmt: skip
        with pytest.raises(ValueError, match="other .* than it was trained with"):
            again.train(resume_from_checkpoint=str(checkpoint))
    other = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path / "c", seed=9, **args), train_dataset=PROMPTS)
    other.train()
    shutil.copy(tmp_path / "c" / "out" / "checkpoint-1" / "es_chain.json", checkpoint / "es_chain.json")
    again = ESTrainer(
        tiny_model_dir, reward, args=es_config(tmp_path / "d", seed=9, max_steps=2), train_dataset=PROMPTS
    )
    with pytest.raises(ValueError, match="saved with other weights"):
        again.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow  # kept out of the fast suite for time; ~3.5 s
def test_chain_only_push_and_replay_from_a_hub_id(tmp_path, tiny_model_dir, monkeypatch):
    """The Hub is the one outside boundary: HfApi and hf_hub_download are replaced by stand-ins that keep the files
    locally; what trl-es uploads and reads back is real."""
    import huggingface_hub

    uploaded = {}

    class Repo:
        repo_id = "me/tiny-es-chain"

    class StandInApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo, private=None, exist_ok=False):
            return Repo()

        def upload_folder(self, repo_id, folder_path, commit_message, revision=None):
            uploaded.update({p.name: p.read_bytes() for p in __import__("pathlib").Path(folder_path).iterdir()})

    trainer = train(tmp_path, tiny_model_dir)
    monkeypatch.setattr(huggingface_hub, "HfApi", StandInApi)
    trainer.push_to_hub(chain_only=True)
    assert set(uploaded) == {"es_chain.json", "README.md"}
    card = uploaded["README.md"].decode()
    assert "trl-es replay --base" in card and "--chain me/tiny-es-chain" in card and "SHA-256" in card
    assert len(uploaded["es_chain.json"]) < 16 * 1024  # 3 steps × 4 members: kilobytes

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "es_chain.json").write_bytes(uploaded["es_chain.json"])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename: str(hub / filename))
    replay(load_chain("me/tiny-es-chain"), tiny_model_dir, str(tmp_path / "from-hub"))
    from transformers import AutoModelForCausalLM

    assert same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "from-hub"), trainer.model)
