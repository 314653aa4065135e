"""What ESTrainer's arguments alone decide is refused before any model weights load (`training.checks`): a test that
lists those refusals, with weights loading turned into a failure, so a refusal that moved after the load fails here.
What the run's set-up decides (`check_setup`, on its `RunFacts`) is refused before any engine starts: likewise
listed, with making the generation backend turned into a failure."""

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


def set_up_refusals(tmp_path, moe_dir):
    """(ESTrainer's arguments, the refusal's message) for each refusal `check_setup` makes that one process can
    reach (the others need ZeRO-3 or several processes: tests/trl/test_trl_entry_points.py gives their facts)."""
    from peft import LoraConfig

    def args(**fields):
        return ESConfig(str(tmp_path / "out"), report_to="none", **fields)

    lora = LoraConfig(r=2, target_modules=["q_proj"])
    experts = LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    server = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://127.0.0.1:9"}
    lowrank = args(use_vllm=True, es_search_space="lowrank")
    return [
        ({"args": args(**server), "peft_config": lora}, "an adapter .peft_config, es_adapter_only. with vllm_mode"),
        ({"args": lowrank, "peft_config": lora}, "with an adapter and use_vllm"),
        ({"args": args(sparse_delta_tau=1e-3), "peft_config": lora}, "sparse_delta_tau needs a full model"),
        ({"model": moe_dir, "args": args(es_search_space="lowrank"), "peft_config": experts}, "adapter on parameters"),
    ]


def test_every_set_up_refusal_comes_before_any_engine_starts(tmp_path, tiny_model_dir, tiny_moe_dir, monkeypatch):
    """`check_setup` runs on the run's facts before the generation backend (and any vLLM engine) is made: with
    making it turned into a failure, each refusal is still the one raised."""
    from trl_es.training import trainer

    def backend(*args, **kwargs):
        raise AssertionError("the generation backend was made before the refusal")

    monkeypatch.setattr(trainer, "make_backend", backend)
    for given, message in set_up_refusals(tmp_path, tiny_moe_dir):
        arguments = {"model": tiny_model_dir, "reward_funcs": reward, "train_dataset": PROMPTS, **given}
        with pytest.raises(ValueError, match=message):
            ESTrainer(**arguments)
