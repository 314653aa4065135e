"""The default generation backend: transformers' `generate` on the trainer's own model (CPU or GPU), images
included for a vision-language model."""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..es.weights import LocalWeights
from ..util.compat import SAMPLING_FIELDS, sampling_warpers
from .base import Generation
from .lowrank_forward import LowRankPopulation


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) = −Σ_v p_v log p_v (nats) over the last dimension, with 0·log 0 = 0: a token a logits
    processor masked to −∞ (e.g. a VLM's image token, suppressed) adds nothing instead of a NaN."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


class EntropyRecorder(LogitsProcessor):
    """Records each row's next-token entropy at every step and leaves the scores unchanged. transformers runs user
    processors before temperature, top-k and top-p, so this is the entropy of the model's own distribution."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(token_entropy(scores).cpu())
        return scores


@torch.no_grad()
def completion_logits(model, prompts: list[list[int]], completions: list[list[int]], pad_token_id: int = 0) -> list:
    """Teacher forcing: for each (prompt, completion) pair of token ids, the model's next-token logits (float32) at
    every completion token — row j is the distribution that drew completion token j — from one right-padded forward
    pass in eval mode."""
    rows = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)], attention[r, : len(ids)] = torch.tensor(ids), 1
    device, training = next(model.parameters()).device, model.training
    model.eval()
    try:
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits.float()
    finally:
        model.train(training)
    starts = [len(prompt) - 1 for prompt in prompts]  # the logits that drew each completion's first token
    return [logits[r, start : start + len(c)] for r, (start, c) in enumerate(zip(starts, completions, strict=True))]


def completion_entropy_sums(
    model, rows: list[list[int]], completion_ids: list[list[int]], batch_size: int = 16
) -> list[float]:
    """Σ over each completion's tokens of H(π(·|prompt, earlier completion tokens)), scored by teacher forcing
    (`completion_logits`, `batch_size` rows a forward): what `EntropyRecorder` records while generating, for
    completions generated elsewhere (vLLM)."""
    sums = []
    for start in range(0, len(rows), batch_size):
        end = start + batch_size
        sums += [float(token_entropy(logits).double().sum()) for logits in
                 completion_logits(model, rows[start:end], completion_ids[start:end])]  # fmt: skip
    return sums


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


class TransformersGeneration(Generation):
    """Generates in one left-padded batch with transformers' `generate` and cuts each completion after its first
    EOS; records token entropies. With `compute_dtype` (bfloat16, float16) it generates under autocast in that dtype,
    as GRPOTrainer does with bf16/fp16, the weights staying in their own."""

    records_entropy = True

    def __init__(self, *args, compute_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute_dtype = compute_dtype

    def vision_inputs(self, input_ids: torch.Tensor, images: list[list]) -> dict[str, torch.Tensor]:
        """What a vision-language model's `generate` takes besides the token ids, for rows whose image tokens the
        processor has already expanded: the image processor's tensors of each row's images (`images[r]`, in the
        order of their tokens; pixel_values and what comes with them, e.g. image_grid_thw), and the per-token type
        ids the processor gives its model (1 at image tokens), as GRPOTrainer builds them for tool images."""
        inputs = dict(self.processor.image_processor(images=[list(row) for row in images], return_tensors="pt"))
        image_token_id = getattr(self.processor, "image_token_id", None) or self.model.config.image_token_id
        for name in {"mm_token_type_ids", "token_type_ids"} & set(self.processor.model_input_names):
            inputs[name] = (input_ids == image_token_id).long()
        return inputs

    @torch.no_grad()
    def generate_ids(
        self,
        rows: list[list[int]],
        seeds: list[int],
        record_entropy: bool = False,
        max_new_tokens: int | None = None,
        images: list[list] | None = None,
    ) -> tuple[list[list[int]], list[bool], list[float] | None]:
        """One completion per row of prompt token ids, in one left-padded batch: (completion ids, each cut after its
        first EOS; whether it was truncated; its summed token entropy, with `record_entropy`). Row r samples from a
        generator of its own seeded by `seeds[r]` (`SeededSampler`), so its tokens never depend on the other rows;
        greedy decoding (`do_sample=False`) ignores the seeds, and beam sampling (`num_beams` > 1 in
        `generation_kwargs`) draws from torch's RNG seeded by `seeds[0]`, shared by the call's rows.
        `max_new_tokens` overrides the config's. `images[r]`: row r's images, shown to a vision-language model
        (`vision_inputs`)."""
        self.check_images(images)
        if len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} sampling seeds for {len(rows)} rows")
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])
        device = self.model.device
        vision = self.vision_inputs(input_ids, images) if images else {}
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
            autocast = torch.autocast(device.type, self.compute_dtype, enabled=self.compute_dtype is not None)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
                torch.manual_seed(seeds[0] if seeds else 0)  # only beam sampling draws from it
                output = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    **{name: tensor.to(device) for name, tensor in vision.items()},
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


class TransformersWeights(LocalWeights):
    """The transformers engine's weights backend: `LocalWeights` over the trainer's tensors, and for
    es_search_space='lowrank' an `AdapterWeights` whose low-rank members are evaluated in the model's forward pass
    (`LowRankPopulation` on `targets`: the weights by name, with the module that applies each)."""

    def __init__(self, *args, targets: dict[str, torch.nn.Module] | None = None, rank: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets, self.rank = targets, rank
        self.lowrank_names = None if targets is None else list(targets)

    @contextlib.contextmanager
    def lowrank_members(self, members: list[tuple[int, float]]):
        """Within the context, the forward passes' rows routed to entry k evaluate member k = (seed, σ·sign; scale 0:
        the centre θ); yields the `Route` of the next generate calls' rows."""
        perturbed = [(seed, scale) for seed, scale in members if scale != 0]
        if not perturbed:  # the centre alone (e.g. lowrank_members_per_call=1 with es_baseline="center"): θ itself
            yield lambda rows: None
            return
        positions, k = [], 0
        for _, scale in members:  # index into `members` → index into the perturbed ones (−1: the centre)
            positions.append(-1 if scale == 0 else k)
            k += scale != 0
        seeds, signs = [seed for seed, _ in perturbed], [1 if scale > 0 else -1 for _, scale in perturbed]
        with LowRankPopulation(self.targets, seeds, signs, abs(perturbed[0][1]), self.rank) as route:
            yield lambda rows: route(positions[rows] if isinstance(rows, int) else [positions[i] for i in rows])

    def lowrank_update(self, norm: float, coefficients: dict[int, float], names: list[str], rank: int) -> None:
        """Nothing more: θ is the trainer's tensors, which the search space updated."""
