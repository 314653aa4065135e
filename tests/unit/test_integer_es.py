"""QES's integer arithmetic on plain int8 tensors (trl_es.es.qes): members and updates written in place and undone
bitwise, saturated ±127 integers included; the stochastic rounding; the error feedback, rebuilt from the recent
updates' seeds as a step-by-step computation keeps it; ESConfig's refusals."""

import pytest
import torch

from trl_es import ESConfig
from trl_es.es.noise import CHUNK, NoiseTable, member_noise
from trl_es.es.qes import Int8Weights, add_within, feedback, integer_noise, subtract_except


@pytest.fixture(scope="module")
def table():
    return NoiseTable(seed=0, size=2 * CHUNK)


def int8_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Integers as LLM.int8 holds them, each row reaching ±127, one row saturated throughout; one tensor spans two
    noise windows."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in (("small", (8, 16)), ("large", (CHUNK // 1000 + 3, 1000))):
        q = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
        q[:, 0], q[1] = 127, -127
        q[2, ::2] = 127
        tensors[name] = q
    return tensors


def test_add_within_leaves_integers_that_would_leave_the_range_and_subtract_except_undoes_it():
    q = torch.tensor([127, -127, 120, -120, 0, 127], dtype=torch.int8)
    start = q.clone()
    step = torch.tensor([1, -3, 9, -7, 5, -2], dtype=torch.int16)
    kept = add_within(q, step)
    assert q.tolist() == [127, -127, 120, -127, 5, 125] and kept.tolist() == [0, 1, 2]
    subtract_except(q, torch.tensor([1, -3, 9, -7, 5, -2], dtype=torch.int16), kept)
    assert torch.equal(q, start)


def test_members_and_an_update_are_undone_bitwise_without_a_copy(table):
    tensors = int8_tensors()
    start = {name: q.clone() for name, q in tensors.items()}
    weights = Int8Weights(tensors, seed=0, table_size=2 * CHUNK, table=table)
    weights.capture()
    weights.member(11, 1, 4.0)
    assert not torch.equal(tensors["large"], start["large"])
    assert all(q.abs().max() <= 127 for q in tensors.values())
    weights.member(11, -1, 4.0)  # the previous member is undone first, never accumulated
    weights.center()
    assert all(torch.equal(tensors[name], start[name]) for name in start)
    weights.member(12, 1, 16.0)  # large steps: many saturate
    assert any(len(entry[-1]) for entry in weights.member_log)
    norm = weights.update([{"sigma": 16.0, "coefficients": [[12, 0.05], [13, -0.03]]}], decay=0.9)
    assert norm > 0 and not torch.equal(tensors["small"], start["small"])
    weights.restore()
    assert all(torch.equal(tensors[name], start[name]) for name in start)


def test_integer_noise_rounds_sigma_epsilon_stochastically_and_replays(table):
    whole = torch.cat([u for _, _, u in integer_noise(table, 5, "w", CHUNK + 10, 1.7)])
    again = torch.cat([u for _, _, u in integer_noise(table, 5, "w", CHUNK + 10, 1.7, CHUNK - 4, CHUNK + 10)])
    assert whole.dtype == torch.int16 and torch.equal(again, whole[CHUNK - 4 :])
    epsilon = torch.cat([w for _, _, w in member_noise(table, 5, "w", CHUNK)])
    error = whole[:CHUNK].float() - 1.7 * epsilon
    assert ((error > -1) & (error < 1)).all()  # ⌊σε⌋ or ⌈σε⌉
    assert abs(float(error.mean())) < 5e-3  # unbiased: E[u] = σ·ε


def test_error_feedback_moves_integers_that_rounding_alone_never_moves(table):
    """Each update's Δ is below half a step everywhere, so plain rounding (γ = 0) never moves q; with γ = 0.9 the
    feedback adds the residuals up and moves it within a few steps. The e each update rebuilds from its window equals
    the e a step-by-step computation keeps."""
    q = {"w": torch.zeros(4096, dtype=torch.int8)}
    u = torch.cat([u for _, _, u in integer_noise(table, 3, "w", 4096, 2.0)]).float()
    update = {"sigma": 2.0, "coefficients": [[3, 0.45 / float(u.abs().max())]]}
    assert float((0.45 / u.abs().max() * u).abs().max()) < 0.5

    def run(decay: float, window: int, steps: int) -> list[int]:
        q["w"].zero_()
        weights, moved, earlier = Int8Weights(q, 0, CHUNK, table), [], []
        for _ in range(steps):
            weights.capture()
            weights.update([*earlier, update], decay)
            earlier = [*earlier, update][-window:]
            moved.append(int(q["w"].ne(0).sum()))
        return moved

    assert run(0.0, 4, 5) == [0] * 5
    moved = run(0.9, 4, 5)
    assert moved[0] == 0 and moved[-1] > 100

    step_by_step, kept = 0.0, torch.zeros(4096)
    for k in range(1, 5):  # e after k updates, kept from one to the next, vs rebuilt from the window of k
        delta = 0.45 / float(u.abs().max()) * u + 0.9 * kept
        step_by_step = delta.round()
        kept = delta - step_by_step
        step, rebuilt = feedback(table, [update] * k, 0.9, "w", 4096, 0, 4096)
        torch.testing.assert_close(rebuilt, kept, rtol=0, atol=1e-6)
        assert torch.equal(step, step_by_step)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"qes_feedback_decay": 1.0}, "qes_feedback_decay=1.0 .*0 ≤ γ < 1"),
        ({"qes_feedback_window": -1}, "qes_feedback_window=-1 .*0 ≤ H ≤ 64"),
        ({"sigma": 20.0}, "sigma=20.0 .*quantization steps"),
        ({"use_vllm": True}, "use_vllm=True .*vLLM quantizes its own copy"),
        ({"es_optimizer": True}, "es_optimizer=True .*whole quantization steps"),
        ({"es_anchor_decay": 0.1}, "es_anchor_decay=0.1 .*whole quantization steps"),
        ({"weight_decay": 0.1}, "weight_decay=0.1 .*whole quantization steps"),
        ({"es_adapter_only": True}, "es_adapter_only=True .*not an adapter"),
        ({"sparse_delta_tau": 0.0}, "sparse_delta_tau=0.0 .*saved 8-bit"),
    ],
)
def test_qes_refuses_what_integers_cannot_take(tmp_path, fields, message):
    with pytest.raises(ValueError, match=f"ESConfig.{message}"):
        ESConfig(str(tmp_path), es_search_space="qes", **{"sigma": 1.5, "learning_rate": 0.5, **fields})


def test_qes_refuses_zero3():
    from trl_es.es.qes import QESSpace

    with pytest.raises(ValueError, match="qes.*ZeRO-2"):
        QESSpace.check_setup(None, zero_stage=3)


def test_qes_fields_in_a_run_of_another_space_are_refused_not_ignored(tmp_path):
    with pytest.raises(ValueError, match="ESConfig.qes_feedback_window=2 .*only es_search_space='qes' reads it"):
        ESConfig(str(tmp_path), es_search_space="full", qes_feedback_window=2)
    ESConfig(str(tmp_path), es_search_space="full", qes_feedback_window=4)  # the default: nothing to ignore
