"""The documentation site (mkdocs.yml, docs/gen_pages.py, docs/check_site.py): the strict build's reference has an
entry for every public name, every ESConfig field under its group and every subcommand's help; the logged-metrics
page names every key a run logs, and logs every key it names; the site renders in headless Chromium."""

import importlib
import inspect
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
from datasets import Dataset
from helpers import REPOSITORY, es_config


sys.path.insert(0, str(REPOSITORY / "docs"))
from check_site import check_site, find_chromium  # noqa: E402


pytestmark = pytest.mark.xdist_group("docs")  # one build, on one worker

PUBLIC_MODULES = ["trl_es.es", "trl_es.tasks", "trl_es.evaluation", "trl_es.chains", "trl_es.rewards"]
"""Modules whose `__all__` the reference documents, beside `trl_es` itself."""
FORMAT_MODULES = ["trl_es.util.deltas", "trl_es.commands.deltas"]
"""Modules without `__all__` whose public names the reference documents (the sparse-delta format)."""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(out)],
        cwd=REPOSITORY,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]  # strict: any warning fails
    return out


def reference_ids(site) -> set[str]:
    return {i for page in (site / "reference").glob("*.html") for i in re.findall(r'\bid="([^"]+)"', page.read_text())}


def defined_at(obj) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


@pytest.mark.slow
def test_the_reference_has_an_entry_for_every_public_name(site):
    import trl_es
    from trl_es.training.trainer import ESTrainer

    ids = reference_ids(site)
    public = {("trl_es", name) for name in trl_es.__all__}
    public |= {(path, name) for path in PUBLIC_MODULES for name in importlib.import_module(path).__all__}
    for path in FORMAT_MODULES:
        module = importlib.import_module(path)
        public |= {(path, name) for name, obj in vars(module).items()
                   if not name.startswith("_") and not inspect.ismodule(obj) and getattr(obj, "__module__", path) == path}  # fmt: skip
    missing = []
    for path, name in sorted(public):
        obj = getattr(importlib.import_module(path), name)
        places = {f"{path}.{name}", defined_at(obj)} | {f"{module}.{name}" for module in PUBLIC_MODULES}
        if not places & ids:
            missing.append(f"{path}.{name}")
    for klass in ESTrainer.__mro__:  # its public methods and attributes, those of its trl_es mixins included
        if klass.__module__.startswith("trl_es."):
            names = [name for name in vars(klass) if not name.startswith("_")]
            missing += [name for name in names if f"{defined_at(ESTrainer)}.{name}" not in ids]
    assert len(public) > 80 and not missing


@pytest.mark.slow
def test_the_esconfig_reference_has_every_field_under_its_group(site):
    from trl_es.training.config import GROUPS, ESConfig

    page = (site / "reference" / "config.html").read_text()
    missing = [f.name for f in fields(ESConfig) if f'id="ESConfig.{f.name}"' not in page]
    assert not missing
    headings = [(m.start(), m.group(1)) for m in re.finditer(r"<h2 id=\"[^\"]*\">([^<]*)<", page)]
    assert [title for _, title in headings if title in GROUPS] == list(GROUPS)
    for f in fields(ESConfig):
        if "group" in f.metadata:
            where = page.index(f'id="ESConfig.{f.name}"')
            assert [title for start, title in headings if start < where][-1] == f.metadata["group"], f.name


@pytest.mark.slow
def test_the_cli_reference_has_every_subcommands_help(site):
    from trl_es.cli import COMMANDS

    page = (site / "reference" / "cli.html").read_text()
    assert "usage: trl-es es" in page and "--lowrank_members_per_call" in page
    assert [command for command in COMMANDS if f"usage: trl-es {command}" not in page] == []


def documented_keys() -> list[str]:
    """The keys in the first column of docs/logged_metrics.md's tables."""
    lines = (REPOSITORY / "docs" / "logged_metrics.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    return [key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])]


def key_pattern(key: str) -> re.Pattern:
    """A documented key as a pattern: `rewards/<f>/mean` matches `rewards/correct/mean`."""
    return re.compile(
        "".join("[^/]+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", key))
    )


NOT_IN_THESE_RUNS = ["tools/call_frequency", "tools/failure_frequency", "es/merge_best_reward", "eval_<name>_<metric>"]
"""Documented keys the runs below do not log: agent tools, the merge space, a dict of eval datasets."""


def test_the_logged_metrics_page_names_every_key_a_run_logs_and_no_other(tmp_path, tiny_model_dir):
    def even_first_token(completion_ids, **kwargs):
        return [float(ids[0] % 2 == 0) for ids in completion_ids]

    def short(completion_ids, **kwargs):
        return [1.0 / (1 + len(ids)) for ids in completion_ids]

    prompts = [[{"role": "user", "content": f"What is {a} + 1?"}] for a in range(4)]
    data = Dataset.from_dict({"prompt": prompts, "answer": [str(a + 1) for a in range(4)]})
    from trl_es import ESTrainer

    settings = [  # every optional log on; then es_optimizer, which logs es/gradient_norm in place of es/update_norm
        dict(es_baseline="center", log_completion_entropy=True, log_population_diversity=True, eval_strategy="steps",
             eval_steps=1, eval_task="small_sums", eval_k=[1, 2], num_generations_eval=2, per_device_eval_batch_size=2),
        dict(es_optimizer=True, optim="sgd", output_dir=str(tmp_path / "optimizer")),
    ]  # fmt: skip
    logged = set()
    for values in settings:
        args = es_config(tmp_path, max_steps=1, max_completion_length=4, **values)
        trainer = ESTrainer(
            tiny_model_dir, [even_first_token, short], args=args, train_dataset=data, eval_dataset=data
        )
        trainer.train()
        logged |= {key for record in trainer.state.log_history for key in record} - {"step"}  # the record's index
    assert {"rewards/short/mean", "es/gradient_norm", "eval_maj@2", "train_loss"} <= logged

    documented = [key for key in documented_keys() if not key.startswith("<")]  # `<name>`: log_metric's own names
    assert set(NOT_IN_THESE_RUNS) <= set(documented)
    undocumented = [key for key in logged if not any(key_pattern(d).fullmatch(key) for d in documented)]
    not_logged = [d for d in documented if d not in NOT_IN_THESE_RUNS and not any(key_pattern(d).fullmatch(k) for k in logged)]  # fmt: skip
    assert (sorted(undocumented), not_logged) == ([], [])


@pytest.mark.slow
def test_the_site_renders_in_chromium_and_its_search_finds_a_field(site):
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("TRL_ES_REQUIRE_CHROMIUM"):  # .ci/run installs it: there, its absence fails
            pytest.fail("no Chromium found, and TRL_ES_REQUIRE_CHROMIUM is set")
        pytest.skip("no Chromium: apt-get install chromium (or set CHROMIUM) to run the browser check")
    pytest.importorskip("playwright", reason="the docs extra is not installed: pip install -e '.[docs]'")
    assert check_site(site, REPOSITORY / "build" / "docs-check", chromium) == []
