"""What ESTrainer's arguments alone decide is refused before any model weights load (`training.checks`): a test that
lists those refusals, with weights loading turned into a failure, so a refusal that moved after the load fails here."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig

from trl_es import ESConfig, ESTrainer
from trl_es.util import models


PROMPTS = Dataset.from_dict({"prompt": ["Count to 3:"]})


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def tool() -> str:
    """A tool.

    Returns:
        Nothing useful.
    """
    return ""


def refusals(tmp_path, model_dir):
    """(ESTrainer's arguments, the refusal's message) for each refusal `check_arguments` makes."""
    entropy = ESConfig(str(tmp_path / "out"), report_to="none", log_completion_entropy=True)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return [
        ({"model": 3}, "`model` must be a model id, a path"),
        ({"args": GRPOConfig(str(tmp_path / "grpo"), use_cpu=True, bf16=False)}, "`args` is a GRPOConfig"),
        ({"args": ESConfig(model_dir, report_to="none")}, "holds the model this run starts from"),
        ({"optimizers": (optimizer, None)}, "which the plain ES update does not use"),
        ({"tools": [tool], "rollout_func": lambda prompts, trainer: {}}, "rollout_func"),
        ({"args": entropy, "tools": [tool]}, "log_completion_entropy is not recorded for agent episodes"),
    ]


def test_every_argument_refusal_comes_before_any_weights_load(tmp_path, tiny_model_dir, monkeypatch):
    def loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(models, "create_model_from_path", loading)
    for given, message in refusals(tmp_path, tiny_model_dir):
        arguments = {"model": tiny_model_dir, "reward_funcs": reward, "train_dataset": PROMPTS, **given}
        arguments.setdefault("args", ESConfig(str(tmp_path / "out"), report_to="none"))
        with pytest.raises((TypeError, ValueError), match=message):
            ESTrainer(**arguments)
