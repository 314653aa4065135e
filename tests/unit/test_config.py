"""ESConfig: bad values are refused at construction naming the field; gradient-only fields are refused or warned; a
ported GRPOConfig keeps what its user set."""

import warnings

import pytest
import torch
from trl import GRPOConfig

from trl_es import ESConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("sigma", 0.0),
        ("sigma", -1e-3),
        ("sigma", float("nan")),
        ("sigma_decay", 0.0),
        ("sigma_decay", 1.5),
        ("sigma_decay", float("nan")),
        ("sigma_limit", -1e-4),
        ("sigma_limit", 1.0),
        ("population_size", 1),
        ("learning_rate", -1.0),
        ("fitness_shaping", "softmax"),
        ("es_baseline", "partner"),
        ("num_generations", 0),
        ("max_completion_length", 0),
        ("temperature", 0.0),
        ("top_p", 1.5),
        ("noise_table_size", 1000),
        ("weight_decay", -0.1),
        ("gradient_accumulation_steps", 0),
        ("vllm_model_impl", "tensorrt"),
        ("scale_rewards", "rank"),
        ("fitness_pass_k", 2),  # above num_generations=1
        ("fitness_pass_k", 0),
        ("fitness_top_k", 30),  # the whole default population of 30
        ("fitness_top_k", 0),
        ("noise_reuse", 0),
    ],
)
def test_bad_values_raise_naming_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"ESConfig.{field}="):
        ESConfig(str(tmp_path), **{field: value})


def test_a_noise_table_of_one_window_is_refused_as_every_member_would_read_the_same_noise(tmp_path):
    """A window starts at an offset in [0, size − window]: a table of one window (2**20 values, accepted before) gave
    every member of every step the same noise, so members never differed and ES learned nothing, silently."""
    from trl_es.es.noise import CHUNK, MIN_TABLE_SIZE, NoiseTable, member_noise

    with pytest.raises(ValueError, match="every member would read the same noise"):
        ESConfig(str(tmp_path), noise_table_size=CHUNK)
    with pytest.raises(ValueError, match="every member would read the same noise"):
        NoiseTable(0, CHUNK)
    table = NoiseTable(0, MIN_TABLE_SIZE)
    (_, _, first), (_, _, second) = (next(member_noise(table, seed, "w", 1000)) for seed in (1, 2))
    assert not torch.equal(first, second)


def test_antithetic_needs_an_even_population(tmp_path):
    with pytest.raises(ValueError, match="ESConfig.population_size=5.*even"):
        ESConfig(str(tmp_path), population_size=5, antithetic=True)
    assert ESConfig(str(tmp_path), population_size=6, antithetic=True).antithetic


def test_sigma_schedule_decays_to_its_floor(tmp_path):
    from trl_es.es.space import UpdateRule

    def schedule(**fields):
        return UpdateRule.from_config(ESConfig(str(tmp_path), sigma=0.02, **fields)).sigma_at

    assert [schedule(sigma_decay=0.5, sigma_limit=0.004)(t) for t in range(4)] == [0.02, 0.01, 0.005, 0.004]
    assert schedule()(100) == 0.02  # sigma_decay=1: constant


def test_gradient_only_fields_warn_and_are_ignored(tmp_path):
    with pytest.warns(UserWarning, match="max_grad_norm is ignored"):
        args = ESConfig(str(tmp_path), max_grad_norm=0.5)
    assert args.max_grad_norm == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TrainingArguments' and GRPOConfig's defaults: reset without a word
        args = ESConfig(str(tmp_path), max_grad_norm=1.0, gradient_checkpointing=True, optim="adamw_torch_fused")
    assert args.max_grad_norm == 0.0 and args.gradient_checkpointing is False
    with pytest.warns(UserWarning, match="optim='sgd' is ignored"):
        ESConfig(str(tmp_path), optim="sgd")


def test_defaults_follow_qiu_et_al_and_document_every_field(tmp_path):
    from dataclasses import fields

    args = ESConfig(str(tmp_path))
    assert (args.population_size, args.sigma, args.learning_rate) == (30, 1e-3, 5e-4)
    assert args.lr_scheduler_type == "constant" and args.remove_unused_columns is False
    own = [f for f in fields(ESConfig) if f.name in ESConfig.__dataclass_fields__ and f.metadata]
    assert all(f.metadata.get("help") for f in own)


def test_every_es_field_is_documented_once_under_a_parameter_group():
    """ESConfig's own fields (its additions and the TrainingArguments defaults it changes) each sit in exactly one
    group of the docstring's Parameters section, with their help text."""
    from trl_es.training.config import GROUPS, marked

    own = set(ESConfig.__annotations__)
    grouped = [name for title in GROUPS for name in marked("group", title)]
    assert sorted(grouped) == sorted(own)
    declared = [ESConfig.__dataclass_fields__[name].metadata["group"] for name in ESConfig.__annotations__]
    runs = [group for k, group in enumerate(declared) if k == 0 or group != declared[k - 1]]
    assert runs == list(GROUPS)  # declared group by group, in the docstring's order
    for name in own:
        assert f"        {name} (`" in ESConfig.__doc__


def test_a_ported_grpo_config_keeps_the_constant_step_size_unless_its_user_set_a_schedule(tmp_path):
    """GRPOConfig's lr_scheduler_type defaults to "linear" (decay to 0); left at that default, ES's constant α
    stays. Another schedule is the user's choice and is kept, as is one passed among the changes."""

    def grpo(**kwargs):
        return GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, learning_rate=1e-3, **kwargs)

    assert ESConfig.from_grpo_config(grpo()).lr_scheduler_type == "constant"
    assert ESConfig.from_grpo_config(grpo(lr_scheduler_type="cosine")).lr_scheduler_type == "cosine"
    assert ESConfig.from_grpo_config(grpo(), lr_scheduler_type="linear").lr_scheduler_type == "linear"


def test_fitness_variants_are_refused_where_they_cannot_mean_what_they_say(tmp_path):
    """A per-prompt fitness with the centre's baseline or per-function normalisation; top-K with CoPES or Hyper-ES;
    noise reuse with Hyper-ES: each refused naming the field and the reason. A ported GRPOConfig's default
    scale_rewards ("group") keeps ES's "none"; one its user set is kept."""
    refused = [
        ({"scale_rewards": "group", "es_baseline": "center"}, "scale_rewards.*es_baseline='none'"),
        ({"fitness_pass_k": 1, "multi_objective_aggregation": "normalize_then_sum"}, "fitness_pass_k.*sum_then"),
        ({"fitness_top_k": 2, "es_search_space": "copes", "copes_groups": 2}, "fitness_top_k.*CoPES"),
        ({"fitness_top_k": 2, "es_search_space": "merge", "merge_models": ["m"]}, "fitness_top_k.*CMA-ES"),
        ({"noise_reuse": 2, "es_search_space": "merge", "merge_models": ["m"]}, "noise_reuse.*CMA-ES"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=f"ESConfig.{message}"):
            ESConfig(str(tmp_path), **fields)
    grpo = GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, learning_rate=1e-3)
    assert ESConfig.from_grpo_config(grpo).scale_rewards == "none"
    grpo = GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, learning_rate=1e-3, scale_rewards="batch")
    assert ESConfig.from_grpo_config(grpo).scale_rewards == "batch"
    assert ESConfig(str(tmp_path), scale_rewards=True).scale_rewards == "group"


def test_gradient_accumulation_is_kept_as_more_prompts_per_step(tmp_path):
    """TRL's agent examples set gradient_accumulation_steps: ES accepts it (its steps take
    per_device_train_batch_size × gradient_accumulation_steps prompts), from a GRPOConfig too."""
    grpo = GRPOConfig(str(tmp_path), use_cpu=True, bf16=False, learning_rate=1e-3, gradient_accumulation_steps=4)
    args = ESConfig.from_grpo_config(grpo)
    assert args.gradient_accumulation_steps == 4
    assert ESConfig(str(tmp_path), gradient_accumulation_steps=4).gradient_accumulation_steps == 4


def test_every_field_shared_with_grpo_defaults_to_the_installed_grpo_configs_value(tmp_path):
    """Field by field over the installed TRL's GRPOConfig (TrainingArguments' fields included, GRPO's loss and
    batching fields left out): ESConfig's default is GRPO's, except the documented DEFAULTS_UNLIKE_GRPO — so a TRL
    release that moves a default is caught. bf16 is None in both and resolves apart on CPU only."""
    from dataclasses import MISSING, fields

    from trl_es.training.config import DEFAULTS_UNLIKE_GRPO, GRPO_ONLY_FIELDS

    def default(cls, name):
        spec = cls.__dataclass_fields__[name]
        return spec.default_factory() if spec.default is MISSING else spec.default

    shared = [f.name for f in fields(GRPOConfig) if f.name in ESConfig.__dataclass_fields__]
    different = {
        name
        for name in shared
        if name not in GRPO_ONLY_FIELDS and default(ESConfig, name) != default(GRPOConfig, name)
    }
    assert different | {"bf16"} == set(DEFAULTS_UNLIKE_GRPO)
    assert ESConfig(str(tmp_path)).bf16 is False and GRPOConfig(str(tmp_path), use_cpu=True).bf16 is True
    assert ESConfig(str(tmp_path), bf16=True, use_cpu=True).bf16 is True


def test_a_warmup_without_a_schedule_that_warms_up_warns(tmp_path):
    """TRL's sudoku.py and browsergym examples set warmup_steps; ES's constant α (transformers' 'constant') ignores
    it: a warning names the schedule that warms up, which runs without one."""
    with pytest.warns(UserWarning, match="warmup_steps=10 has no effect.*constant_with_warmup"):
        ESConfig(str(tmp_path), warmup_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ESConfig(str(tmp_path), warmup_steps=10, lr_scheduler_type="constant_with_warmup")
