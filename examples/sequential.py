"""GRPO then ES, or ES then GRPO: two stages with real TRL GRPOTrainer and trl-es ESTrainer, each stage's model kept.

    python examples/sequential.py --order grpo-es [--model smollm2] [--output-dir outputs/sequential]
    python examples/sequential.py --order es-grpo --grpo-steps 20 --es-steps 12

The ES research reports that the two orders give Pass@1/Pass@K trade-offs neither method gives alone. Each stage
starts from the previous stage's output directory (weights, tokenizer and chat template), as a user would chain
two recipes; the stages write `<output-dir>/1-<first>` and `<output-dir>/2-<second>`. The task is the built-in
small sums; `--reward` takes a dotted path to your own TRL-signature reward function.
"""

from __future__ import annotations

import argparse
import os


def run_grpo(model: str, output_dir: str, steps: int, dataset, reward) -> str:
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # float32 like the ES stage (and CPUs); GRPOConfig's default is bf16
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()
    return output_dir


def run_es(model: str, output_dir: str, steps: int, dataset, reward) -> str:
    from trl_es import ESConfig, ESTrainer

    args = ESConfig(
        output_dir=output_dir,
        max_steps=steps,
        population_size=8,
        sigma=3e-3,
        learning_rate=2e-3,
        per_device_train_batch_size=8,
        max_completion_length=12,
        generation_kwargs={"do_sample": False},
        save_strategy="no",
        report_to="none",
    )
    trainer = ESTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()
    return output_dir


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description="GRPO → ES or ES → GRPO, each stage's model kept.")
    parser.add_argument("--order", choices=["grpo-es", "es-grpo"], required=True)
    parser.add_argument("--model", default="smollm2", help="model path or id; 'smollm2' is SmolLM2-135M-Instruct")
    parser.add_argument("--output-dir", default="outputs/sequential")
    parser.add_argument("--grpo-steps", type=int, default=8)
    parser.add_argument("--es-steps", type=int, default=8)
    parser.add_argument("--reward", default="first_integer_reward", help="built-in name or dotted import path")
    options = parser.parse_args(argv)

    from trl_es.commands.train import load_reward_funcs
    from trl_es.tasks import small_sums
    from trl_es.util.models import smollm2_dir

    model = smollm2_dir() if options.model == "smollm2" else options.model
    dataset, reward = small_sums("train"), load_reward_funcs([options.reward])
    stages = {"grpo": (run_grpo, options.grpo_steps), "es": (run_es, options.es_steps)}
    outputs = []
    for position, name in enumerate(options.order.split("-"), start=1):
        run, steps = stages[name]
        model = run(model, os.path.join(options.output_dir, f"{position}-{name}"), steps, dataset, reward)
        outputs.append(model)
        print(f"stage {position} ({name.upper()}, {steps} steps) saved to {model}")
    return outputs


if __name__ == "__main__":
    main()
