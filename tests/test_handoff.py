"""GRPO ⇄ ES hand-off with real TRL GRPOTrainer and ESTrainer: each order, each stage's output kept and loadable."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLE = Path(__file__).parents[1] / "examples" / "sequential.py"


def token_sum_reward(completion_ids, **kwargs):
    """Varies between completions (and between ES members), so both trainers get a signal on a tiny model."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def weights(path):
    return dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())


@pytest.mark.parametrize("order", ["grpo-es", "es-grpo"])
def test_sequential_example_runs_both_orders_and_keeps_each_stage(tmp_path, tiny_model_dir, order):
    spec = importlib.util.spec_from_file_location("sequential", EXAMPLE)
    sequential = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sequential)
    outputs = sequential.main([
        "--order", order, "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--grpo-steps", "2",
        "--es-steps", "2", "--reward", "test_handoff.token_sum_reward",
    ])
    first, second = order.split("-")
    assert outputs == [str(tmp_path / f"1-{first}"), str(tmp_path / f"2-{second}")]
    chain = [tiny_model_dir, *outputs]
    for previous, stage, name in zip(chain, chain[1:], order.split("-")):
        tokenizer = AutoTokenizer.from_pretrained(stage)  # the tokenizer and chat template travel with the model
        assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
        before, after = weights(previous), weights(stage)
        assert any(not torch.equal(before[n], after[n]) for n in before), f"{stage} did not train"
        if name == "es":  # ESTrainer's card names the weights it started from
            assert f"| base model | `{previous}` |" in (Path(stage) / "README.md").read_text()
    if order == "es-grpo":  # GRPO started from the ES output: it is nearer to it than to the original model
        original, es, grpo = weights(tiny_model_dir), weights(outputs[0]), weights(outputs[1])
        distance = lambda a, b: sum(float((a[n] - b[n]).square().sum()) for n in a)  # noqa: E731
        assert distance(grpo, es) < distance(grpo, original)
