"""The README's demo: ES on SmolLM2-135M-Instruct (CPU) learning small sums, with held-out accuracy before/after.

    python -m trl_es.commands.demo [--steps 12] [--population 8]

Settings (N=8, σ=5e-3, α=5e-3, greedy decoding, 8 prompts per step) are the best of the ES settings compared in
`benchmarks/learning.py` on 2 CPU cores: held-out greedy accuracy 0.72 on average over 3 seeds after 4 minutes,
against 0.35 for the earlier σ=3e-3, α=2e-3 (better on every seed); Qiu et al.'s defaults (σ=1e-3, α=5e-4) moved
it within noise. Against TRL's GRPOTrainer the learning curves (docs/benchmarks.md) show ES ahead on greedy accuracy
for the first 5 minutes and GRPO ahead on sampled Pass@8 at 5 and 7.5 minutes. Completions are cut at 12 tokens:
only the first integer is scored.
"""

from __future__ import annotations

import logging
import time

from transformers import PrinterCallback, TrainerCallback

from .parser import command_parser


def held_out_accuracy(trainer, dataset) -> float:
    """Share of held-out prompts whose greedy completion (current weights) earns the correctness reward."""
    from ..es.seeds import completion_seeds
    from ..tasks import first_integer_reward

    generation = trainer.generation
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    result = generation.generate(prompts, generation.tokenize(prompts), 1, completion_seeds(0, len(prompts), 1))
    rewards = first_integer_reward(result.completions, answers)
    return sum(r >= 1.0 for r in rewards) / len(rewards)


def not_deepspeeds_cpu_notice(record: logging.LogRecord) -> bool:
    """DeepSpeed, where installed (`make demo` installs it for the tests), is imported by accelerate in every Trainer
    and says first that it set its accelerator to CPU: the demo never uses DeepSpeed, so that line is dropped."""
    return not str(record.msg).startswith("Setting accelerator to CPU")


FLAT_STEPS = (
    "  every member scored the same, so none ranks above another and ES leaves the weights as they were: early on "
    "the model gets few sums right, so steps stay flat until a member answers a sum the others miss"
)


class PrintReward(TrainerCallback):
    """One line per step (rewards, times); the first step without spread is followed by `FLAT_STEPS`, saying why."""

    def __init__(self):
        self.explained = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            print(
                f"step {state.global_step:3d}  mean member reward {logs['reward']:.3f}  "
                f"(min {logs['es/population_reward_min']:.3f}, max {logs['es/population_reward_max']:.3f})  "
                f"generate {logs['es/time/generate']:.1f}s  "
                f"noise+update {logs['es/time/noise'] + logs['es/time/update']:.2f}s"
                f"{'  (no spread: weights unchanged)' if logs.get('es/skipped_update') else ''}",
                flush=True,
            )
            if logs.get("es/skipped_update") and not self.explained:
                print(FLAT_STEPS, flush=True)
                self.explained = True


def main(argv=None):
    parser = command_parser("trl-es demo", __doc__)
    parser.add_argument("--steps", type=int, default=12, help="ES steps")
    parser.add_argument("--population", type=int, default=8, help="members per step (N)")
    parser.add_argument("--sigma", type=float, default=5e-3, help="noise scale σ")
    parser.add_argument("--learning-rate", type=float, default=5e-3, help="ES step size α")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (noise, sampling)")
    parser.add_argument("--output-dir", default="outputs/demo", help="where the trained model goes")
    parser.add_argument(
        "--held-out", type=int, default=64, help="held-out problems scored before and after (the first of 64)"
    )
    options = parser.parse_args(argv)
    if not 1 <= options.held_out <= 64:
        parser.error(f"--held-out must be 1..64 problems, got {options.held_out}")
    logging.getLogger("DeepSpeed").addFilter(not_deepspeeds_cpu_notice)

    from .. import ESConfig, ESTrainer
    from ..tasks import first_integer_reward, small_sums
    from ..util.models import smollm2_dir

    start = time.time()
    model_dir = smollm2_dir()
    args = ESConfig(
        output_dir=options.output_dir,
        population_size=options.population,
        sigma=options.sigma,
        learning_rate=options.learning_rate,
        per_device_train_batch_size=8,
        max_steps=options.steps,
        max_completion_length=12,
        generation_kwargs={"do_sample": False},
        seed=options.seed,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = ESTrainer(
        model=model_dir,
        reward_funcs=first_integer_reward,
        args=args,
        train_dataset=small_sums("train"),
        callbacks=[PrintReward()],
    )
    trainer.remove_callback(PrinterCallback)  # PrintReward prints the lines that matter
    held_out = small_sums("test").select(range(options.held_out))
    before = held_out_accuracy(trainer, held_out)
    print(f"held-out accuracy before ES: {before:.3f} ({round(before * len(held_out))}/{len(held_out)})", flush=True)
    trainer.train()
    after = held_out_accuracy(trainer, held_out)
    print(f"held-out accuracy after ES:  {after:.3f} ({round(after * len(held_out))}/{len(held_out)})")
    trainer.save_model()
    print(f"model saved to {options.output_dir}; total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
