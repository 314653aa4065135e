"""TRL's GRPO entry points with ESTrainer swapped in: the scenarios of TRL's example scripts and documentation
recipes that no other test runs. docs/migrating_from_grpo.md ("TRL's GRPO entry points, with ESTrainer swapped in")
lists every entry point, its status and the test that runs it; the GRPO trainer page's examples are in
test_trl_grpo_docs.py, TRL's contract tests in test_trl_grpo_parity.py, the agent recipes in
tests/training/test_agents.py.

Each scenario is written anew from the script or recipe it names (its arguments, columns, reward functions and
trainer call), with `from trl_es import ESConfig as GRPOConfig, ESTrainer as GRPOTrainer` as its one-line swap.
What changes, and only at these boundaries:
- the model: the tiny offline Llama (tests/helpers.py) for the Hub model, its tokenizer with TRL's Qwen2.5 template
  (which can call tools, as the scripts' Qwen3 models can);
- the data: a few local rows with the columns of the Hub dataset (tests/data where it has them);
- the device: CPU, without vLLM;
- the budget (`BUDGET`): one ES step of 2 members, 2 completions per prompt, a few tokens (`EPISODE` for a
  tool-calling scenario: one episode per prompt and member, room for a call and its result);
- trackers and the Hub: report_to="none", nothing pushed.
A tool-calling episode's turns are scripted as in tests/training/test_agents.py (`helpers.scripted`): the real
`generate` runs with each member's weights, and the script decides what the completion says.
"""

import dataclasses
import http.server
import importlib.util
import json
import sqlite3
import threading

import pytest
import torch
from datasets import Dataset
from helpers import CALL, DATA, QWEN_TEMPLATE, REPOSITORY, build_tiny_model, scripted
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es import ESConfig as GRPOConfig
from trl_es import ESTrainer as GRPOTrainer


BUDGET = dict(max_steps=1, population_size=2, sigma=0.05, num_generations=2, max_completion_length=8,
              report_to="none", save_strategy="no", disable_tqdm=True)  # fmt: skip
"""The budget every scenario runs on, in place of the script's (its steps, group size and completion length)."""
EPISODE = dict(num_generations=1, max_completion_length=64)
"""The budget of a tool-calling scenario: one episode per prompt and member, room for a call, its result, an answer."""


def budgeted(recipe: dict, **budget) -> dict:
    """The recipe's GRPOConfig fields with the budget (and `budget`) in place of its own."""
    return {**recipe, **BUDGET, **budget}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama standing in for the scripts' Qwen models: TRL's Qwen2.5 chat template (tools included), and a
    context that holds the template's tool prompt and an episode."""
    path = build_tiny_model(tmp_path_factory.mktemp("entry-points") / "model", tokenizer_dir,
                            max_position_embeddings=1024)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN_TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    return path


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def math_rows(n: int = 4) -> list[dict]:
    """MATH-500's first rows (tests/data): a `problem`, its worked `solution` (ending in \\boxed{}) and `answer`."""
    with open(DATA / "math500" / "test.jsonl") as file:
        return [json.loads(line) for line in file][:n]


# ---- trl/scripts/grpo.py (`trl grpo`), as `trl-es es`


def es_cli(*args: str) -> int:
    from trl_es.cli import main

    return main(["es", *args])


def test_trl_grpo_lora_recipe_names_no_reward_and_stops_as_grpo_does_then_trains_the_adapter_with_one(
    tmp_path, model_dir
):
    """PEFT integration page: `python trl/scripts/grpo.py --use_peft --lora_r 32 --lora_alpha 16` on
    trl-lib/math-reasoning. It names no reward function, so TRL's script hands GRPOTrainer an empty list, which stops
    with "No reward source provided"; `trl-es es` stops too, before loading the model. With `--reward_funcs
    accuracy_reward` it trains the adapter."""
    folder = tmp_path / "math-reasoning"
    folder.mkdir()
    rows = [{"prompt": chat(row["problem"]), "solution": row["answer"]} for row in math_rows()]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    recipe = ["--model_name_or_path", model_dir, "--dataset_name", str(folder), "--learning_rate", "1.0e-5",
              "--per_device_train_batch_size", "2", "--use_peft", "--lora_r", "32", "--lora_alpha", "16",
              "--output_dir", str(tmp_path / "out")]  # fmt: skip
    budget = ["--max_steps", "1", "--population_size", "2", "--num_generations", "2", "--max_completion_length", "8",
              "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    with pytest.raises(SystemExit, match="give reward_funcs"):  # before any model loads
        es_cli(*recipe, *budget)
    assert es_cli(*recipe, *budget, "--reward_funcs", "accuracy_reward") == 0
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (32, 16)


# ---- examples/scripts


def test_gspo_script_trains_its_adapter_and_names_the_loss_settings_es_ignores(tmp_path, model_dir):
    """examples/scripts/gspo.py with its documented command (one process): TrlParser over ScriptArguments,
    GRPOConfig and ModelConfig; NuminaMath-TIR's rows turned into a system + user conversation, `messages` and
    `problem` removed, `solution` kept for accuracy_reward; think_format_reward and accuracy_reward; a LoRA adapter
    on q_proj and v_proj of a bfloat16 model. GSPO's settings (sequence-level importance sampling, ε, ε_high, the
    loss type, generation batching) have no ES counterpart: accepted, and those away from GRPO's defaults named in
    one warning."""
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
    from trl.rewards import accuracy_reward, think_format_reward

    command = ["--model_name_or_path", model_dir, "--output_dir", str(tmp_path / "gspo"), "--learning_rate", "1e-5",
               "--dtype", "bfloat16", "--max_completion_length", "1024", "--use_peft", "--lora_target_modules",
               "q_proj", "v_proj", "--log_completions", "--per_device_train_batch_size", "8", "--num_generations", "8",
               "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4", "--beta",
               "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2", "--steps_per_generation", "8"]  # fmt: skip
    budget = ["--max_steps", "1", "--population_size", "2", "--sigma", "0.05", "--per_device_train_batch_size", "2",
              "--num_generations", "2", "--max_completion_length", "8", "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    with pytest.warns(UserWarning) as caught:
        script_args, training_args, model_args = parser.parse_args_and_config(args=command + budget)
    ignored = [str(w.message) for w in caught if "ignored by ES" in str(w.message)]
    assert len(ignored) == 1
    assert all(name in ignored[0] for name in ("importance_sampling_level", "epsilon_high", "steps_per_generation"))

    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    training_args.model_init_kwargs = dict(revision=model_args.model_revision,
                                           attn_implementation=model_args.attn_implementation, dtype=dtype)  # fmt: skip
    rows = [{"problem": r["problem"], "solution": r["solution"], "messages": chat(r["problem"])} for r in math_rows()]
    train_dataset, eval_dataset = Dataset.from_list(rows), Dataset.from_list(rows[:2])  # AI-MO/NuminaMath-TIR

    def make_conversation(example):
        return {"prompt": [{"role": "system", "content": "Think in <think></think>, then answer."},
                           {"role": "user", "content": example["problem"]}]}  # fmt: skip

    train_dataset = train_dataset.map(make_conversation).remove_columns(["messages", "problem"])
    eval_dataset = eval_dataset.map(make_conversation).remove_columns(["messages", "problem"])
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        reward_funcs=[think_format_reward, accuracy_reward],
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    assert trainer.es_params and all(".lora_" in name and name.split(".lora_")[0].endswith(("q_proj", "v_proj"))
                                     for name in trainer.es_params)  # fmt: skip
    trainer.train()
    trainer.save_model(training_args.output_dir)
    assert trainer.model.base_model.model.model.embed_tokens.weight.dtype == torch.bfloat16  # the base as loaded
    assert all(trainer.es_params[name].dtype == torch.float32 for name in trainer.es_params)  # the adapter, θ
    assert {"rewards/think_format_reward/mean", "rewards/accuracy_reward/mean"} <= trainer.state.log_history[0].keys()
    assert (tmp_path / "gspo" / "adapter_model.safetensors").is_file()


def gsm8k(split: str = "train") -> Dataset:
    """openai/gsm8k (main) from its first rows in tests/data: `question`, and `answer` ending in `#### <number>`."""
    with open(DATA / "gsm8k" / f"{split}.jsonl") as file:
        return Dataset.from_list([json.loads(line) for line in file])


def test_grpo_continuous_batching_script_is_refused_with_what_to_run_instead(tmp_path, model_dir):
    """examples/scripts/grpo_continuous_batching.py: it parses its GRPOConfig, then sets
    `use_transformers_continuous_batching = True` (and a continuous-batching config) on it before building the
    trainer. ESConfig refuses that field at construction, naming use_vllm=True; set afterwards, the trainer must refuse
    it too rather than generate another way without a word."""

    def correctness_reward(completions, reference_answer, **kwargs):
        return [
            float(ref in completion[-1]["content"])
            for completion, ref in zip(completions, reference_answer, strict=True)
        ]

    training_args = GRPOConfig(**budgeted(dict(output_dir=str(tmp_path / "cb")), per_device_train_batch_size=2))
    dataset = gsm8k().map(
        lambda example: {"prompt": [{"role": "system", "content": "Answer with #### <number>."},
                                    {"role": "user", "content": example["question"]}],
                         "reference_answer": example["answer"].split("####")[-1].strip().replace(",", "")},
        remove_columns=["question", "answer"],
    )  # fmt: skip
    training_args.use_transformers_continuous_batching = True
    if training_args.transformers_continuous_batching_config is None:
        training_args.transformers_continuous_batching_config = {"use_cuda_graph": False}
    with pytest.raises(ValueError, match="use_transformers_continuous_batching.*use_vllm=True"):
        trainer = GRPOTrainer(model=model_dir, reward_funcs=correctness_reward, args=training_args,
                              train_dataset=dataset)  # fmt: skip
        trainer.train()


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    connection = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
    try:
        return connection.execute(sql_command).fetchall()
    finally:
        connection.close()


def test_grpo_agent_script_queries_its_database_and_its_rewards_read_the_episodes(tmp_path, model_dir, monkeypatch):
    """examples/scripts/grpo_agent.py: a read-only SQLite tool over a BioGRID table built in the working directory,
    yes/no questions, `chat_template_kwargs={"enable_thinking": False}`, and three reward functions that read the
    episode's messages: the final answer in stars, the call → tool-result structure, and the SQL of each call with
    the rows it returned. Its command's `--use_vllm` is left off (the device); the rewards are the stand-ins'
    own, written to the script's contract (the same message fields)."""
    monkeypatch.chdir(tmp_path)
    with sqlite3.connect("biogrid.db") as connection:
        connection.execute("CREATE TABLE interactions (Alt_IDs_Interactor_A TEXT, Alt_IDs_Interactor_B TEXT)")
        connection.executemany("INSERT INTO interactions VALUES (?, ?)", [("JNKK|MAPKK4", "TP53"), ("BRCA1", "ATM")])
    questions = ["Does the gene JNKK interact with TP53?", "Does the gene BRCA1 interact with TP53?"]
    dataset = Dataset.from_dict({"prompt": [chat(q) for q in questions], "answer": ["yes", "no"]})  # biogrid_qa

    def correctness_reward(completions, answer, **kwargs):
        return [0.6 if f"*{a}*" in completion[-1]["content"].lower() else -0.5
                for completion, a in zip(completions, answer, strict=True)]  # fmt: skip

    def structure_reward(completions, **kwargs):
        called = [any(turn.get("tool_calls") for turn in c) for c in completions]
        answered = [any(turn["role"] == "tool" for turn in c) for c in completions]
        return [0.1 if call and tool else -0.15 if call else 0.0 for call, tool in zip(called, answered, strict=True)]

    def query_reward(completions, answer, **kwargs):
        rewards = []
        for completion, a in zip(completions, answer, strict=True):
            sql = [call["function"]["arguments"].get("sql_command", "").lower()
                   for turn in completion for call in turn.get("tool_calls") or []]  # fmt: skip
            rows = [row for turn in completion if turn["role"] == "tool" and isinstance(turn["content"], list)
                    for row in turn["content"]]  # a tool's list of rows stays a list, as in GRPOTrainer  # fmt: skip
            hits = bool(rows)
            rewards.append(sum(0.4 for q in sql if " where " in q) + (2.0 if hits == (a == "yes") and sql else -1.5))
        return rewards

    def script(row, prompt, ids):
        if "tool_response" in prompt:  # the turn after the tool's rows
            return "*yes*<|im_end|>" if "JNKK" in prompt else "*no*<|im_end|>"
        gene = "JNKK" if "JNKK" in prompt.rsplit("<|im_start|>user", 1)[-1] else "BRCA1"
        sql = (
            f"SELECT * FROM interactions WHERE Alt_IDs_Interactor_A LIKE '%{gene}%' AND Alt_IDs_Interactor_B = 'TP53'"
        )
        return CALL.format(name="query_biogrid", arguments=json.dumps({"sql_command": sql}))

    # its command's `--log_completions True` stops in TRL's completions printer (print_prompt_completions_sample
    # reads the tool's list of rows as content blocks), for GRPOTrainer as for ESTrainer: left off here
    recipe = dict(output_dir=str(tmp_path / "agent"), push_to_hub=False, max_steps=400)
    training_args = GRPOConfig(
        **budgeted(recipe, **EPISODE) | dict(max_completion_length=128, per_device_train_batch_size=2)
    )
    training_args.chat_template_kwargs = {"enable_thinking": False}
    trainer = GRPOTrainer(model=model_dir, train_dataset=dataset, eval_dataset=None, tools=[query_biogrid],
                          reward_funcs=[correctness_reward, structure_reward, query_reward], args=training_args)  # fmt: skip
    scripted(trainer, script)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == 1 and log["tools/failure_frequency"] == 0
    assert log["rewards/correctness_reward/mean"] == pytest.approx(0.6)  # *yes* after the row, *no* after none
    assert log["rewards/structure_reward/mean"] == pytest.approx(0.1)
    assert log["rewards/query_reward/mean"] == pytest.approx(2.4)  # a WHERE query whose rows support the answer


def openenv_example(name: str):
    """One of this repository's examples/openenv scripts, imported as a module."""
    spec = importlib.util.spec_from_file_location(
        f"openenv_{name}", REPOSITORY / "examples" / "openenv" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_2048_script_plays_with_its_lora_adapter(tmp_path, model_dir):
    """examples/scripts/grpo_2048.py as TRL ships it: an in-process game behind `environment_factory` (`reset`
    deals a board, the public `move` is the tool, the score is read by the reward function from `environments`),
    1000 identical conversational prompts, a GRPOConfig with `chat_template_kwargs`, logging every step,
    `log_completions`, 4 prompts × 2 accumulated, and `peft_config=LoraConfig()`. The game is this repository's 2048
    (examples/openenv/game_2048.py, a 3 × 3 board) in TRL's shape."""
    from peft import LoraConfig

    game = openenv_example("game_2048")

    class Game2048Env:
        def reset(self, **kwargs) -> str:
            self.game = game.Game2048()
            return self.game.reset(**kwargs)

        def move(self, direction: str) -> str:
            """
            Play one move in 2048.

            Args:
                direction: One of "up", "down", "left", "right".

            Returns:
                Environment feedback after the move.
            """
            return self.game.move(direction)

    def reward_score(environments, **kwargs):
        return [env.game.get_reward() for env in environments]

    def script(row, prompt, ids):  # the direction from the member's first generated token: members play differently
        direction = ("up", "down", "left", "right")[ids[0] % 4]
        return (
            "Done.<|im_end|>"
            if "tool_response" in prompt
            else CALL.format(name="move", arguments=f'{{"direction": "{direction}"}}')
        )

    dataset = Dataset.from_dict({"prompt": [chat("Play 2048 with the tool `move`. Maximize the score.")] * 1000})
    recipe = dict(chat_template_kwargs={"enable_thinking": False}, logging_steps=1, log_completions=True,
                  num_completions_to_print=2, report_to="trackio", trackio_space_id="trl-2048",
                  max_completion_length=2048, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  output_dir=str(tmp_path / "2048"))  # fmt: skip
    args = GRPOConfig(**budgeted(recipe, **EPISODE))
    trainer = GRPOTrainer(model=model_dir, train_dataset=dataset, reward_funcs=reward_score, args=args,
                          environment_factory=Game2048Env, peft_config=LoraConfig())  # fmt: skip
    scripted(trainer, script)
    assert trainer.es_params and all(".lora_" in name for name in trainer.es_params)
    trainer.train()
    log = trainer.state.log_history[0]
    games = trainer.agents.pool[None]
    assert len(games) == 2 * 4 * 2  # one game per episode: members × (4 prompts × 2 accumulated) × 1 generation
    assert log["tools/call_frequency"] == 1
    assert log["rewards/reward_score/mean"] == pytest.approx(sum(g.game.get_reward() for g in games) / len(games))


def test_the_openenv_scripts_progress_callback_shows_es_steps(tmp_path, model_dir, prompt_dataset):
    """examples/scripts/openenv/catch.py and sudoku.py pass `callbacks=[RichProgressCallback()]` (TRL's)."""
    from trl import RichProgressCallback

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_len, train_dataset=prompt_dataset,
                          args=GRPOConfig(**budgeted(dict(output_dir=str(tmp_path / "rich")), per_device_train_batch_size=2)),
                          callbacks=[RichProgressCallback()])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1


# ---- Recipes of TRL's documentation


def deepmath(n: int = 4) -> Dataset:
    """Rows shaped like trl-lib/DeepMath-103K and HuggingFaceH4/OpenR1-Math-220k-default-verified: a conversational
    `prompt` and the `solution` (an answer in LaTeX)."""
    return Dataset.from_dict({"prompt": [chat(row["problem"]) for row in math_rows(n)],
                              "solution": [row["answer"] for row in math_rows(n)]})  # fmt: skip


def test_peft_integration_recipe_names_no_reward_and_trains_the_adapter_once_given_one(tmp_path, model_dir):
    """PEFT integration page, GRPO's Python example: LoraConfig(r=32, lora_alpha=16, lora_dropout=0.05,
    bias="none"), learning_rate=1.0e-5, the model by name. As printed it passes no reward function: GRPOTrainer and
    ESTrainer stop alike. With one, only the adapter moves."""
    from peft import LoraConfig
    from trl.rewards import accuracy_reward

    peft_config = LoraConfig(r=32, lora_alpha=16, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
    recipe = dict(learning_rate=1.0e-5, output_dir=str(tmp_path / "peft"))
    training_args = GRPOConfig(**budgeted(recipe, per_device_train_batch_size=2))
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=model_dir, args=training_args, train_dataset=deepmath(), peft_config=peft_config)
    trainer = GRPOTrainer(model=model_dir, args=training_args, train_dataset=deepmath(), peft_config=peft_config,
                          reward_funcs=accuracy_reward)  # fmt: skip
    assert trainer.es_params and all(".lora_" in name for name in trainer.es_params)
    trainer.train()
    assert trainer.state.global_step == 1


def test_lora_without_regret_recipe_trains_a_rank_1_adapter_on_every_linear_layer(tmp_path, model_dir):
    """LoRA Without Regret page, GRPO's Python example: LoraConfig(r=1, lora_alpha=32, target_modules="all-linear"),
    learning_rate=5e-5, 1 prompt × 4 accumulated, generation_batch_size=8 (ES generates a step's completions at
    once: named as ignored), reasoning_accuracy_reward on OpenR1-Math's prompt and solution columns."""
    from peft import LoraConfig
    from trl.rewards import reasoning_accuracy_reward

    peft_config = LoraConfig(r=1, lora_alpha=32, target_modules="all-linear")
    with pytest.warns(UserWarning, match="ignored by ES: generation_batch_size"):
        recipe = dict(learning_rate=5e-5, per_device_train_batch_size=1, gradient_accumulation_steps=4,
                      num_train_epochs=1, num_generations=8, generation_batch_size=8, report_to=["trackio"],
                      output_dir=str(tmp_path / "lwr"))  # fmt: skip
        training_args = GRPOConfig(**budgeted(recipe))
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reasoning_accuracy_reward, args=training_args,
                          train_dataset=deepmath(), peft_config=peft_config)  # fmt: skip
    adapted = {name.split(".lora_")[0] for name in trainer.es_params}
    assert len(adapted) == 2 * 7  # q, k, v, o, gate, up, down of both layers
    assert all(p.shape[0] == 1 or p.shape[1] == 1 for p in trainer.es_params.values())  # rank 1
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["num_tokens"] > 0


def test_an_environment_reads_its_task_from_an_external_dataset(tmp_path, model_dir):
    """GRPO trainer page, "Providing an external dataset": each row's `prompt` is the prompt and its other columns
    reach `reset` as keyword arguments (here the counter's `target`); `get_reward` scores the episode."""
    targets = []

    class IncrementEnv:
        def reset(self, target, **kwargs) -> None:
            self.counter, self.target = 0, target
            targets.append(target)

        def get_reward(self) -> float:
            return float(self.counter == self.target)

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

    def script(row, prompt, ids):
        return (
            "Done.<|im_end|>" if "tool_response" in prompt else CALL.format(name="increment", arguments='{"step": 2}')
        )

    dataset = Dataset.from_dict({"prompt": [chat(f"Increment the counter to {i}.") for i in range(1, 7)],
                                 "target": list(range(1, 7))})  # fmt: skip
    args = GRPOConfig(**budgeted(dict(output_dir=str(tmp_path / "env")), **EPISODE, per_device_train_batch_size=6))
    trainer = GRPOTrainer(model=model_dir, args=args, train_dataset=dataset, environment_factory=IncrementEnv)
    scripted(trainer, script)
    targets.clear()  # the reproducibility check at start-up reset an environment with the first row
    trainer.train()
    assert sorted(set(targets)) == [1, 2, 3, 4, 5, 6]
    assert trainer.state.log_history[0]["rewards/IncrementEnv/mean"] == pytest.approx(1 / 6)  # only target 2 is hit


@pytest.mark.parametrize(
    "recipe",
    [
        dict(entropy_coef=0.05),  # static entropy
        dict(
            entropy_coef=0.01,
            use_adaptive_entropy=True,
            entropy_target=5.0,
            entropy_coef_delta=0.005,
            entropy_coef_min=0.0,
            entropy_coef_max=1.0,
        ),  # adaptive entropy  # fmt: skip
    ],
    ids=["static-entropy", "adaptive-entropy"],
)
def test_the_entropy_bonus_recipes_are_accepted_and_named_as_ignored(tmp_path, recipe):
    """GRPO trainer page, "Entropy regularization": ES adds no entropy bonus to a loss (it has none); the fields are
    accepted, for the recipe's sake, and named in one warning."""
    with pytest.warns(UserWarning, match="ignored by ES: entropy_coef") as caught:
        GRPOConfig(output_dir=str(tmp_path), **recipe)
    assert sum("ignored by ES" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize(
    "recipe, message",
    [
        (dict(ds3_gather_for_generation=False), "gathered whole"),  # reducing memory usage
        (
            dict(
                use_transformers_continuous_batching=True,
                transformers_continuous_batching_config={"use_cuda_graph": False, "max_memory_percent": 0.4},
            ),
            "use_vllm=True",
        ),  # GRPO trainer page, continuous batching  # fmt: skip
    ],
    ids=["ds3_gather_for_generation", "continuous_batching"],
)
def test_recipes_es_cannot_honour_are_refused_saying_why(tmp_path, recipe, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), **recipe)


@pytest.mark.parametrize(
    "settings, zero_stage, processes, message",
    [
        (dict(use_vllm=True, vllm_mode="server"), 3, 32, "use ZeRO-2 or none"),
        (dict(use_vllm=True, vllm_mode="server"), 2, 32, "32 processes and 1 server"),
        (dict(bf16=True, use_cpu=True), 3, 32, "Use ZeRO-2"),
    ],
    ids=["vllm-with-zero3", "server-with-32-processes", "bf16-with-zero3"],
)
def test_the_70b_multi_node_recipe_is_refused_naming_what_to_run_instead(
    tmp_path, tiny_model_dir, settings, zero_stage, processes, message
):
    """GRPO trainer page, "GRPO at scale": 4 nodes × 8 processes under ZeRO-3 (bf16, TRL's default on GPU) talking
    to one vLLM server. Each of its three settings is refused once the processes are known (checked here directly,
    with the launch's ZeRO stage and process count)."""
    from accelerate import Accelerator

    from trl_es.training.checks import check_setup
    from trl_es.training.loading import run_facts

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **settings)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    facts = run_facts(model, AutoTokenizer.from_pretrained(tiny_model_dir), dict(model.named_parameters()), args,
                      Accelerator(cpu=True), zero_stage)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check_setup(args, dataclasses.replace(facts, num_processes=processes))


class VLLMDevServer(http.server.BaseHTTPRequestHandler):
    """What `trl vllm-serve` (TRL 1.16) starts: vLLM's OpenAI server with its development endpoints
    (VLLM_SERVER_DEV_MODE=1) and no ES worker extension, so a `collective_rpc` of an ES method fails inside vLLM."""

    def reply(self, status: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, "")
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "Qwen/Qwen2.5-7B", "object": "model"}]})
        else:
            self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(500 if self.path == "/collective_rpc" else 404, "Internal Server Error")

    def log_message(self, *args):
        pass


def test_a_trl_vllm_serve_server_is_refused_naming_trl_es_vllm_serve(tmp_path, tiny_model_dir, prompt_dataset):
    """GRPO trainer, vLLM integration and speeding-up pages: `trl vllm-serve --model <model>` then
    `GRPOConfig(use_vllm=True, vllm_mode="server")`. ES needs its own worker extension in the server."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), VLLMDevServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recipe = dict(
            output_dir=str(tmp_path),
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=f"http://127.0.0.1:{server.server_port}",
        )  # the server's address
        args = GRPOConfig(**budgeted(recipe, per_device_train_batch_size=2))
        with pytest.raises(Exception, match="trl-es vllm-serve"):
            trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=prompt_dataset)  # fmt: skip
            trainer.train()
    finally:
        server.shutdown()


# ---- TRL's accelerate configs


def test_trl_zero3_config_as_shipped_keeps_theta_in_float32_or_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    """`trl grpo --accelerate_config zero3`, with TRL's zero3.yaml as it ships (`mixed_precision: bf16`) and bf16 off
    (ES's default on CPU; what the bf16 + ZeRO-3 refusal asks for on GPU): DeepSpeed kept θ's partitions in bfloat16
    (2 CPU processes ended 5.5e-3 away from one process's weights). The launcher's mixed precision reaches the run
    (`ACCELERATE_MIXED_PRECISION`, which `accelerate launch` sets from the config) and, with ZeRO-3, is refused naming
    it."""
    from trl_es.training.checks import check_setup

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what the launcher sets from the config
    args = GRPOConfig(**budgeted(dict(output_dir=str(tmp_path), use_cpu=True)))
    assert args.bf16 is False
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["Count to 3:"]}))  # fmt: skip
    assert trainer.accelerator.mixed_precision == "bf16"
    assert trainer.generation.compute_dtype == torch.bfloat16  # the members in bfloat16, as GRPO's autocast
    assert trainer.facts.half_precision == "bf16"  # the launcher's, in the run's facts
    with pytest.raises(ValueError, match="mixed precision .bf16.*accelerate config's mixed_precision.*ZeRO-3"):
        check_setup(trainer.args, dataclasses.replace(trainer.facts, zero_stage=3, num_processes=2))
