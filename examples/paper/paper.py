"""The research's two settings (ES vs GRPO on reasoning), as runnable recipes for GPU users.

    python examples/paper/paper.py --setting easy --method es              # then: trl-es eval --suite easy ...
    python examples/paper/paper.py --setting hard --method grpo-es
    python examples/paper/paper.py --setting easy --method es --model smollm2 --smoke   # 1 tiny step, on CPU

Easy: Qwen2.5-1.5B-Instruct post-trained on GSM8K train for two epochs, evaluated with `--suite easy` (GSM8K,
CommonsenseQA, HotpotQA, Countdown, GPQA, MBPP). Hard: DeepSeek-R1-Distill-Qwen-1.5B on DeepScaleR for one epoch,
8,192 new tokens, evaluated with `--suite math` (AIME 2024/2025, AMC 2023, MATH-500) and `--suite heldout`.
Methods: `es` (ESTrainer), `grpo` (TRL's GRPOTrainer), and the sequential compositions `grpo-es` and `es-grpo`
(each stage gets half the epochs; the second starts from the first's output). Each run's output directory ends in
the method's name; the evaluation command to run on it is printed at the end.

What the research states and what it leaves open is said beside each value (`SETTINGS`, `ES`, `GRPO`); the open
ones are Qiu et al. 2025's ES defaults (which the research builds on) and TRL's GRPO defaults.
"""

from __future__ import annotations

import argparse
import os


SETTINGS = {
    "easy": {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",  # stated
        "task": "gsm8k",  # GSM8K train (stated)
        "epochs": 2,  # stated ("two epochs of GSM8K post-training")
        "max_completion_length": 2048,  # stated for evaluation; training length left open: the same here
        "suites": "easy",
    },
    "hard": {
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",  # stated
        "task": "deepscaler",  # DeepScaleR-Preview (stated)
        "epochs": 1,  # stated ("one-epoch Hard Setting")
        "max_completion_length": 8192,  # stated for evaluation; the same for training here
        "suites": "math,heldout",
    },
}
"""What the research states for each setting."""

ES = {"population_size": 30, "sigma": 1e-3, "learning_rate": 5e-4, "per_device_train_batch_size": 8}
"""ES's settings: Qiu et al. 2025's defaults (N=30, σ=1e-3, α=5e-4, greedy members); the research leaves them
open."""

GRPO = {"learning_rate": 1e-6, "per_device_train_batch_size": 8, "num_generations": 8, "bf16": True}
"""GRPO's settings: TRL's defaults; the research's Hard GRPO is a released checkpoint (SofT-GRPO's), so its
training parameters are not the research's own."""

SMOKE = {"max_steps": 1, "max_completion_length": 8, "per_device_train_batch_size": 2}
"""`--smoke`: one tiny step of each stage, to check a recipe runs (the tests run every method this way)."""


def train(method: str, model: str, setting: dict, output_dir: str, epochs: float, smoke: bool, use_vllm: bool):
    """One stage: `method` ("es" or "grpo") from `model` into `output_dir`; returns `output_dir`."""
    from trl_es.tasks import get_task

    task = get_task(setting["task"])
    common = dict(output_dir=output_dir, num_train_epochs=epochs, max_completion_length=setting["max_completion_length"],
                  save_strategy="no", report_to="none", logging_steps=1, use_vllm=use_vllm)  # fmt: skip
    if smoke:
        common |= SMOKE
    if method == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        values = {**GRPO, **common}
        if smoke:
            values |= {"num_generations": 2, "bf16": False}
        trainer = GRPOTrainer(model, task.reward, args=GRPOConfig(**values), train_dataset=task.load("train"))
    else:
        from trl_es import ESConfig, ESTrainer

        values = {**ES, "generation_kwargs": {"do_sample": False}, **common}  # greedy members, as Qiu et al.
        if smoke:
            values |= {"population_size": 2}
        trainer = ESTrainer(model, task.reward, args=ESConfig(**values), train_dataset=task.load("train"))
    trainer.train()
    trainer.save_model()
    return output_dir


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=list(SETTINGS), required=True)
    parser.add_argument("--method", choices=("es", "grpo", "grpo-es", "es-grpo"), required=True)
    parser.add_argument("--model", default=None, help="default: the setting's model ('smollm2' runs offline)")
    parser.add_argument("--output-dir", default="outputs/paper")
    parser.add_argument("--use-vllm", action="store_true", help="generate with vLLM (GPU)")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each stage (checks a recipe runs)")
    options = parser.parse_args(argv)
    setting = SETTINGS[options.setting]
    from trl_es.util.models import resolve_model

    model, stages = resolve_model(options.model or setting["model"]), options.method.split("-")
    folder, outputs = os.path.join(options.output_dir, options.setting), []
    for k, method in enumerate(stages):
        output = os.path.join(folder, "-".join(stages[: k + 1]))
        model = train(method, model, setting, output, setting["epochs"] / len(stages), options.smoke, options.use_vllm)
        outputs.append(output)
    suites = setting["suites"]
    print(
        f"trained {outputs[-1]}; evaluate it in the research's protocol beside the base model:\n"
        f"  trl-es eval --model {options.model or setting['model']} --model {outputs[-1]} --suite {suites} "
        f"--protocol {'paper-hard' if options.setting == 'hard' else 'paper'} --train-task {setting['task']} "
        f"{'--use-vllm --vllm-entropy ' if options.use_vllm else ''}--out-dir {folder}/eval"
    )
    return outputs


if __name__ == "__main__":
    main()
