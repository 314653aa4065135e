"""`trl-es diagnose` (`trl_es.research.diagnose`): κ and correlations of X0 = F(θ), X± = F(θ ± σε_d) across
directions, their bootstrap intervals, members formed by the run's own search space, θ restored bitwise."""

import json
import math
import sys

import pytest
import torch
from datasets import Dataset
from helpers import es_config

from trl_es import ESTrainer
from trl_es.cli import main as cli
from trl_es.es.seeds import diagnose_direction_seed
from trl_es.research.diagnose import Probe, measure, prompt_batches, statistics, table


def test_kappa_and_correlations_are_the_formulas():
    x0 = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    plus, minus = x0 + torch.tensor([0.5, -0.5, 0.5, -0.5]), x0.flip(0)
    record = statistics(torch.stack([x0, plus, minus], 1), resamples=200)
    var = lambda v: float(v.var())  # noqa: E731
    assert record["kappa_base"] == pytest.approx(var(plus - x0) / var(plus))  # X+ = 1.5, 1.5, 3.5, 3.5: (1/3) / (4/3)
    assert record["kappa_base"] == pytest.approx(1 / 4)
    assert record["kappa_pair"] == pytest.approx(var(plus - minus) / var(plus))
    assert record["corr_base"] == pytest.approx(float(torch.corrcoef(torch.stack([plus, x0]))[0, 1]))
    assert record["corr_pair"] == pytest.approx(float(torch.corrcoef(torch.stack([plus, minus]))[0, 1]))
    low, high = record["kappa_base_ci"]
    assert low <= record["kappa_base"] <= high
    assert record["unchanged"] == 0.0


def test_coupled_draws_give_kappa_below_one_and_independent_ones_about_two():
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(400, 1, generator=generator, dtype=torch.float64)
    coupled = shared + 0.1 * torch.randn(400, 3, generator=generator, dtype=torch.float64)
    independent = torch.randn(400, 3, generator=generator, dtype=torch.float64)
    assert statistics(coupled)["kappa_base"] < 0.05 and statistics(coupled)["corr_pair"] > 0.95
    record = statistics(independent)
    assert 1.6 < record["kappa_base"] < 2.4 and 1.6 < record["kappa_pair"] < 2.4
    assert record["kappa_pair_ci"][0] < 2 < record["kappa_pair_ci"][1]


def test_no_spread_is_undefined_not_a_number():
    record = statistics(torch.ones(5, 3, dtype=torch.float64), resamples=20)
    assert record["kappa_base"] is None and record["corr_pair"] is None and record["unchanged"] == 1.0
    json.dumps(record, allow_nan=False)


def test_a_direction_without_reward_leaves_kappa_and_its_interval_undefined():
    """A NaN objective (no completion of the direction got a reward) makes κ undefined: its interval too, not the
    interval of the resamples that happened to leave that direction out."""
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[2] = math.nan
    record = statistics(x, resamples=200)
    assert record["kappa_base"] is None and record["kappa_base_ci"] == [None, None]
    assert "| n/a [n/a, n/a] |" in table([{"objective": "reward", "coupling": "common", "sigma": 0.01, **record}])


def test_each_direction_has_its_own_batch_disjoint_while_the_data_lasts():
    batches = prompt_batches(10, 4, 2, seed=0)
    assert [len(b) for b in batches] == [2, 2, 2, 2]
    assert len({i for b in batches for i in b}) == 8
    assert batches == prompt_batches(10, 4, 2, seed=0) != prompt_batches(10, 4, 2, seed=1)
    assert len(prompt_batches(3, 5, 2, seed=0)) == 5  # more directions than disjoint batches: further permutations
    with pytest.raises(ValueError, match="--prompts must lie in 1..3"):
        prompt_batches(3, 2, 4, seed=0)


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def probe_of(trainer, seed=5):
    return Probe.of(trainer, seed)


@pytest.mark.parametrize("space", ["full", "lowrank"])
def test_members_are_the_search_spaces_and_theta_is_restored_bitwise(tmp_path, tiny_model_dir, space):
    """X± of the logprob objective are the model's scores of θ's rollouts with θ ± σε_d: bitwise those with the
    member written as training writes it (full: `LocalWeights.member`), and for the low-rank space's forward hooks
    those of W − σ·A·Bᵀ/√r written into the weights, up to rounding; the weights are bitwise θ afterwards."""
    from trl_es.research.diagnose import mean_logprobs

    trainer = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path, es_search_space=space), train_dataset=PROMPTS)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    probe = probe_of(trainer)
    rows = [[PROMPTS[i] for i in batch] for batch in prompt_batches(len(PROMPTS), 3, 2, probe.seed)]
    values = measure(probe, rows, [0.05], ["logprob", "reward"], ["common"])
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    x = values["logprob", "common", 0.05]
    assert x.shape == (3, 3) and not torch.equal(x[:, 1], x[:, 0])
    assert values["reward", "common", 0.05].shape == (3, 3)
    # X+ of direction 0 again, by hand: the model with θ + σε_0, scoring θ's rollouts of that direction
    from trl_es.es.seeds import completion_seeds, diagnose_sampling_seed

    seeds = completion_seeds(diagnose_sampling_seed(probe.seed, 0, "common"), 2, probe.n)
    trainer.weights.capture()
    with trainer.space.evaluating([None]) as route:
        completions = trainer.rollout(rows[0], probe.n, seeds, 1, route, 0)
    if space == "full":
        trainer.weights.member(diagnose_direction_seed(probe.seed, 0), 0.05)
        assert mean_logprobs(probe, [completions])[0] == x[0, 1]
        trainer.weights.restore()
    else:  # θ − σε_0 written into the weights: W − σ·A·Bᵀ/√r, the same numbers up to rounding
        from trl_es.es.lowrank import lowrank_factors

        with torch.no_grad():
            for name in trainer.space.targets:
                weight = trainer.es_params[name]
                a, b = lowrank_factors(diagnose_direction_seed(probe.seed, 0), name, weight.shape, 1)
                weight.sub_(0.05 * a @ b.T)
        assert mean_logprobs(probe, [completions])[0] == pytest.approx(float(x[0, 2]), rel=1e-5)
        trainer.weights.restore()
    assert mean_logprobs(probe, [completions])[0] == x[0, 0]


def test_the_command_writes_the_records_and_the_table(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "diagnose"
    argv = ["diagnose", "--model", tiny_model_dir, "--task", "small_sums", "--reward", "helpers.upper_vocab_share",
            "--directions", "4", "--prompts", "2", "--max-completion-length", "4", "--sigma", "0.02,0.2",
            "--resamples", "50", "--out", str(out)]  # fmt: skip
    assert cli(argv) == 0
    records = json.loads((out / "diagnose.json").read_text())
    assert [(r["objective"], r["coupling"], r["sigma"]) for r in records] == [
        (o, c, s) for o in ("reward", "logprob") for c in ("common", "independent") for s in (0.02, 0.2)
    ]
    for record in records:
        assert {"corr_base", "corr_pair", "kappa_base", "kappa_pair", "directions", "kappa_base_ci"} <= record.keys()
        assert record["directions"] == 4 and len(record["values"]) == 4
    by = {(r["objective"], r["coupling"], r["sigma"]): r for r in records}
    for coupling in ("common", "independent"):  # θ's common rollouts are X0 of both couplings
        assert by["reward", coupling, 0.2]["values"][0][0] == by["reward", "common", 0.02]["values"][0][0]
    assert "| logprob | independent | 0.2 |" in (out / "diagnose.md").read_text()
    assert "κ_base" in capsys.readouterr().out
    assert cli(["diagnose", "--model", tiny_model_dir, "--task", "small_sums", "--objective", "kl"]) == 1
    assert "--objective takes a comma-separated list of reward, logprob" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # vLLM holds the members, the scoring model stays at θ
        cli(["diagnose", "--model", tiny_model_dir, "--task", "small_sums", "--use-vllm"])
    assert "--use-vllm: the logprob objective scores with the transformers model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sigma", "1e-2,0.01"], "--sigma lists a value twice"),
        (["--sigma", "1e-2,nan"], "--sigma takes a comma-separated list of positive numbers"),
        (["--coupling", "common,common"], "--coupling takes a comma-separated list of common, independent, each once"),
        (["--resamples", "-1"], "--resamples must be at least 1"),
        (["--out", "a-file"], "--out a-file is not a folder it can write into"),
        (["--use-vllm", "--objective", "reward"], "--use-vllm needs vLLM, which is not installed"),
    ],
    ids=["duplicate-sigma", "nan-sigma", "duplicate-coupling", "resamples", "out-is-a-file", "no-vllm"],
)
def test_bad_arguments_are_one_line_before_any_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys, flags,
                                                           message):  # fmt: skip
    import trl_es

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not installed: `import vllm` fails
    monkeypatch.setattr(trl_es, "ESTrainer", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli(["diagnose", "--model", tiny_model_dir, "--task", "small_sums", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"trl-es diagnose: {message}") and err.count("\n") == 1, err
