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
trl-es eval --model M [--model M2 ...] (--task gsm8k,math500 | --suite easy|math|heldout) [--protocol paper]
            [--n 8 --k 1,4,8] [--limit 50] [--train-task T] [--out-dir D]
                                     # Pass@K, Maj@K and token entropy per model and task: the research's
                                     # tables (Average, held-out change), results.json, plots; resumes
trl-es study --task small_sums --budget-minutes 20 [--methods es,grpo,grpo-es,es-grpo] [--out D]
                                     # ES vs GRPO at the same wall-clock budget: Pass@K, Maj@K, entropy,
                                     # update size and sparsity, KL drift; a table, results.json, plots; resumes
trl-es diagnose --model M --task T [--sigma 1e-3,3e-3,1e-2] [--directions 16] [--out DIR]
                                     # κ = Var(X+ − X0)/Var(X+) and Var(X+ − X−)/Var(X+) per objective, coupling
                                     # and σ: do a centre baseline, antithetic pairs, common seeds help?
trl-es replay --chain es_chain.json --base M --out DIR [--steps K]
                                     # the trained model rebuilt bitwise from the starting model and the seed chain
trl-es vllm-serve --model M [--host 127.0.0.1] [--port 8000] [vllm serve flags ...]
                                     # vLLM's server with the ES worker extension, for vllm_mode="server"

"""

from __future__ import annotations

import importlib
import sys


COMMANDS = {
    "es": ("train", "run"),
    "demo": ("demo", "main"),
    "sparsify": ("deltas", "sparsify"),
    "apply-delta": ("deltas", "apply_delta_command"),
    "eval": ("eval", "main"),
    "study": ("study", "main"),
    "replay": ("replay", "main"),
    "diagnose": ("diagnose", "main"),
    "sparsity-sweep": ("sweep", "main"),
    "vllm-serve": ("vllm_serve", "main"),
}
"""Each subcommand: its module in `trl_es.commands` and the function that takes its arguments."""

ONE_LINE_ERRORS = ("sparsify", "apply-delta", "eval", "study", "replay", "diagnose")
"""Subcommands whose bad input (ValueError, FileNotFoundError) is one line on stderr and exit status 1."""


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
    if command not in COMMANDS:
        print(f"trl-es: unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    from .commands.parser import dashed

    if command not in ("es", "vllm-serve"):  # those two parse as TRL's and vLLM's commands do
        rest = dashed(rest)
    module, name = COMMANDS[command]
    function = getattr(importlib.import_module(f"trl_es.commands.{module}"), name)
    if command not in ONE_LINE_ERRORS:
        function(rest)  # vllm-serve replaces this process with `vllm serve`
        return 0
    try:
        function(rest)
    except (ValueError, FileNotFoundError) as error:
        print(f"trl-es {command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
