"""`trl-es study` in quick mode on a tiny offline model: every method trains, the base and the results are
evaluated (at the research's temperature, and on held-out tasks) and measured, the outputs are written, and a second
run resumes instead of training again."""

import json
import os
import sys

import pytest

from trl_es.commands import study as study_module
from trl_es.commands import study_settings
from trl_es.commands.study import main as study


REWARD = '''
from trl_es.tasks.data import completion_text


def text_length(completions, **kwargs):
    """A reward a random tiny model earns unevenly: its completion's length in characters."""
    return [len(completion_text(c)) / 10 for c in completions]
'''


def quick(out, model, methods="es,grpo,grpo-es"):
    return ["--task", "small_sums", "--model", model, "--methods", methods, "--out", str(out),
            "--budget-minutes", "0.001", "--max-steps", "2", "--max-completion-length", "4",
            "--n", "4", "--k", "1,2,4", "--limit", "4", "--reward", "study_reward.text_length"]  # fmt: skip


@pytest.mark.slow  # trains three stages and evaluates four models
def test_quick_study_writes_the_comparison_and_resumes(tmp_path, tiny_model_dir, monkeypatch, capsys):
    (tmp_path / "study_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    results = study([*quick(tmp_path / "study", tiny_model_dir), "--heldout", "commonsenseqa"])

    assert list(results["models"]) == ["base", "es", "grpo", "grpo-es"]
    assert results["evaluation"]["temperature"] == 0.6  # the research's, by default
    for name, row in results["models"].items():
        assert 0 <= row["eval"]["pass@1"] <= row["eval"]["pass@2"] <= row["eval"]["pass@4"] <= 1
        assert {"maj@4", "mean_token_entropy"} <= set(row["eval"])
        if name == "base":
            continue
        training = row["training"]
        assert training["steps"] == 1  # the budget has passed after the first step
        assert training["completions"] == {"es": 64, "grpo": 16, "grpo-es": 64}[name]  # 8 members × 8 prompts
        assert training["starts_from"] == {"es": "base", "grpo": "base", "grpo-es": "grpo"}[name]
        assert training["history"] and training["settings"]["trainer"].endswith("Trainer")
        assert row["update"]["relative_l2"] > 0 and row["update"]["kl_drift"] >= 0  # KL ≥ 0 (one tiny step)
        assert row["update"]["kl_drift"] > 0 or row["update"]["relative_l2"] < 1e-3  # visible once θ moves
        assert set(row["update"]["s_tau"]) == {"0.001", "0.0015", "0.002"}
    assert -1 <= results["cosine_es_grpo"] <= 1
    out = tmp_path / "study"
    assert json.loads((out / "results.json").read_text())["models"].keys() == results["models"].keys()
    table = (out / "table.md").read_text()
    assert all(f"| {name} |" in table for name in results["models"]) and "cos(Δ_ES, Δ_GRPO)" in table
    for plot in ("reward_vs_time.png", "pass_at_k.png", "pareto.png"):
        assert (out / plot).stat().st_size > 0
    # held-out: the base and every result on commonsenseqa, each result's change against the base in points
    heldout = results["heldout"]
    assert heldout["tasks"] == ["commonsenseqa"] and heldout["train_task"] == "small_sums"
    base = heldout["models"]["base"]["tasks"]["commonsenseqa"]
    for name in ("es", "grpo", "grpo-es"):
        scores = heldout["models"][name]["tasks"]["commonsenseqa"]
        assert heldout["heldout_change"][name] == pytest.approx(
            {key: 100 * (scores[key] - base[key]) for key in ("pass@1", "pass@2", "pass@4", "maj@2", "maj@4")}
        )
        deltas = heldout["heldout_change"][name]
        row = f"| {name} | " + " | ".join(f"{deltas[key]:+.1f}" for key in ("pass@1", "pass@2", "pass@4")) + " |"
        assert row in table
    assert "Held-out change against base (points; mean over commonsenseqa)" in table
    assert (out / "heldout" / "records" / "commonsenseqa" / "es.jsonl").is_file()

    trained = {m: os.path.getmtime(out / m / "training.json") for m in ("es", "grpo", "grpo-es")}
    capsys.readouterr()
    again = study(quick(tmp_path / "study", tiny_model_dir))
    assert capsys.readouterr().err.count("trained in an earlier run") == 3
    assert trained == {m: os.path.getmtime(out / m / "training.json") for m in trained}
    scores = ("pass@1", "pass@4", "maj@4", "mean_token_entropy")  # the finished evaluation batches are reused
    assert [again["models"]["es"]["eval"][s] for s in scores] == [results["models"]["es"]["eval"][s] for s in scores]
    for flag, value in [("--budget-minutes", "0.002"), ("--model", str(tmp_path / "study" / "grpo"))]:
        argv = quick(tmp_path / "study", tiny_model_dir)
        argv[argv.index(flag) + 1] = value  # another budget or base on the same --out: not reported as this run's
        with pytest.raises(ValueError, match="was trained with other .* than this run's"):
            study(argv)
    with pytest.raises(ValueError, match="was trained with other .* than this run's"):  # ES anchored toward the base
        study([*quick(tmp_path / "study", tiny_model_dir), "--es-anchor-decay", "0.1"])


@pytest.mark.parametrize(
    ("methods", "message"),
    [("es,grpo-es", "grpo-es continues the grpo result"), ("es,ppo", "unknown method 'ppo'")],
)
def test_bad_methods_are_refused_before_training(tmp_path, tiny_model_dir, methods, message):
    with pytest.raises(ValueError, match=message):
        study(quick(tmp_path / "study", tiny_model_dir, methods))
    assert not (tmp_path / "study").exists()


@pytest.mark.slow  # two seeds
def test_several_seeds_give_one_study_each_and_the_table_of_their_spread(tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "study_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    results = study([*quick(tmp_path / "study", tiny_model_dir, "es"), "--seeds", "0,1", "--marks", "2"])

    out = tmp_path / "study"
    assert results["seeds"] == [0, 1]
    for seed in ("0", "1"):  # each seed a whole study of its own, resumable as one
        assert (out / f"seed-{seed}" / "es" / "training.json").is_file()
        assert results["by_seed"][seed]["models"].keys() == {"base", "es"}
    es_l2 = [results["by_seed"][seed]["models"]["es"]["update"]["relative_l2"] for seed in ("0", "1")]
    assert es_l2[0] != es_l2[1]  # other seeds, other noise: the spread is real
    table = (out / "table.md").read_text()
    (es_row,) = [line for line in table.splitlines() if line.startswith("| es |")]
    mean, low, high = sum(es_l2) / 2, min(es_l2), max(es_l2)
    assert f"{mean:.2e} ({low:.2e}–{high:.2e})" in es_row
    assert json.loads((out / "results.json").read_text())["seeds"] == [0, 1]
    assert (out / "reward_vs_time.png").stat().st_size > 0
    # --marks 2: a point saved before the end, evaluated as the result is; the curve ends on the result's scores
    for seed in ("0", "1"):
        for method in ("es",):
            row = results["by_seed"][seed]["models"][method]
            first, last = row["curve"]
            assert (out / f"seed-{seed}" / method / "mark-1" / "config.json").is_file()
            assert first["step"] <= last["step"] == row["training"]["steps"] and first["seconds"] <= last["seconds"]
            assert last["pass@1"] == row["eval"]["pass@1"] and last["pass@4"] == row["eval"]["pass@4"]
            assert 0 <= first["pass@1"] <= first["pass@4"] <= 1
    assert (out / "pass_vs_time.png").stat().st_size > 0 and (out / "seed-0" / "pass_vs_time.png").is_file()


def test_the_evaluation_defaults_to_the_research_protocol(tmp_path, monkeypatch):
    """Temperature 0.6 (it was 1 with no way to change it) and the research's K values up to --n."""
    monkeypatch.setattr(study_module, "study", lambda options: options)
    options = study(["--out", str(tmp_path / "study")])
    assert options.temperature == 0.6 and options.k is None and options.n == 16 and options.heldout == []
    assert study_module.research_k(options.n) == [1, 16] and study_module.research_k(32) == [1, 16, 32]
    options = study(["--temperature", "1.0", "--heldout", "gpqa,mbpp", "--k", "1,4"])
    assert options.temperature == 1.0 and options.heldout == ["gpqa", "mbpp"] and options.k == [1, 4]


def test_bad_seeds_and_marks_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit):
        study([*quick(tmp_path / "study", tiny_model_dir), "--seeds", "one,two"])
    with pytest.raises(ValueError, match="--marks must be ≥ 1"):
        study([*quick(tmp_path / "study", tiny_model_dir), "--marks", "0"])
    with pytest.raises(ValueError, match="unknown task 'gpqa2'"):
        study([*quick(tmp_path / "study", tiny_model_dir), "--heldout", "mbpp,gpqa2"])
    with pytest.raises(ValueError, match="--temperature must be a finite number > 0"):
        study([*quick(tmp_path / "study", tiny_model_dir), "--temperature", "0"])
    assert not (tmp_path / "study").exists()


def test_what_the_evaluation_refuses_is_refused_before_training(tmp_path, tiny_model_dir, monkeypatch):
    """An infinite temperature, a completion length of 0 (silently each task's) and --use-vllm without vLLM were
    accepted, or failed only at the evaluation, once every method had trained for its budget."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed: `import vllm` raises ImportError
    (tmp_path / "study_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    for flags, message in [
        (["--temperature", "inf"], "--temperature must be a finite number > 0"),
        (["--temperature", "nan"], "--temperature must be a finite number > 0"),
        (["--max-completion-length", "0"], "--max-completion-length must be ≥ 1 token, got 0"),
        (["--use-vllm"], "use_vllm=True needs vLLM, which is not installed"),
        (["--vllm-entropy"], "--vllm-entropy scores vLLM's completions: add --use-vllm"),
    ]:
        with pytest.raises(ValueError, match=message):
            study([*quick(tmp_path / "study", tiny_model_dir), *flags])
    assert not (tmp_path / "study").exists()


def test_tables_say_when_the_entropy_was_not_scored(tmp_path):
    """Evaluated through vLLM without --vllm-entropy, the scores have no entropy: the tables leave its cells empty and
    say how to get it, for one seed and for several."""
    from trl_es.commands.study_report import write_seeds_table, write_table

    scores = {"pass@1": 0.5, "maj@1": 0.5}
    results = {"k": [1], "models": {"base": {"eval": scores}, "es": {"eval": scores}}}
    note = "entropy: not scored (evaluated through vLLM; --vllm-entropy scores it)"
    for text in (
        write_table(results, tmp_path / "one.md"),
        write_seeds_table({0: results, 1: results}, tmp_path / "two.md"),
    ):
        assert "| base | " in text and note in text
    results["models"]["base"]["eval"] = {**scores, "mean_token_entropy": 1.5}
    assert note not in write_table(results, tmp_path / "one.md")


def test_each_method_trains_with_the_search_space_and_engine_asked(tmp_path, monkeypatch):
    """--es-space, --es-population/-sigma/-learning-rate and --es-vllm reach ESConfig, --grpo-vllm GRPOConfig, and
    the recorded settings say which engine each used; without them the settings are the calibrated ones exactly
    (so a stage trained before these options existed still resumes); --es-vllm brings its engine's own defaults."""
    from trl import GRPOConfig

    from trl_es import ESConfig

    monkeypatch.setattr(study_module, "study", lambda options: options)
    plain = study(["--out", str(tmp_path / "study")])
    assert study_settings.stage_settings("es", plain) == {"trainer": "trl_es.ESTrainer", **study_settings.ES_SETTINGS,
                                                        "do_sample": False}  # fmt: skip
    assert study_settings.stage_settings("grpo", plain) == {
        "trainer": "trl.GRPOTrainer",
        **study_settings.GRPO_SETTINGS,
    }

    options = study(["--es-space", "lowrank", "--es-population", "32", "--es-sigma", "1e-3", "--es-learning-rate",
                     "2e-3", "--es-vllm", "--grpo-vllm"])  # fmt: skip
    es = ESConfig(output_dir=str(tmp_path / "es"), **study_settings.trainer_settings("es", options))
    assert (es.es_search_space, es.population_size, es.sigma, es.learning_rate) == ("lowrank", 32, 1e-3, 2e-3)
    assert es.use_vllm and es.vllm_mode == "colocate" and study_settings.stage_settings("es", options)["use_vllm"]
    grpo = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), use_cpu=True, **study_settings.trainer_settings("grpo", options)
    )
    assert grpo.use_vllm and grpo.vllm_mode == "colocate" and grpo.learning_rate == 1e-5
    # --es-vllm alone: the settings measured fastest on that engine, in low-rank members unless --es-space full
    fastest = study_settings.trainer_settings("es", study(["--es-vllm"]))
    assert fastest == {**study_settings.ES_VLLM_SETTINGS, "es_search_space": "lowrank", "use_vllm": True,
                       "vllm_mode": "colocate", "vllm_max_model_length": study_settings.VLLM_MAX_MODEL_LENGTH}  # fmt: skip
    in_place = study_settings.trainer_settings(
        "es", study(["--es-vllm", "--es-space", "full", "--es-population", "8"])
    )
    assert "es_search_space" not in in_place and in_place["population_size"] == 8 and in_place["sigma"] == 1e-2
    with pytest.raises(SystemExit):
        study(["--es-space", "merge"])
    # --es-variant: its fields over the engine's settings, the command's own after them; a sampling one samples
    top = ESConfig(output_dir=str(tmp_path / "top"), **study_settings.trainer_settings("es", study(
        ["--es-vllm", "--es-variant", "top8", "--es-population", "16"])))  # fmt: skip
    assert (top.fitness_top_k, top.learning_rate, top.population_size) == (8, 1.6e-2, 16)
    sampled = study(["--es-vllm", "--es-variant", "pass4-sampled"])
    settings = study_settings.stage_settings("es", sampled)
    assert settings["do_sample"] and (settings["fitness_pass_k"], settings["num_generations"]) == (4, 4)
    with pytest.raises(SystemExit):
        study(["--es-variant", "bogus"])


def test_bad_engine_and_population_settings_are_refused_before_training(tmp_path, tiny_model_dir, monkeypatch):
    """GRPOTrainer's vLLM weight sync fails inside vLLM's CPU backend after minutes of set-up; a population of one
    member has no spread to learn from."""
    monkeypatch.setattr(study_module.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--grpo-vllm needs a GPU: GRPOTrainer's weight sync"):
        study([*quick(tmp_path / "study", tiny_model_dir, "es,grpo"), "--grpo-vllm"])
    with monkeypatch.context() as patch:  # ES alone on CPU with --grpo-vllm: nothing trains GRPO, nothing refused
        patch.setattr(study_module, "study", lambda options: options)
        study_module.check_study(study([*quick(tmp_path / "study", tiny_model_dir, "es"), "--grpo-vllm"]))
    with pytest.raises(ValueError, match="--es-population must be ≥ 2 members, got 1"):
        study([*quick(tmp_path / "study", tiny_model_dir, "es"), "--es-population", "1"])
    assert not (tmp_path / "study").exists()
