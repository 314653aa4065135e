"""QES: full-parameter ES on the int8 integers of an 8-bit model (bitsandbytes' LLM.int8), after Xu et al. 2026,
"Quantized Evolution Strategies" (arXiv:2602.03120).

θ is the integers q ∈ [−127, 127] of every `Int8Params` weight (each row's float scale, SCB, never changes), and σ is
in quantization steps. Member i adds the integer noise u_i = sign_i·⌊σ·ε_i + U_i⌋ (`integer_noise`): ε_i the run's
seeded noise, U_i = Φ(ε′_i) ~ Uniform(0, 1) from the noise of `rounding_seed`, so E[u_i] = σ·ε_i (stochastic
rounding), regenerated on demand as ε is. The update, with the members' shaped fitness z_i, is

    Δ = α·(1/(N·σ))·Σ_i z_i·u_i + γ·e,   q ← q + round(Δ),   e ← Δ − round(Δ)

where e, the error feedback (γ = `qes_feedback_decay`), keeps what rounding dropped, so that steps below half a
quantization step add up over updates. e is never stored: each update rebuilds it, one noise window of elements at a
time, by replaying the last H (`qes_feedback_window`) updates' (seed, coefficient) lists from e = 0 ("stateless seed
replay", `feedback`); training, a resumed run and a seed chain's replay compute the same integers bitwise.

Every change of q (a member's u_i, an update's round(Δ)) is made in place where q stays in [−127, 127]; where it
would leave (a saturated row maximum pushed outward), that integer is left as it is and its position recorded
(`add_within`), so subtracting the change again is exact without any copy of θ (`Int8Weights`). Such a dropped step
is not carried in e, which depends on the updates alone, not on q: that is what lets replay rebuild it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator

import torch

from .noise import CHUNK, NoiseTable, member_noise
from .params import int8_parameters
from .seeds import rounding_seed
from .space import Direction, SearchSpace, UpdateRule, directions, one_member, read_state, register
from .update import update_coefficients
from .weights import weights_hash


INT8_LIMIT = 127
"""LLM.int8's integers lie in [−127, 127] (absmax scaling per row: each row's largest weight is ±127)."""
MAX_SIGMA = 16.0
"""The largest σ QES takes, in quantization steps (its integer noise stays well inside int16)."""
MAX_WINDOW = 64
"""The longest feedback window: each update replays its H earlier updates' noise again."""

Steps = Iterator[tuple[int, int, torch.Tensor]]
Change = Callable[[str, int, int], Steps]
"""A change of θ: `change(name, start, end)` yields `(a, b, d)`, its int16 steps d over flat elements [a, b) of tensor
`name`, one noise window at a time, covering [start, end); the same at every call, so that it can be undone."""


def windows(start: int, end: int) -> list[tuple[int, int]]:
    """The ranges [a, b) of flat elements [start, end) that fall in one noise window (`CHUNK`) each, in order."""
    return [(max(start, c * CHUNK), min(end, (c + 1) * CHUNK)) for c in range(start // CHUNK, -(-end // CHUNK))]


def integer_noise(
    table: NoiseTable, seed: int, name: str, numel: int, sigma: float, start: int = 0, end: int | None = None
) -> Steps:
    """Yield `(a, b, u[a:b])` (int16) covering flat elements [start, end) of parameter `name`'s integer noise for
    member seed `seed`: u = ⌊σ·ε + U⌋, ε = ε(seed) and U = Φ(ε(rounding_seed(seed))), in `member_noise`'s windows."""
    noise = member_noise(table, seed, name, numel, start, end)
    uniforms = member_noise(table, rounding_seed(seed), name, numel, start, end)
    for (a, b, epsilon), (_, _, other) in zip(noise, uniforms, strict=True):
        yield a, b, torch.special.ndtr(other).add_(epsilon, alpha=sigma).floor_().to(torch.int16)


def noise_sum(table: NoiseTable, update: dict, name: str, numel: int, a: int, b: int) -> torch.Tensor:
    """Σ_s c_s·u_s over flat elements [a, b) (within one noise window) of parameter `name`: `update`'s (seed,
    coefficient) pairs, in order, over their integer noise at its σ, summed in float32."""
    total = torch.zeros(b - a, dtype=torch.float32, device=table.values.device)
    for seed, coefficient in update["coefficients"]:
        for _, _, u in integer_noise(table, seed, name, numel, update["sigma"], a, b):
            total.add_(u, alpha=coefficient)
    return total


def feedback(
    table: NoiseTable, updates: list[dict], decay: float, name: str, numel: int, a: int, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(Δ), e) of the last of `updates` over flat elements [a, b) (within one noise window) of parameter
    `name`, replayed from e = 0: Δ_k = Σ_s c_s·u_s + γ·e_{k−1} and e_k = Δ_k − round(Δ_k), γ = `decay`."""
    step = residual = torch.zeros(b - a, dtype=torch.float32, device=table.values.device)
    for update in updates:
        delta = noise_sum(table, update, name, numel, a, b).add_(residual, alpha=decay)
        step = delta.round()
        residual = delta.sub_(step)
    return step, residual


def update_steps(
    table: NoiseTable, updates: list[dict], decay: float, name: str, numel: int, start: int = 0, end: int | None = None
) -> Steps:
    """Yield `(a, b, round(Δ)[a:b])` (int16) of the last of `updates` over flat elements [start, end) of parameter
    `name` (`feedback`), clamped to ±255: from any q ∈ [−127, 127] a step of 255 leaves the range as any larger one
    does, so the clamp changes no integer and keeps the step in int16."""
    for a, b in windows(start, numel if end is None else end):
        step, _ = feedback(table, updates, decay, name, numel, a, b)
        yield a, b, step.clamp_(-2 * INT8_LIMIT - 1, 2 * INT8_LIMIT + 1).to(torch.int16)


def add_within(q: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """q ← q + step in place (int8 `q`, int16 `step`) where the sum stays in [−127, 127]; elsewhere q is left as it is
    and `step` zeroed. Returns those positions (indices into q): `subtract_except` with them undoes it exactly."""
    outside = (q.to(torch.int16) + step).abs_() > INT8_LIMIT
    step.masked_fill_(outside, 0)
    q.copy_(q.to(torch.int16).add_(step))
    return outside.nonzero().view(-1)


def subtract_except(q: torch.Tensor, step: torch.Tensor, kept: torch.Tensor) -> None:
    """q ← q − step in place except at the positions `kept` (as `add_within` returned them): its exact inverse."""
    step[kept] = 0
    q.copy_(q.to(torch.int16).sub_(step))


class Int8Weights:
    """The weights backend of QES: θ is the int8 tensors `params` themselves (bitsandbytes' `Int8Params`, whose data
    is the integer matrix CB their layer's forward reads), changed in place and never copied. Each change (a
    member's integer noise, an update's rounded step) is journalled window by window — what made it, where, the
    positions `add_within` left as they were — so `center` and `restore` subtract it again bitwise, regenerating its
    steps from their seeds. `table`: a noise table to use (default: made from `seed` at the first `capture`)."""

    def __init__(self, params: dict, seed: int, table_size: int, table: NoiseTable | None = None):
        self.params, self.seed, self.table_size, self.table = params, seed, table_size, table
        self.batches_members, self.member_slots = False, 1
        self.member_log: list[tuple] = []  # the member's changes, undone by `center`
        self.update_log: list[tuple] = []  # the step's update, undone by `restore`

    def start(self) -> None:
        """Nothing to do: θ is in the tensors."""

    def loaded(self, checkpoint: str) -> None:
        """Nothing to do: the tensors themselves were loaded from the checkpoint."""

    def release(self) -> None:
        """Free the noise table (rebuilt from the seed when needed again)."""
        self.table = None

    def capture(self) -> None:
        """The start of a step: θ is what the tensors hold now, with nothing to undo. A layer that has not run its
        first forward yet reads its integers from `weight.CB` then and makes that the weight's data; where CB is
        another tensor than the data (seen in multi-process runs once training starts: the first forward then put the
        loaded integers back, undoing a member written before it), CB becomes the data, so that the forward reads the
        integers QES writes."""
        if self.table is None:
            self.table = NoiseTable(self.seed, self.table_size, next(iter(self.params.values())).device)
        for p in self.params.values():
            if getattr(p, "CB", None) is not None and p.CB.data_ptr() != p.data.data_ptr():
                p.CB = p.data
        self.member_log, self.update_log = [], []

    def member(self, seed: int, sign: int, sigma: float) -> None:
        """θ + sign·u(seed) at noise scale `sigma` (`integer_noise`), after undoing the previous member."""
        self.center()

        def change(name: str, start: int, end: int) -> Steps:
            numel = self.params[name].numel()
            for a, b, u in integer_noise(self.table, seed, name, numel, sigma, start, end):
                yield a, b, u.mul_(sign)

        self._change(change, self.member_log)

    def center(self) -> None:
        """θ again, after a member."""
        self._undo(self.member_log)

    def restore(self) -> None:
        """θ as captured, bitwise, whatever happened since (a member, an update, either cut short: each window is
        journalled as soon as it is written)."""
        self._undo(self.member_log)
        self._undo(self.update_log)

    def update(self, updates: list[dict], decay: float) -> float:
        """q ← q + round(Δ) of the last of `updates` (`update_steps`, error feedback decay `decay`), after undoing the
        member; returns ‖Δq‖₂, the norm of the integer steps applied."""
        self.center()

        def change(name: str, start: int, end: int) -> Steps:
            return update_steps(self.table, updates, decay, name, self.params[name].numel(), start, end)

        return self._change(change, self.update_log) ** 0.5

    @torch.no_grad()
    def _change(self, change: Change, log: list[tuple]) -> float:
        """Apply `change` to every tensor, window by window (`add_within`), each window journalled in `log` once
        written; returns the sum of the squared steps applied."""
        squared = 0.0
        for name, p in self.params.items():
            flat = p.data.view(-1)
            for a, b, step in change(name, 0, flat.numel()):
                kept = add_within(flat[a:b], step)
                log.append((change, name, a, b, kept))
                squared += float(step.float().square().sum())
        return squared

    @torch.no_grad()
    def _undo(self, log: list[tuple]) -> None:
        """Undo the changes journalled in `log`, the last first (`subtract_except`)."""
        while log:
            change, name, a, b, kept = log[-1]
            ((_, _, step),) = change(name, a, b)
            subtract_except(self.params[name].data.view(-1)[a:b], step, kept)
            log.pop()

    def fingerprint(self) -> str:
        return weights_hash(self.params)


@register
class QESSpace(SearchSpace):
    """QES (see the module docstring): Gaussian directions rounded to integers, written into the int8 weights by
    `Int8Weights`; the records of the last `window` updates (oldest first) are the space's state, checkpointed as JSON
    in `STATE_FILE`."""

    name = "qes"
    backend = Int8Weights
    fields = ("qes_feedback_decay", "qes_feedback_window")
    STATE_FILE = "qes_updates.json"
    STATE_FORMAT = "trl-es-qes-updates/1"

    def __init__(
        self,
        weights: Int8Weights,
        seed: int,
        population_size: int,
        antithetic: bool = False,
        decay: float = 0.9,
        window: int = 4,
        rule: UpdateRule | None = None,
    ):
        super().__init__(weights, rule)
        self.seed, self.population_size, self.antithetic = seed, population_size, antithetic
        self.decay, self.window = decay, window
        self.recent: list[dict] = []

    @classmethod
    def parameters(cls, named_parameters, patterns: list[str] | None) -> dict[str, torch.nn.Parameter]:
        return int8_parameters(named_parameters, patterns)

    @classmethod
    def check_config(cls, args, refuse) -> None:
        decay, window = args.qes_feedback_decay, args.qes_feedback_window
        if not (type(decay) in (int, float) and 0 <= decay < 1):
            refuse("qes_feedback_decay", "the error feedback γ·e needs 0 ≤ γ < 1 (0: plain rounding)")
        if not (type(window) is int and 0 <= window <= MAX_WINDOW):
            refuse("qes_feedback_window", f"each update replays its last H updates to rebuild e: 0 ≤ H ≤ {MAX_WINDOW}")
        if args.sigma > MAX_SIGMA:
            refuse("sigma", f"QES's σ is in quantization steps of integers in [−127, 127]: at most {MAX_SIGMA}")
        float_steps = "QES moves θ by whole quantization steps, which"
        refusals = {
            "use_vllm": (args.use_vllm, "vLLM quantizes its own copy of the base and cannot take the integers QES "
                         "writes in place: use_vllm=False"),
            "es_optimizer": (args.es_optimizer, f"{float_steps} an optimizer's float step on ĝ is not"),
            "es_anchor_decay": (args.es_anchor_decay, f"{float_steps} the pull θ ← θ − λ·(θ − θ₀) is not"),
            "weight_decay": (args.weight_decay, f"{float_steps} the decay θ ← θ − α·λ·θ is not"),
            "es_adapter_only": (args.es_adapter_only, "QES trains the base's int8 weights, not an adapter"),
            "sparse_delta_tau": (args.sparse_delta_tau is not None, "the sparse delta file holds float weight "
                                 "deltas, and a QES model is saved 8-bit"),
        }  # fmt: skip
        for field, (given, why) in refusals.items():
            if given:
                refuse(field, why)

    @classmethod
    def check_setup(cls, args, zero_stage) -> None:
        if zero_stage == 3:
            raise ValueError("es_search_space='qes' writes the int8 weights whole on each process: use ZeRO-2 or none")

    @classmethod
    def from_config(cls, args, model, weights, load_model=None) -> QESSpace:
        common = (args.seed, args.population_size, args.antithetic)
        window = (args.qes_feedback_decay, args.qes_feedback_window)
        return cls(weights, *common, *window, rule=UpdateRule.from_config(args))

    def _ask(self, step: int, sigma: float) -> list[Direction]:
        return directions(self.seed, step, self.population_size, self.antithetic, sigma)

    @contextlib.contextmanager
    def evaluating(self, members: list[Direction | None]):
        route = one_member(members)
        (member,) = members
        if member is None:
            self.weights.center()
        else:
            self.weights.member(member.seed, member.sign, member.sigma)
        yield route

    def _tell(self, members: list[Direction], rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float):
        """Δ's coefficients c_s = α/(N·σ)·Σ_{i: seed_i = s} sign_i·z_i (`update_coefficients`), the update applied
        with the feedback of the recent updates, and recorded among them."""
        sigma, n_valid = members[0].sigma, int((~torch.isnan(rewards)).sum())
        pairs = [(m.seed, m.sign) for m in members]
        coefficients = update_coefficients(fitness, pairs, learning_rate / sigma, n_valid)
        record = {"sigma": sigma, "coefficients": [[seed, c] for seed, c in coefficients.items()]}
        norm = self.weights.update([*self.recent, record], self.decay)
        self.recent = recent(self.recent, record, self.window)
        return {"es/update_norm": norm}, record

    def chain_header(self) -> dict:
        return {"kind": self.name, "feedback_decay": self.decay, "feedback_window": self.window}

    @staticmethod
    def check_chain_header(header: dict, parameters: list[str]) -> str | None:
        decay, window = header.get("feedback_decay"), header.get("feedback_window")
        if type(decay) not in (int, float) or not 0 <= decay < 1:
            return "header.space.feedback_decay must be a number in [0, 1)"
        if type(window) is not int or not 0 <= window <= MAX_WINDOW:
            return f"header.space.feedback_window must be an integer in 0..{MAX_WINDOW}"
        return None

    @staticmethod
    def replayer(header: dict, weights, load_model=None):
        """Each update applied as `_tell` applied it, with the same window of earlier updates (the chain's, from
        its base), on `weights`' int8 tensors and noise table."""
        decay, window = header["feedback_decay"], header["feedback_window"]
        int8 = Int8Weights(weights.params, weights.seed, weights.table_size, weights.table)
        earlier: list[dict] = []

        def replay(update: dict) -> None:
            nonlocal earlier
            int8.capture()
            int8.update([*earlier, update], decay)
            earlier = recent(earlier, update, window)

        return replay

    def save_state(self, folder: str) -> None:
        """The recent updates, into the checkpoint's staging folder (published whole with the checkpoint)."""
        state = {"format": self.STATE_FORMAT, "window": self.window, "updates": self.recent}
        with open(os.path.join(folder, self.STATE_FILE), "w", encoding="utf-8") as file:
            json.dump(state, file)

    def load_state(self, folder: str) -> None:
        path = os.path.join(folder, self.STATE_FILE)
        state = read_state(path, "QES")
        updates = state.get("updates") if isinstance(state, dict) else None
        if not (isinstance(updates, list) and len(updates) <= self.window and all(map(is_record, updates))) or (
            state.get("format") != self.STATE_FORMAT
        ):
            raise ValueError(f"{path} is not a QES state of format {self.STATE_FORMAT!r} with at most "
                             f"{self.window} update records")  # fmt: skip
        self.recent = updates


def recent(updates: list[dict], update: dict, window: int) -> list[dict]:
    """The last `window` of `updates` followed by `update`, oldest first."""
    return [*updates, update][-window:] if window else []


def is_record(value) -> bool:
    """Whether `value` is a QES update record: {"sigma": σ > 0, "coefficients": [[seed, c], ...]}."""
    if not isinstance(value, dict) or type(value.get("sigma")) not in (int, float) or not value["sigma"] > 0:
        return False
    pairs = value.get("coefficients")
    return isinstance(pairs, list) and all(
        isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) in (int, float)
        and math.isfinite(pair[1]) for pair in pairs
    )  # fmt: skip
