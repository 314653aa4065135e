"""The user's rollout function as a rollout: `rollout_func(prompts, trainer)` generates by itself, as GRPOTrainer
takes it, and returns `prompt_ids`, `completion_ids`, `logprobs` and any extra per-completion fields (passed to the
reward functions; `env_mask` marks the model's own tokens)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from trl.data_utils import is_conversational

from ..generation import Completions
from ..generation.base import row_prompts
from ..util.compat import parse_response, parses_responses


ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What a `rollout_func` must return, as in GRPOTrainer."""


class RolloutFunction:
    """One member per call (the function generates with whatever weights the model holds): each row's prompt
    repeated `n` times, as GRPOTrainer's batches are, handed to `rollout_func(prompts, trainer)`."""

    batches_members = False
    records_entropy = False

    def __init__(self, rollout_func: Callable, trainer, generation):
        self.rollout_func, self.trainer, self.generation = rollout_func, trainer, generation
        self.tokenizer = generation.tokenizer

    def __call__(self, rows, n, seeds, n_members=1, route=None, key=None, record_entropy=False) -> Completions:
        if route is not None:
            route(0)  # the call's one member generates every row the function asks for
        prompts = [prompt for prompt in row_prompts(rows) for _ in range(n)]  # images put in, as GRPOTrainer does
        output = self.rollout_func(copy.deepcopy(prompts), self.trainer)
        missing = sorted(set(ROLLOUT_KEYS) - set(output))
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
        extras = {key: list(values) for key, values in output.items() if key not in ROLLOUT_KEYS}
        mask = extras.pop("env_mask", None)
        ids = [list(map(int, row)) for row in output["completion_ids"]]
        for name, values in {
            "completion_ids": ids,
            **extras,
            **({"env_mask": mask} if mask is not None else {}),
        }.items():
            if len(values) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(values)} {name!r} for {len(prompts)} prompts (one per prompt × "
                    f"num_generations)"
                )
        for r, (row, marks) in enumerate(zip(ids, mask or (), strict=False)):
            check_env_mask(list(marks), r, len(row))
        eos = set(self.generation.eos_token_ids)
        return Completions(
            prompts=prompts,
            completions=self._messages(prompts, ids, output["prompt_ids"]),
            completion_ids=ids,
            truncated=[bool(row) and row[-1] not in eos for row in ids],
            tool_mask=None if mask is None else [list(row) for row in mask],
            extras=extras,
        )

    def _messages(self, prompts: list, ids: list[list[int]], prompt_ids: list) -> list:
        """The completions as GRPOTrainer decodes them: text for text prompts; for conversational ones an assistant
        message, parsed (tool calls included) when the tokenizer has a response schema."""
        if not is_conversational({"prompt": prompts[0]}):
            return self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if parses_responses(self.tokenizer):
            return [
                [parse_response(self.tokenizer, row, prefix=list(prefix))]
                for row, prefix in zip(ids, prompt_ids, strict=True)
            ]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": text}] for text in texts]


def check_env_mask(marks: list, completion: int, length: int) -> None:
    """A ValueError unless `marks`, a rollout_func's `env_mask` of completion `completion` (`length` tokens), marks
    each token with 1 (the model's) or 0 (the environment's)."""
    if len(marks) != length:
        raise ValueError(
            f"rollout_func's env_mask has {len(marks)} values for completion {completion} of {length} tokens: it "
            "needs one per completion token (1: the model's, 0: the environment's)"
        )
    wrong = sorted({float(mark) for mark in marks} - {0.0, 1.0})
    if wrong:
        raise ValueError(
            f"rollout_func's env_mask marks each token with 0 (the environment's) or 1 (the model's); completion "
            f"{completion}'s holds {wrong}"
        )
