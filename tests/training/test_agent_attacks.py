"""Agent episodes under attack: environments and tools that misbehave (keep what they are given, walk their own data,
leave state behind, answer late, call exit(), nest, flood) must not make members face different episodes, end the
run, or exhaust the machine; inputs that cannot work are refused with errors naming them.

Episodes are played with `Agents.run` directly where a test needs the members' calls of one step (same `key`) or of
consecutive steps. The episode loop alone is under test, so no model generates: the generation backend's
`generate_ids` returns what a script writes (tests/training/test_agents.py runs the model under its scripts).
"""

import asyncio
import concurrent.futures
import os
import random
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
from datasets import Dataset
from helpers import CALL, Dice, agent_config, answer_digits, build_tiny_model, tool_tokenizer
from transformers import AutoTokenizer

from trl_es import ESTrainer
from trl_es.rollout import RolloutFunction


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with a context that holds the tool template's system prompt (~200 tokens) and an episode."""
    return build_tiny_model(tmp_path_factory.mktemp("attacks") / "model", tokenizer_dir, max_position_embeddings=1024)


def scripted_ids(trainer, script):
    """Patch the generation backend's `generate_ids`: `script(row, prompt_text, [])` gives each row's completion."""
    tokenizer = trainer.processing_class

    def generate_ids(rows, seeds, record_entropy=False, max_new_tokens=None):
        texts = [script(r, tokenizer.decode(row), []) for r, row in enumerate(rows)]
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts], [False] * len(rows), None

    trainer.generation.generate_ids = generate_ids


def trainer_for(tmp_path, model_dir, environment_factory, script, dataset=None, **overrides):
    reward = None if hasattr(environment_factory, "get_reward") else answer_digits
    trainer = ESTrainer(model_dir, reward, args=agent_config(tmp_path, **overrides), train_dataset=dataset,
                        environment_factory=environment_factory, processing_class=tool_tokenizer(model_dir))  # fmt: skip
    scripted_ids(trainer, script)
    return trainer


def play(trainer, rows, n_members=1, key=0):
    """One generate call's episodes: `n_members` members × `rows`, one generation each, at step `key`."""
    seeds = list(range(n_members * len(rows)))
    return trainer.agents.run(rows, n_members, 1, seeds, key, lambda members: None, trainer.generation)


ROW = {"prompt": [{"role": "user", "content": "Play."}]}


def calling(name, arguments="{}"):
    """A script: the first turn calls tool `name`, the turn after its result ends."""

    def script(row, prompt, ids):
        return "Done<|im_end|>" if "tool_response" in prompt else CALL.format(name=name, arguments=arguments)

    return script


def done(row, prompt, ids):
    return "Done<|im_end|>"


def tool_messages(completions) -> list[str]:
    return [m["content"] for episode in completions.completions for m in episode if m["role"] == "tool"]


class Waiting:
    """A tool that does nothing: completions are parsed for tool calls, as in any run with tools."""

    def wait(self) -> str:
        """Wait a turn.

        Returns:
            Nothing new.
        """
        return "waited"


# ---- Seeds: get_reward's, and reset's own


class Lucky(Waiting):
    def reset(self, **kwargs):
        self.base = random.randint(1, 9)

    def get_reward(self) -> float:
        return self.base + random.random()


def test_get_reward_draws_the_same_value_for_every_member_of_an_episode(tmp_path, tiny_model_dir):
    trainer = trainer_for(tmp_path, tiny_model_dir, Lucky, done)
    completions = play(trainer, [ROW], n_members=3)
    state = random.getstate()
    rewards = trainer.reward_funcs[-1](environments=completions.environments)
    assert len(set(rewards)) == 1  # common random numbers: one episode, one reward
    assert random.getstate() == state  # the global RNG is left as it was


class Remote(Waiting):
    """An OpenEnv-style client: the server draws the episode from the seed `reset` is given."""

    def reset(self, seed=None, **kwargs):
        self.seed = seed


def test_a_reset_that_takes_a_seed_gets_the_episodes_seed(tmp_path, tiny_model_dir):
    trainer = trainer_for(tmp_path, tiny_model_dir, Remote, done)
    rows = [ROW, {"prompt": [{"role": "user", "content": "Play again."}]}]
    seeds = [e.seed for e in play(trainer, rows, n_members=2).environments]
    assert None not in seeds and seeds[:2] == seeds[2:] and seeds[0] != seeds[1]  # per episode, the same per member
    assert seeds != [e.seed for e in play(trainer, rows, n_members=2, key=1).environments]  # a new step, new episodes


# ---- One instance per episode of a step, its own copy of the row, none shared after a timeout


class Deck(Waiting):
    def reset(self, cards, **kwargs):
        self.cards = cards  # kept, and mutated
        return f" Top card: {self.cards.pop()}."


def test_every_reset_receives_the_row_as_the_dataset_holds_it(tmp_path, tiny_model_dir):
    dataset = Dataset.from_dict({"prompt": [ROW["prompt"]], "cards": [[1, 2, 3, 4]]})
    trainer = trainer_for(tmp_path, tiny_model_dir, Deck, done, dataset)
    row = {**ROW, "cards": [1, 2, 3, 4]}
    prompts = [p[-1]["content"] for p in play(trainer, [row], n_members=3).prompts]
    assert prompts == ["Play. Top card: 4."] * 3 and row["cards"] == [1, 2, 3, 4]


class Walker(Waiting):
    """Walks its own data: each reset serves the next item."""

    def __init__(self):
        self.i = 0

    def reset(self, **kwargs):
        self.i += 1
        return f" Item {self.i}."


def test_an_environment_walking_its_own_data_is_named_at_construction(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match=r"Walker.*different observations"):
        trainer_for(tmp_path, tiny_model_dir, Walker, done)


class Notebook:
    """A careless reset: the notes of earlier episodes stay."""

    def __init__(self):
        self.notes = []

    def reset(self, **kwargs):
        pass

    def note(self, text: str) -> int:
        """Take a note.

        Args:
            text: The note.

        Returns:
            How many notes there are.
        """
        self.notes.append(text)
        return len(self.notes)


def test_state_a_careless_reset_leaves_does_not_reach_another_member_of_the_step(tmp_path, tiny_model_dir):
    trainer = trainer_for(tmp_path, tiny_model_dir, Notebook, calling("note", '{"text": "mine"}'))
    first, second = play(trainer, [ROW], key=0), play(trainer, [ROW], key=0)  # two members' calls of one step
    assert tool_messages(first) == tool_messages(second) == ["1"]
    assert second.environments[0].notes == ["mine"]


class Late:
    """A tool that answers after its timeout, then writes into its instance."""

    release, written = threading.Event(), threading.Event()
    pending = False

    def reset(self, **kwargs):
        self.log = []
        if Late.pending:  # the late write lands now, after this episode's reset
            Late.release.set()
            Late.written.wait(5)

    def slow_write(self) -> str:
        """Write slowly.

        Returns:
            Done.
        """
        Late.pending = True
        Late.release.wait(5)
        self.log.append("late")
        Late.written.set()
        return "written"


def test_a_timed_out_tool_never_writes_into_another_episodes_instance(tmp_path, tiny_model_dir):
    def script(row, prompt, ids):  # the first episode calls the tool, the next step's does not
        return done(row, prompt, ids) if Late.pending else calling("slow_write")(row, prompt, ids)

    trainer = trainer_for(tmp_path, tiny_model_dir, Late, script, tool_call_timeout=0.2)
    first = play(trainer, [ROW], key=0)
    assert "tool_call_timeout=0.2" in tool_messages(first)[0]
    second = play(trainer, [ROW], key=1)
    assert Late.written.is_set() and first.environments[0].log == ["late"]  # it wrote, into its own instance
    assert second.environments[0].log == []


# ---- An environment without tools


class Quiz:
    def reset(self, **kwargs):
        return " Say anything."

    def get_reward(self) -> float:
        return 1.0


def test_an_environment_without_tools_trains(tmp_path, tiny_model_dir):
    trainer = trainer_for(tmp_path, tiny_model_dir, Quiz, done)
    trainer.train()
    assert trainer.state.log_history[0]["rewards/Quiz/mean"] == 1


# ---- The reproducibility check


class Hidden(Waiting):
    """A silent reset drawing from a generator of its own, unseeded."""

    def __init__(self):
        self.rng = random.Random()

    def reset(self, **kwargs):
        self.target = self.rng.randint(1, 5)


class Lucky5(Waiting):
    """Five possible starts from a source trl-es does not seed; its first two resets agree."""

    source = random.Random(0)

    def reset(self, **kwargs):
        return f" Start at {Lucky5.source.randint(1, 5)}."


def test_the_check_sees_silent_resets_and_more_than_one_pair(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match=r"Hidden.*(target|rng)"):
        trainer_for(tmp_path, tiny_model_dir, Hidden, done)
    with pytest.warns(UserWarning, match=r"Lucky5.*different observations"):
        trainer_for(tmp_path, tiny_model_dir, Lucky5, done)


class Connection:
    """A remote service's client connection, from another package: a session id of its own per connect."""

    def connect(self):
        self.session = os.urandom(8).hex()


Connection.__module__ = "remote_service"


class Served(Waiting):
    """OpenEnv-style: the episode lives on the server (reached through `seed`); the client reconnects in reset."""

    def __init__(self):
        self.client = Connection()

    def reset(self, seed=None, **kwargs):
        self.client.connect()
        self.seed = seed


def test_the_check_compares_a_clients_connection_by_its_type(tmp_path, tiny_model_dir):
    """Its ids and sockets differ between instances by design (TRL's OpenEnv echo example warned on them); the
    environment's own state is still compared — `Hidden` above keeps its generator in itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer_for(tmp_path, tiny_model_dir, Served, done)


class Clock(Waiting):
    def reset(self, **kwargs):
        return f" It is {time.perf_counter_ns()}."


class Calm(Waiting):
    def reset(self, **kwargs):
        return " Calm."


def test_every_environment_of_a_dict_is_checked(tmp_path, tiny_model_dir):
    dataset = Dataset.from_dict({"environment": ["calm", "clock"]})
    trainer = trainer_for(tmp_path, tiny_model_dir, {"calm": Calm, "clock": Clock}, done, dataset)
    with pytest.warns(UserWarning, match=r"clock.*different observations"):
        play(trainer, [{"environment": "calm"}, {"environment": "clock"}])


def test_the_check_takes_its_instances_from_the_pool(tmp_path, tiny_model_dir):
    """TRL's CARLA example: each instance connects to a server of its own, and there are as many as episodes."""
    servers = ["server-a", "server-b"]

    class Car(Waiting):
        def __init__(self):
            if not servers:
                raise RuntimeError("no server left")
            self.url = servers.pop()

        def reset(self, **kwargs):
            return " Drive."

    trainer = trainer_for(tmp_path, tiny_model_dir, Car, done, population_size=2, per_device_train_batch_size=1)
    trainer.train()
    assert sorted(car.url for car in trainer.agents.pool[None]) == ["server-a", "server-b"]


# ---- Tools that call exit(), nest, flood


def run_code(code: str) -> str:
    """Run code.

    Args:
        code: The code.

    Returns:
        Its output.
    """
    exit()


async def async_run_code(code: str) -> str:
    """Run code.

    Args:
        code: The code.

    Returns:
        Its output.
    """
    exit()


async def async_echo(text: str) -> str:
    """Echo.

    Args:
        text: The text.

    Returns:
        The text.
    """
    return text


@pytest.mark.parametrize(
    "tool, timeout", [(run_code, None), (run_code, 2.0), (async_run_code, 2.0)], ids=["sync", "sync-timeout", "async"]
)
def test_a_tool_calling_exit_is_a_failed_call(tmp_path, tiny_model_dir, tool, timeout):
    def script(row, prompt, ids):
        if "Stay alive." in prompt:
            return calling("async_echo", '{"text": "alive"}')(row, prompt, ids)
        return calling(tool.__name__, '{"code": "exit()"}')(row, prompt, ids)

    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path, tool_call_timeout=timeout),
                        train_dataset=Dataset.from_dict({"prompt": [ROW["prompt"]]}), tools=[tool, async_echo],
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted_ids(trainer, script)
    completions = play(trainer, [ROW])
    assert completions.tool_failures == [1] and "exit" in tool_messages(completions)[0]
    echo = play(trainer, [{"prompt": [{"role": "user", "content": "Stay alive."}]}])
    assert tool_messages(echo) == ["alive"]  # the tool loop survived


def test_deeply_nested_tool_call_json_is_never_a_recursion_error(tmp_path, tiny_model_dir):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Nest {k}."}] for k in range(2)]})
    depths = {"Nest 0.": 600, "Nest 1.": 1200}  # past deepcopy's recursion limit; past json's

    def script(row, prompt, ids):
        if "tool_response" in prompt:
            return "Done<|im_end|>"
        depth = next(d for text, d in depths.items() if text in prompt)
        return CALL.format(name="async_echo", arguments='{"text": ' + "[" * depth + "]" * depth + "}")

    args = agent_config(tmp_path, per_device_train_batch_size=2, population_size=2, max_completion_length=1300)
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=args, train_dataset=dataset, tools=[async_echo],
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted_ids(trainer, script)
    trainer.train()  # each call stays text or fails: the step is scored
    assert trainer.state.global_step == 1


def test_a_tool_result_far_beyond_the_budget_is_not_tokenized(tmp_path, tiny_model_dir):
    def flood() -> str:
        """Flood.

        Returns:
            A lot.
        """
        return "x" * 2_000_000

    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), tools=[flood],
                        train_dataset=Dataset.from_dict({"prompt": [ROW["prompt"]]}),
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted_ids(trainer, calling("flood"))
    tokenizer, rendered = trainer.processing_class, []
    real = tokenizer.apply_chat_template

    def recording(conversation, **kwargs):  # one conversation, or a batch of them
        batch = conversation if conversation and isinstance(conversation[0], list) else [conversation]
        rendered.extend(len(str(m.get("content"))) for messages in batch for m in messages if isinstance(m, dict))
        return real(conversation, **kwargs)

    tokenizer.apply_chat_template = recording
    completions = play(trainer, [ROW])
    assert completions.tool_calls == [1] and [m["role"] for m in completions.completions[0]] == ["assistant"]
    assert max(rendered) < 100_000


# ---- Inputs that cannot work


def test_an_agent_runs_inputs_that_cannot_work_are_refused(tmp_path, tiny_model_dir):
    trainer = trainer_for(tmp_path, tiny_model_dir, Calm, done)
    with pytest.raises(ValueError, match="prompt 1 of this step is None"):
        play(trainer, [ROW, {"prompt": None}])
    with pytest.raises(ValueError, match="`train_dataset` is empty"):
        trainer_for(tmp_path, tiny_model_dir, Calm, done, Dataset.from_dict({"level": []}))


def test_a_rollout_funcs_env_mask_must_mark_each_token_with_0_or_1(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generation = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id])

    def returning(env_mask):
        output = {"prompt_ids": [[1]], "completion_ids": [[5, 6, 7]], "logprobs": [[0.0] * 3], "env_mask": env_mask}
        return RolloutFunction(lambda prompts, trainer: output, None, generation)

    assert returning([[1, 0, 1]])([{"prompt": "Hi"}], 1, [0]).tool_mask == [[1, 0, 1]]
    with pytest.raises(ValueError, match=r"env_mask.*2 values for completion 0 of 3 tokens"):
        returning([[1, 0]])([{"prompt": "Hi"}], 1, [0])
    with pytest.raises(ValueError, match=r"env_mask marks each token with 0 .* or 1 .*holds \[2\.0\]"):
        returning([[1, 2, 1]])([{"prompt": "Hi"}], 1, [0])


# ---- Async tools


def test_async_tools_of_one_turn_run_concurrently(tmp_path, tiny_model_dir):
    arrived = []

    async def meet(name: str) -> str:
        """Meet the others.

        Args:
            name: Who arrives.

        Returns:
            Whether they met.
        """
        arrived.append(name)
        for _ in range(100):
            if len(arrived) == 2:
                return "met"
            await asyncio.sleep(0.01)
        return "alone"

    two_calls = (
        CALL.format(name="meet", arguments='{"name": "a"}').removesuffix("<|im_end|>")
        + "\n"
        + CALL.format(name="meet", arguments='{"name": "b"}')
    )

    def script(row, prompt, ids):
        return "Done<|im_end|>" if "tool_response" in prompt else two_calls

    args = agent_config(tmp_path, max_completion_length=200)
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=args, tools=[meet],
                        train_dataset=Dataset.from_dict({"prompt": [ROW["prompt"]]}),
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted_ids(trainer, script)
    assert tool_messages(play(trainer, [ROW])) == ["met", "met"]


def test_an_async_timeout_cancels_the_task_whatever_timeout_error_futures_raise(tmp_path, tiny_model_dir, monkeypatch):
    """On Python 3.10 `concurrent.futures.TimeoutError` is not the builtin TimeoutError: simulated here."""
    cancelled = threading.Event()

    class FuturesTimeoutError(Exception):
        pass

    monkeypatch.setattr(concurrent.futures._base, "TimeoutError", FuturesTimeoutError)
    monkeypatch.setattr(concurrent.futures, "TimeoutError", FuturesTimeoutError)

    async def hang() -> str:
        """Hang.

        Returns:
            Never.
        """
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path, tool_call_timeout=0.2),
                        tools=[hang], train_dataset=Dataset.from_dict({"prompt": [ROW["prompt"]]}),
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted_ids(trainer, calling("hang"))
    assert "tool_call_timeout=0.2" in tool_messages(play(trainer, [ROW]))[0]
    assert cancelled.wait(5)


def test_a_factory_that_runs_out_of_instances_names_why(tmp_path, tiny_model_dir):
    """TRL's carla.py: each environment instance takes the next of a fixed list of server URLs in __init__. ES plays
    every episode of a generate call on an instance of its own (and checks resets on two at start), so a short list
    runs out: a bare StopIteration before, now an error saying what the factory must provide."""
    from trl_es import ESTrainer

    urls = iter(["http://server-0"])

    class OneServer(Dice):
        def __init__(self):
            self.url = next(urls)

    args = agent_config(tmp_path, population_size=2, sigma=0.5, learning_rate=0.5, per_device_train_batch_size=1,
                        num_generations=1, max_steps=1)  # fmt: skip
    with pytest.raises(RuntimeError, match="could not make instance 2 .*StopIteration.*an instance of its own"):
        ESTrainer(tiny_model_dir, answer_digits, args=args, environment_factory=OneServer,
                  processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
