"""Agent episodes: tools and environments, taken as GRPOTrainer takes them.

`ESTrainer(..., tools=[...], environment_factory=...)` with GRPOTrainer's contracts (TRL's `grpo_trainer.py`, whose
helpers are imported: `supports_tool_calling`, `add_response_schema`, the prefix-preserving template check,
`parse_response`, the tool-result suffix):

- `tools`: callables (sync or async) with docstrings, rendered into the prompt by the chat template. A completion's
  tool calls are parsed (`parse_response`, when the tokenizer has a response schema), executed (a turn's async calls
  together), their results appended as `tool` messages, and generation continues from prompt + completion + tool
  results, up to `max_tool_calling_iterations` times. A tool may return content blocks; for a vision-language model
  (a processor as processing_class) its images are expanded into the result's tokens and shown to the model with the
  prompt's own for the rest of the episode, as GRPOTrainer shows them. A failing or unknown tool (or one calling
  `exit()`) becomes `{"error": ...}` text; a turn whose tool results would overflow `max_completion_length` (the
  whole episode's budget) or the model's context is rolled back and the episode ends there.
- `environment_factory`: a callable (or a dict of them, selected by an `environment` column) making an environment
  with `reset(**row)` (a returned string is appended to the last user message), public methods that become tools,
  and optionally `get_reward()`, an environment-owned reward (weight 1, named after the class). Instances come from
  a pool: constructed once, reset often.

What ES adds: an episode is (member, prompt, generation), and the member stays formed for every turn of its
episodes (the `evaluating` context spans the episode loop; batched low-rank members are routed row by row at every
turn). Episode (prompt k, generation g) of every member starts from the same reset, seeded by
`environment_seed(seed, step, k, g)` (common random numbers): Python's, NumPy's and torch's global RNGs are seeded
around every reset, tool call and `get_reward`, and a `reset` that takes a `seed` is given it, so 1 or K processes,
a resumed run and a replay see the same episodes. Each episode of a step has an instance of its own (no member sees
what another's episode left in it) and its own copy of the row; an instance whose episode had a tool call time out
is retired (the call may still write into it). The reproducibility check names an environment whose resets depend
on more than those seeds.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import copy
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    supports_tool_calling,
)
from trl.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

from ..es.seeds import environment_check_seed, environment_reward_seed, environment_seed, tool_seed, turn_seed
from ..generation import Completions
from ..generation.base import chat_template_ids, check_prompts, message_images, row_prompts
from ..util.compat import parse_response, parses_responses, tool_suffix_ids
from ..util.models import processor_of, text_tokenizer
from .environments import (
    CHECK_ROUNDS,
    appended,
    attribute_pictures,
    environment_methods,
    environment_reward,
    no_exit,
    seeded,
)
from .tools import MAX_NESTING, TOOL_TEMPLATE_HINT, ToolTimeout, call_with_timeout, exit_guarded, nesting


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
    images: list = field(default_factory=list)  # a vision-language model's: the prompt's and its tools', in order


class Agents:
    """The tools and environments of a run (see the module docstring), checked at construction as GRPOTrainer checks
    them; `run` plays episodes through a generation backend (`AgentRollout` is the run's rollout over it)."""

    def __init__(self, processing_class, args, tools: list[Callable] | None = None, environment_factory=None):
        """`processing_class`: the tokenizer, or a vision-language model's processor (which renders the prompts and
        their images)."""
        self.processing_class, self.args = processing_class, args
        self.processor = processor_of(processing_class)
        self.tokenizer = text_tokenizer(processing_class)
        self.standalone_tools = list(tools or [])
        self.factories = None
        self.multi_environment = isinstance(environment_factory, dict)
        if environment_factory is not None:
            self.factories = environment_factory if self.multi_environment else {None: environment_factory}
        self.max_iterations = args.max_tool_calling_iterations
        self.environment_tools: dict = {}  # environment name → the tools its episodes are rendered with
        self.pool: dict = {}  # environment name → its instances, each handed to one episode per step
        self.step = None  # the `key` of the calls that handed them out
        self.reset_seeds: dict = {}  # id of an instance → the seed of its last reset
        self.checked: set = set()  # the environments the reproducibility check has seen
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
                self.reward_funcs.append(environment_reward(type(instance), self._rewarding))
        self.handed = dict.fromkeys(self.pool, 0)  # name → how many of its instances the step's calls handed out
        if self.tools:
            if not supports_tool_calling(processing_class):
                raise ValueError(f"the tokenizer's chat template cannot call tools: {TOOL_TEMPLATE_HINT}")
            if not parses_responses(self.tokenizer):
                add_response_schema(processing_class)  # a processor's: on its tokenizer
        self.parses = parses_responses(self.tokenizer)  # as GRPOTrainer: else completions are text
        self.chat_template = None
        if self.tools and not is_chat_template_prefix_preserving(processing_class):
            self.chat_template = get_training_chat_template(processing_class)
        self._loop = None
        if any(is_async_callable(tool) for tool in self.tools):
            self._thread, self._loop, ready = start_event_loop_in_daemon(name="ESTrainer-tool-loop")
            ready.wait()
            atexit.register(shutdown_event_loop_in_daemon, self._thread, self._loop)

    @property
    def environments(self) -> bool:
        return self.factories is not None

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token decodes to: a text longer than n times this has more than n tokens."""
        return max(map(len, self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])))

    # ---- environments -------------------------------------------------------------------------------------------

    def check_reproducible(self, row: dict, seed: int) -> None:
        """Check the environment of `row` (`_check`) unless it has been; `run` checks each other environment of a
        dict of factories at its first row."""
        name = row.get("environment") if self.multi_environment else None
        if self.environments and name in self.factories and name not in self.checked:
            self._check(name, row, seed)

    def _check(self, name, row: dict, seed: int) -> None:
        """Reset two of the pool's instances of environment `name` `CHECK_ROUNDS` times each, all under one seed with
        `row`, and compare what the resets return and the attributes they set or change (what a silent reset leaves):
        a difference gets one warning naming the environment and saying what it breaks."""
        self.checked.add(name)
        pool = self.pool[name]
        while len(pool) < 2:  # kept: a step plays more episodes than one, so training hands it out too
            self._grow(name)
        resets = []  # (observation, attributes before, attributes after)
        for _ in range(CHECK_ROUNDS):
            for instance in pool[:2]:
                before = attribute_pictures(instance)
                observation = repr(self._reset(instance, row, environment_check_seed(seed)))
                resets.append((observation, before, attribute_pictures(instance)))
        changed = sorted({a for _, before, after in resets for a, value in after.items() if before.get(a) != value})
        first, _, state = resets[0]
        for observation, _, other in resets[1:]:
            if observation != first:
                difference = f"returned different observations ({first[:80]} vs {observation[:80]})"
            elif attribute := next((a for a in changed if other.get(a) != state.get(a)), None):
                difference = f"left different values in `{attribute}`"
            else:
                continue
            label = type(pool[0]).__name__ + ("" if name is None else f" (environment_factory[{name!r}])")
            warnings.warn(
                f"environment {label}: its instances reset under the same seed {difference}: its episodes depend on "
                "more than the seeds trl-es sets (Python's, NumPy's and torch's global RNGs, and reset's `seed` where "
                "it takes one) — a clock, a remote service, a generator of its own, or its own earlier resets. So "
                "members do not face the same episodes (noisier fitness), and 1 vs K processes, a resumed run and a "
                "seed-chain replay are no longer guaranteed to give the same weights. Draw the environment's "
                "randomness from `random`, NumPy or torch (or reset's `seed`), and start every episode afresh in "
                "`reset`.",
                stacklevel=3,
            )
            return

    def _reset_kwargs(self, row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row

    def _reset(self, environment, row: dict, seed: int):
        """`environment.reset` given its own copy of `row` (and `seed`, 31 bits, where it takes one and the row has
        no `seed` column), under the global RNGs seeded with `seed`; the seed is kept for its `get_reward`."""
        kwargs = copy.deepcopy(self._reset_kwargs(row))
        if "seed" in inspect.signature(environment.reset).parameters and "seed" not in kwargs:
            kwargs["seed"] = seed % 2**31
        with seeded(seed), no_exit(f"{type(environment).__name__}.reset"):
            observation = environment.reset(**kwargs)
        self.reset_seeds[id(environment)] = seed
        return observation

    def _rewarding(self, environment) -> contextlib.AbstractContextManager:
        """Where `environment.get_reward` runs: under the global RNGs seeded from its last reset's seed (unseeded for
        an instance trl-es did not reset), a SystemExit a RuntimeError."""
        stack = contextlib.ExitStack()
        seed = self.reset_seeds.get(id(environment))
        if seed is not None:
            stack.enter_context(seeded(environment_reward_seed(seed)))
        stack.enter_context(no_exit(f"{type(environment).__name__}.get_reward"))
        return stack

    def _instance(self, name):
        """An instance of environment `name` no episode of this step has had (constructed when the pool has none)."""
        pool, index = self.pool[name], self.handed[name]
        if index == len(pool):
            self._grow(name)
        self.handed[name] = index + 1
        return pool[index]

    def _grow(self, name) -> None:
        """One more instance of environment `name` in its pool; a RuntimeError saying why when its factory has no
        more to give (StopIteration: a factory handing out a fixed set, e.g. one server URL per instance)."""
        try:
            self.pool[name].append(self.factories[name]())
        except StopIteration as error:
            raise RuntimeError(
                f"environment_factory{'' if name is None else f'[{name!r}]'} could not make instance "
                f"{len(self.pool[name]) + 1} (StopIteration: it hands out a fixed set, and the set is spent): ES plays "
                "each episode of a generate call on an instance of its own — members × prompts × num_generations of "
                "the call — and checks resets on two. Give the factory that many (or lower population_size, "
                "per_device_train_batch_size)"
            ) from error

    def _retire(self, environment) -> None:
        """Never hand `environment` out again: a tool call that timed out may still write into it."""
        for name, pool in self.pool.items():
            for index, instance in enumerate(pool):
                if instance is environment:
                    del pool[index]
                    if index < self.handed[name]:
                        self.handed[name] -= 1
                    return

    # ---- one generate call --------------------------------------------------------------------------------------

    def run(self, rows: list[dict], n_members: int, n: int, seeds: list[int], key, route, generation):
        """The episodes of one generate call: `n_members` members × `rows` × `n` generations, member-major, the
        call's first turn for every episode and later turns for those still calling tools (each routed to its member
        with `route`), generated by `generation` (`generate_ids`), sampled with `seeds` (one per episode); episode
        (k, g) resets under `environment_seed(seed, key, k, g)` (`key`: the training step, or an evaluation batch's),
        on an instance no other episode of the calls with this `key` has had. Returns the call's `Completions` (tool
        masks, environments and tool counts included)."""
        names = [row.get("environment") if self.multi_environment else None for row in rows]
        for name in set(names) if self.multi_environment else ():
            if name not in self.factories:
                raise ValueError(
                    f"a row has environment={name!r}, which is not among the environments passed to "
                    f"environment_factory; expected one of {list(self.factories)}"
                )
        hint = " (or, with an environment_factory, no 'prompt' column: reset then fills an empty user message)"
        check_prompts([row["prompt"] for row in rows if "prompt" in row], hint)
        if key is None or key != self.step:  # a new step: every instance is free again
            self.step, self.handed = key, dict.fromkeys(self.pool, 0)
        for k, name in enumerate(names if self.environments else ()):
            if name not in self.checked:
                self._check(name, rows[k], self.args.seed)
        episodes = []
        prompts = row_prompts(rows, default=[{"role": "user", "content": ""}])  # a row's images in its conversation
        for j in range(n_members):
            for k, row in enumerate(rows):
                for g in range(n):
                    images = message_images(prompts[k])
                    prompt = copy.deepcopy(prompts[k], memo={id(image): image for image in images})  # images shared
                    environment = self._instance(names[k]) if self.environments else None
                    if environment is not None:
                        observation = self._reset(environment, row, environment_seed(self.args.seed, key, k, g))
                        if observation is not None:
                            prompt = prompt[:-1] + [{**prompt[-1], "content": appended(prompt[-1], observation)}]
                    tools = self.standalone_tools  # plus the methods of the episode's own environment instance
                    if environment is not None:
                        tools = tools + environment_methods(environment)[0]
                    e = len(episodes)
                    ids = self._tokenize(prompt, tools)
                    episodes.append(Episode(j, prompt, environment, tools, ids, seeds[e], images=images))
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

    def _tokenize(self, prompt: list, tools: list) -> list[int]:
        """The prompt's token ids (`chat_template_ids`), with the episode's tools and chat template."""
        template = {"tools": tools or None, "chat_template": self.chat_template}  # `or None`: some templates render
        template |= self.args.chat_template_kwargs or {}  # tool boilerplate for tools=[]
        return chat_template_ids(self.processor or self.tokenizer, [prompt], **template)[0]

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
            seeds = [episodes[e].seed if turn == 0 else turn_seed(episodes[e].seed, turn) for e in active]
            room = max(budget - len(episodes[e].completion_ids) for e in active)
            route([episodes[e].member for e in active])
            images = [episodes[e].images for e in active]
            vision = {"images": images} if any(images) else {}
            new_ids, _, _ = generation.generate_ids(inputs, seeds, max_new_tokens=room, **vision)
            calling = []
            for e, ids in zip(active, new_ids, strict=True):
                episode = episodes[e]
                ids = ids[: budget - len(episode.completion_ids)]
                prefix = episode.prompt_ids + episode.completion_ids
                episode.completion_ids += ids
                episode.tool_mask += [1] * len(ids)
                message = self._message(ids, prefix, episode.tools) if ids else {}
                if message or turn == 0:
                    episode.messages.append(message or {"role": "assistant", "content": ""})
                if (
                    message.get("tool_calls")
                    and self.tools
                    and (self.max_iterations is None or turn < self.max_iterations)
                ):
                    calling.append(e)
            active = [e for e in calling if self._call_tools(episodes[e], generation.max_model_length)]
            turn += 1

    def _message(self, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict:
        """The assistant message of completion `ids`, as GRPOTrainer makes it: parsed (tool calls included) where the
        tokenizer has a response schema, else the decoded text. Tool calls nested deeper than `MAX_NESTING` stay
        text, as malformed ones do."""
        if self.parses:
            with contextlib.suppress(RecursionError):
                message = parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)
                if nesting(message.get("tool_calls")) <= MAX_NESTING:
                    return message
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}

    # ---- tools --------------------------------------------------------------------------------------------------

    def _call_tools(self, episode: Episode, context: int | None) -> bool:
        """Run the tool calls of the episode's last message (its sync calls in order, then its async calls together)
        and append their results; False (and nothing appended) when the results would overflow the completion budget
        or the model's `context` (None: unbounded): the episode ends there. A result too long to fit is not even
        tokenized."""
        calls = episode.messages[-1]["tool_calls"]
        names = [call.get("function", {}).get("name", call.get("name", "unknown")) for call in calls]
        results, waiting = [None] * len(calls), {}  # waiting: call index → its coroutine
        for i, call in enumerate(calls):
            episode.tool_calls += 1
            try:
                if call.get("type") != "function":
                    raise ValueError(f"Unsupported tool call type: {call.get('type')}")
                tool = next((t for t in episode.tools if t.__name__ == names[i]), None)
                if tool is None:
                    raise ValueError(f"Tool {names[i]} not found.")
                arguments = call["function"].get("arguments") or {}
                if is_async_callable(tool):
                    waiting[i] = tool(**arguments)
                else:
                    results[i] = self._call(tool, arguments, names[i], tool_seed(episode.seed, episode.tool_calls))
            except Exception as error:  # the model's mistake, shown to it as the tool's answer
                results[i] = self._failed(episode, error)
        if waiting:
            self._call_async(waiting, names, results, episode)
        messages = [
            {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
            for name, result in zip(names, results, strict=True)
        ]
        room = self.args.max_completion_length - len(episode.completion_ids)
        lengths = [len(m["content"]) for m in messages if isinstance(m["content"], str)]
        if any(length > room and length > room * self.longest_token for length in lengths):
            return False  # more tokens than the room left, whatever they are
        suffix = tool_suffix_ids(self.processing_class, self.chat_template, self.args.chat_template_kwargs, messages)
        total = len(episode.completion_ids) + len(suffix)
        if total > self.args.max_completion_length or (context and len(episode.prompt_ids) + total >= context):
            return False
        episode.messages += messages
        episode.completion_ids += suffix
        episode.tool_mask += [0] * len(suffix)
        if self.processor is not None:  # the images the processor expanded into the suffix, shown from now on
            episode.images = episode.images + message_images(messages)
        return True

    def _failed(self, episode: Episode, error: Exception) -> dict:
        """A failed call's result; the episode's instance retired when the call timed out."""
        episode.tool_failures += 1
        if isinstance(error, ToolTimeout) and episode.environment is not None:
            self._retire(episode.environment)
        return {"error": str(error)}

    def _call(self, tool: Callable, arguments: dict, name: str, seed: int):
        """Sync tool `name` called with `arguments`, under the global RNGs seeded with `seed`, within
        `tool_call_timeout`."""
        timeout = self.args.tool_call_timeout
        with seeded(seed), no_exit(f"tool {name}"):
            if timeout is None:
                return tool(**arguments)
            return call_with_timeout(tool, arguments, timeout, name)

    def _call_async(self, coroutines: dict, names: list[str], results: list, episode: Episode) -> None:
        """The turn's async tool calls (call index → coroutine) run together on the tool loop, as GRPOTrainer gathers
        them, under the seed of the turn's last call; each result (or failure) written into `results`. A call still
        running after `tool_call_timeout` fails and its task is cancelled; the others keep their results."""
        timeout = self.args.tool_call_timeout
        with seeded(tool_seed(episode.seed, episode.tool_calls)):
            futures = {
                i: asyncio.run_coroutine_threadsafe(exit_guarded(coroutine, f"tool {names[i]}"), self._loop)
                for i, coroutine in coroutines.items()
            }
            concurrent.futures.wait(futures.values(), timeout)
        for i, future in futures.items():
            if not future.done():
                future.cancel()
                results[i] = self._failed(episode, ToolTimeout(names[i], timeout))
                continue
            try:
                results[i] = future.result()
            except Exception as error:  # the model's mistake, shown to it as the tool's answer
                results[i] = self._failed(episode, error)
