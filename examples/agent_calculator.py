"""A tool-using agent trained with ES on CPU: SmolLM2-135M-Instruct learns to call a calculator environment's tool.

    python examples/agent_calculator.py [--steps 8] [--population 8] [--output-dir outputs/agent]

Each problem adds two 3-digit numbers, too large for a 135M model to add in its head (it answers correctly about
1 time in 20 unaided). The environment (`Calculator`) gives the model an `add` tool; its reward (`get_reward`,
environment-owned, as in TRL) is 1 when the model called `add` on the problem's numbers, and the reward function
`answered` adds 1 when the final message states the sum. The prompt shows two worked episodes (call `add`, read the
result, answer): with them SmolLM2 knows the format, but greedily it writes a `<tool_response>` itself instead of
calling the tool (with three worked episodes it calls it every time, so there would be nothing to learn). Sampled at
temperature 0.7 it calls the tool about 40% of the time: ES trains on that signal.
SmolLM2 has no tool template: TRL's Qwen2.5 template uses the same special tokens.

Prints the held-out tool-call and success rates (greedy and sampled) before and after training, and each step's
mean reward. `--probe` only measures the base model.
"""

from __future__ import annotations

import argparse
import os
import random
import time


class Calculator:
    """One problem per episode: `reset` reads the row's numbers, `add` is the tool, `get_reward` is 1 when `add` was
    called on the problem's two numbers (in either order)."""

    def reset(self, numbers, **row):
        self.numbers, self.calls = sorted(numbers), []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum a + b.
        """
        self.calls.append(sorted([int(a), int(b)]))
        return int(a) + int(b)

    def get_reward(self) -> float:
        return float(self.numbers in self.calls)


def answered(completions, environments, **kwargs):
    """1 when the episode's last message states the problem's total (its first integer)."""
    import re

    rewards = []
    for completion, environment in zip(completions, environments, strict=True):
        found = re.search(r"-?\d+", completion[-1].get("content") or "")
        rewards.append(float(found is not None and int(found.group()) == sum(environment.numbers)))
    return rewards


def call(name: str, **arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


SYSTEM = "You are a calculator agent. Add with the add tool, then answer with the sum."


def worked_episodes() -> list[dict]:
    """Two worked episodes: call add, read the result, answer."""
    messages = []
    for a, b in [(123, 456), (808, 97)]:
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            call("add", a=a, b=b),
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
    return messages


def problems(n: int, seed: int, terms: int = 2):
    from datasets import Dataset

    rng = random.Random(seed)
    numbers = [[rng.randint(100, 999) for _ in range(terms)] for _ in range(n)]
    prompts = [
        [
            {"role": "system", "content": SYSTEM},
            *worked_episodes(),
            {"role": "user", "content": f"What is {' + '.join(map(str, row))}?"},
        ]
        for row in numbers
    ]
    return Dataset.from_dict({"prompt": prompts, "numbers": numbers})


def rates(trainer, dataset, samples: int = 1) -> tuple[float, float]:
    """(share of episodes calling `add` on the problem's numbers, share answering the sum) of θ on `dataset`,
    greedy with `samples` = 1, else `samples` sampled episodes per problem at the training temperature."""
    from trl_es.generation.transformers_backend import greedy_config

    generation, rows = trainer.generation, dataset.to_list()
    sampled = generation.generation_config
    if samples == 1:
        generation.generation_config = greedy_config(sampled)
    try:
        completions = trainer.rollout(rows, samples, list(range(len(rows) * samples)), key="held-out")
    finally:
        generation.generation_config = sampled
    called = sum(e.get_reward() for e in completions.environments) / len(completions.environments)
    solved = sum(answered(completions.completions, completions.environments)) / len(completions.environments)
    return called, solved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=5e-3)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--prompts", type=int, default=2, help="problems per ES step (2 episodes each per member)")
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/agent")
    parser.add_argument("--probe", action="store_true", help="only measure the base model")
    options = parser.parse_args(argv)

    import trl
    from transformers import AutoTokenizer

    from trl_es import ESConfig, ESTrainer
    from trl_es.util.models import smollm2_dir

    start = time.time()
    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as template:
        tokenizer.chat_template = template.read()
    args = ESConfig(
        output_dir=options.output_dir,
        population_size=options.population,
        sigma=options.sigma,
        learning_rate=options.learning_rate,
        per_device_train_batch_size=options.prompts,
        num_generations=2,
        temperature=0.7,
        max_steps=options.steps,
        max_completion_length=64,  # the whole episode: the call (~26 tokens), the tool result (~20), the answer
        max_tool_calling_iterations=2,
        seed=options.seed,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = ESTrainer(
        model=model_dir,
        reward_funcs=answered,
        args=args,
        train_dataset=problems(256, options.seed),
        processing_class=tokenizer,
        environment_factory=Calculator,
    )
    held_out = problems(options.held_out, 10_000 + options.seed)

    def report(when: str) -> None:
        (called, solved), (called_t, solved_t) = rates(trainer, held_out), rates(trainer, held_out, samples=2)
        print(
            f"{when}: greedy: calls add {called:.3f}, solves {solved:.3f}; sampled (T=0.7): calls add {called_t:.3f}, "
            f"solves {solved_t:.3f}  ({len(held_out)} held-out problems, {time.time() - start:.0f}s)",
            flush=True,
        )

    report("before ES")
    if options.probe:
        return
    trainer.train()
    for log in trainer.state.log_history:
        if "reward" in log:
            print(
                f"step {log['step']:3d}  mean member reward {log['reward']:.3f}  "
                f"(calls add {log['rewards/Calculator/mean']:.3f}, answers {log['rewards/answered/mean']:.3f})"
            )
    report("after ES")
    trainer.save_model()
    print(f"model saved to {options.output_dir}; total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
