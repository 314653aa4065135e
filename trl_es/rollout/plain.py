"""The plain rollout: every member's completions of the rows' prompts in one batched `generate` call."""

from __future__ import annotations

from ..generation import Completions
from ..generation.base import row_prompts


class PlainRollout:
    """`n` completions of each row's prompt per member, in one call of the generation backend (`generate`): rows
    member-major, each routed to its member, each with its prompt's images."""

    batches_members = True

    def __init__(self, generation):
        self.generation = generation
        self.records_entropy = generation.records_entropy

    def __call__(self, rows, n, seeds, n_members=1, route=None, key=None, record_entropy=False) -> Completions:
        prompts = row_prompts(rows)  # a row's images in its conversation
        prompt_ids = self.generation.tokenize(prompts)
        if route is not None:
            route([j for j in range(n_members) for _ in range(len(rows) * n)])
        return self.generation.generate(prompts * n_members, prompt_ids * n_members, n, seeds, record_entropy)
