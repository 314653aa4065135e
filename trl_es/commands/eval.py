"""`trl-es eval`: Pass@K, Maj@K and token entropy of models on tasks, in the research's tables (`trl_es.evaluation`).

trl-es eval --model smollm2 --model outputs/es --suite easy --protocol paper --limit 50 --out-dir outputs/eval
trl-es eval --model smollm2 --model outputs/es --task gsm8k,math500 --n 8 --k 1,4,8 --limit 50
"""

from __future__ import annotations

from ..evaluation import PROTOCOLS, SUITES, decoding_description, evaluate_tasks, expand_tasks
from ..tasks import TASKS
from .parser import command_parser


def names(text: str | None) -> list[str]:
    return [name for name in (text or "").split(",") if name]


def eval_parser():
    """`trl-es eval`'s arguments."""
    parser = command_parser("trl-es eval", __doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        help="a model directory, checkpoint, PEFT adapter or id ('smollm2'); repeat for several (the first is the "
        "base of the held-out change table)",
    )
    parser.add_argument("--task", default=None, help="comma-separated, of " + ", ".join(TASKS))
    parser.add_argument(
        "--suite",
        default=None,
        help="comma-separated, of " + "; ".join(f"{name} ({', '.join(tasks)})" for name, tasks in SUITES.items()),
    )
    parser.add_argument(
        "--protocol",
        choices=list(PROTOCOLS),
        default=None,
        help="the research's: paper = --temperature 0.6 --n 32 --k 1,16,32 --max-completion-length 2048 (Maj@16/32); "
        "paper-hard: 8192 tokens. Flags given explicitly override it",
    )
    parser.add_argument("--train-task", default=None, help="the task the models were trained on: left out of the "
                        "held-out change table")  # fmt: skip
    parser.add_argument("--n", type=int, default=None, help="completions sampled per problem (None: the protocol's, "
                        "else 8; 1 with --greedy)")  # fmt: skip
    parser.add_argument("--k", default=None, help="comma-separated K values for Pass@K and Maj@K, each ≤ n "
                        "(None: the protocol's, else 1)")  # fmt: skip
    parser.add_argument("--split", default=None, help="the task's split (default: its evaluation split; one task)")
    parser.add_argument("--source", default=None, help="a local data file or hub id instead of the built-in copy "
                        "(one task)")  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first LIMIT problems of each task")
    parser.add_argument("--max-completion-length", type=int, default=None, help="tokens (None: the protocol's, "
                        "else each task's)")  # fmt: skip
    parser.add_argument("--greedy", action="store_true", help="decode greedily (as the demo trains); with --n 1")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (None: the "
                        "protocol's, else 1; 0: greedy)")  # fmt: skip
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: off)")
    parser.add_argument("--batch-size", type=int, default=8, help="problems per generate call (× n completions)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out-dir", default="outputs/eval", help="results, records, tables and plots")
    parser.add_argument("--use-vllm", action="store_true", help="generate with an in-process vLLM engine (each model "
                        "in turn; every completion under its own seed); no token entropy unless --vllm-entropy")  # fmt: skip
    parser.add_argument("--vllm-entropy", action="store_true", help="with --use-vllm, also score the token entropy: "
                        "the model reads every completion again in transformers (teacher forcing), which costs "
                        "more than generating on CPU")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = eval_parser()
    options = parser.parse_args(argv)
    k_values = None
    if options.k is not None:
        try:
            k_values = [int(k) for k in names(options.k)]
        except ValueError:
            parser.error(f"--k must be comma-separated integers, got {options.k!r}")
    tasks = expand_tasks(names(options.task), names(options.suite))
    settings = {name: getattr(options, name) for name in ("n", "out_dir", "split", "source", "limit",
                "max_completion_length", "temperature", "top_p", "batch_size", "seed", "greedy", "top_k", "protocol",
                "train_task", "use_vllm", "vllm_entropy")}  # fmt: skip
    results = evaluate_tasks(options.model, tasks, k=k_values, **settings)
    print_results(results, tasks, options.out_dir)
    return results


def print_results(results: dict, tasks: list[str], out_dir: str) -> None:
    """The protocol, the decoding, the tables and each model's entropy, length and time on each task."""
    protocol = results["protocol"]
    if protocol:
        overridden = ", ".join(f"{key} {value}" for key, value in protocol["overridden"].items()) or "nothing"
        print(f"protocol: {protocol['name']} ({overridden} overridden)")
    print(f"decoding: {decoding_description(results['settings'][tasks[0]])}, n={results['settings'][tasks[0]]['n']}")
    for text in results["tables"].values():
        if text:
            print(f"\n{text}")
    print()
    for name, row in results["models"].items():
        for task, scores in row["tasks"].items():
            entropy = (
                f"mean token entropy {scores['mean_token_entropy']:.3f} nats"
                if "mean_token_entropy" in scores
                else "token entropy not scored (--use-vllm; --vllm-entropy scores it)"
            )
            print(
                f"{name} on {task}: {entropy}, mean length {scores['mean_completion_length']:.1f} tokens, "
                f"{scores['wall_s']:.0f} s"
            )
    print(f"wrote {out_dir}/results.json, tables.md, pass_at_k.png, pareto.png")
