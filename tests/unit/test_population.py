"""Splitting the population across processes and the per-member summaries, on plain tensors (hand-computed)."""

import math

import pytest
import torch

from trl_es.generation import Completions
from trl_es.training.distributed import all_reduce_summaries, local_slots
from trl_es.training.population import SummaryLayout


def test_slots_are_dealt_round_robin_and_cover_the_population_once():
    assert local_slots(6, 0, 2) == [0, 2, 4] and local_slots(6, 1, 2) == [1, 3, 5]
    assert local_slots(5, 1, 3) == [1, 4]  # N not a multiple of K: some processes evaluate one more
    assert local_slots(3, 3, 4) == []  # K > N: this process only waits
    for n, k in [(7, 3), (2, 4), (30, 8)]:
        dealt = sorted(s for r in range(k) for s in local_slots(n, r, k))
        assert dealt == list(range(n))


def test_summary_row_and_metrics_by_hand():
    nan = math.nan
    # member 0: completions with combined rewards 1 and 3 (function f gave 1 and 3), lengths 2 and 4, one truncated,
    # token entropies summing to 3.0, 3 tool calls of which 1 failed, success on prompt 0 only
    layout = SummaryLayout(1, 2)

    def completions(lengths, truncated, entropy_sums, tool_calls, tool_failures):
        ids = [[0] * length for length in lengths]
        return Completions(["p", "q"], ["a", "b"], ids, truncated, entropy_sums, None, None, tool_calls, tool_failures)

    row0 = layout.row(
        torch.tensor([[1.0, 1.0], [3.0, 3.0]]), completions([2, 4], [True, False], [1.0, 2.0], [3, 0], [1, 0]),
        torch.tensor([1.0, 0]),
    )  # fmt: skip
    # member 1: one reward 0 and one completion without any reward (NaN), lengths 6 and 1, one tool call, success on
    # prompt 1
    row1 = layout.row(
        torch.tensor([[0.0, 0.0], [nan, nan]]), completions([6, 1], [False, False], [1.0, 0.0], [1, 0], [0, 0]),
        torch.tensor([0, 0.5]),
    )  # fmt: skip
    assert row0.numel() == layout.width == 23
    # reward; (sum, count, squares) of the combined reward and of f; lengths (sum, min, max, count, truncated,
    # entropy, then sum, min, max of the terminated one, prompt tokens: none given); tools; each prompt's mean reward;
    # each prompt's success
    assert row0.tolist() == [2.0, 4.0, 2.0, 10.0, 4.0, 2.0, 10.0, 6.0, 2.0, 4.0, 2.0, 1.0, 3.0, 4.0, 4.0, 4.0, 0.0,
                             3.0, 1.0, 1.0, 3.0, 1.0, 0.0]  # fmt: skip
    assert row0[layout.tools].tolist() == [3.0, 1.0] and row0[layout.success].tolist() == [1.0, 0.0]
    assert row0[layout.prompt_rewards].tolist() == [1.0, 3.0]
    tools = layout.metrics(torch.stack([row0, row1]), ["f"], tools=True)
    assert tools["tools/call_frequency"] == 1.0 and tools["tools/failure_frequency"] == 0.25  # 4 calls, 4 completions
    metrics = layout.metrics(torch.stack([row0, row1]), ["f"], entropy=True)
    # rewards 1, 3, 0 (the NaN excluded): mean 4/3, unbiased std sqrt(((1-4/3)^2 + (3-4/3)^2 + (4/3)^2) / 2)
    assert metrics["reward"] == pytest.approx(4 / 3)
    assert metrics["reward_std"] == pytest.approx(math.sqrt((1 / 9 + 25 / 9 + 16 / 9) / 2))
    assert metrics["rewards/f/mean"] == metrics["reward"] and metrics["rewards/f/std"] == metrics["reward_std"]
    assert metrics["completions/mean_length"] == pytest.approx(13 / 4)
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (1.0, 6.0)
    assert metrics["completions/clipped_ratio"] == 0.25
    # terminated: 4 (member 0), 6 and 1 (member 1)
    assert metrics["completions/mean_terminated_length"] == pytest.approx(11 / 3)
    assert (metrics["completions/min_terminated_length"], metrics["completions/max_terminated_length"]) == (1.0, 6.0)
    assert metrics["completions/mean_token_entropy"] == pytest.approx(4.0 / 13)
    assert "completions/mean_token_entropy" not in layout.metrics(torch.stack([row0, row1]), ["f"])
    # disjoint successes: the two members' distributions over prompts are (1, 0) and (0, 1): diversity log 2
    assert layout.diversity(torch.stack([row0, row1])) == pytest.approx(math.log(2))
    assert layout.diversity(torch.stack([row0, row0])) == pytest.approx(0.0)


def test_one_process_reduce_is_the_identity_and_reports_its_own_failure():
    summaries = torch.arange(6, dtype=torch.float64).view(2, 3)
    assert all_reduce_summaries(summaries, False, torch.device("cpu"), 5)[0] is summaries
    assert all_reduce_summaries(summaries, True, torch.device("cpu"), 5)[1] == [0]
