"""What every generation backend shares: the `Completions` it returns, and `Generation`, the base that tokenizes
prompts as GRPOTrainer does (a vision-language model's through its processor, images included), warns when a prompt
leaves no room in the model's context, and decodes completions; a backend implements `generate_ids` (one completion
per row of prompt token ids, and of images for a vision-language model)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl.data_utils import is_conversational, prepare_multimodal_messages

from ..util.models import processor_of, text_tokenizer


def compute_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype members are computed in, from the run's mixed precision (`Accelerator.mixed_precision`: ESConfig's
    `bf16`/`fp16`, or the accelerate config's `mixed_precision`, as GRPOTrainer's autocast follows): bfloat16 or
    float16 (autocast on the transformers path, vLLM's engine in it), else None (the weights' own)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


def check_prompts(prompts: list, hint: str = "") -> None:
    """A ValueError naming the first prompt of the step that is None or empty (text of whitespace only, no messages):
    every row needs a prompt, text or a list of chat messages; `hint` says what else the caller accepts."""
    for k, prompt in enumerate(prompts):
        if prompt is None or not (prompt.strip() if isinstance(prompt, str) else prompt):
            raise ValueError(
                f"prompt {k} of this step is {'None' if prompt is None else 'empty'} ({prompt!r}): every row needs a "
                f"prompt, text or a list of chat messages{hint}"
            )


def row_prompts(rows: list[dict], default=None) -> list:
    """Each row's prompt (`default` for a row without one) as GRPOTrainer shows it to the model and the reward
    functions: with an 'images' column (a list) or an 'image' column (one), the row's images are put into its
    conversation's first user message (TRL's `prepare_multimodal_messages`)."""
    prompts = [row.get("prompt", default) for row in rows]
    if rows and "images" in rows[0]:
        images = [row.get("images") or [] for row in rows]
    elif rows and "image" in rows[0]:
        images = [[] if row.get("image") is None else [row["image"]] for row in rows]
    else:
        return prompts
    return [prepare_multimodal_messages(p, images=i) if i else p for p, i in zip(prompts, images, strict=True)]


def message_images(prompt) -> list:
    """The images of a conversation's image blocks ({"type": "image", "image": ...}), in order ([] for text)."""
    if isinstance(prompt, str):
        return []
    return [
        part["image"]
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None
    ]


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


def chat_template_ids(processing_class, conversations: list[list[dict]], **template_kwargs) -> list[list[int]]:
    """Each conversation's token ids, rendered by the chat template with the generation prompt, as GRPOTrainer renders
    prompts; a vision-language model's processor takes them as content blocks and expands each image into its
    tokens. `template_kwargs`: `chat_template_kwargs`, `tools`, `chat_template`."""
    if processor_of(processing_class) is not None:
        conversations = [prepare_multimodal_messages(conversation) for conversation in conversations]
    return processing_class.apply_chat_template(
        conversation=conversations, add_generation_prompt=True, tokenize=True, return_dict=True, **template_kwargs
    )["input_ids"]


class Generation:
    """Tokenizes prompts as GRPOTrainer does (chat template for conversational prompts, plain text otherwise; a
    vision-language model's conversations through its processor, which expands each image into its tokens) and
    decodes completions as it does; `generate_ids` is the backend's (transformers `generate`, or vLLM)."""

    records_entropy = False  # whether `generate(..., record_entropy=True)` gives each completion's token entropy

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
        generation_config: GenerationConfig,
        eos_token_ids: list[int],
        chat_template_kwargs: dict | None = None,
    ):
        self.model = model
        self.processor = processor_of(tokenizer)
        self.tokenizer = text_tokenizer(tokenizer)
        self.generation_config = generation_config
        self.eos_token_ids = eos_token_ids
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.warned_context = False

    def tokenize(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt; a ValueError names an empty or missing prompt, and a prompt that leaves no room
        for the completion within the model's context warns (once)."""
        prompts = list(prompts)
        check_prompts(prompts)
        if is_conversational({"prompt": prompts[0]}):
            ids = chat_template_ids(self.processor or self.tokenizer, prompts, **self.chat_template_kwargs)
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
        images = [message_images(prompt) for prompt in prompts for _ in range(num_generations)]
        vision = {"images": images} if any(images) else {}  # each row its prompt's images
        completion_ids, truncated, entropy_sums = self.generate_ids(rows, seeds, record_entropy, **vision)
        return self.completions(prompts, num_generations, completion_ids, truncated, entropy_sums)

    def generate_ids(self, rows, seeds, record_entropy=False, max_new_tokens=None, images=None):
        """(completion ids, each cut after its first EOS; whether each was truncated; summed token entropies or
        None): one completion per row of prompt token ids, row r sampled with `seeds[r]`; `images[r]`, row r's
        images in the order of their tokens (a vision-language model's; backends without vision take none)."""
        raise NotImplementedError

    def check_images(self, images: list[list] | None) -> None:
        """A ValueError when images reach a model without a processor (a text model, e.g. shown an iterable
        dataset's images, whose columns ESTrainer's construction cannot see): each backend's `generate_ids` first."""
        if images and any(images) and self.processor is None:
            raise ValueError(
                "images reached the generation of a model without a processor: a vision-language model and its "
                "processor (ESTrainer's processing_class) show them to the model"
            )

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
