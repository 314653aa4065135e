"""What `trl-es eval` and `trl-es study` show of their results: the paper-style tables and the plots (matplotlib,
the `eval` extra)."""

from __future__ import annotations

from ..util.compat import import_extra


def table(results: dict, metric: str = "pass") -> str:
    """The paper's layout: one row per model, one column per task × @K (`metric` "pass" or "maj")."""
    keys = [f"{metric}@{k}" for k in results["k"]]
    titles = [f"{results['task']} {metric.capitalize()}@{k}" for k in results["k"]]
    width = max(map(len, titles)) + 2
    lines = [f"{'model':24}" + "".join(title.rjust(width) for title in titles)]
    for name, scores in results["models"].items():
        cells = (f"{scores[key]:.3f}" if key in scores else "-" for key in keys)
        lines.append(f"{name:24}" + "".join(cell.rjust(width) for cell in cells))
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only); the [eval] extra."""
    import_extra("matplotlib", "eval", "plotting").use("Agg")
    return import_extra("matplotlib.pyplot", "eval", "plotting")


def plot_pass_at_k(results: dict, path: str) -> None:
    """Pass@K against K (log scale), one line per model."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, scores in results["models"].items():
        axes.plot(results["k"], [scores[f"pass@{k}"] for k in results["k"]], "o-", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(results["k"], [str(k) for k in results["k"]])
    axes.set_xlabel("K")
    axes.set_ylabel(f"{results['task']} Pass@K")
    axes.legend(fontsize=8)
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
    """Pass@1 against Pass@K_max across models, the Pareto front joined."""
    k_max, plt = results["k"][-1], pyplot()
    points = {name: (s[f"pass@{results['k'][0]}"], s[f"pass@{k_max}"]) for name, s in results["models"].items()}
    figure, axes = plt.subplots(figsize=(5, 4))
    for name, (x, y) in points.items():
        axes.plot(x, y, "o")
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(points)
    axes.plot([points[n][0] for n in front], [points[n][1] for n in front], "--", color="gray", label="Pareto front")
    axes.set_xlabel(f"Pass@{results['k'][0]}")
    axes.set_ylabel(f"Pass@{k_max}")
    axes.set_title(results["task"])
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
