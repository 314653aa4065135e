"""The research's Easy and Hard recipes (examples/paper/paper.py) run: every method, one tiny step of each stage on
SmolLM2, offline (the tests' TRL_ES_DATA holds the tasks' first rows)."""

import importlib.util

import pytest
from helpers import REPOSITORY
from transformers import AutoModelForCausalLM


SCRIPT = REPOSITORY / "examples" / "paper" / "paper.py"


def paper():
    spec = importlib.util.spec_from_file_location("paper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "method"), [("hard", "grpo-es")])  # both trainers, the longer setting
def test_a_settings_recipe_trains_each_stage_and_names_its_evaluation(tmp_path, setting, method, capsys):
    outputs = paper().main(["--setting", setting, "--method", method, "--model", "smollm2", "--smoke",
                            "--output-dir", str(tmp_path)])  # fmt: skip
    assert [path.rsplit("/", 1)[-1] for path in outputs] == ["-".join(method.split("-")[: k + 1])
                                                             for k in range(len(method.split("-")))]  # fmt: skip
    AutoModelForCausalLM.from_pretrained(outputs[-1])  # each stage saved a loadable model
    suite = "easy" if setting == "easy" else "math,heldout"
    assert f"--suite {suite} --protocol {'paper' if setting == 'easy' else 'paper-hard'}" in capsys.readouterr().out


def test_the_settings_state_the_researchs_models_data_and_lengths():
    settings = paper().SETTINGS
    assert settings["easy"]["model"] == "Qwen/Qwen2.5-1.5B-Instruct" and settings["easy"]["task"] == "gsm8k"
    assert settings["hard"]["model"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert (settings["hard"]["task"], settings["hard"]["max_completion_length"]) == ("deepscaler", 8192)
