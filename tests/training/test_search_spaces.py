"""Search-space strategies: parameter subsets (name patterns, a new LoRA adapter via peft_config) and CoPES."""

import pytest
import torch
from helpers import REPOSITORY, upper_vocab_share
from helpers import es_config as config

from trl_es import ESTrainer
from trl_es.es import NoiseTable, ParameterSnapshot, member_groups, partition_parameters


NAMES = [
    "model.embed_tokens.weight",
    *(
        f"model.layers.{i}.{m}.weight"
        for i in range(4)
        for m in ("self_attn.q_proj", "mlp.up_proj", "input_layernorm")
    ),
    "model.norm.weight",
]


def test_partitions():
    layer = partition_parameters(NAMES, 2, "layer")
    assert all("layers.0." in n or "layers.1." in n for n in layer[0] if "layers" in n)
    assert all("layers.2." in n or "layers.3." in n for n in layer[1] if "layers" in n)
    assert layer[0][0] == "model.embed_tokens.weight" and "model.norm.weight" in layer[1]  # others round-robin
    module = partition_parameters(NAMES, 3, "module")
    # types sorted (embed_tokens, input_layernorm, norm, q_proj, up_proj) and dealt round-robin over 3 groups
    assert [{n.split(".")[-2] for n in g} for g in module] == [
        {"embed_tokens", "q_proj"},
        {"input_layernorm", "up_proj"},
        {"norm"},
    ]
    random = partition_parameters(NAMES, 3, "random", seed=1)
    assert random == partition_parameters(NAMES, 3, "random", seed=1) != partition_parameters(NAMES, 3, "random", 2)
    for groups in (layer, module, random):
        assert sorted(n for g in groups for n in g) == sorted(NAMES)  # a partition: every name once
    with pytest.raises(ValueError, match="leaves 2 empty"):
        partition_parameters(NAMES, 6, "layer")  # 4 layers + 2 others: fine, but 6 blocks of 4 layers leave gaps
    assert member_groups(6, 3, antithetic=False) == [0, 1, 2, 0, 1, 2]
    assert member_groups(6, 3, antithetic=True) == [0, 0, 1, 1, 2, 2]  # ±ε of a pair share their group


def test_group_perturbation_and_restore_touch_only_the_group():
    params = {n: torch.nn.Parameter(torch.randn(3, 4)) for n in ("a", "b", "c")}
    before = {n: p.detach().clone() for n, p in params.items()}
    snapshot = ParameterSnapshot(params)
    snapshot.capture()
    snapshot.perturb(NoiseTable(0, 1 << 21), seed=5, scale=0.1, names=["b"])
    assert torch.equal(params["a"], before["a"]) and torch.equal(params["c"], before["c"])
    assert not torch.equal(params["b"], before["b"])
    snapshot.restore(["b"])
    assert all(torch.equal(params[n], before[n]) for n in params)


@pytest.mark.slow  # kept out of the fast suite for time; ~4 s
def test_copes_with_one_group_is_full_es_bitwise(tmp_path, tiny_model_dir, prompt_dataset):
    runs = {}
    for space in ("full", "copes"):
        args = config(tmp_path / space, es_search_space=space, copes_groups=1, max_steps=2)
        trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
        trainer.train()
        runs[space] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(runs["full"][n], runs["copes"][n]) for n in runs["full"])


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s
def test_copes_learns(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(
        tmp_path,
        es_search_space="copes",
        copes_groups=2,
        copes_partition="layer",
        population_size=16,
        antithetic=True,
        sigma=0.01,
        learning_rate=0.01,
        per_device_train_batch_size=8,
        num_generations=1,
        generation_kwargs={"do_sample": False},
        max_steps=10,
        seed=0,
    )
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert rewards[0] < 0.3 and max(rewards[-3:]) > rewards[0] + 0.3, rewards


def test_bad_search_space_settings(tmp_path):
    with pytest.raises(ValueError, match="es_search_space='eggs' is invalid"):
        config(tmp_path, es_search_space="eggs")
    with pytest.raises(ValueError, match="copes_groups=5 is invalid: every group needs a member"):
        config(tmp_path, es_search_space="copes", copes_groups=5, population_size=4)
    with pytest.raises(ValueError, match="copes_partition='heads' is invalid"):
        config(tmp_path, es_search_space="copes", copes_partition="heads")


@pytest.mark.slow
def test_peft_config_trains_a_new_lora_adapter_only(tmp_path, tiny_model_dir, prompt_dataset):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config(tmp_path, population_size=8, sigma=1.0, learning_rate=0.5)  # LoRA's B starts at 0: large σ
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset, peft_config=lora)
    assert isinstance(trainer.model, PeftModel)
    assert trainer.es_params and all("lora_" in n for n in trainer.es_params)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainer.save_model()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
    saved = tmp_path / "out"
    assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), saved)
    current = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, current[n]) for n, p in reloaded.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="already is a PeftModel"):
        ESTrainer(trainer.model, upper_vocab_share, args=args, train_dataset=prompt_dataset, peft_config=lora)


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s
def test_lowrank_batched_population_learns_and_moves_only_linear_weights_by_low_rank(
    tmp_path, tiny_model_dir, prompt_dataset
):
    from transformers import AutoModelForCausalLM

    args = config(tmp_path / "one", es_search_space="lowrank", population_size=4, max_steps=1, sigma=0.05)
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
    trainer.train()
    start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    targets = set(trainer.space.targets)
    assert targets and all("proj" in name for name in targets)  # attention and MLP matrices, not the tied head
    for name, p in trainer.model.named_parameters():
        delta = (p - start[name]).detach()
        if name in targets:  # 4 members of rank 1: ΔW = Σ c_i A_i B_iᵀ has rank ≤ 4
            assert delta.abs().max() > 0 and torch.linalg.matrix_rank(delta) <= 4, name
        else:
            assert torch.equal(p, start[name]), name  # embeddings and norms are not perturbed

    args = config(
        tmp_path / "learn",
        es_search_space="lowrank",
        population_size=16,
        sigma=0.05,
        learning_rate=0.05,
        per_device_train_batch_size=8,
        num_generations=1,
        generation_kwargs={"do_sample": False},
        lowrank_members_per_call=8,
        max_steps=10,
        seed=0,
    )
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert max(rewards[-3:]) > rewards[0] + 0.2, rewards
    with pytest.raises(ValueError, match="lowrank_rank=0 is invalid"):
        config(tmp_path, es_search_space="lowrank", lowrank_rank=0)


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s; the regression guard checks it too
def test_sampled_lowrank_completions_do_not_depend_on_which_members_share_a_call(
    tmp_path, tiny_model_dir, prompt_dataset
):
    """A completion's randomness is a function of (step, member, prompt, generation) only: the weights of a sampled
    low-rank run are bitwise the same whether 1, 2 or all 4 members share each generate call (which members share a
    call is what changes with the number of processes; it failed before completions were seeded one by one)."""
    from transformers import AutoModelForCausalLM

    def weights(per_call):
        args = config(
            tmp_path / str(per_call), es_search_space="lowrank", sigma=0.05, lowrank_members_per_call=per_call
        )
        trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
        trainer.train()
        return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    reference = weights(None)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(p, start[name]) for name, p in reference.items())  # it learned something
    for per_call in (1, 2):
        other = weights(per_call)
        assert all(torch.equal(other[name], p) for name, p in reference.items()), per_call


@pytest.mark.slow  # ~N/512 generate calls a step; the fast suite keeps the per-call scenario above
def test_a_population_of_thousands_runs_in_bounded_calls_resumes_and_replays_bitwise(tmp_path, tiny_model_dir):
    """2,048 rank-1 low-rank members: by default a step's generate calls hold at most ROWS_PER_CALL rows (so memory
    stays that of one call, not of the population: benchmarks/population_scale.py measures it), the update sums
    the seeds in parts of SEEDS_PER_MATMUL, a run resumed from its checkpoint ends on the uninterrupted weights and
    the seed chain replays them, bitwise."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_es.chains import load_chain, replay
    from trl_es.es.lowrank import ROWS_PER_CALL, SEEDS_PER_MATMUL

    n, data = 2048, Dataset.from_dict({"prompt": ["Count to 3:"] * 2})
    assert n > SEEDS_PER_MATMUL

    def trainer(name, **overrides):
        args = config(tmp_path / name, es_search_space="lowrank", population_size=n, per_device_train_batch_size=2,
                      num_generations=1, max_completion_length=1, generation_kwargs={"do_sample": False},
                      **overrides)  # fmt: skip
        return ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=data)

    full, calls = trainer("full", save_strategy="steps", save_steps=1), []
    generate_ids = full.generation.generate_ids
    full.generation.generate_ids = lambda rows, *args, **kwargs: (
        calls.append(len(rows)) or generate_ids(rows, *args, **kwargs)
    )
    full.train()
    assert max(calls) <= ROWS_PER_CALL and sum(calls) == 2 * n * 2  # 2 steps × N members × 2 prompts
    full.save_model()
    final = {name: p.detach().clone() for name, p in full.model.named_parameters()}
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(p, start[name]) for name, p in final.items())
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-1"))
    assert all(torch.equal(p, final[name]) for name, p in resumed.model.named_parameters())
    replay(load_chain(str(tmp_path / "full" / "out")), tiny_model_dir, str(tmp_path / "replayed"))
    replayed = AutoModelForCausalLM.from_pretrained(tmp_path / "replayed")
    assert all(torch.equal(p, final[name]) for name, p in replayed.named_parameters())


@pytest.fixture(scope="module")
def merge_parts(tmp_path_factory, tiny_model_dir):
    """Two fine-tuned versions of the tiny model: one trained by ES toward upper_vocab_share, one random drift."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("merge")
    prompts = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    args = config(
        folder / "train",
        population_size=16,
        sigma=0.01,
        learning_rate=0.01,
        per_device_train_batch_size=8,
        num_generations=1,
        generation_kwargs={"do_sample": False},
        max_steps=8,
        seed=0,
    )
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompts)
    trainer.train()
    trainer.save_model(str(folder / "skilled"))
    drift = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drift.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    drift.save_pretrained(folder / "drift")
    return [str(folder / "skilled"), str(folder / "drift")], prompts


@pytest.mark.slow  # 4 CMA-ES steps twice; the fast regression guard holds Hyper-ES's resume bitwise too
def test_hyper_es_finds_a_merge_saves_it_and_resumes_bitwise(tmp_path, tiny_model_dir, merge_parts):
    models, prompts = merge_parts
    settings = {
        "es_search_space": "merge",
        "merge_models": models,
        "population_size": 6,
        "max_steps": 4,
        "per_device_train_batch_size": 8,
        "num_generations": 1,
        "generation_kwargs": {"do_sample": False},
        "save_strategy": "steps",
        "save_steps": 2,
    }
    trainer = ESTrainer(
        tiny_model_dir, upper_vocab_share, args=config(tmp_path / "run", **settings), train_dataset=prompts
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "es/merge_best_reward" in log]
    assert logs[-1]["es/merge_best_reward"] > 0.5  # the base scores ~0: the skilled vector is found
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert (tmp_path / "run" / "out" / "checkpoint-2" / "merge_search.json").is_file()

    resumed = ESTrainer(
        tiny_model_dir, upper_vocab_share, args=config(tmp_path / "run", **settings), train_dataset=prompts
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "out" / "checkpoint-2"))
    assert all(torch.equal(p, final[n]) for n, p in resumed.model.named_parameters())


def test_hyper_es_bad_input(tmp_path, tiny_model_dir, prompt_dataset):
    from transformers import AutoConfig, LlamaForCausalLM

    with pytest.raises(ValueError, match="merge_models=None is invalid"):
        config(tmp_path, es_search_space="merge")
    with pytest.raises(ValueError, match="sigma_decay=0.9 is invalid: Hyper-ES's CMA-ES adapts its own step size"):
        config(tmp_path, es_search_space="merge", merge_models=[tiny_model_dir], sigma_decay=0.9)
    wider = AutoConfig.from_pretrained(tiny_model_dir)
    wider.intermediate_size = 48  # the same architecture with wider MLPs: task vectors cannot be formed
    LlamaForCausalLM(wider).save_pretrained(tmp_path / "wider")
    with pytest.raises(ValueError, match="shape"):
        ESTrainer(
            tiny_model_dir,
            upper_vocab_share,
            train_dataset=prompt_dataset,
            args=config(tmp_path, es_search_space="merge", merge_models=[str(tmp_path / "wider")]),
        )


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in ("patterns", "qes") else name
        for name in ("patterns", "lora", "copes", "lowrank", "merge", "qes")
    ],
)
def test_search_space_recipes_run(recipe, tmp_path, tiny_model_dir, merge_parts):
    """Each recipe in examples/search_spaces/ runs through `trl-es es` (on the tiny model, one step)."""

    from trl_es.cli import main

    path = REPOSITORY / "examples" / "search_spaces" / f"{recipe}.yaml"
    out = tmp_path / "out"
    overrides = [
        "--model_name_or_path",
        tiny_model_dir,
        "--max_steps",
        "1",
        "--output_dir",
        str(out),
        "--max_completion_length",
        "4",
    ]
    if recipe == "merge":
        overrides += ["--merge_models", *merge_parts[0]]
    if recipe == "copes":
        overrides += ["--copes_groups", "2"]  # the tiny model has 2 layers
    assert main(["es", "--config", str(path), *overrides]) == 0
    saved = "adapter_config.json" if recipe == "lora" else "model.safetensors"
    assert (out / saved).is_file()
