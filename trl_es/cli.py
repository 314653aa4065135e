"""The `trl-es` command.

trl-es es --config examples/recipe.yaml [--flag value ...]   # TRL's `trl grpo` with ES: any GRPO recipe runs
trl-es es --config recipe.yaml --accelerate_config zero3 [--num_processes 4 ...]
                                     # the same through `accelerate launch`, as TRL's CLI: a config file or one
                                     # of TRL's short names (multi_gpu, zero1, zero2, zero3, ...), plus any
                                     # `accelerate launch` flag
trl-es demo [--steps 12]                                      # the README demo on SmolLM2-135M-Instruct
trl-es sparsify --base B --tuned T (--tau 1e-3 | --top_fraction 0.01) --out delta.safetensors
                                     # update statistics and a sparse delta of the entries kept
trl-es apply-delta --base B --delta delta.safetensors --out M [--force]
                                     # the thresholded model, rebuilt bitwise from the base and the delta
trl-es sparsity-sweep --base B --tuned T [--taus 1e-3,2e-3] [--top 0.01]
                                     # Pass@1 of thresholded updates across τ, delta sizes, a plot
trl-es eval --model M [--model M2 ...] --task gsm8k --n 8 --k 1,4,8 [--limit 50] [--out-dir D]
                                     # Pass@K, Maj@K and token entropy per model: a table, results.json,
                                     # Pass@K-profile and Pareto plots; resumes an interrupted run
trl-es study --task small_sums --budget-minutes 20 [--methods es,grpo,grpo-es,es-grpo] [--out D]
                                     # ES vs GRPO at the same wall-clock budget: Pass@K, Maj@K, entropy,
                                     # update size and sparsity, KL drift; a table, results.json, plots; resumes
trl-es replay --chain es_chain.json --base M --out DIR [--steps K]
                                     # the trained model rebuilt bitwise from the starting model and the seed chain
trl-es vllm-serve --model M [--host 127.0.0.1] [--port 8000] [vllm serve flags ...]
                                     # vLLM's server with the ES worker extension, for vllm_mode="server"

"""

from __future__ import annotations

import argparse
import os
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's help with its default; the description as written."""


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of a `trl-es` subcommand (options spelled with dashes; `dashed` maps underscores)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def dashed(argv: list[str]) -> list[str]:
    """`argv` with every option name spelled with dashes: each subcommand takes `--max_steps` and `--max-steps`
    alike, as `trl-es es` (TRL's parser) does."""
    spelled = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, equals, value = token.partition("=")
            token = name.replace("_", "-") + equals + value
        spelled.append(token)
    return spelled


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
    from .sparse import save_delta, threshold_masks, update_statistics

    parser = command_parser("trl-es sparsify", "Update statistics and a sparse delta.")
    parser.add_argument("--base", required=True, help="the model training started from")
    parser.add_argument("--tuned", required=True, help="the trained model (same architecture)")
    keep = parser.add_mutually_exclusive_group(required=True)
    keep.add_argument("--tau", type=float, help="keep the entries with |Δ| > tau")
    keep.add_argument("--top-fraction", type=float, help="keep this fraction of entries, largest |Δ| first")
    parser.add_argument("--taus", default="1e-3,1.5e-3,2e-3", help="τ values for the s_τ statistics")
    parser.add_argument("--out", required=True, help="the delta file to write (.safetensors)")
    options = parser.parse_args(argv)
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
    import torch

    from .atomic import atomic_directory
    from .sparse import apply_delta

    parser = command_parser("trl-es apply-delta", "Rebuild the thresholded model.")
    parser.add_argument("--base", required=True, help="the model the delta was taken from")
    parser.add_argument("--delta", required=True, help="the delta file (trl-es sparsify --out)")
    parser.add_argument("--out", required=True, help="a new directory (an existing one is never overwritten)")
    parser.add_argument("--force", action="store_true", help="apply even if the base weights' hash differs")
    options = parser.parse_args(argv)
    if os.path.lexists(options.out):  # a dangling symlink too
        parser.error(f"--out {options.out} already exists; choose a new directory")
    model, tokenizer, base = load_weights(options.base)
    with torch.no_grad():
        for name, tensor in apply_delta(base, options.delta, force=options.force).items():
            base[name].copy_(tensor)
    with atomic_directory(options.out) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    print(f"Model saved to {options.out}.")


def _run(command: str, function, rest: list[str]) -> int:
    """Run a subcommand; bad input (ValueError, FileNotFoundError) is one line naming it on stderr, exit status 1."""
    try:
        function(rest)
    except (ValueError, FileNotFoundError) as error:
        print(f"trl-es {command}: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"trl-es {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in ("es", "vllm-serve"):  # those two parse as TRL's and vLLM's commands do
        rest = dashed(rest)
    if command == "demo":
        from .demo import main as demo

        demo(rest)
        return 0
    if command in ("sparsify", "apply-delta"):
        return _run(command, sparsify if command == "sparsify" else apply_delta_command, rest)
    if command == "eval":
        from .evaluation import main as evaluate

        return _run(command, evaluate, rest)
    if command == "study":
        from .study import main as study

        return _run(command, study, rest)
    if command == "replay":
        from .chains import main as replay

        return _run(command, replay, rest)
    if command == "vllm-serve":
        from .vllm_serve import main as serve

        serve(rest)  # replaces this process with `vllm serve`
        return 0
    if command == "sparsity-sweep":
        from .sweep import main as sweep

        sweep(rest)
        return 0
    if command == "es":
        from .script import run

        run(rest)
        return 0
    print(f"trl-es: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
