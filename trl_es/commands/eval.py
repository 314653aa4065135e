"""`trl-es eval`: Pass@K, Maj@K and token entropy of models on a task (`trl_es.evaluation`).

trl-es eval --model smollm2 --model outputs/es --task gsm8k --n 8 --k 1,4,8 --limit 50 --out-dir outputs/eval
"""

from __future__ import annotations

from ..evaluation import decoding_description, evaluate
from ..evaluation.report import table
from ..tasks import TASKS
from .parser import command_parser


def main(argv: list[str] | None = None) -> dict:
    parser = command_parser("trl-es eval", __doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        help="a model directory, checkpoint, PEFT adapter or id ('smollm2'); repeat for several",
    )
    parser.add_argument("--task", required=True, help=", ".join(TASKS))
    parser.add_argument("--n", type=int, default=8, help="completions sampled per problem (1 with --greedy)")
    parser.add_argument("--k", default="1", help="comma-separated K values for Pass@K and Maj@K, each ≤ n")
    parser.add_argument("--split", default=None, help="the task's split (default: its evaluation split)")
    parser.add_argument("--source", default=None, help="a local data file or hub id instead of the built-in copy")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first LIMIT problems")
    parser.add_argument("--max-completion-length", type=int, default=None, help="tokens (None: the task's)")
    parser.add_argument("--greedy", action="store_true", help="decode greedily (as the demo trains); with --n 1")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: off)")
    parser.add_argument("--batch-size", type=int, default=8, help="problems per generate call (× n completions)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out-dir", default="outputs/eval", help="results, records and plots")
    options = parser.parse_args(argv)
    try:
        k_values = [int(k) for k in options.k.split(",") if k]
    except ValueError:
        parser.error(f"--k must be comma-separated integers, got {options.k!r}")
    results = evaluate(
        options.model,
        options.task,
        options.n,
        k_values,
        options.out_dir,
        options.split,
        options.source,
        options.limit,
        options.max_completion_length,
        options.temperature,
        options.top_p,
        options.batch_size,
        options.seed,
        greedy=options.greedy,
        top_k=options.top_k,
    )
    print(f"decoding: {decoding_description(results['settings'])}")
    print(table(results, "pass"))
    if any(key.startswith("maj@") for key in next(iter(results["models"].values()))):
        print(table(results, "maj"))
    for name, scores in results["models"].items():
        print(
            f"{name}: mean token entropy {scores['mean_token_entropy']:.3f} nats, mean length "
            f"{scores['mean_completion_length']:.1f} tokens, {scores['wall_s']:.0f} s"
        )
    print(f"wrote {options.out_dir}/results.json, pass_at_k.png, pareto.png")
    return results
