"""A mixture of experts (the tiny Qwen3-MoE: fused 3-D experts, a router per layer) in every search space: updates
reach the experts (low-rank: rank r per expert), the centre comes back bitwise, the low-rank space's mixed batch
equals each member evaluated alone, bf16, LoRA adapters on modules and the refusal of adapters on parameters."""

import pytest
import torch
from helpers import es_config as config
from helpers import weights

from trl_es import ESTrainer


EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def even_token_share(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def moe_config(tmp_path, **overrides):
    """One step of 4 members over 2 prompts: σ large enough that members of the random tiny MoE differ."""
    values = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1, sigma=0.05)
    return config(tmp_path, **{**values, **overrides})


def recorded(reward=None):
    """A reward function that keeps each member's completions (one call per member, in order), and its list."""
    calls = []

    def score(completion_ids, **kwargs):
        calls.append([tuple(ids) for ids in completion_ids])
        return even_token_share(completion_ids) if reward is None else [reward] * len(completion_ids)

    return score, calls


def expert_names(model):
    return [n for n, _ in model.named_parameters() if n.endswith(EXPERTS)]


@pytest.mark.parametrize("space", ["full", "copes", "lowrank"])
def test_an_update_moves_every_expert_and_the_routers(tmp_path, tiny_moe_dir, prompt_dataset, space):
    """Every expert of every fused tensor changes, and so do the routers; in the low-rank space expert e's change
    is Σ_s c_s·A_s,e·B_s,eᵀ/√r over the step's 4 seeds: of rank ≤ 4·r, where a full update would have rank 32."""
    args = moe_config(tmp_path, es_search_space=space, copes_groups=2, copes_partition="module", lowrank_rank=1)
    trainer = ESTrainer(tiny_moe_dir, even_token_share, args=args, train_dataset=prompt_dataset)
    before = weights(trainer.model)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert trainer.state.log_history[0]["es/skipped_update"] == 0.0
    assert len(expert_names(trainer.model)) == 4
    for name in expert_names(trainer.model):
        delta = (after[name] - before[name]).detach()
        assert all(delta[e].abs().max() > 0 for e in range(delta.shape[0])), name
        ranks = [torch.linalg.matrix_rank(delta[e]).item() for e in range(delta.shape[0])]
        assert all(r <= 4 for r in ranks) if space == "lowrank" else all(r == min(delta.shape[1:]) for r in ranks)
    assert all(not torch.equal(after[n], before[n]) for n in after if n.endswith("mlp.gate.weight"))


@pytest.mark.parametrize("space", ["full", pytest.param("copes", marks=pytest.mark.slow)])  # copes: a variant of full
def test_a_step_without_signal_puts_the_centre_back_bitwise(tmp_path, tiny_moe_dir, prompt_dataset, space):
    """Members were written into the experts (their completions differ), and a step whose rewards carry no signal
    leaves θ bitwise as it was."""
    score, calls = recorded(reward=1.0)
    args = moe_config(tmp_path, es_search_space=space, copes_groups=2, copes_partition="module")
    trainer = ESTrainer(tiny_moe_dir, score, args=args, train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.warns(UserWarning, match="no signal"):
        trainer.train()
    assert len(calls) == 4 and len({tuple(c) for c in calls}) > 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_lowrank_mixed_batch_equals_each_member_alone(tmp_path, tiny_moe_dir, prompt_dataset):
    """Greedy completions of the 4 members generated in one batch (each row its member's experts and routers) equal
    those generated one member per call, and differ between members; the weights stay bitwise θ."""
    runs = {}
    for per_call in (None, 1):
        score, calls = recorded(reward=1.0)
        args = moe_config(tmp_path / str(per_call), es_search_space="lowrank", lowrank_members_per_call=per_call,
                          generation_kwargs={"do_sample": False}, max_completion_length=6)  # fmt: skip
        trainer = ESTrainer(tiny_moe_dir, score, args=args, train_dataset=prompt_dataset)
        before = weights(trainer.model)
        with pytest.warns(UserWarning, match="no signal"):
            trainer.train()
        assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
        runs[per_call] = calls
    assert len(runs[None]) == 4 and runs[None] == runs[1]
    assert len({tuple(c) for c in runs[None]}) > 1


@pytest.mark.parametrize("space", [pytest.param("full", marks=pytest.mark.slow), "lowrank"])  # full: test_precision.py
def test_bf16_computes_in_bfloat16_and_keeps_the_experts_float32(tmp_path, tiny_moe_dir, prompt_dataset, space):
    args = moe_config(tmp_path, es_search_space=space, bf16=True, use_cpu=True)
    trainer = ESTrainer(tiny_moe_dir, even_token_share, args=args, train_dataset=prompt_dataset)
    before = weights(trainer.model)
    trainer.train()
    for name, p in trainer.model.named_parameters():
        if name.endswith(EXPERTS):
            assert p.dtype == torch.float32 and not torch.equal(p, before[name]), name


@pytest.mark.parametrize("space", ["full", "lowrank"])
def test_a_lora_adapter_on_attention_trains_on_the_moe(tmp_path, tiny_moe_dir, prompt_dataset, space):
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = moe_config(tmp_path, es_search_space=space, sigma=1.0, learning_rate=0.5)  # LoRA's B starts at 0
    trainer = ESTrainer(tiny_moe_dir, even_token_share, args=args, train_dataset=prompt_dataset, peft_config=lora)
    before = weights(trainer.model)
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)


def test_an_adapter_on_the_experts_parameters_trains_in_full_and_is_refused_in_lowrank(
    tmp_path, tiny_moe_dir, prompt_dataset
):
    """peft's `target_parameters` LoRA on the fused experts: its factors are read inside the experts' forward,
    where full ES writes its members and low-rank ES could not add them."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, target_modules=[], target_parameters=list(EXPERTS))
    with pytest.raises(ValueError, match=r"lowrank' with a PEFT adapter on parameters.*target_parameters"):
        ESTrainer(tiny_moe_dir, even_token_share, args=moe_config(tmp_path / "lowrank", es_search_space="lowrank"),
                  train_dataset=prompt_dataset, peft_config=lora)  # fmt: skip
    args = moe_config(tmp_path / "full", sigma=1.0, learning_rate=0.5)
    trainer = ESTrainer(tiny_moe_dir, even_token_share, args=args, train_dataset=prompt_dataset, peft_config=lora)
    before = weights(trainer.model)
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n and ".experts." in n for n in moved)
