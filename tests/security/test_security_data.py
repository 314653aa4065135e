"""Bad data gets a clear error or GRPO's behaviour: empty or missing prompts name their row, each reward function
sees its own copy of the completions, an empty iterable dataset is an error, prompts beyond the model's context warn
once. (Numpy and torch scalar rewards: tests/security/test_security_values.py.)"""

import warnings

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import es_config, weights

from trl_es import ESTrainer


def reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.mark.parametrize("bad", ["", None, "   "], ids=["empty", "none", "blank"])
def test_an_empty_or_missing_prompt_in_a_later_row_names_the_row(tmp_path, tiny_model_dir, bad):
    prompts = [f"Count to {n}:" for n in range(1, 9)]
    prompts[5] = bad  # in the second step's batch
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=2), train_dataset=dataset)
    states = [weights(trainer.model)]
    trainer.add_callback(type("Keep", (__import__("transformers").TrainerCallback,), {
        "on_step_end": lambda self, args, state, control, model=None, **kw: states.append(weights(model))
    })())  # fmt: skip
    with pytest.raises(ValueError, match=r"prompt \d of this step is (empty|None)"):
        trainer.train()
    assert len(states) <= 2  # the bad row is in step 0 or 1 (shuffled); what came before it is kept
    assert all(torch.equal(p, states[-1][n]) for n, p in trainer.model.named_parameters())


def test_each_reward_function_sees_its_own_copy_of_the_completions(tmp_path, tiny_model_dir, prompt_dataset):
    seen = []

    def vandal(completions, completion_ids, **kwargs):
        originals = list(completions)
        completions[:] = ["x"] * len(completions)
        for ids in completion_ids:
            ids.clear()
        return [float(len(c)) for c in originals]

    def observer(completions, completion_ids, **kwargs):
        seen.append((list(completions), [len(ids) for ids in completion_ids]))
        return [0.0] * len(completions)

    args = es_config(tmp_path, max_steps=1)
    trainer = ESTrainer(tiny_model_dir, [vandal, observer], args=args, train_dataset=prompt_dataset)
    trainer.train()
    assert seen and all(c != "x" for completions, _ in seen for c in completions)
    assert all(length > 0 for _, lengths in seen for length in lengths)
    assert trainer.state.log_history[0]["completions/mean_length"] > 0  # the trainer's own copy is intact too


def test_an_empty_iterable_dataset_is_an_error(tmp_path, tiny_model_dir):
    def nothing():
        yield from ()

    dataset = IterableDataset.from_generator(nothing, features=Dataset.from_dict({"prompt": ["x"]}).features)
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=2), train_dataset=dataset)
    with pytest.raises(ValueError, match="no prompts"):
        trainer.train()


@pytest.mark.slow
def test_prompts_beyond_the_context_warn_once(tmp_path, tiny_model_dir):
    long_prompt = "count " * 300  # the tiny model's context is 256 positions
    dataset = Dataset.from_dict({"prompt": [long_prompt] * 8})
    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, max_steps=2), train_dataset=dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    context = [w for w in caught if "max_position_embeddings" in str(w.message)]
    assert len(context) == 1 and "256" in str(context[0].message)
