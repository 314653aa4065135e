"""What `trl-es eval` and `trl-es study` show of their results: the research's tables (markdown) and the plots
(matplotlib, the `eval` extra).

They read the layout `evaluate_tasks` returns (`results["models"][name]["tasks"][task]` holds a model's scores on a
task). The Pass@K and Maj@K tables have one row per model and one column per task × K, then the Average over the
tasks (each task weighs the same; Maj@K's over the tasks with answers to vote on), scores ×100. Maj@K is shown for
K > 1 (Maj@1 is Pass@1). The held-out change table gives each model's difference from the first model (the base) in
points (×100), averaged over the tasks other than `train_task`: gains are positive, forgetting negative.
"""

from __future__ import annotations

from ..util.compat import import_extra


def maj_k(k_values: list[int]) -> list[int]:
    """The K values of the Maj@K columns: those above 1 (Maj@1 is Pass@1), else [1]."""
    return [k for k in k_values if k > 1] or list(k_values)


def averages(results: dict, name: str) -> dict:
    """Model `name`'s Pass@K and Maj@K, each the mean over the tasks that have it."""
    per_task = [results["models"][name]["tasks"][task] for task in results["tasks"]]
    means = {}
    for key in [f"{metric}@{k}" for metric in ("pass", "maj") for k in results["k"]]:
        values = [scores[key] for scores in per_task if key in scores]
        if values:
            means[key] = sum(values) / len(values)
    return means


def heldout_tasks(results: dict) -> list[str]:
    return [task for task in results["tasks"] if task != results.get("train_task")]


def heldout_change(results: dict) -> dict:
    """Each model after the first: its Pass@K and Maj@K minus the first model's, in points (×100), averaged over
    the held-out tasks (all but `train_task`; Maj@K over those with answers). {} with one model or no such task."""
    names, tasks = list(results["models"]), heldout_tasks(results)
    if len(names) < 2 or not tasks:
        return {}
    keys = [f"pass@{k}" for k in results["k"]] + [f"maj@{k}" for k in maj_k(results["k"])]
    first, change = results["models"][names[0]]["tasks"], {}
    for name in names[1:]:
        scores, change[name] = results["models"][name]["tasks"], {}
        for key in keys:
            deltas = [scores[task][key] - first[task][key] for task in tasks if key in first[task]]
            if deltas:
                change[name][key] = 100 * sum(deltas) / len(deltas)
    return change


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def table(results: dict, metric: str = "pass") -> str | None:
    """The research's Pass@K (`metric` "pass") or Maj@K ("maj") table, ×100: one row per model, one column per
    task × K, then the Average over the tasks (with several); None when no task has the metric."""
    ks = results["k"] if metric == "pass" else maj_k(results["k"])
    first = next(iter(results["models"].values()))["tasks"]
    tasks = [task for task in results["tasks"] if f"{metric}@{ks[0]}" in first[task]]
    if not tasks:
        return None
    columns = [(task, k) for task in tasks for k in ks] + [("Average", k) for k in ks if len(tasks) > 1]
    rows = []
    for name, row in results["models"].items():
        scores = {**row["tasks"], "Average": row.get("average", {})}
        rows.append([name, *(f"{100 * scores[task][f'{metric}@{k}']:.1f}" for task, k in columns)])
    title = f"{metric.capitalize()}@K (×100)"
    lacking = [task for task in results["tasks"] if task not in tasks]
    if lacking:
        title += f"; {', '.join(lacking)}: no answers to vote on"
    return title + "\n\n" + markdown(["model", *(f"{task} @{k}" for task, k in columns)], rows)


def heldout_table(results: dict) -> str | None:
    """`results["heldout_change"]` as the research's table: Δ@K (Pass@K) and ΔM@K (Maj@K) in points, signed."""
    change = results.get("heldout_change")
    if not change:
        return None
    keys = [f"pass@{k}" for k in results["k"]] + [f"maj@{k}" for k in maj_k(results["k"])]
    keys = [key for key in keys if key in next(iter(change.values()))]
    header = ["model", *(f"Δ{'M' if key.startswith('maj') else ''}@{key.split('@')[1]}" for key in keys)]
    rows = [[name, *(f"{deltas[key]:+.1f}" for key in keys)] for name, deltas in change.items()]
    first = next(iter(results["models"]))
    title = f"Held-out change against {first} (points; mean over {', '.join(heldout_tasks(results))})"
    return title + "\n\n" + markdown(header, rows)


def tables(results: dict) -> dict[str, str | None]:
    """The three tables: "pass", "maj" and "heldout" (None where there is nothing to show)."""
    return {"pass": table(results, "pass"), "maj": table(results, "maj"), "heldout": heldout_table(results)}


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only); the [eval] extra."""
    import_extra("matplotlib", "eval", "plotting").use("Agg")
    return import_extra("matplotlib.pyplot", "eval", "plotting")


def panels(results: dict) -> list[tuple[str, dict[str, dict]]]:
    """(title, {model: scores}) for each task, then the Average over tasks when there are several."""
    models = results["models"]
    shown = [(task, {name: row["tasks"][task] for name, row in models.items()}) for task in results["tasks"]]
    if len(results["tasks"]) > 1:
        shown.append(("Average", {name: row["average"] for name, row in models.items()}))
    return shown


def grid(plt, count: int):
    """A figure with `count` panels, up to 4 a row (the unused ones hidden), and its panels in order."""
    columns = min(count, 4)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns + 1, 3.6 * rows), squeeze=False)
    for axis in axes.flat[count:]:
        axis.set_visible(False)
    return figure, list(axes.flat[:count])


def plot_pass_at_k(results: dict, path: str) -> None:
    """Pass@K against K (log scale), one line per model, one panel per task (and the Average)."""
    plt, ks, shown = pyplot(), results["k"], panels(results)
    figure, axes = grid(plt, len(shown))
    for axis, (title, scores) in zip(axes, shown, strict=True):
        for name, row in scores.items():
            axis.plot(ks, [row[f"pass@{k}"] for k in ks], "o-", label=name)
        axis.set_xscale("log", base=2)
        axis.set_xticks(ks, [str(k) for k in ks])
        axis.set_xlabel("K")
        axis.set_title(title)
    axes[0].set_ylabel("Pass@K")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point beats on both coordinates (ties kept), by increasing x."""
    front = [
        name
        for name, (x, y) in points.items()
        if not any(ox >= x and oy >= y and (ox, oy) != (x, y) for ox, oy in points.values())
    ]
    return sorted(front, key=lambda name: points[name])


def plot_pareto(results: dict, path: str) -> None:
    """Pass@K_min against Pass@K_max across models, the Pareto front joined, one panel per task (and the Average)."""
    plt, (low, high), shown = pyplot(), (results["k"][0], results["k"][-1]), panels(results)
    figure, axes = grid(plt, len(shown))
    for axis, (title, scores) in zip(axes, shown, strict=True):
        points = {name: (row[f"pass@{low}"], row[f"pass@{high}"]) for name, row in scores.items()}
        for name, (x, y) in points.items():
            axis.plot(x, y, "o")
            axis.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = pareto_front(points)
        axis.plot(
            [points[n][0] for n in front], [points[n][1] for n in front], "--", color="gray", label="Pareto front"
        )
        axis.set_xlabel(f"Pass@{low}")
        axis.set_title(title)
    axes[0].set_ylabel(f"Pass@{high}")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
