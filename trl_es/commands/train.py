"""`trl-es es`: TRL's `trl grpo` script with ES swapped in.

    trl-es es --config recipe.yaml [--field value ...]          # any recipe `trl grpo --config` accepts
    trl-es es --config recipe.yaml --accelerate_config zero3 --num_processes 4

The same argument dataclasses as `trl grpo` — TRL's `GRPOScriptArguments` (dataset_name, dataset_config, splits,
dataset_streaming, reward_funcs, reward_model_name_or_path), `ModelConfig` (model_name_or_path, model_revision,
dtype, attn_implementation, LoRA fields, load_in_4bit / load_in_8bit: an adapter on a quantized base),
`DatasetMixtureConfig` (datasets) — with `ESConfig` in place of GRPOConfig (which accepts every GRPOConfig field).
Reward functions resolve as in TRL's script (its registry, factories included, then dotted import paths), plus the
built-in tasks' rewards; datasets load with TRL's `get_dataset` or `datasets.load_dataset`, plus the built-in tasks
and local files. What no dataclass knows goes to `accelerate launch` when it is one of its flags (TRL's
`--accelerate_config` short names resolved as in `trl`); anything else is an error naming the closest field.
"""

from __future__ import annotations

import importlib
import os
import sys

import yaml

from ..tasks import TASKS
from ..training.config import ESConfig, unknown_field_error
from ..util.compat import subtract_subsequence


BUILTIN_REWARDS = {task.reward.__name__: task.reward for task in TASKS.values()}
"""The built-in tasks' reward functions, by name."""
FILE_BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}


def make_parser():
    """TRL's `trl grpo` parser with ESConfig in place of GRPOConfig."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    parser = TrlParser((GRPOScriptArguments, ESConfig, ModelConfig, DatasetMixtureConfig), prog="trl-es es")
    for action in parser._actions:  # TRL's help lists its own registry; ES's also holds the built-in tasks' rewards
        if action.dest == "reward_funcs":
            action.help = (
                f"Reward functions: names from {sorted(reward_registry())}, or dotted import paths "
                "(my_lib.rewards.custom_reward)."
            )
    return parser


def reward_registry() -> dict:
    """`trl grpo`'s reward registry (TRL builds it inside its script's `main`, with these values), and the built-in
    tasks' rewards."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        **BUILTIN_REWARDS,
    }


def load_reward_funcs(names: list[str] | None, reward_model: str | None = None) -> list:
    """The reward functions `names` designate (registry names or dotted import paths, modules in the working
    directory importable, as in TRL's script), after the reward model when one is given."""
    registry, funcs = reward_registry(), [reward_model] if reward_model else []
    for name in names or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module_path, attribute = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                funcs.append(getattr(importlib.import_module(module_path), attribute))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"Could not import reward function '{name}': {error}") from error
        else:
            raise ValueError(
                f"Unknown reward function '{name}': use one of {sorted(registry)} or a dotted import path."
            )
    if not funcs:
        raise ValueError("give reward_funcs (or reward_model_name_or_path): ES learns from rewards only")
    return funcs


def load_datasets(script_args, dataset_args):
    """The splits to train and evaluate on: TRL's dataset mixture (`datasets`), a built-in task, a local file, or
    `load_dataset(dataset_name, dataset_config)`, as `trl grpo` loads them."""
    from datasets import load_dataset
    from trl import get_dataset

    name = script_args.dataset_name
    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if not name:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")
    if name in TASKS:
        task = TASKS[name]
        return {"train": task.load("train"), "test": task.load(task.eval_split)}
    if os.path.isfile(name):
        suffix = name.rsplit(".", 1)[-1]
        if suffix not in FILE_BUILDERS:
            raise ValueError(f"Unsupported dataset file type '.{suffix}' for {name}")
        return load_dataset(FILE_BUILDERS[suffix], data_files=name)
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def build_trainer(script_args, training_args, model_args, dataset_args):
    """The ESTrainer the arguments describe, as TRL's GRPO script builds its GRPOTrainer."""
    from trl import get_peft_config, get_quantization_config

    from .. import ESTrainer

    model_init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                         "dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}  # fmt: skip
    training_args.model_init_kwargs = {key: value for key, value in model_init_kwargs.items() if value is not None}
    model = model_args.model_name_or_path
    if model is None:
        raise ValueError("give model_name_or_path: a model id or directory ('smollm2' for SmolLM2-135M-Instruct)")
    dataset = load_datasets(script_args, dataset_args)
    evaluating = training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset
    return ESTrainer(
        model=model,
        reward_funcs=load_reward_funcs(script_args.reward_funcs, script_args.reward_model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluating else None,
        quantization_config=get_quantization_config(model_args),  # load_in_4bit / load_in_8bit, with an adapter
        peft_config=get_peft_config(model_args),
    )


def train_and_save(trainer, script_args, training_args) -> None:
    """Train, save and push, as TRL's GRPO script does."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def launch_arguments(parser, remaining: list[str]) -> list[str]:
    """`remaining` (what no dataclass knew) as `accelerate launch` arguments, TRL's `--accelerate_config` resolved; an
    argument accelerate does not know either is an error naming the closest field."""
    from accelerate.commands.launch import launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    launch_args = resolve_accelerate_config_argument(remaining)
    launcher = launch_command_parser()
    _, unknown = launcher.parse_known_args([*launch_args, "-m", "trl_es.cli"])
    flags = [flag for flag in unknown if flag.startswith("--")]
    if flags:
        known = [action.dest for action in parser._actions] + [
            option.lstrip("-") for action in launcher._actions for option in action.option_strings
        ]
        raise unknown_field_error(flags[0].lstrip("-").split("=")[0], known, owner="trl-es es")
    return launch_args


def run(argv: list[str]) -> None:
    """Parse `trl-es es` arguments; train here, or re-run under `accelerate launch` when launch settings are given
    (the launched processes see TRL_ES_LAUNCHED=1 and ignore the launch settings of the recipe). A bad argument,
    recipe or set-up ends the program with one line naming the problem, before any training."""
    try:
        parser = make_parser()
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            args=argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        launch_args = launch_arguments(parser, config_remaining + cli_remaining)
        if launch_args and not os.environ.get("TRL_ES_LAUNCHED"):
            from accelerate.commands.launch import launch_command, launch_command_parser

            os.environ["TRL_ES_LAUNCHED"] = "1"
            script_args = subtract_subsequence(argv, cli_remaining)
            command = [*launch_args, "-m", "trl_es.cli", "es", *script_args]
            launch_command(launch_command_parser().parse_args(command))
            return
        trainer = build_trainer(*parsed)
    except yaml.YAMLError as error:  # a syntax error, or a tag such as !!python/... that safe loading refuses
        where = getattr(error, "problem_mark", None)
        raise SystemExit(f"trl-es es: the recipe is not plain YAML data ({getattr(error, 'problem', None) or error}"
                         f"{f', line {where.line + 1}' if where else ''}); nothing ran") from error  # fmt: skip
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise SystemExit(f"trl-es es: {error}") from error
    train_and_save(trainer, parsed[0], parsed[1])
