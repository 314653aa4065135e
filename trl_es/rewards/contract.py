"""The reward contract of TRL's GRPOTrainer, for ESTrainer.

Reward functions come in GRPOTrainer's forms, with the same meaning:
- a callable `f(prompts, completions, completion_ids, **kwargs) -> list[float | None]` (sync or async), which also
  receives every extra dataset column (one value per completion), `trainer_state`, `log_metric` and `log_extra`;
- a sequence-classification reward model, or its id/path (loaded with `num_labels=1`), scoring prompt + completion
  as text with its own tokenizer (`reward_processing_classes`).
`None` becomes NaN. A completion's reward is the weighted sum of its non-NaN function rewards (NaN when all are NaN).

TRL's helpers (`get_callable_name`, `is_async_callable`, `apply_chat_template`, the daemon event loop) are reused;
GRPOTrainer's `_calculate_rewards` itself is a method bound to GRPOTrainer's state, so the calling loop lives here,
with stricter checks: a wrong length or a non-number names the function.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from trl.data_utils import apply_chat_template, is_conversational
from trl.trainer.utils import (
    get_callable_name,
    get_config_model_id,
    is_async_callable,
    shutdown_event_loop_in_daemon,
    start_event_loop_in_daemon,
)

from ..util.models import with_pad_token


RewardFunc = str | PreTrainedModel | Callable[..., list[float | None]]


FLOAT32_MAX = torch.finfo(torch.float32).max


def _as_reward(value: Any, func_name: str, index: int) -> float:
    """A returned reward as a float: None → NaN (as TRL); numpy scalars and 0-d tensors are numbers. ±inf, a value
    float32 cannot hold (rewards are kept in float32, as in GRPO) or anything not a real number is an error naming
    the function, since one infinite reward would turn the whole update into NaN."""
    if value is None:
        return math.nan
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        value = value.item()
    if isinstance(value, numbers.Real):  # includes bool
        if not isinstance(value, numbers.Integral) and math.isinf(value):  # math.isinf(10**400) overflows
            raise ValueError(
                f"The reward function '{func_name}' returned {value} at position {index}; rewards must be finite "
                "(return None to give a completion no reward)."
            )
        if abs(value) > FLOAT32_MAX:
            raise ValueError(
                f"The reward function '{func_name}' returned {value} at position {index}, beyond what float32 (the "
                f"precision rewards are kept in) holds: |reward| must stay below {FLOAT32_MAX:.3g}."
            )
        return float(value)
    raise TypeError(
        f"The reward function '{func_name}' returned {value!r} (type {type(value).__name__}) at position {index}; "
        "each reward must be a real number or None."
    )


def _reward_tokenizers(funcs: list, classes, trust_remote_code: bool) -> list:
    """One tokenizer per reward model (given in `classes`, else the model's own, with a pad token), None for
    callables; each reward model is put in eval mode with that pad token."""
    classes = [None] * len(funcs) if classes is None else classes if isinstance(classes, list) else [classes]
    if len(classes) != len(funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(classes)}) must match the number of reward functions "
            f"({len(funcs)})."
        )
    for i, func in enumerate(funcs):
        if isinstance(func, PreTrainedModel):
            if classes[i] is None:
                classes[i] = AutoTokenizer.from_pretrained(
                    get_config_model_id(func.config), trust_remote_code=trust_remote_code
                )
            with_pad_token(classes[i])
            func.config.get_text_config().pad_token_id = classes[i].pad_token_id
            func.eval()
    return classes


class RewardFunctions:
    """Loads reward functions as GRPOTrainer does and scores completions with them."""

    def __init__(
        self,
        reward_funcs: RewardFunc | list[RewardFunc] | None,
        reward_weights: list[float] | None = None,
        reward_processing_classes=None,
        model_init_kwargs: dict | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict | None = None,
        owned: list[Callable] = (),
    ):
        """`owned`: reward functions of the rollout's own (environments' `get_reward`), weight 1, after the user's,
        as GRPOTrainer adds them."""
        funcs = (
            [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        )
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise ValueError(
                f"Number of reward weights ({len(reward_weights)}) must match number of reward functions ({len(funcs)})"
            )
        if reward_weights is not None:
            reward_weights = [*reward_weights, *[1.0] * len(owned)]
        funcs += list(owned)
        if not funcs:
            raise ValueError(
                "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment defines "
                "a `get_reward` method: ES learns from rewards only."
            )
        kwargs = {"trust_remote_code": trust_remote_code, **(model_init_kwargs or {})}
        for i, func in enumerate(funcs):
            if isinstance(func, str):
                funcs[i] = AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **kwargs)
            elif not (isinstance(funcs[i], nn.Module) or callable(funcs[i])):
                raise TypeError(f"reward_funcs[{i}] is a {type(func).__name__}: expected a callable, a model or an id")
        self.funcs = funcs
        self.names = [
            get_config_model_id(f.config).split("/")[-1] if isinstance(f, nn.Module) else get_callable_name(f)
            for f in funcs
        ]

        self.reward_weights = torch.tensor(reward_weights or [1.0] * len(funcs), dtype=torch.float32)

        self.processing_classes = _reward_tokenizers(funcs, reward_processing_classes, trust_remote_code)
        self.chat_template_kwargs = chat_template_kwargs or {}

        self._loop = None
        if any(not isinstance(f, nn.Module) and is_async_callable(f) for f in funcs):
            self._thread, self._loop, ready = start_event_loop_in_daemon(name="ESTrainer-reward-loop")
            ready.wait()
            atexit.register(shutdown_event_loop_in_daemon, self._thread, self._loop)

    def check_signatures(self, columns: list[str] | None, environments: bool, extras: bool) -> None:
        """Before anything is generated: every reward function can take what it will be given, the keyword lists of
        `__call__` (`columns`: the training dataset's; None when unknown, as for a stream) and its context. A
        function without `**kwargs` must name each one; a required parameter must be one of them (unless the
        columns are unknown, or a rollout function adds `extras`)."""
        given = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"}
        given |= set(columns or ()) - {"prompt", "completion", "completion_ids"}
        given |= {"environments"} if environments else set()
        for func, name in zip(self.funcs, self.names, strict=True):
            if isinstance(func, nn.Module):
                continue
            try:
                parameters = inspect.signature(func).parameters.values()
            except (TypeError, ValueError):  # a builtin or C callable: nothing to check
                continue
            if any(p.kind is p.VAR_KEYWORD for p in parameters):
                unexpected = []
            else:  # what is always given, and the known columns, must each be named
                named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
                unexpected = sorted(given - named)
            required = [
                p.name for p in parameters
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]  # fmt: skip
            missing = [] if extras or columns is None else [p for p in required if p not in given]
            if unexpected:
                raise TypeError(
                    f"reward function {name!r} cannot take the keyword arguments {unexpected} it will be given "
                    "(GRPOTrainer's reward contract passes prompts, completions, completion_ids, every dataset column, "
                    "trainer_state, log_metric and log_extra): add **kwargs to its signature"
                )
            if missing:
                raise TypeError(
                    f"reward function {name!r} requires {missing}, which it will not be given: the training dataset's "
                    f"columns are {sorted(columns)}"
                )

    def to(self, device: torch.device) -> RewardFunctions:
        for f in self.funcs:
            if isinstance(f, nn.Module):
                f.to(device)
        return self

    def _check(self, output: Any, name: str, expected: int) -> list[float]:
        if isinstance(output, (str, bytes)) or not hasattr(output, "__len__"):
            raise TypeError(
                f"The reward function '{name}' returned a {type(output).__name__}; expected a list of rewards"
            )
        if len(output) != expected:
            raise ValueError(
                f"The reward function '{name}' returned {len(output)} rewards, but {expected} were expected "
                "(one per prompt-completion pair)."
            )
        return [_as_reward(v, name, i) for i, v in enumerate(output)]

    def _model_rewards(self, model, tokenizer, prompts, completions) -> list[float]:
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": p + c}, tokenizer, **self.chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        device = next(model.parameters()).device
        with torch.inference_mode():
            return model(**inputs.to(device)).logits[:, 0].float().tolist()

    def __call__(
        self,
        rows: list[dict],
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        extras: dict[str, list] | None = None,
        **context,
    ) -> torch.Tensor:
        """Rewards, shape (len(prompts), number of functions), NaN where a function returned None.

        `rows[k]` is the dataset row of completion k; its columns other than "prompt" and "completion" are passed
        as keyword lists, as are `extras` (a rollout_func's extra fields, one value per completion). `context`
        carries `trainer_state`, `log_metric`, `log_extra` and, in agent runs, `environments` (each completion's
        environment, passed as it is: a reward may read its state).
        """
        keys = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        data = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        data |= {key: [row[key] for row in rows] for key in keys} | (extras or {})
        rewards = torch.full((len(prompts), len(self.funcs)), math.nan)
        pending = []
        for i, (func, name) in enumerate(zip(self.funcs, self.names, strict=True)):
            if isinstance(func, nn.Module):
                rewards[:, i] = torch.tensor(
                    self._model_rewards(func, self.processing_classes[i], prompts, completions)
                )
            elif is_async_callable(func):
                pending.append((i, func(**copy.deepcopy(data), **context)))
            else:
                output = func(**copy.deepcopy(data), **context)  # its own copy: what it changes, no one else sees
                rewards[:, i] = torch.tensor(self._check(output, name, len(prompts)))
        if pending:

            async def gather():
                return await asyncio.gather(*(coro for _, coro in pending))

            outputs = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
            for (i, _), output in zip(pending, outputs, strict=True):
                rewards[:, i] = torch.tensor(self._check(output, self.names[i], len(prompts)))
        return rewards

    def score(self, rows: list[dict], completions, **context) -> torch.Tensor:
        """Each function's rewards of `completions` (a `trl_es.generation.Completions` of the prompts of `rows`, each
        repeated as generated), every completion given its dataset row, a rollout's extra fields and, in agent runs,
        its environment; `context` as in `__call__`."""
        repeats = len(completions.completions) // len(rows)
        context = {"log_metric": lambda *_: None, "log_extra": lambda *_: None, **context}
        if completions.environments is not None:
            context["environments"] = completions.environments
        return self(
            [row for row in rows for _ in range(repeats)],
            completions.prompts,
            completions.completions,
            completions.completion_ids,
            completions.extras,
            **context,
        )

    def combine(self, rewards: torch.Tensor) -> torch.Tensor:
        """Per-completion reward: Σ_f w_f·r_f over the non-NaN r_f; NaN when every function returned None."""
        weighted = (rewards * self.reward_weights.unsqueeze(0)).nansum(dim=1)
        none = torch.isnan(rewards).all(dim=1)
        if not torch.isfinite(weighted[~none]).all():
            k = int((~torch.isfinite(weighted) & ~none).nonzero()[0])
            raise ValueError(
                f"The weighted sum of the rewards of completion {k} is not finite in float32: "
                f"{dict(zip(self.names, rewards[k].tolist(), strict=True))} with reward_weights {self.reward_weights.tolist()}"
            )
        weighted[none] = math.nan
        return weighted
