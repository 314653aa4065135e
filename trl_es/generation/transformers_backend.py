"""The default generation backend: transformers' `generate` on the trainer's own model (CPU or GPU)."""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field, fields

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl.data_utils import is_conversational

from ..util.compat import SAMPLING_FIELDS, sampling_warpers


@dataclass
class Completions:
    """Completions for `prompts` repeated `num_generations` times each (prompt-major order). Agent episodes
    (`trl_es.rollout.episodes`) also fill the per-completion fields after `entropy_sums`."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    truncated: list[bool]
    entropy_sums: list[float] | None = None  # Σ over each completion's tokens of H(π(·|x_<t)), when recorded
    tool_mask: list[list[int]] | None = None  # 1: a token the model generated, 0: a tool's or environment's
    environments: list | None = None  # each completion's environment instance
    tool_calls: list[int] | None = None  # each completion's number of tool calls …
    tool_failures: list[int] | None = None  # … and of those that failed
    extras: dict[str, list] = field(default_factory=dict)  # a rollout_func's extra fields, one value per completion

    def select(self, start: int, end: int) -> Completions:
        """Completions start..end-1 (e.g. one member's rows of a batched population)."""
        part = lambda values: None if values is None else values[start:end]  # noqa: E731
        return Completions(
            *(part(getattr(self, f.name)) for f in fields(self) if f.name != "extras"),
            extras={key: values[start:end] for key, values in self.extras.items()},
        )

    @property
    def lengths(self) -> list[int]:
        """Each completion's number of model-generated tokens (tool results left out, as in GRPOTrainer)."""
        if self.tool_mask is None:
            return [len(ids) for ids in self.completion_ids]
        return [sum(mask) for mask in self.tool_mask]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) = −Σ_v p_v log p_v (nats) over the last dimension."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


class EntropyRecorder(LogitsProcessor):
    """Records each row's next-token entropy at every step and leaves the scores unchanged. transformers runs user
    processors before temperature, top-k and top-p, so this is the entropy of the model's own distribution."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(token_entropy(scores).cpu())
        return scores


class SeededSampler(LogitsProcessor):
    """Sampling with one generator per batch row: the scores go through transformers' sampling warpers
    (temperature, top-k, top-p, min-p, …), row b draws its token with `torch.multinomial` (the sampler transformers
    uses) from its own generator (seeded by `seeds[b]`), and the returned scores leave only that token, so greedy
    decoding emits it. A row's tokens are thus a function of its prompt and seed alone, never of which other rows
    (members, prompts) share the batch. With common random numbers, members sample with the same generators: their
    completions agree until a member's distribution tips a draw. Put last: it replaces the scores."""

    def __init__(self, warpers: LogitsProcessorList, seeds: list[int], device: torch.device):
        self.warpers = warpers
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = self.warpers(input_ids, scores).float().softmax(-1)  # warped-away tokens: 0
        choice = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators, strict=True)])
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(1, choice[:, None], 0.0)


def greedy_config(config: GenerationConfig) -> GenerationConfig:
    """`config` with `do_sample=False` and no sampling warpers (`SeededSampler` applies them instead)."""
    config = copy.deepcopy(config)
    config.do_sample = False
    for name in SAMPLING_FIELDS:
        setattr(config, name, None)
    return config


class TransformersGeneration:
    """Tokenizes prompts as GRPOTrainer does (chat template for conversational prompts, plain text otherwise),
    generates in one left-padded batch, and cuts each completion after its first EOS."""

    records_entropy = True  # `generate(..., record_entropy=True)` gives each completion's token entropy

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        generation_config: GenerationConfig,
        eos_token_ids: list[int],
        chat_template_kwargs: dict | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.eos_token_ids = eos_token_ids
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.warned_context = False

    def tokenize(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt; a ValueError names an empty or missing prompt, and a prompt that leaves no room
        for the completion within the model's context warns (once)."""
        prompts = list(prompts)
        for k, prompt in enumerate(prompts):
            if prompt is None or not (prompt.strip() if isinstance(prompt, str) else prompt):
                raise ValueError(
                    f"prompt {k} of this step is {'None' if prompt is None else 'empty'} ({prompt!r}): every row needs "
                    "a prompt, text or a list of chat messages"
                )
        if is_conversational({"prompt": prompts[0]}):
            ids = self.tokenizer.apply_chat_template(
                conversation=prompts,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **self.chat_template_kwargs,
            )["input_ids"]
        else:
            ids = self.tokenizer(text=prompts)["input_ids"]
        self._check_context(max(map(len, ids)))
        return ids

    @property
    def max_model_length(self) -> int | None:
        """The longest prompt + completion the engine takes (the model's context)."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def _check_context(self, prompt_length: int) -> None:
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        needed = prompt_length + (self.generation_config.max_new_tokens or 0)
        if context and needed > context and not self.warned_context:
            self.warned_context = True
            warnings.warn(
                f"a prompt of {prompt_length} tokens plus max_completion_length={self.generation_config.max_new_tokens} "
                f"exceeds the model's context (max_position_embeddings={context}); GRPOTrainer does not truncate "
                "prompts either: what the model generates beyond its context is unreliable. Shorten the prompts or "
                "max_completion_length.",
                stacklevel=2,
            )

    def generate(
        self, prompts: list, prompt_ids: list[list[int]], num_generations: int, seeds: list[int], record_entropy=False
    ) -> Completions:
        """`num_generations` completions of each prompt (prompt-major order), completion r sampled with `seeds[r]`
        (`trl_es.es.seeds.completion_seeds`); with `record_entropy`, also each completion's summed token entropy."""
        rows = [ids for ids in prompt_ids for _ in range(num_generations)]
        completion_ids, truncated, entropy_sums = self.generate_ids(rows, seeds, record_entropy)
        return self.completions(prompts, num_generations, completion_ids, truncated, entropy_sums)

    @torch.no_grad()
    def generate_ids(
        self, rows: list[list[int]], seeds: list[int], record_entropy: bool = False, max_new_tokens: int | None = None
    ) -> tuple[list[list[int]], list[bool], list[float] | None]:
        """One completion per row of prompt token ids, in one left-padded batch: (completion ids, each cut after its
        first EOS; whether it was truncated; its summed token entropy, with `record_entropy`). Row r samples from a
        generator of its own seeded by `seeds[r]` (`SeededSampler`), so its tokens never depend on the other rows;
        greedy decoding (`do_sample=False`) ignores the seeds, and beam sampling (`num_beams` > 1 in
        `generation_kwargs`) draws from torch's RNG seeded by `seeds[0]`, shared by the call's rows.
        `max_new_tokens` overrides the config's."""
        if len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} sampling seeds for {len(rows)} rows")
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])
        device = self.model.device
        recorder = EntropyRecorder() if record_entropy else None
        config, processors = self.generation_config, [recorder] if recorder else []
        beams = (config.num_beams or 1) > 1  # beam sampling keeps transformers' sampler, seeded by the first row
        if config.do_sample and not beams:  # sampled row by row: transformers' warpers, then each row's own draw
            processors.append(SeededSampler(sampling_warpers(self.model, config), seeds, device))
            config = greedy_config(config)
        if max_new_tokens is not None:
            config = copy.deepcopy(config)
            config.max_new_tokens = max_new_tokens
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seeds[0] if seeds else 0)  # only beam sampling draws from it
                output = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=config,
                    synced_gpus=False,  # processes generate for different members, never in lockstep
                    logits_processor=LogitsProcessorList(processors),
                )
        finally:
            self.model.train(was_training)
        completion_ids, truncated = [], []
        for row in output[:, width:].tolist():
            end = next((k for k, token in enumerate(row) if token in self.eos_token_ids), None)
            completion_ids.append(row if end is None else row[: end + 1])
            truncated.append(end is None)
        entropy_sums = None
        if recorder is not None:
            per_step = torch.stack(recorder.steps, dim=1).double()  # (rows, generated steps)
            entropy_sums = [float(per_step[row, : len(ids)].sum()) for row, ids in enumerate(completion_ids)]
        return completion_ids, truncated, entropy_sums

    def completions(self, prompts, num_generations, completion_ids, truncated, entropy_sums=None) -> Completions:
        """The Completions of `completion_ids` (each ending with its EOS unless truncated), decoded as GRPOTrainer does:
        text for text prompts, an assistant message for conversational ones."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        repeated_prompts = [p for p in prompts for _ in range(num_generations)]
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        return Completions(repeated_prompts, completions, completion_ids, truncated, entropy_sums)
