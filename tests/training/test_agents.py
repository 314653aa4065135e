"""Agent training, as GRPOTrainer takes it: tools, environment_factory, rollout_func. TRL's agent tests
(tests/test_grpo_trainer.py) carried over as scenarios on the tiny Llama with SmolLM2's tokenizer and TRL's Qwen2.5
tool template, plus what ES adds: the member is formed for every turn of its episodes, common random numbers for
environments, resume, seed-chain replay, tool timeouts (1 vs 2 processes: the regression guard's `agents` scenario).

As TRL's tests do, the model's `generate` is patched to decide when a completion calls a tool (`scripted`): the real
`generate` still runs with the member's weights, hooks and seeds, and the scripted text keeps a part of what it
generated, so completions (and rewards) still differ between members.
"""

import time

import pandas as pd
import pytest
import torch
from datasets import Dataset
from helpers import (  # noqa: E402
    CALL,
    agent_config,
    answer_digits,
    build_tiny_model,
    dice_script,
    dice_trainer,
    digits,
    scripted,
    tool_tokenizer,
    weights,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es import ESConfig, ESTrainer, load_chain
from trl_es.es import weights_hash


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with a context that holds the tool template's system prompt (~200 tokens) and an episode."""
    return build_tiny_model(tmp_path_factory.mktemp("agents") / "model", tokenizer_dir, max_position_embeddings=1024)


def conversational(n=4):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {k} + {k}?"}] for k in range(n)]})


def multiply_tool(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def moved(trainer, start: dict) -> bool:
    return any(not torch.equal(p, start[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize(
    "tool", [multiply_tool, pytest.param(async_multiply_tool, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_tools_are_called_and_failures_become_error_text(tmp_path, tiny_model_dir, tool):
    """TRL's test_train_with_tools: one correct call, one with a wrong argument (a failure, answered as error text),
    one completion without a call; the post-tool turn runs for the two that called."""
    name = tool.__name__

    def script(row, prompt, ids):
        if "tool_response" in prompt:  # the turn after a tool result
            return f"Done {digits(ids)}<|im_end|>"
        return [CALL.format(name=name, arguments='{"a": 3, "b": 4}'), CALL.format(name=name, arguments='{"a": 3, "c": 4}'),
                f"I don't know any tool {digits(ids)}<|im_end|>"][row % 3]  # fmt: skip

    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return answer_digits(completions)

    args = agent_config(tmp_path, log_completions=True)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=conversational(3), tools=[tool],
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    start = weights(trainer.model)
    batches = scripted(trainer, script)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3)
    assert log["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert batches[:2] == [3, 2]  # first turn: the 3 prompts; the tool turn: the 2 that called
    roles = [[m["role"] for m in completion] for completion in seen[:3]]
    assert roles == [["assistant", "tool", "assistant"], ["assistant", "tool", "assistant"], ["assistant"]]
    assert seen[0][1]["content"] == "12" and "unexpected keyword" in seen[1][1]["content"]
    assert moved(trainer, start)
    table = pd.read_parquet(next((tmp_path / "out" / "completions").glob("*.parquet")))  # episodes as messages
    assert len(table) == 3 and "tool" in str(table["completion"][0])


@pytest.mark.slow  # kept out of the fast suite for time; ~4 s
def test_malformed_tool_calls_are_text(tmp_path, tiny_model_dir):
    """TRL's test_train_with_malformed_tool_calls: no name, a wrong tag, invalid JSON: none is a call, so no
    second turn runs."""
    rows = [
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        '<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall><|im_end|>',
        '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',
    ]
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), train_dataset=conversational(3),
                        tools=[multiply_tool], processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    batches = scripted(trainer, lambda row, prompt, ids: rows[row % 3])
    trainer.train()
    assert set(batches) == {3}  # every call is a first turn
    assert trainer.state.log_history[0]["tools/call_frequency"] == 0


class Counter:
    """TRL's DummyEnvironment: `increment` adds to a counter, `get_reward` returns it."""

    def reset(self, **kwargs):
        self.counter = 0

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: How much to add.

        Returns:
            The counter.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)


def counting_script(row, prompt, ids):
    """Row 0 increments by a member-dependent step, row 1 calls an unknown tool, row 2 declines."""
    if "tool_response" in prompt:
        return "Done!<|im_end|>"
    step = 1 + ids[0] % 3
    calls = [CALL.format(name="increment", arguments=f'{{"step": {step}}}'),
             CALL.format(name="decrement", arguments='{"step": 2}'), "I won't increment<|im_end|>"]  # fmt: skip
    return calls[row % 3]


@pytest.mark.slow  # ~10 s
def test_environment_owned_reward_and_data_without_a_dataset(tmp_path, tiny_model_dir):
    """TRL's test_train_with_environment_factory + test_train_with_environment_owned_reward: no dataset, no reward
    functions; the environment's `get_reward` is the reward (named after the class, weight 1), its public methods
    the tools; one instance per episode."""
    trainer = ESTrainer(tiny_model_dir, args=agent_config(tmp_path, max_steps=2), environment_factory=Counter,
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    assert trainer.reward_func_names == ["Counter"] and trainer.reward_weights.tolist() == [1.0]
    assert [tool.__name__ for tool in trainer.agents.tools] == ["increment"]  # not reset, not get_reward
    start = weights(trainer.model)
    scripted(trainer, counting_script)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == pytest.approx(
        1 / 2
    )
    assert 1 / 3 <= log["rewards/Counter/mean"] <= 1  # counters (1..3, 0, 0): each episode its own instance
    assert len(trainer.agents.pool[None]) == 4 * 3  # one per episode of a step (members × prompts), reset each step
    assert moved(trainer, start)


def test_environment_owned_reward_beside_reward_functions_and_mixed_environments(tmp_path, tiny_model_dir):
    """TRL's test_environment_owned_reward_coexists_with_reward_funcs and _mixed_environments."""

    def format_reward(completions, **kwargs):
        return [0.0] * len(completions)

    class Plain:
        def reset(self, **kwargs):
            pass

        def play(self, x: int) -> int:
            """Play.

            Args:
                x: A move.

            Returns:
                The move.
            """
            return x

    tokenizer = tool_tokenizer(tiny_model_dir)
    args = agent_config(tmp_path, reward_weights=[0.5])
    trainer = ESTrainer(
        tiny_model_dir, format_reward, args=args, environment_factory=Counter, processing_class=tokenizer
    )
    assert trainer.reward_func_names == ["format_reward", "Counter"] and trainer.reward_weights.tolist() == [0.5, 1.0]
    dataset = Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    trainer = ESTrainer(tiny_model_dir, format_reward, args=agent_config(tmp_path), train_dataset=dataset,
                        environment_factory={"scored": Counter, "scored2": Counter, "plain": Plain},
                        processing_class=tokenizer)  # fmt: skip
    assert trainer.reward_func_names == ["format_reward", "Counter"]  # one column per environment class
    scored, plain = Counter(), Plain()
    scored.reset()
    assert trainer.reward_funcs[-1](environments=[scored, plain]) == [0.0, None]


@pytest.mark.slow  # kept out of the fast suite for time; ~8 s
def test_several_environments_each_with_its_tools_and_an_unknown_one(tmp_path, tiny_model_dir):
    """TRL's test_train_with_multiple_environments and test_train_with_unknown_environment_raises."""
    seen = {"counter": [], "echo": []}

    class Echo:
        def reset(self, **kwargs):
            seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """Shout.

            Args:
                text: What to shout.

            Returns:
                The text in capitals.
            """
            return text.upper()

    class Count(Counter):
        def reset(self, **kwargs):
            seen["counter"].append(kwargs)
            super().reset()
            return "Count."

    def script(row, prompt, ids):
        if "tool_response" in prompt:
            return f"Done {digits(ids)}<|im_end|>"
        if prompt.rstrip().endswith("Echo.<|im_end|>\n<|im_start|>assistant"):
            return CALL.format(name="shout", arguments='{"text": "hi"}')
        return CALL.format(name="increment", arguments='{"step": 1}')

    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 2})
    tokenizer = tool_tokenizer(tiny_model_dir)
    factories = {"counter": Count, "echo": Echo}
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path, per_device_train_batch_size=4),
                        train_dataset=dataset, environment_factory=factories, processing_class=tokenizer)  # fmt: skip
    scripted(trainer, script)
    seen["counter"].clear(), seen["echo"].clear()  # the reproducibility check reset the first row's environment
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == 1 and log["tools/failure_frequency"] == 0  # each used its own tool
    assert seen["counter"] and seen["echo"] and all("environment" not in kwargs for kwargs in seen["counter"])
    unknown = Dataset.from_dict({"environment": ["unknown"] * 3})
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), train_dataset=unknown,
                        environment_factory={"counter": Count}, processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_bad_agent_set_ups_get_trl_errors(tmp_path, tiny_model_dir):
    tokenizer = tool_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="No reward source provided"):
        ESTrainer(
            tiny_model_dir, args=agent_config(tmp_path), train_dataset=conversational(), processing_class=tokenizer
        )
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path))
    with pytest.raises(ValueError, match="max_steps"):
        ESTrainer(tiny_model_dir, args=agent_config(tmp_path, max_steps=-1), environment_factory=Counter,
                  processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), environment_factory={"a": Counter},
                  processing_class=tokenizer)  # fmt: skip

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A move.
            """
            return x

    with pytest.raises(ValueError, match="no `reset` method"):
        ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), environment_factory=NoReset,
                  processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="cannot call tools: set a tool-capable chat template"):  # SmolLM2's own
        ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path), train_dataset=conversational(),
                  tools=[multiply_tool])  # fmt: skip


def test_rollout_func_keys_extra_fields_and_env_mask(tmp_path, tiny_model_dir):
    """TRL's rollout_func contract: called with (prompts, trainer), `num_generations` copies of each prompt; the
    required keys; extra keys reach the reward functions per completion; `env_mask` marks the model's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = {}

    def rollout_func(prompts, trainer):
        seen["prompts"], seen["trainer"] = prompts, trainer
        ids = tokenizer(prompts)["input_ids"]
        completions = trainer.generation.generate_ids(ids, list(range(len(ids))))[0]
        return {"prompt_ids": ids, "completion_ids": [c + [7, 7] for c in completions], "logprobs": [[0.0]] * len(ids),
                "score": [len(c) / 10 for c in completions], "env_mask": [[1] * len(c) + [0, 0] for c in completions]}  # fmt: skip

    def from_rollout(score, **kwargs):
        return score

    dataset = Dataset.from_dict({"prompt": [f"Count to {k}:" for k in range(3)]})
    args = agent_config(tmp_path, num_generations=2, max_completion_length=6)
    trainer = ESTrainer(tiny_model_dir, from_rollout, args=args, train_dataset=dataset, rollout_func=rollout_func)
    trainer.train()
    prompts = seen["prompts"]  # the step's rows (shuffled), each twice in a row
    assert seen["trainer"] is trainer and prompts[::2] == prompts[1::2] and sorted(prompts[::2]) == dataset["prompt"]
    log = trainer.state.log_history[0]
    assert log["completions/max_length"] <= 6  # the two environment tokens are left out
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        broken = ESTrainer(tiny_model_dir, from_rollout, args=agent_config(tmp_path), train_dataset=dataset,
                           rollout_func=lambda prompts, trainer: {"prompt_ids": [], "completion_ids": []})  # fmt: skip
        broken.train()


def test_the_member_is_formed_for_every_turn_of_its_episodes(tmp_path, tiny_model_dir):
    """Every generate call of one member's episodes (first turn, tool turns) runs on that member's weights."""
    trainer = ESTrainer(tiny_model_dir, answer_digits, args=agent_config(tmp_path, population_size=3), tools=[multiply_tool],
                        train_dataset=conversational(3), processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    theta = weights_hash(dict(trainer.model.named_parameters()))
    seen = []

    def script(row, prompt, ids):
        if row == 0:
            seen.append((weights_hash(dict(trainer.model.named_parameters())), "tool_response" in prompt))
        if "tool_response" in prompt:
            return f"Done {digits(ids)}<|im_end|>"
        return CALL.format(name="multiply_tool", arguments='{"a": 2, "b": 3}')

    scripted(trainer, script)
    trainer.train()
    assert [turn for _, turn in seen] == [False, True] * 3  # each member: its first turn, then its tool turn
    members = [seen[k][0] for k in range(0, 6, 2)]
    assert [seen[k + 1][0] for k in range(0, 6, 2)] == members  # the same weights for both turns
    assert len(set(members)) == 3 and theta not in members  # each member's own, none of them θ


def budget_script(row, prompt, ids):
    if "tool_response" in prompt:
        return f"Done {digits(ids)}<|im_end|>"
    return CALL.format(name="multiply_tool", arguments='{"a": 2, "b": 3}')


@pytest.mark.slow  # ~7 s
def test_a_tool_turn_that_would_overflow_the_budget_is_rolled_back_and_iterations_are_capped(tmp_path, tiny_model_dir):
    tokenizer = tool_tokenizer(tiny_model_dir)
    call_length = len(tokenizer(CALL.format(name="multiply_tool", arguments='{"a": 2, "b": 3}'))["input_ids"])
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return answer_digits(completions)

    for k, overrides in enumerate([{"max_completion_length": call_length + 2}, {"max_tool_calling_iterations": 0}]):
        trainer = ESTrainer(tiny_model_dir, reward, args=agent_config(tmp_path / str(k), **overrides), tools=[multiply_tool],
                            train_dataset=conversational(3), processing_class=tokenizer)  # fmt: skip
        batches = scripted(trainer, budget_script)
        seen.clear()
        trainer.train()
        assert set(batches) == {3}  # no tool turn was generated
        assert all([m["role"] for m in c] == ["assistant"] for c in seen)  # the tool result was not kept
        log = trainer.state.log_history[0]
        assert log["tools/call_frequency"] == (1 if k == 0 else 0)  # rolled back: called; capped: not called


def test_a_hanging_tool_times_out_and_the_episode_goes_on(tmp_path, tiny_model_dir):
    def slow_tool(a: int) -> int:
        """Answers slowly.

        Args:
            a: A number.

        Returns:
            The number.
        """
        time.sleep(30)
        return a

    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return answer_digits(completions)

    def script(row, prompt, ids):
        if "tool_response" in prompt:
            return f"Done {digits(ids)}<|im_end|>"
        return CALL.format(name="slow_tool", arguments='{"a": 1}')

    args = agent_config(tmp_path, population_size=2, per_device_train_batch_size=1, tool_call_timeout=0.2)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, tools=[slow_tool], train_dataset=conversational(1),
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    scripted(trainer, script)
    start = time.perf_counter()
    trainer.train()
    assert time.perf_counter() - start < 20
    assert trainer.state.log_history[0]["tools/failure_frequency"] == 1
    assert "tool_call_timeout=0.2" in seen[0][1]["content"] and seen[0][-1]["role"] == "assistant"
    with pytest.raises(ValueError, match="tool_call_timeout"):
        ESConfig(output_dir=str(tmp_path), tool_call_timeout=0)


@pytest.mark.slow  # three short runs (~30 s)
def test_members_face_the_same_episodes_and_a_resumed_run_and_the_chain_give_the_same_weights(
    tmp_path, tiny_model_dir
):
    prompts = []
    trainer = dice_trainer(tiny_model_dir, tmp_path / "full")
    real_run = trainer.agents.run

    def recording_run(rows, n_members, n, seeds, key, route, generation):
        completions = real_run(rows, n_members, n, seeds, key, route, generation)
        prompts.append([p[-1]["content"] for p in completions.prompts])
        return completions

    trainer.agents.run = recording_run
    trainer.train()
    trainer.save_model()
    assert len({tuple(p) for p in prompts[:4]}) == 1 and prompts[0] != prompts[4]  # one set of episodes per step
    full = weights(trainer.model)
    first = dice_trainer(tiny_model_dir, tmp_path / "resumed", save_strategy="steps", save_steps=1, max_steps=1)
    first.train()
    resumed = dice_trainer(tiny_model_dir, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "out" / "checkpoint-1"))
    assert all(torch.equal(p, full[name]) for name, p in resumed.model.named_parameters())
    replayed = load_chain(str(tmp_path / "full" / "out")).apply(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert all(torch.equal(p, full[name]) for name, p in replayed.named_parameters())
    assert any(not torch.equal(p, q) for p, q in zip(replayed.parameters(), first.model.parameters(), strict=True))


def test_an_unreproducible_environment_warns_once_and_a_failing_reset_restores_theta(tmp_path, tiny_model_dir):
    class Clock(Counter):
        def reset(self, **kwargs):
            super().reset()
            return f" It is {time.perf_counter_ns()}."

    with pytest.warns(UserWarning, match="reset under the same seed returned different observations"):
        ESTrainer(tiny_model_dir, args=agent_config(tmp_path), environment_factory=Clock,
                  processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip

    class Broken(Counter):
        gone = False

        def reset(self, **kwargs):
            if Broken.gone:  # after the reproducibility check
                raise ConnectionError("environment server gone")
            return super().reset()

    trainer = ESTrainer(tiny_model_dir, args=agent_config(tmp_path), environment_factory=Broken,
                        processing_class=tool_tokenizer(tiny_model_dir))  # fmt: skip
    Broken.gone = True
    start = weights(trainer.model)
    with pytest.raises(ConnectionError, match="environment server gone"):
        trainer.train()
    assert not moved(trainer, start)


@pytest.mark.slow  # ~13 s
def test_batched_lowrank_episodes_do_not_depend_on_which_members_share_a_call(tmp_path, tiny_model_dir):
    """Low-rank members batched in one call play their episodes together: later turns carry only the rows still
    calling tools, each routed to its member. The weights equal those of one member per call."""

    def run(per_call):
        trainer = dice_trainer(tiny_model_dir, tmp_path / str(per_call), es_search_space="lowrank",
                               lowrank_members_per_call=per_call, max_steps=1)  # fmt: skip
        batches = scripted(trainer, dice_script)
        trainer.train()
        return weights(trainer.model), batches

    together, batches = run(None)
    alone, _ = run(1)
    assert batches[0] == 4 * 2 * 2 and batches[1] == 4 * 2 * 2  # all 4 members × 2 prompts × 2 generations
    assert all(torch.equal(p, together[name]) for name, p in alone.items())


# Two processes give the weights of one with an environment: the regression guard's `agents` scenario
# (tests/distributed/test_regression_guard.py).
