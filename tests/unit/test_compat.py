"""The compatibility module (trl_es/util/compat.py) on the installed TRL and transformers: the CI matrix runs this on the
oldest and the newest supported versions, so a release that renames a hook fails here with the supported range."""

import pytest

from trl_es.util.compat import BaseTrainer, check_trainer_hooks, is_peft_model, subtract_subsequence


def test_the_trainer_hooks_estrainer_relies_on_are_there():
    check_trainer_hooks()  # the installed transformers


def test_the_private_attributes_estrainer_uses_are_the_installed_trainers():
    """Every private attribute in the register is one the installed TRL or transformers still defines or sets."""
    import inspect

    from transformers import Trainer, TrainingArguments

    from trl_es.util.compat import TRAINER_ATTRIBUTES

    sources = "".join(inspect.getsource(cls) for cls in (Trainer, TrainingArguments, BaseTrainer))
    for name in TRAINER_ATTRIBUTES:
        assert f"self.{name} =" in sources or f"{name} =" in sources, name


def test_every_other_private_name_is_in_its_installed_module():
    """Each name of compat's `PRIVATE_NAMES` occurs in the installed source of the module that defines it (found
    without importing it)."""
    import importlib.util
    import os

    from trl_es.util.compat import PRIVATE_NAMES

    for (module, name), use in PRIVATE_NAMES.items():
        package, *path = module.split(".")
        spec = importlib.util.find_spec(package)
        if spec is None and package == "vllm":
            continue  # vLLM is an extra
        origin = os.path.join(os.path.dirname(spec.origin), *path) + ".py" if path else spec.origin
        with open(origin, encoding="utf-8") as source:
            text = source.read()
        forms = (f".{name}", f"def {name}(", f"class {name}(", f'"{name}"')  # an attribute, a function, a class
        assert any(form in text for form in forms), (module, name, use)


def test_a_transformers_without_a_hook_is_an_error_naming_the_supported_range():
    from transformers import Trainer

    class Renamed(Trainer):
        _prepare_for_training = None

    with pytest.raises(ImportError, match=r"Trainer._prepare_for_training.*transformers>=5.16.1,<6"):
        check_trainer_hooks(Renamed)


def test_subtract_subsequence_matches_trl_where_trl_has_it():
    cases = [
        (["--config", "r.yaml", "--num_processes", "2", "--max_steps", "3"], ["--num_processes", "2"]),
        (["a", "b", "a", "c"], ["a", "c"]),
        (["x"], []),
        (["--a", "1", "--a", "1"], ["--a", "1"]),
    ]
    expected = [["--config", "r.yaml", "--max_steps", "3"], ["b", "a"], ["x"], ["--a", "1"]]
    assert [subtract_subsequence(items, sub) for items, sub in cases] == expected
    try:
        from trl.cli.commands.training import _subtract_subsequence
    except ImportError:
        return
    assert [_subtract_subsequence(items, sub) for items, sub in cases] == expected


def test_is_peft_model_and_the_base_trainer(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.base_trainer import _BaseTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not is_peft_model(model)
    assert is_peft_model(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))
    assert BaseTrainer is _BaseTrainer  # TRL's, with its model card, on the supported range


def test_a_missing_optional_package_is_an_error_naming_its_extra(monkeypatch):
    import sys

    from trl_es.evaluation.report import pyplot
    from trl_es.util.compat import import_extra

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the [eval] extra were not installed
    with pytest.raises(ImportError, match=r"plotting needs matplotlib.*pip install 'trl-es\[eval\]'"):
        pyplot()
    monkeypatch.setitem(sys.modules, "math_verify", None)
    from trl_es.tasks.math500 import math_reward

    with pytest.raises(ImportError, match=r"pip install 'trl-es\[tasks\]'"):
        math_reward(["$2$"], ["2"])
    assert import_extra("json", "none", "-").dumps([1]) == "[1]"
