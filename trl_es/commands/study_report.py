"""What `trl-es study` shows of its results: the table of every method's scores (one seed, or each metric's mean and
range over seeds) and the plots of training reward and of the scores against wall clock."""

from __future__ import annotations

from ..evaluation.report import heldout_table, markdown, pyplot
from ..util.atomic import atomic_write_text


TAUS = (1e-3, 1.5e-3, 2e-3)
"""The research's thresholds for s_τ, the share of an update's nonzero entries with |Δ| ≤ τ."""
NO_ENTROPY = "entropy: not scored (evaluated through vLLM; --vllm-entropy scores it)"


def table_columns(results: dict) -> list[str]:
    ks, k = results["k"], results["k"][-1]
    return ["steps", "seconds", *(f"pass@{x}" for x in ks), f"maj@{k}", "entropy", "rel. L2",
            "s_τ " + "/".join(f"{t:g}" for t in TAUS), "KL drift"]  # fmt: skip


def table_values(results: dict, name: str) -> dict:
    """A model's row of the table as numbers, by column (a column without a value, as the base's training or an
    entropy not scored, absent; s_τ is a tuple, one share per τ)."""
    row, ks, k = results["models"][name], results["k"], results["k"][-1]
    scores, training, update = row["eval"], row.get("training"), row.get("update")
    values = {f"pass@{x}": scores[f"pass@{x}"] for x in ks}
    values[f"maj@{k}"] = scores.get(f"maj@{k}", float("nan"))
    if "mean_token_entropy" in scores:
        values["entropy"] = scores["mean_token_entropy"]
    if training:
        values |= {"steps": training["steps"], "seconds": training["seconds"]}
    if update:
        values |= {"rel. L2": update["relative_l2"], "KL drift": update["kl_drift"],
                   table_columns(results)[-2]: tuple(update["s_tau"].values())}  # fmt: skip
    return values


def cell(column: str, value) -> str:
    if isinstance(value, tuple):
        return "/".join(f"{share:.2f}" for share in value)
    formats = {"steps": "{:.0f}", "seconds": "{:.0f}", "rel. L2": "{:.2e}", "KL drift": "{:.4f}"}
    return formats.get(column, "{:.3f}").format(value)


def write_table(results: dict, path: str) -> str:
    """The research's form: one row per model, one column per metric."""
    columns = table_columns(results)
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name in results["models"]:
        values = table_values(results, name)
        lines.append(f"| {name} | " + " | ".join(cell(c, values[c]) if c in values else "" for c in columns) + " |")
    if "mean_token_entropy" not in results["models"]["base"]["eval"]:
        lines.append(f"\n{NO_ENTROPY}")
    if "cosine_es_grpo" in results:
        lines.append(f"\ncos(Δ_ES, Δ_GRPO) = {results['cosine_es_grpo']:.4f}")
    if "heldout" in results:
        lines.append("\n" + heldout_table(results["heldout"]))
    text = "\n".join(lines) + "\n"
    atomic_write_text(path, text)
    return text


def write_seeds_table(by_seed: dict[int, dict], path: str) -> str:
    """`write_table` over several seeds: each cell the mean (min–max) of the seeds' values (s_τ: the mean)."""
    first = next(iter(by_seed.values()))
    columns = [c for c in table_columns(first) if not c.startswith("s_τ")]
    lines = [f"seeds {', '.join(map(str, by_seed))}: mean (min–max)\n", "| model | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]  # fmt: skip
    for name in first["models"]:
        rows = [table_values(results, name) for results in by_seed.values()]
        cells = []
        for column in columns:
            values = [row[column] for row in rows if column in row]
            mean = sum(values) / len(values) if values else None
            cells.append(f"{cell(column, mean)} ({cell(column, min(values))}–{cell(column, max(values))})"
                         if values else "")  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "mean_token_entropy" not in first["models"]["base"]["eval"]:
        lines.append(f"\n{NO_ENTROPY}")
    cosines = [results["cosine_es_grpo"] for results in by_seed.values() if "cosine_es_grpo" in results]
    if cosines:
        lines.append(
            f"\ncos(Δ_ES, Δ_GRPO) = {sum(cosines) / len(cosines):.4f} ({min(cosines):.4f}–{max(cosines):.4f})"
        )
    if "heldout" in first:
        changes = [results["heldout"]["heldout_change"] for results in by_seed.values()]
        keys = list(next(iter(changes[0].values())))
        rows = []
        for name in changes[0]:
            spread = [[change[name][key] for change in changes] for key in keys]
            rows.append([name, *(f"{sum(v) / len(v):+.1f} ({min(v):+.1f}–{max(v):+.1f})" for v in spread)])
        header = ["model", *(f"Δ{'M' if key.startswith('maj') else ''}@{key.split('@')[1]}" for key in keys)]
        lines.append(f"\nHeld-out change against base (points; mean over {', '.join(first['heldout']['tasks'])})\n")
        lines.append(markdown(header, rows))
    text = "\n".join(lines) + "\n"
    atomic_write_text(path, text)
    return text


def plot_rewards(runs: list[dict], path: str) -> None:
    """Mean training reward against wall clock per method (a continued method after its first stage's time); `runs`:
    the training records of each seed, {method: record}, drawn in one colour per method."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for records in runs:
        for color, (method, record) in enumerate(records.items(), start=1):  # C0 is the base's in the Pass@K plots
            offset = records[record["starts_from"]]["seconds"] if record["starts_from"] != "base" else 0.0
            if record["history"]:
                seconds, _, rewards = zip(*record["history"], strict=True)
                axes.plot([offset + s for s in seconds], rewards, ".-", color=f"C{color}",
                          label=method if records is runs[0] else None)  # fmt: skip
    axes.set_xlabel("wall clock (s)")
    axes.set_ylabel("mean training reward")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_curves(runs: list[dict], path: str) -> None:
    """Pass@1 and Pass@K (the largest K) of each method's `--marks` points against wall clock, from the base's score
    at 0 (a continued method from its first stage's end); `runs`: the results of each seed, one colour per method."""
    plt = pyplot()
    k = runs[0]["k"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for results in runs:
        models = results["models"]
        for color, (method, row) in enumerate(((m, r) for m, r in models.items() if m != "base"), start=1):
            start = row["training"]["starts_from"]
            offset = models[start]["training"]["seconds"] if start != "base" else 0.0
            origin = models[start]["curve"][-1] if start != "base" else {"seconds": 0.0, **models["base"]["eval"]}
            points = [origin | {"seconds": origin["seconds"] - offset}, *row["curve"]]
            for axis, metric in zip(axes, (f"pass@{k[0]}", f"pass@{k[-1]}"), strict=True):
                axis.plot([offset + p["seconds"] for p in points], [p[metric] for p in points], ".-",
                          color=f"C{color}", label=method if results is runs[0] else None)  # fmt: skip
                axis.set_title(f"held-out Pass@{metric.removeprefix('pass@')}")
                axis.set_xlabel("wall clock (s)")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
