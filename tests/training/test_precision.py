"""Mixed precision as GRPO's `bf16`/`fp16`: members computed in half precision (autocast on the transformers path),
θ and its updates kept in float32 — also for a half-precision model, whose ES parameters are upcast — restored
bitwise, resumed and replayed bitwise."""

import pytest
import torch
from helpers import assert_same_weights, weights
from helpers import es_config as config
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay


def even_token_share(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def mixed(tmp_path, **overrides):
    return config(tmp_path, bf16=True, use_cpu=True, **overrides)


def test_bf16_computes_members_in_bfloat16_and_keeps_theta_in_float32(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = ESTrainer(tiny_model_dir, even_token_share, args=mixed(tmp_path), train_dataset=prompt_dataset)
    seen = set()
    layer = trainer.model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
    before = weights(trainer.model)
    trainer.train()
    assert seen == {torch.bfloat16}  # every forward of generation ran in bfloat16
    after = weights(trainer.model)
    assert all(t.dtype == torch.float32 for t in after.values())
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    plain = ESTrainer(tiny_model_dir, even_token_share, args=config(tmp_path / "fp32"), train_dataset=prompt_dataset)
    plain.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, output: seen.add(output.dtype))
    seen.clear()
    plain.generation.generate(["Count to 3:"], plain.generation.tokenize(["Count to 3:"]), 1, [0])
    assert seen == {torch.float32}  # bf16 off (the CPU default): the weights' own dtype


def test_a_bfloat16_model_trains_a_float32_theta_whose_small_updates_are_kept(
    tmp_path, tiny_model_dir, prompt_dataset
):
    """Loaded in bfloat16 with bf16=True, the ES parameters are upcast (values exact) and take updates far below
    bfloat16's rounding step in full: the weights move by the logged update norm. Without bf16 the same updates are
    mostly rounded away, and a warning said so."""
    step = dict(sigma=0.05, learning_rate=2e-6, max_steps=1)  # a step of ~2e-6 per weight: bf16's ~1e-4 rounds it
    start = weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16))
    moved = {}
    for name, overrides in [("mixed", dict(bf16=True, use_cpu=True)), ("bf16 only", {})]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        with pytest.warns(UserWarning) as caught:
            trainer = ESTrainer(
                model,
                even_token_share,
                args=config(tmp_path / name, **step, **overrides),
                train_dataset=prompt_dataset,
            )
        rounding_warned = any("rounded to their precision" in str(w.message) for w in caught)
        assert rounding_warned is (name == "bf16 only")
        if name == "mixed":
            assert all(p.dtype == torch.float32 for p in trainer.es_params.values())
            assert all(torch.equal(p.detach(), start[n].float()) for n, p in trainer.es_params.items())
        trainer.train()
        norm = next(log["es/update_norm"] for log in trainer.state.log_history if "es/update_norm" in log)
        distance = sum(
            float((p.detach().float() - start[n].float()).square().sum()) for n, p in trainer.es_params.items()
        )
        moved[name] = distance**0.5 / norm
    assert moved["mixed"] == pytest.approx(1.0, rel=1e-3)
    assert moved["bf16 only"] < 0.5, moved  # measured: most of the update lost to rounding


def test_bf16_restores_the_float32_theta_bitwise_after_a_failure(tmp_path, tiny_model_dir, prompt_dataset):
    calls = []

    def flaky(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C while the third member is scored
        return even_token_share(completion_ids)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    trainer = ESTrainer(model, flaky, args=mixed(tmp_path), train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert_same_weights(trainer.model, before)


@pytest.mark.slow  # a further variant: resume and replay (tests/training/test_trainer.py, test_chains.py) in bf16
def test_a_bf16_run_resumes_and_replays_bitwise(tmp_path, tiny_model_dir, prompt_dataset):
    """A bfloat16 model trained with bf16=True: resumed from its checkpoint it reaches the uninterrupted run's
    float32 weights, and its seed chain replays them from the bfloat16 base."""

    def run(name, **overrides):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        args = mixed(tmp_path / name, max_steps=4, **overrides)
        return ESTrainer(model, even_token_share, args=args, train_dataset=prompt_dataset)

    full = run("full")
    full.train()
    first = run("resumed", save_strategy="steps", save_steps=2)
    first.train()
    resumed = run("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "out" / "checkpoint-2"))
    assert_same_weights(resumed.model, weights(full.model))
    full.save_model()
    out = tmp_path / "replayed"
    bf16_base = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bf16_base)
    chain = load_chain(str(tmp_path / "full" / "out"))
    assert chain.header["dtype"] == "float32"
    replay(chain, str(bf16_base), str(out))
    replayed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert_same_weights(replayed, weights(full.model))
