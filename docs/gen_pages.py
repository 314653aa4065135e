"""The site's pages written at each build (mkdocs-gen-files, mkdocs.yml): the home page and quick start from the
README, the changelog, and the reference — ESConfig's fields from their metadata, the API from the docstrings
(mkdocstrings), the CLI from each subcommand's parser. Nothing in the reference is written by hand, so a field, a
name or a flag that changes in the code changes here at the next build."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import mkdocs_gen_files


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's trl_es, whatever else the environment holds

API_PAGES = {
    "trainer": (
        "ESTrainer",
        "`from trl_es import ESTrainer`: the trainer, its public methods and attributes, and the contract by which it "
        "calls reward functions.",
        ["trl_es.training.trainer.ESTrainer", "trl_es.rewards"],
    ),
    "search_spaces": (
        "Search spaces and the ES step",
        "What a member perturbs (`es_search_space`: `FullSpace`, `CoPESSpace`, `LowRankSpace`, `MergeSpace`, "
        "`QESSpace`), the search-space protocol and registry, and the algorithm on plain tensors: seeds, the noise "
        "table, fitness shaping, the update. Guide: [search spaces](../search_spaces.md).",
        ["trl_es.es"],
    ),
    "tasks": (
        "Tasks",
        "The built-in tasks: loaders with a `prompt` column and TRL-signature rewards. Guide: "
        "[evaluation](../evaluation.md).",
        ["trl_es.tasks"],
    ),
    "evaluation": (
        "Evaluation",
        "Pass@K, Maj@K and token entropy of models on tasks, as `trl-es eval` and `ESTrainer.evaluate` compute them. "
        "Guide: [evaluation](../evaluation.md).",
        ["trl_es.evaluation"],
    ),
    "chains": (
        "Seed chains and sparse deltas",
        "The seed-chain format (`es_chain.json`: a run as its seeds and coefficients) and the sparse-delta format "
        "(`trl-es sparsify`, `trl-es apply-delta`). Guides: [seed chains](../chains.md), "
        "[sparse updates](../handoff.md).",
        ["trl_es.chains", "trl_es.util.deltas", "trl_es.commands.deltas"],
    ),
}
"""Each API page: its title, its introduction and the objects mkdocstrings renders on it (a module: the names of its
`__all__`, or its public names without one)."""


def public_methods(cls) -> list[str]:
    """The public names `cls` and its bases within trl_es define (not those of transformers' Trainer)."""
    names = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("trl_es."):
            names += [name for name in vars(klass) if not name.startswith("_") and name not in names]
    return names


def shadowed(module) -> list[str]:
    """The names of `module.__all__` that are also the names of its submodules (`trl_es.tasks.gsm8k`: the function,
    and the module defining it), where mkdocstrings sees the submodule: their paths where they are defined."""
    names = [name for name in getattr(module, "__all__", ()) if f"{module.__name__}.{name}" in sys.modules]
    objects = [getattr(module, name) for name in names]
    return [f"{obj.__module__}.{obj.__qualname__}" for obj in objects if not inspect.ismodule(obj)]


def directive(path: str) -> str:
    """The mkdocstrings block for `path` (a module's: then the names it shadows)."""
    if path == "trl_es.training.trainer.ESTrainer":
        from trl_es.training.trainer import ESTrainer

        members = public_methods(ESTrainer)
        return f"::: {path}\n    options:\n      members: {members}\n      inherited_members: {members}\n"
    module = importlib.import_module(path)
    nested = "    options:\n      heading_level: 3\n      show_root_full_path: false\n"
    return f"::: {path}\n" + "".join(f"::: {name}\n{nested}" for name in shadowed(module))


def api_page(title: str, intro: str, paths: list[str]) -> str:
    return f"# {title}\n\n{intro}\n\n" + "\n".join(directive(path) for path in paths)


# ---- ESConfig ----------------------------------------------------------------------------------------------------


def default_of(f):
    """A dataclass field's default value."""
    return f.default_factory() if f.default is MISSING else f.default


def type_name(annotation) -> str:
    """An annotation as written in code: `int`, `str | None`."""
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("transformers.training_args.", "")


def code(text: str) -> str:
    """`text` as a code span in one cell of a Markdown table."""
    return cell(f"`{text}`")


def cell(text: str) -> str:
    """`text` as one cell of a Markdown table: one line, its pipes escaped outside code spans (which keep theirs)."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def grpo_meanings() -> dict[str, str]:
    """Each field whose meaning differs in GRPO → what it means there: the table "Fields with a different meaning"
    of docs/migrating_from_grpo.md."""
    text = (ROOT / "docs" / "migrating_from_grpo.md").read_text()
    section = text.split("\n## Fields with a different meaning\n")[1].split("\n## ")[0]
    meanings = {}
    for line in section.splitlines():
        cells = [part.strip() for part in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            meanings |= dict.fromkeys(re.findall(r"`(\w+)`", cells[0]), cells[1])
    if not meanings:
        raise ValueError("docs/migrating_from_grpo.md lost its table of fields with a different meaning")
    return meanings


MIGRATING = "../migrating_from_grpo.md"


def against_grpo(name: str, default, grpo_fields: dict, meanings: dict[str, str]) -> str:
    """What GRPOConfig's field of the same name means or defaults to, where it differs from ESConfig's."""
    from trl_es.training.config import DEFAULTS_UNLIKE_GRPO

    if name not in grpo_fields:
        return "ES only: GRPOConfig has no such field."
    notes = []
    if name in meanings:
        notes.append(f"In GRPOConfig: {meanings[name]} ([migrating]({MIGRATING}#fields-with-a-different-meaning)).")
    grpo_default = default_of(grpo_fields[name])
    if name in DEFAULTS_UNLIKE_GRPO or grpo_default != default:
        why = DEFAULTS_UNLIKE_GRPO.get(name)
        notes.append(f"GRPOConfig's default: `{grpo_default!r}`" + (f"; ES's: {why}." if why else "."))
    return " ".join(notes) or "As in GRPOConfig, with the same default."


ROLES = {"chain": "recorded in the seed chain", "card": "listed in the model card", "decoding": "a decoding setting"}
"""What a field's metadata marks, in words."""


def config_page() -> str:
    from trl.trainer.grpo_config import GRPOConfig

    from trl_es.training.config import GROUPS, GRPO_ONLY_FIELDS, ESConfig, marked

    grpo_fields = {f.name: f for f in fields(GRPOConfig)}
    meanings = grpo_meanings()
    lines = [
        "# ESConfig",
        "",
        "`from trl_es import ESConfig`. Every field below, ESConfig's own grouped as its docstring groups them (each "
        "with its type, default and help, and what GRPOConfig's field of the same name means where that differs), "
        "then the GRPOConfig fields ES accepts for recipes, then the TrainingArguments fields it inherits. On the "
        "command line every field is a flag of `trl-es es` ([CLI](cli.md)).",
        "",
        "::: trl_es.training.config.ESConfig\n    options:\n      members: [from_grpo_config]\n"
        "      show_signature: false\n      separate_signature: false\n",
    ]
    for group in GROUPS:
        lines += [f"## {group}", ""]
        for name in marked("group", group):
            f = ESConfig.__dataclass_fields__[name]
            default = default_of(f)
            facts = [f"`{type_name(f.type)}`", f"default `{default!r}`"]
            facts += [text for role, text in ROLES.items() if f.metadata.get(role)]
            choices = [f"`{choice}`" for choice in f.metadata.get("choices", ())]
            help_text = f.metadata["help"] + (f" Choices: {', '.join(choices)}." if choices else "")
            lines += [f"### `{name}` {{ #ESConfig.{name} }}", "", "; ".join(facts) + ".", "", help_text, ""]
            lines += [against_grpo(name, default, grpo_fields, meanings), ""]
    lines += [
        "## GRPOConfig fields ES accepts for recipes",
        "",
        "Accepted so that any GRPO recipe runs unchanged; a value away from GRPO's default is named in one warning "
        f"(ignored) or refused with the reason ([migrating]({MIGRATING})).",
        "",
        "| field | type | default (GRPOConfig's) | for ES |",
        "|---|---|---|---|",
    ]
    for name in GRPO_ONLY_FIELDS:
        f = ESConfig.__dataclass_fields__[name]
        lines.append(
            f'| <span id="ESConfig.{name}"></span>`{name}` | {code(type_name(f.type))} | {code(repr(default_of(f)))} '
            f"| {cell(f.metadata['help'])} |"
        )
    own = set(GRPO_ONLY_FIELDS) | {f.name for f in fields(ESConfig) if "group" in f.metadata}
    lines += [
        "",
        "## TrainingArguments fields",
        "",
        "Inherited from transformers' `TrainingArguments` with their meaning there (the help below is the installed "
        "transformers'); where the meaning or default differs for ES, the help says so after **For ES**.",
        "",
        "| field | type | default | help |",
        "|---|---|---|---|",
    ]
    for f in fields(ESConfig):
        if f.name not in own:
            default = default_of(f)
            note = against_grpo(f.name, default, grpo_fields, meanings)
            note = "" if note.startswith("As in GRPOConfig") else f" **For ES:** {note}"
            lines.append(
                f'| <span id="ESConfig.{f.name}"></span>`{f.name}` | {code(type_name(f.type))} | '
                f"{code(repr(default))} | {cell(f.metadata.get('help', '') + note)} |"
            )
    return "\n".join(lines) + "\n"


# ---- CLI -----------------------------------------------------------------------------------------------------------


def command_help(argv: list[str]) -> str:
    """What `trl-es ARGV` prints, run in this process."""
    from trl_es import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:
            status = exit_.code
    if status not in (0, None) or not out.getvalue().strip():
        raise RuntimeError(f"`trl-es {' '.join(argv)}` printed no help (exit status {status})")
    return out.getvalue().rstrip()


def cli_page() -> str:
    from trl_es import cli

    os.environ["COLUMNS"] = "110"  # argparse's width, whatever the terminal the build runs in
    lines = [
        "# Command line",
        "",
        "`trl-es --help` and each subcommand's `--help`, as the installed parsers print them. Every subcommand takes "
        "`--max_steps` and `--max-steps` alike.",
        "",
        "## `trl-es`",
        "",
        "```text",
        command_help(["--help"]),
        "```",
        "",
    ]
    for command in cli.COMMANDS:
        text = command_help([command, "--help"])
        block = ["```text", text, "```"]
        if len(text) > 20_000:  # `es`: every ESConfig, ModelConfig and script field
            block = [f'??? note "`trl-es {command} --help` ({len(text.splitlines())} lines)"', ""]
            block += ["    " + line if line else "" for line in ["```text", *text.splitlines(), "```"]]
        lines += [f"## `trl-es {command}`", "", *block, ""]
    return "\n".join(lines)


# ---- Pages from the README and the changelog ----------------------------------------------------------------------


README_LINKS = {"](docs/": "](", "](CHANGELOG.md": "](changelog.md"}
"""The README's links into the repository, as links of the site."""


def readme_sections() -> tuple[str, dict[str, str]]:
    """The README with its links made site links: (its text, {section title: section})."""
    text = (ROOT / "README.md").read_text()
    for link, page in README_LINKS.items():
        text = text.replace(link, page)
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return text, {part.split("\n", 1)[0]: "## " + part for part in parts[1:]}


def quickstart_page(sections: dict[str, str]) -> str:
    kept = [sections[title] for title in ("Two commands", "Install", "Use")]
    return "# Quick start\n\nThe README's first steps.\n\n" + "\n".join(kept)


def reference_index() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the code at each build: the docstrings (mkdocstrings), ESConfig's field metadata and the "
        "command-line parsers.",
        "",
        "| page | what |",
        "|---|---|",
        "| [ESConfig](config.md) | every field, grouped, with its type, default and help, against GRPOConfig's |",
    ]
    for page, (title, intro, _) in API_PAGES.items():
        lines.append(f"| [{title}]({page}.md) | {intro.split('. ')[0].rstrip('.')} |")
    lines += ["| [Command line](cli.md) | `trl-es --help` and every subcommand's |"]
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> None:
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(text)


readme, sections = readme_sections()
write("index.md", readme)
write("quickstart.md", quickstart_page(sections))
write("changelog.md", (ROOT / "CHANGELOG.md").read_text())
write("reference/index.md", reference_index())
write("reference/config.md", config_page())
for page, spec in API_PAGES.items():
    write(f"reference/{page}.md", api_page(*spec))
write("reference/cli.md", cli_page())
