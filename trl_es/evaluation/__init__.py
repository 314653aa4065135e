"""Evaluation: Pass@K, Maj@K and token entropy of models on tasks (`loop`: `trl-es eval`'s loop, which
`ESTrainer.evaluate` runs too), the records it keeps and resumes from (`records`), the models and engine it loads
(`models`), the metrics themselves (`metrics`), the research's protocol and suites (`protocol`), and the research's
tables and plots (`report`)."""

from .loop import (
    check_k,
    decoding_description,
    evaluate,
    evaluate_batch,
    evaluate_tasks,
    print_progress,
    score_problems,
)
from .models import check_vllm_options
from .protocol import PROTOCOLS, SUITES, expand_tasks, research_k, resolve_protocol
from .records import summarize_records


__all__ = [
    "PROTOCOLS",
    "SUITES",
    "check_k",
    "check_vllm_options",
    "decoding_description",
    "evaluate",
    "evaluate_batch",
    "evaluate_tasks",
    "expand_tasks",
    "print_progress",
    "research_k",
    "resolve_protocol",
    "score_problems",
    "summarize_records",
]
