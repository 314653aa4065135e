"""Evaluation: Pass@K, Maj@K and token entropy of models on a task (`loop`: `trl-es eval`'s loop, which
`ESTrainer.evaluate` runs too), the metrics themselves (`metrics`), and the paper-style tables and plots
(`report`)."""

from .loop import (
    check_k,
    decoding_description,
    evaluate,
    evaluate_batch,
    print_progress,
    score_problems,
    summarize_records,
)


__all__ = [
    "check_k",
    "decoding_description",
    "evaluate",
    "evaluate_batch",
    "print_progress",
    "score_problems",
    "summarize_records",
]
