"""Agent episodes: tools and environments, taken as GRPOTrainer takes them.

`ESTrainer(..., tools=[...], environment_factory=...)` with GRPOTrainer's contracts (TRL's
`grpo_trainer.py`, whose helpers are imported: `supports_tool_calling`, `add_response_schema`, the prefix-preserving
template check, `parse_response`, the tool-result suffix):

- `tools`: callables (sync or async) with docstrings, rendered into the prompt by the chat template. A completion's
  tool calls are parsed (`parse_response`), executed, their results appended as `tool` messages, and generation
  continues from prompt + completion + tool results, up to `max_tool_calling_iterations` times. A failing or
  unknown tool becomes `{"error": ...}` text; a turn whose tool results would overflow `max_completion_length` (the
  whole episode's budget) or the model's context is rolled back and the episode ends there.
- `environment_factory`: a callable (or a dict of them, selected by an `environment` column) making an environment
  with `reset(**row)` (a returned string is appended to the last user message), public methods that become tools,
  and optionally `get_reward()`, an environment-owned reward (weight 1, named after the class). One instance per
  episode, from a pool: constructed once, reset often.

What ES adds: an episode is (member, prompt, generation), and the member stays formed for every turn of its
episodes (the `evaluating` context spans the episode loop; batched low-rank members are routed row by row at every
turn). Episode (prompt k, generation g) of every member starts from the same reset, seeded by
`environment_seed(seed, step, k, g)` (common random numbers), and Python's, NumPy's and torch's global RNGs are
seeded around every environment call, so 1 or K processes, a resumed run and a replay see the same episodes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import inspect
import random
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    supports_tool_calling,
)
from trl.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

from ..es.seeds import derive_seed, environment_seed
from ..generation import Completions
from ..util.compat import parse_response, tool_suffix_ids


TOOL_TEMPLATE_HINT = (
    "set a tool-capable chat template on the tokenizer (processing_class), e.g. TRL's Qwen2.5 template: "
    "tokenizer.chat_template = open(os.path.join(os.path.dirname(trl.__file__), 'chat_templates', "
    "'qwen2_5.jinja')).read()"
)


@contextlib.contextmanager
def seeded(seed: int):
    """Python's, NumPy's and torch's global RNGs seeded with `seed` inside, their states restored on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def environment_methods(environment) -> tuple[list[Callable], bool, bool]:
    """(its public methods, bound: the tools), whether it has `reset`, whether it has `get_reward` — listed on the
    class, as TRL does (listing the instance would evaluate its properties)."""
    tools, has_reset, has_reward = [], False, False
    for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction):
        if name == "reset":
            has_reset = True
        elif name == "get_reward":
            has_reward = True
        elif not name.startswith("_"):
            tools.append(getattr(environment, name))
    return tools, has_reset, has_reward


def environment_reward(env_type: type) -> Callable:
    """The reward function of an environment class that owns its reward: `get_reward()` of each completion's
    environment of exactly that class, None (no reward) for the others."""

    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = env_type.__name__
    return get_reward


@dataclass
class Episode:
    """One episode's state: its prompt (with the reset's observation), environment, tools, token ids so far."""

    member: int  # its member's index among the call's members
    prompt: list
    environment: object | None
    tools: list[Callable]
    prompt_ids: list[int]
    seed: int  # the completion seed of its first turn; later turns derive theirs from it
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)  # 1: a token the model generated, 0: a tool result's
    messages: list[dict] = field(default_factory=list)  # the completion: assistant and tool messages
    tool_calls: int = 0
    tool_failures: int = 0


class Agents:
    """The tools and environments of a run (see the module docstring), checked at construction as GRPOTrainer checks
    them; a rollout (`trl_es.rollout.Rollout`) over `generation` whose calls play episodes (`run`)."""

    batches_members = True
    records_entropy = False
    generation = None  # the generation backend, given by `make_rollout`

    def __init__(self, tokenizer, args, tools: list[Callable] | None = None, environment_factory=None):
        self.tokenizer, self.args = tokenizer, args
        self.standalone_tools = list(tools or [])
        self.factories = None
        self.multi_environment = isinstance(environment_factory, dict)
        if environment_factory is not None:
            self.factories = environment_factory if self.multi_environment else {None: environment_factory}
        self.max_model_length = None
        self.max_iterations = args.max_tool_calling_iterations
        self.environment_tools: dict = {}  # environment name → the tools its episodes are rendered with
        self.pool: dict = {}  # environment name → reusable instances
        self.reward_funcs: list[Callable] = []  # environment-owned rewards
        self.tools = list(self.standalone_tools)
        reward_types = []
        for name, factory in (self.factories or {}).items():
            instance = factory()
            methods, has_reset, has_reward = environment_methods(instance)
            if not has_reset:
                raise ValueError(
                    f"the environment {type(instance).__name__} made by environment_factory"
                    f"{'' if name is None else f'[{name!r}]'} has no `reset` method: every environment needs one"
                )
            self.environment_tools[name] = self.standalone_tools + methods
            self.pool[name] = [instance]
            self.tools += [method for method in methods if method.__name__ not in {t.__name__ for t in self.tools}]
            if has_reward and type(instance) not in reward_types:
                reward_types.append(type(instance))
                self.reward_funcs.append(environment_reward(type(instance)))
        if self.tools:
            if not supports_tool_calling(tokenizer):
                raise ValueError(f"the tokenizer's chat template cannot call tools: {TOOL_TEMPLATE_HINT}")
            if (
                getattr(tokenizer, "response_template", None) is None
                and getattr(tokenizer, "response_schema", None) is None
            ):
                add_response_schema(tokenizer)
        self.chat_template = None
        if self.tools and not is_chat_template_prefix_preserving(tokenizer):
            self.chat_template = get_training_chat_template(tokenizer)
        self._loop = None
        if any(is_async_callable(tool) for tool in self.tools):
            self._thread, self._loop, ready = start_event_loop_in_daemon(name="ESTrainer-tool-loop")
            ready.wait()
            atexit.register(shutdown_event_loop_in_daemon, self._thread, self._loop)

    @property
    def environments(self) -> bool:
        return self.factories is not None

    def check_reproducible(self, row: dict, seed: int) -> None:
        """Reset two new instances of each environment under one seed with `row` and compare what they return: an
        environment whose resets differ gets one warning saying what it breaks."""
        for name, factory in (self.factories or {}).items():
            if self.multi_environment and row.get("environment") != name:
                continue
            observations = []
            for _ in range(2):
                with seeded(derive_seed("es-environment-check", seed)):
                    observations.append(repr(factory().reset(**self._reset_kwargs(row))))
            if observations[0] != observations[1]:
                label = factory.__name__ if hasattr(factory, "__name__") else repr(factory)
                warnings.warn(
                    f"environment {label}: two instances reset under the same seed returned different observations "
                    f"({observations[0][:80]} vs {observations[1][:80]}): its episodes depend on more than the seeds "
                    "trl-es sets (Python's, NumPy's and torch's global RNGs), so members do not face the same episodes "
                    "(noisier fitness), and 1 vs K processes, a resumed run and a seed-chain replay are no longer "
                    "guaranteed to give the same weights. Draw the environment's randomness from `random`, NumPy or "
                    "torch.",
                    stacklevel=3,
                )

    def _reset_kwargs(self, row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row

    # ---- one generate call --------------------------------------------------------------------------------------

    def __call__(self, rows, n, seeds, n_members=1, route=None, key=None, record_entropy=False) -> Completions:
        """The `Rollout` call: `run` with this rollout's generation backend."""
        return self.run(rows, n_members, n, seeds, key, route or (lambda members: None), self.generation)

    def run(self, rows: list[dict], n_members: int, n: int, seeds: list[int], key, route, generation):
        """The episodes of one generate call: `n_members` members × `rows` × `n` generations, member-major, the
        call's first turn for every episode and later turns for those still calling tools (each routed to its member
        with `route`), generated by `generation` (`generate_ids`), sampled with `seeds` (one per episode); episode
        (k, g) resets under `environment_seed(seed, key, k, g)` (`key`: the training step, or an evaluation batch's).
        Returns the call's `Completions` (tool masks, environments and tool counts included)."""
        names = [row.get("environment") if self.multi_environment else None for row in rows]
        for name in set(names) if self.multi_environment else ():
            if name not in self.factories:
                raise ValueError(
                    f"a row has environment={name!r}, which is not among the environments passed to "
                    f"environment_factory; expected one of {list(self.factories)}"
                )
        handed = dict.fromkeys(self.pool, 0)
        episodes = []
        for j in range(n_members):
            for k, row in enumerate(rows):
                for g in range(n):
                    environment = self._instance(names[k], handed) if self.environments else None
                    prompt = copy.deepcopy(row.get("prompt") or [{"role": "user", "content": ""}])
                    if environment is not None:
                        with seeded(environment_seed(self.args.seed, key, k, g)):
                            observation = environment.reset(**self._reset_kwargs(row))
                        if observation is not None:
                            prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
                    tools = self.standalone_tools  # plus the methods of the episode's own environment instance
                    if environment is not None:
                        tools = tools + environment_methods(environment)[0]
                    e = len(episodes)
                    episodes.append(Episode(j, prompt, environment, tools, self._tokenize(prompt, tools), seeds[e]))
        self._play(episodes, route, generation)
        eos = set(generation.eos_token_ids)
        return Completions(
            prompts=[e.prompt for e in episodes],
            completions=[e.messages for e in episodes],
            completion_ids=[e.completion_ids for e in episodes],
            truncated=[bool(e.completion_ids) and e.completion_ids[-1] not in eos for e in episodes],
            tool_mask=[e.tool_mask for e in episodes],
            environments=[e.environment for e in episodes],
            tool_calls=[e.tool_calls for e in episodes],
            tool_failures=[e.tool_failures for e in episodes],
        )

    def _instance(self, name, handed: dict):
        pool = self.pool[name]
        if handed[name] == len(pool):
            pool.append(self.factories[name]())
        handed[name] += 1
        return pool[handed[name] - 1]

    def _tokenize(self, prompt: list, tools: list) -> list[int]:
        return self.tokenizer.apply_chat_template(
            conversation=prompt,
            tools=tools or None,  # `or None`: some templates render tool boilerplate for tools=[]
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(self.args.chat_template_kwargs or {}),
        )["input_ids"]

    def _play(self, episodes: list[Episode], route, generation) -> None:
        """Turn 0 for every episode, then tool turns for those whose last message calls tools."""
        budget = self.args.max_completion_length
        active = list(range(len(episodes)))
        turn = 0
        while active:
            active = [e for e in active if len(episodes[e].completion_ids) < budget]  # no room left: it ends here
            if not active:
                break
            inputs = [episodes[e].prompt_ids + episodes[e].completion_ids for e in active]
            seeds = [episodes[e].seed if turn == 0 else derive_seed("es-turn", episodes[e].seed, turn) for e in active]
            room = max(budget - len(episodes[e].completion_ids) for e in active)
            route([episodes[e].member for e in active])
            new_ids, _, _ = generation.generate_ids(inputs, seeds, max_new_tokens=room)
            calling = []
            for e, ids in zip(active, new_ids, strict=True):
                episode = episodes[e]
                ids = ids[: budget - len(episode.completion_ids)]
                prefix = episode.prompt_ids + episode.completion_ids
                episode.completion_ids += ids
                episode.tool_mask += [1] * len(ids)
                message = parse_response(self.tokenizer, ids, prefix=prefix, tools=episode.tools) if ids else {}
                if message or turn == 0:
                    episode.messages.append(message or {"role": "assistant", "content": ""})
                if (
                    message.get("tool_calls")
                    and self.tools
                    and (self.max_iterations is None or turn < self.max_iterations)
                ):
                    calling.append(e)
            active = [e for e in calling if self._call_tools(episodes[e])]
            turn += 1

    def _call_tools(self, episode: Episode) -> bool:
        """Run the tool calls of the episode's last message and append their results; False (and nothing appended)
        when the results would overflow the completion budget or the model's context: the episode ends there."""
        results = []
        for call in episode.messages[-1]["tool_calls"]:
            episode.tool_calls += 1
            name = call.get("function", {}).get("name", call.get("name", "unknown"))
            try:
                if call.get("type") != "function":
                    raise ValueError(f"Unsupported tool call type: {call.get('type')}")
                result = self._call(episode.tools, name, call["function"].get("arguments") or {}, episode)
            except Exception as error:  # the model's mistake, shown to it as the tool's answer
                episode.tool_failures += 1
                result = {"error": str(error)}
            results.append(
                {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
            )
        suffix = tool_suffix_ids(self.tokenizer, self.chat_template, self.args.chat_template_kwargs, results)
        total = len(episode.completion_ids) + len(suffix)
        context = self.max_model_length
        if total > self.args.max_completion_length or (context and len(episode.prompt_ids) + total >= context):
            return False
        episode.messages += results
        episode.completion_ids += suffix
        episode.tool_mask += [0] * len(suffix)
        return True

    def _call(self, tools: list[Callable], name: str, arguments: dict, episode: Episode):
        """Tool `name` called with `arguments`, under its seeded RNGs and within `tool_call_timeout`."""
        tool = next((t for t in tools if t.__name__ == name), None)
        if tool is None:
            raise ValueError(f"Tool {name} not found.")
        timeout = self.args.tool_call_timeout
        with seeded(derive_seed("es-tool", episode.seed, episode.tool_calls)):
            if is_async_callable(tool):
                future = asyncio.run_coroutine_threadsafe(tool(**arguments), self._loop)
                try:
                    return future.result(timeout)
                except TimeoutError:
                    future.cancel()
                    raise TimeoutError(f"tool {name} did not answer within tool_call_timeout={timeout} s") from None
            if timeout is None:
                return tool(**arguments)
            return call_with_timeout(tool, arguments, timeout, name)


def call_with_timeout(tool: Callable, arguments: dict, timeout: float, name: str):
    """`tool(**arguments)` in a daemon thread, waited for `timeout` seconds: a TimeoutError after that (the call
    itself keeps running in the background: Python cannot stop a thread)."""
    outcome = {}

    def target():
        try:
            outcome["result"] = tool(**arguments)
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"trl-es-tool-{name}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"tool {name} did not answer within tool_call_timeout={timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
