"""TRL's 2048 agent example (an in-process game behind `environment_factory`) with ESTrainer in place of
GRPOTrainer.

    python examples/openenv/game_2048.py --model smollm2 [--steps 2] [--population 4]

The script keeps TRL's shape: a game class whose `reset` deals a board and whose public method `move` is the tool,
a dataset of identical prompts, a GRPOConfig and a trainer built from them. What changes for ES on CPU: the
GRPOConfig is converted with `ESConfig.from_grpo_config` (plus the ES fields), bf16 is off (TRL's default is on), no
vLLM, a small model sampled at T=0.7. SmolLM2 ships no tool template, so the tokenizer gets TRL's Qwen2.5 one, and
the prompt opens with a system message and three worked games showing a `move` call in that template's format
(with instructions alone SmolLM2 answers in prose). The board is 3×3 and shown as a list, so that a move and its
answer take ~55 tokens. The reward is the game's score (`get_reward`, owned by the game): the sum of the tiles
merged.
"""

from __future__ import annotations

import argparse
import os
import random
import time


SIZE = 3
DIRECTIONS = ("up", "down", "left", "right")
SYSTEM = "You play 2048: call the move tool."
PROMPT = "Play 2048 with the move tool. Board: "  # `reset` appends the board
# Three worked games for the few-shot prompt: (board, the move called, what the tool answered)
WORKED = [
    ([[2, 2, 0], [0, 0, 0], [0, 4, 0]], "left", "Board: [[4, 0, 0], [0, 0, 0], [4, 0, 2]]. Score: 4"),
    ([[4, 0, 0], [0, 0, 2], [4, 0, 0]], "up", "Board: [[8, 0, 2], [0, 2, 0], [0, 0, 0]]. Score: 8"),
    ([[0, 2, 2], [0, 0, 0], [2, 0, 0]], "right", "Board: [[0, 0, 4], [2, 0, 0], [0, 0, 2]]. Score: 4"),
]


def few_shot() -> list[dict]:
    """The system message and three worked games (call `move`, read the board, stop): SmolLM2 calls the tool after
    them; with instructions alone it answers in prose."""
    messages = [{"role": "system", "content": SYSTEM}]
    for board, direction, answer in WORKED:
        call = {"type": "function", "function": {"name": "move", "arguments": {"direction": direction}}}
        messages += [
            {"role": "user", "content": f"{PROMPT}{board}"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "move", "content": answer},
            {"role": "assistant", "content": "Done."},
        ]
    return messages


class Game2048:
    """One game per episode: `reset` deals three tiles (from Python's RNG, which trl-es seeds) and shows the board,
    `move` is the tool, `get_reward` the score. `calls` counts the tool calls the game received."""

    def reset(self, **row) -> str:
        self.board = [[0] * SIZE for _ in range(SIZE)]
        self.score, self.calls = 0, 0
        for _ in range(3):
            self._spawn()
        return str(self.board)

    def move(self, direction: str) -> str:
        """Slide every tile of the board in one direction; equal tiles that meet merge.

        Args:
            direction: One of "up", "down", "left", "right".

        Returns:
            The board and score after the move.
        """
        self.calls += 1
        direction = str(direction).strip().lower()
        if direction not in DIRECTIONS:
            return f"Unknown direction {direction!r}: use up, down, left or right."
        lines = self._lines(direction)
        merged = [self._merge([self.board[r][c] for r, c in line]) for line in lines]
        if all([self.board[r][c] for r, c in line] == values for line, (values, _) in zip(lines, merged, strict=True)):
            return f"Nothing moved. {self._show()}"
        for line, (values, gained) in zip(lines, merged, strict=True):
            for (r, c), value in zip(line, values, strict=True):
                self.board[r][c] = value
            self.score += gained
        self._spawn()
        return self._show()

    def get_reward(self) -> float:
        return float(self.score)

    @staticmethod
    def _lines(direction: str) -> list[list[tuple[int, int]]]:
        """The board's cells in lines, each ordered from the edge the tiles slide towards."""
        near = range(SIZE) if direction in ("up", "left") else range(SIZE - 1, -1, -1)
        if direction in ("left", "right"):
            return [[(r, c) for c in near] for r in range(SIZE)]
        return [[(r, c) for r in near] for c in range(SIZE)]

    @staticmethod
    def _merge(values: list[int]) -> tuple[list[int], int]:
        """A line slid towards its start: (its new values, the points its merges score)."""
        tiles, out, gained = [v for v in values if v], [], 0
        while tiles:
            if len(tiles) > 1 and tiles[0] == tiles[1]:
                out.append(2 * tiles[0])
                gained += 2 * tiles[0]
                tiles = tiles[2:]
            else:
                out.append(tiles.pop(0))
        return out + [0] * (len(values) - len(out)), gained

    def _spawn(self) -> None:
        empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if not self.board[r][c]]
        if empty:
            r, c = random.choice(empty)
            self.board[r][c] = 4 if random.random() < 0.1 else 2

    def _show(self) -> str:
        return f"Board: {self.board}. Score: {self.score}"


def tool_tokenizer(model: str):
    """The model's tokenizer; TRL's Qwen2.5 template where its own cannot call tools (SmolLM2's)."""
    import trl
    from transformers import AutoTokenizer
    from trl.chat_template_utils import supports_tool_calling

    from trl_es.util.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    if not supports_tool_calling(tokenizer):
        with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as template:
            tokenizer.chat_template = template.read()
    return tokenizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model directory, a Hub id, or 'smollm2'")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=1, help="per_device_train_batch_size (×2 accumulation)")
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--output-dir", default="outputs/openenv-2048")
    return parser.parse_args(argv)


def make_trainer(options):
    """The ESTrainer of TRL's 2048 script for the parsed command line `options`."""
    from datasets import Dataset
    from trl import GRPOConfig
    from trl.trainer.utils import remove_none_values

    from trl_es import ESConfig, ESTrainer

    prompt = [*few_shot(), {"role": "user", "content": PROMPT}]
    dataset = Dataset.from_dict({"prompt": [prompt] * 64})
    # Arrow gives every message every key (`tool_calls: None` on plain ones); TRL's helper drops them again
    dataset = dataset.with_transform(remove_none_values)
    grpo_args = GRPOConfig(
        output_dir=options.output_dir,
        bf16=False,  # CPU
        use_vllm=False,  # CPU
        chat_template_kwargs={"enable_thinking": False},
        logging_steps=1,
        log_completions=True,
        num_completions_to_print=2,
        report_to="none",
        max_completion_length=options.max_completion_length,
        per_device_train_batch_size=options.prompts,
        gradient_accumulation_steps=2,
        num_generations=options.num_generations,
        temperature=0.7,
        max_steps=options.steps,
        max_tool_calling_iterations=3,
        save_strategy="no",
        disable_tqdm=True,
    )
    args = ESConfig.from_grpo_config(grpo_args, population_size=options.population, sigma=5e-3, learning_rate=5e-3)
    return ESTrainer(
        model=options.model,
        args=args,
        train_dataset=dataset,
        processing_class=tool_tokenizer(options.model),
        environment_factory=Game2048,
    )


def summary(trainer) -> str:
    """Each logged step's mean reward (the score) and tool-call frequency, and the moves of the last step's games."""
    lines = [
        f"step {log['step']}: mean score {log['rewards/Game2048/mean']:.2f}, "
        f"tool calls per episode {log['tools/call_frequency']:.2f}"
        for log in trainer.state.log_history
        if "rewards/Game2048/mean" in log
    ]
    games = trainer.agents.pool[None]
    lines.append(f"last step: {sum(g.calls for g in games)} tool calls in {len(games)} games")
    return "\n".join(lines)


def main(argv=None):
    start = time.time()
    trainer = make_trainer(parse_args(argv))
    trainer.train()
    print(summary(trainer))
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
