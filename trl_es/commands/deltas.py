"""`trl-es sparsify` and `trl-es apply-delta`: an update's statistics and its sparse delta, and the thresholded model
rebuilt from the base and the delta (`trl_es.util.deltas`)."""

from __future__ import annotations

import os

from ..util.atomic import is_within
from .parser import command_parser


def load_weights(path: str):
    """(model, tokenizer or None, {name: parameter}) of a causal LM directory or id, in its stored dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"model {path!r} does not exist")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, dict(model.named_parameters())


def sparsify(argv: list[str]) -> None:
    from ..util.deltas import save_delta, threshold_masks, update_statistics

    parser = command_parser("trl-es sparsify", "Update statistics and a sparse delta.")
    parser.add_argument("--base", required=True, help="the model training started from")
    parser.add_argument("--tuned", required=True, help="the trained model (same architecture)")
    keep = parser.add_mutually_exclusive_group(required=True)
    keep.add_argument("--tau", type=float, help="keep the entries with |Δ| > tau")
    keep.add_argument("--top-fraction", type=float, help="keep this fraction of entries, largest |Δ| first")
    parser.add_argument("--taus", default="1e-3,1.5e-3,2e-3", help="τ values for the s_τ statistics")
    parser.add_argument("--out", required=True, help="the delta file to write (.safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    options = parser.parse_args(argv)
    for model in (options.base, options.tuned):
        if os.path.exists(model) and is_within(options.out, model):
            parser.error(f"--out {options.out} is inside the model {model}: write the delta elsewhere")
    if os.path.lexists(options.out) and not options.overwrite:
        parser.error(f"--out {options.out} already exists; choose a new file, or pass --overwrite to replace it")
    _, _, base = load_weights(options.base)
    _, _, tuned = load_weights(options.tuned)
    stats = update_statistics(base, tuned, [float(t) for t in options.taus.split(",")])["total"]
    masks = threshold_masks(base, tuned, tau=options.tau, top_fraction=options.top_fraction)
    metadata = save_delta(
        options.out, base, tuned, masks, base_model=options.base, tau=options.tau, top_fraction=options.top_fraction
    )
    full = sum(t.numel() * t.element_size() for t in base.values())
    print(
        f"relative L2 ‖Δ‖/‖θ_base‖ {stats['relative_l2']:.4g}; nonzero updates {stats['nonzero']} "
        f"({stats['nonzero_share']:.2%}); " + ", ".join(f"s_{t:g} {s:.2%}" for t, s in stats["s_tau"].items())
    )
    print(
        f"kept {metadata['kept']} entries (sparsity {float(metadata['sparsity']):.4%}): {options.out} "
        f"{os.path.getsize(options.out) / 2**20:.2f} MiB vs {full / 2**20:.1f} MiB of full weights"
    )


def apply_delta_command(argv: list[str]) -> None:
    from ..util.atomic import atomic_directory
    from ..util.deltas import apply_delta

    parser = command_parser("trl-es apply-delta", "Rebuild the thresholded model.")
    parser.add_argument("--base", required=True, help="the model the delta was taken from")
    parser.add_argument("--delta", required=True, help="the delta file (trl-es sparsify --out)")
    parser.add_argument("--out", required=True, help="a new directory (an existing one is never overwritten)")
    parser.add_argument("--force", action="store_true", help="apply even if the base weights' hash differs")
    options = parser.parse_args(argv)
    if os.path.lexists(options.out):  # a dangling symlink too
        parser.error(f"--out {options.out} already exists; choose a new directory")
    model, tokenizer, base = load_weights(options.base)
    for name, tensor in apply_delta(base, options.delta, force=options.force).items():
        base[name].data = tensor  # in the delta's dtype where it is wider (a float32 θ over a bfloat16 base)
    with atomic_directory(options.out) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    print(f"Model saved to {options.out}.")
