"""`trl-es sparsity-sweep`: the task score of magnitude-thresholded updates across τ, their delta sizes, and a plot.

    trl-es sparsity-sweep --base smollm2 --tuned outputs/demo [--taus 1e-3,1.5e-3,2e-3] [--top 0.01,0.1] \
        [--out-dir outputs/sweep]

For each τ (keep |Δ| > τ) and each top fraction, the thresholded model θ_base + mask·Δ is scored, next to the base
and the tuned model, and its `trl_es.util.deltas` delta is written to measure its size. The score is Pass@1 with greedy
decoding on the built-in small-sums held-out problems (the demo's task); other tasks and Pass@K come with the
evaluation API. Writes `sweep.json` and `sweep.png` (score against the share of entries kept).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping

import torch

from ..evaluation.report import pyplot
from ..util.atomic import atomic_write_text
from ..util.deltas import save_delta, threshold_masks, thresholded
from .parser import command_parser


def sparsity_sweep(
    base: Mapping[str, torch.Tensor],
    tuned: Mapping[str, torch.Tensor],
    settings: list[tuple[str, float]],
    score: Callable[[Mapping[str, torch.Tensor]], float],
) -> list[dict]:
    """Rows {model, kept, delta_bytes, score} for the base, the tuned model and each ("tau" | "top_fraction", value)."""
    rows = [
        {"model": "base", "kept": 0.0, "score": score(base)},
        {"model": "tuned", "kept": 1.0, "score": score(tuned)},
    ]
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "delta.safetensors")
        for key, value in settings:
            masks = threshold_masks(base, tuned, **{key: value})
            metadata = save_delta(path, base, tuned, masks, **{key: value})
            rows.append(
                {
                    "model": f"{key}={value:g}",
                    "kept": 1 - float(metadata["sparsity"]),
                    "delta_bytes": os.path.getsize(path),
                    "score": score(thresholded(base, tuned, masks)),
                }
            )
    return rows


def plot(rows: list[dict], path: str, metric: str) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for row, style in ((rows[0], "--"), (rows[1], ":")):
        axes.axhline(row["score"], linestyle=style, color="gray", label=f"{row['model']} {row['score']:.3f}")
    swept = sorted(rows[2:], key=lambda row: row["kept"])
    axes.plot([r["kept"] for r in swept], [r["score"] for r in swept], "o-", label="thresholded update")
    for row in swept:
        axes.annotate(row["model"], (row["kept"], row["score"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("share of the update's entries kept")
    axes.set_ylabel(metric)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = command_parser("trl-es sparsity-sweep", __doc__.splitlines()[0])
    parser.add_argument("--base", default="smollm2", help="the starting model ('smollm2': SmolLM2-135M-Instruct)")
    parser.add_argument("--tuned", required=True, help="the trained model")
    parser.add_argument("--taus", default="1e-3,1.5e-3,2e-3", help="comma-separated thresholds τ")
    parser.add_argument("--top", default="0.01,0.1", help="top fractions of entries to keep")
    parser.add_argument("--out-dir", default="outputs/sparsity-sweep", help="results and plot")
    options = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from .. import ESConfig, ESTrainer
    from ..tasks import first_integer_reward, small_sums
    from ..util.models import resolve_model
    from .demo import held_out_accuracy

    base_dir = resolve_model(options.base)
    base = dict(AutoModelForCausalLM.from_pretrained(base_dir).named_parameters())
    tuned = dict(AutoModelForCausalLM.from_pretrained(options.tuned).named_parameters())
    settings = [("tau", float(t)) for t in options.taus.split(",") if t]
    settings += [("top_fraction", float(f)) for f in options.top.split(",") if f]
    with tempfile.TemporaryDirectory() as scratch:  # the scoring trainer's output_dir: removed, whatever happens
        args = ESConfig(output_dir=scratch, max_completion_length=12, generation_kwargs={"do_sample": False},
                        report_to="none")  # fmt: skip
        trainer = ESTrainer(base_dir, first_integer_reward, args=args, train_dataset=small_sums("train"))
        params, held_out = dict(trainer.model.named_parameters()), small_sums("test")

        def score(weights) -> float:
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor)
            return held_out_accuracy(trainer, held_out)

        rows = sparsity_sweep(base, tuned, settings, score)
    full = sum(t.numel() * t.element_size() for t in base.values())
    os.makedirs(options.out_dir, exist_ok=True)
    summary = {"base": options.base, "tuned": options.tuned, "full_bytes": full, "rows": rows}
    atomic_write_text(os.path.join(options.out_dir, "sweep.json"), json.dumps(summary, indent=1))
    plot(rows, os.path.join(options.out_dir, "sweep.png"), "small sums held-out Pass@1 (greedy)")
    print(f"{'model':22} {'kept':>8} {'delta MiB':>10} {'/ full':>7} {'Pass@1':>7}")
    for row in rows:
        size = row.get("delta_bytes")
        sized = f"{size / 2**20:10.1f} {size / full:7.2f}" if size else f"{'':10} {'':7}"
        print(f"{row['model']:22} {row['kept']:8.2%} {sized} {row['score']:7.3f}")
    print(f"wrote {options.out_dir}/sweep.json and sweep.png")
    return rows
