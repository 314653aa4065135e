"""The search-space protocol: what a member is, how the model evaluates it, and how the step's rewards move θ.

evosax's ask/tell shape. One ES step of the trainer reads

    members = space.ask(step)                                   # the step's N members, at σ_t
    with space.evaluating(call_members) as route:               # for each generate call of this process
        route(row_members); generate ...                        # batch row b is member call_members[row_members[b]]
    ... all-reduce the members' rewards ...
    metrics, update = space.tell(members, rewards, α_t, center) # the update, and its seed-chain record

As evosax's base strategy, the base class owns what every space shares — the update rule (`UpdateRule`): σ_t, the
centre baseline, fitness shaping, the step without signal, the optimizer's step, the anchored decay toward the run's
starting weights — and a space implements the small `_ask` (its members) and `_tell` (how shaped fitness moves θ).

Every search space is registered in `SEARCH_SPACES` under its `name` (the `es_search_space` value and the seed
chain's `kind`), read by ESConfig (the choices, `check_config`), the trainer (`check_setup`, `from_config`) and seed
chains (`replayer`): a new search space is one registered class (docs/design.md, "Adding a search space").
Registered here: `FullSpace` (full ES), `CoPESSpace` (cooperative subspaces), `LowRankSpace` (EGGROLL),
`MergeSpace` (Hyper-ES), `QESSpace` (integer ES on an 8-bit model's int8 weights).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .fitness import keep_top_k, shape_fitness
from .params import select_parameters
from .seeds import member_seed, noise_step
from .weights import WeightsBackend


SEARCH_SPACES: dict[str, type[SearchSpace]] = {}
"""Every search space by name (`register`)."""

Route = Callable[[list[int] | int], None]
"""`route(row_members)`: the next forward passes' batch row b evaluates member `row_members[b]` (an index into the
members the `evaluating` context was given); `route(m)`: every row of any batch evaluates member m (a generation
the trainer does not batch itself, e.g. a `rollout_func`'s)."""


def register(cls: type[SearchSpace]) -> type[SearchSpace]:
    """Class decorator: make `cls` the search space `es_search_space=cls.name` selects."""
    if cls.name in SEARCH_SPACES:
        raise ValueError(f"a search space named {cls.name!r} is already registered ({SEARCH_SPACES[cls.name]})")
    SEARCH_SPACES[cls.name] = cls
    return cls


def search_space(name: str) -> type[SearchSpace]:
    """The registered search space `name`; a ValueError naming the known ones otherwise."""
    if name not in SEARCH_SPACES:
        raise ValueError(f"unknown search space {name!r}: this trl-es knows {sorted(SEARCH_SPACES)}")
    return SEARCH_SPACES[name]


@dataclass(frozen=True)
class Direction:
    """A member's noise: σ·sign·ε(seed), over CoPES group `group` (None: every parameter); σ is the step's σ_t."""

    seed: int
    sign: int = 1
    group: int | None = None
    sigma: float = 1e-3


def directions(seed: int, step: int, population_size: int, antithetic: bool, sigma: float) -> list[Direction]:
    """Member i's direction at step `step` and noise scale `sigma`: ε(seed(t, i)), or ±ε(seed(t, k)) for antithetic
    pair k = i // 2."""
    if antithetic:
        pairs = [(member_seed(seed, step, i // 2), 1 if i % 2 == 0 else -1) for i in range(population_size)]
        return [Direction(member, sign, sigma=sigma) for member, sign in pairs]
    return [Direction(member_seed(seed, step, i), sigma=sigma) for i in range(population_size)]


def one_member(members: list) -> Route:
    """The route of a space that forms one member at a time: every row is that member."""

    def route(row_members: list[int] | int) -> None:
        if any(m != 0 for m in ([row_members] if isinstance(row_members, int) else row_members)):
            raise ValueError(
                f"this search space evaluates one member per call, not rows of {sorted(set(row_members))}"
            )

    if len(members) != 1:
        raise ValueError(f"this search space evaluates one member per call, got {len(members)}")
    return route


def sigma_schedule(sigma: float, decay: float, limit: float, step: int) -> float:
    """σ_t = max(σ·decay^t, limit), as evosax's OpenES: the noise scale of step `step`'s members (0-based)."""
    return max(sigma * decay**step, limit)


ANCHOR_WINDOW = 1 << 22
"""Elements per slice of the anchored decay (`anchor_pull`): its float32 temporaries stay small."""


@torch.no_grad()
def anchor_pull(params: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor], decay: float) -> None:
    """The anchored decay θ ← θ − λ·(θ − θ₀) over `params`, θ₀ = `anchor`, λ = `decay`: computed in float32 one slice
    at a time and cast to the parameter's dtype once, the same in training (`SearchSpace.tell`) and in a seed chain's
    replay, so both are bitwise equal. A pull below the parameter dtype's rounding step (bf16) leaves θ as it is."""
    for name, p in params.items():
        flat, start = p.data.view(-1), anchor[name].view(-1)
        for a in range(0, flat.numel(), ANCHOR_WINDOW):
            theta = flat[a : a + ANCHOR_WINDOW].float()
            origin = start[a : a + ANCHOR_WINDOW].to(flat.device, torch.float32)
            flat[a : a + ANCHOR_WINDOW] = theta - decay * (theta - origin)


class UpdateRule:
    """What every search space's `ask` and `tell` share (ESConfig's ES-step fields), with its state explicit: the σ
    schedule (`sigma_at`, `sigma_schedule`), which step's noise directions a step uses (`noise_reuse`), the fitness
    shaping of the members' rewards minus the centre's (`es_baseline="center"`), the best `top_k` members kept, and
    what follows a space's update (`after_update`, in training and in a seed chain's
    replay alike): with `es_optimizer`, the step of the optimizer the trainer hands it (`use_optimizer`) on the
    gradient estimate the space wrote; with `es_anchor_decay` = λ > 0, the anchored decay θ ← θ − λ·(θ − θ₀)
    (`anchor_pull`), θ₀ the run's starting weights, held on the host from the start of training (`hold_anchor`) or taken
    from a checkpoint (`load_state_dict`)."""

    def __init__(
        self,
        sigma: float = 1e-3,
        sigma_decay: float = 1.0,
        sigma_limit: float = 0.0,
        shaping: str = "zscore",
        anchor_decay: float = 0.0,
        top_k: int | None = None,
        noise_reuse: int = 1,
    ):
        self.sigma, self.sigma_decay, self.sigma_limit, self.shaping = sigma, sigma_decay, sigma_limit, shaping
        self.anchor_decay, self.top_k, self.noise_reuse = anchor_decay, top_k, noise_reuse
        self.optimizer: torch.optim.Optimizer | None = None
        self.anchor: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_config(cls, args) -> UpdateRule:
        return cls(args.sigma, args.sigma_decay, args.sigma_limit, args.fitness_shaping, args.es_anchor_decay,
                   top_k=args.fitness_top_k, noise_reuse=args.noise_reuse)  # fmt: skip

    def sigma_at(self, step: int) -> float:
        return sigma_schedule(self.sigma, self.sigma_decay, self.sigma_limit, step)

    def fitness(self, rewards: torch.Tensor, center: float | None) -> torch.Tensor | None:
        """The shaped fitness of the members' `rewards` (NaN: none) minus the centre's reward `center` (when there
        is one, and it is a number), the best `top_k` members' only when set; None when the rewards carry no signal
        (no spread)."""
        baseline = center if center is not None and not math.isnan(center) else 0.0
        fitness = shape_fitness(rewards - baseline, self.shaping)
        return fitness if fitness is None or self.top_k is None else keep_top_k(fitness, rewards, self.top_k)

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """With `es_optimizer`: the optimizer that steps on the gradient estimate after each update."""
        self.optimizer = optimizer

    def hold_anchor(self, params: dict[str, torch.Tensor]) -> None:
        """θ₀ ← a host copy of the weights `params` hold now, once per run (the weights its seed chain starts from),
        when the decay is on."""
        if self.anchor_decay and self.anchor is None:
            self.anchor = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}

    def after_update(self, params: dict[str, torch.Tensor], learning_rates: list[float] | None = None):
        """What follows a space's update of `params`: the optimizer's step (at `learning_rates`, one per param
        group; default its current ones), then the anchored decay. Returns the learning rates the optimizer used
        (for the seed chain; None without an optimizer)."""
        if self.optimizer is not None:
            learning_rates = learning_rates or [group["lr"] for group in self.optimizer.param_groups]
            step_optimizer(self.optimizer, params, learning_rates)
        if self.anchor_decay:
            anchor_pull(params, self.anchor, self.anchor_decay)
        return learning_rates if self.optimizer is not None else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the rule beyond the config: θ₀ of the anchored decay (empty without it)."""
        return dict(self.anchor or {})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.anchor_decay:
            self.anchor = dict(state)


class SearchSpace:
    """Base class of the search spaces (see the module docstring)."""

    name: ClassVar[str]
    """The `es_search_space` value that selects this space, and the `kind` of its seed chains."""
    backend: ClassVar[type] = WeightsBackend
    """The weights-backend protocol this space needs (`trl_es.es.weights`)."""
    fields: ClassVar[tuple[str, ...]] = ()
    """The ESConfig fields only this space reads: ESConfig refuses a value other than the default in a run of another
    space, where it would be silently ignored."""
    rule: UpdateRule
    """The update rule `ask` and `tell` apply: the run's (`UpdateRule.from_config`), given to the space when it is
    made (`__init__`)."""

    def __init__(self, weights, rule: UpdateRule | None = None):
        """A space over the weights backend `weights` under the update rule `rule` (default `UpdateRule()`)."""
        self.weights, self.rule = weights, rule or UpdateRule()

    @classmethod
    def build(cls, args, model: torch.nn.Module, weights, load_model: Callable, zero_stage: int | None) -> SearchSpace:
        """The space ESConfig `args` selects for this run (`check_setup`, the weights backend it needs,
        `from_config`), made with the run's `UpdateRule`."""
        cls.check_setup(args, zero_stage)
        if not isinstance(weights, cls.backend):
            raise ValueError(
                f"es_search_space={cls.name!r} needs a {cls.backend.__name__} weights backend, and this run's is "
                f"a {type(weights).__name__}"
            )
        space = cls.from_config(args, model, weights, load_model)
        if not isinstance(getattr(space, "rule", None), UpdateRule):
            raise TypeError(
                f"search space {cls.name!r} was made without its update rule: its `from_config` must pass "
                "`UpdateRule.from_config(args)` to `SearchSpace.__init__`"
            )
        return space

    @classmethod
    def parameters(cls, named_parameters, patterns: list[str] | None) -> dict[str, torch.nn.Parameter]:
        """θ: the parameters this space moves among the model's `named_parameters`, those whose name matches one of
        `patterns` when given (ESConfig.es_parameter_patterns): the trainable floating-point ones
        (`select_parameters`)."""
        return select_parameters(named_parameters, patterns)

    @classmethod
    def check_config(cls, args, refuse: Callable[[str, str], None]) -> None:
        """Refuse (`refuse(field, why)`) ESConfig settings this space cannot honour: called by ESConfig."""

    @classmethod
    def check_setup(cls, args, zero_stage: int | None) -> None:
        """A ValueError for a run set-up this space cannot work in (e.g. ZeRO-3), known once the trainer starts."""

    @classmethod
    def from_config(cls, args, model: torch.nn.Module, weights, load_model: Callable) -> SearchSpace:
        """The space ESConfig `args` describes, over `model` and its weights backend (`trl_es.es.weights`), made with
        the run's update rule `UpdateRule.from_config(args)`; `load_model(path)` loads another model as training
        loads a starting model (Hyper-ES's merge models)."""
        raise NotImplementedError

    def ask(self, step: int) -> list:
        """The step's members, in order, formed at σ_t (`UpdateRule.sigma_at`; spaces without σ refuse a schedule:
        ESConfig's check) from the noise directions of step `noise_step(step, noise_reuse)` (spaces without noise
        directions refuse noise_reuse)."""
        return self._ask(noise_step(step, self.rule.noise_reuse), self.rule.sigma_at(step))

    def _ask(self, step: int, sigma: float) -> list:
        """The members of the noise directions of step `step` at noise scale `sigma`, in order; each is a value only
        this space reads (a `Direction` carries its σ)."""
        raise NotImplementedError

    def members_per_call(self, n_local: int) -> int:
        """How many of this process's `n_local` members one generate call evaluates together."""
        return 1

    def evaluating(self, members: list) -> contextlib.AbstractContextManager[Route]:
        """A context in which the model evaluates `members` (None: the unperturbed centre θ), giving the `Route`
        that says which member each batch row of the next generate calls evaluates. Everything is undone on exit."""
        raise NotImplementedError

    def tell(
        self, members: list, rewards: torch.Tensor, learning_rate: float, center: float | None = None
    ) -> tuple[dict, dict | None]:
        """The update rule: the members' `rewards` (NaN: none) minus the centre's reward `center` (when there is
        one, and it is a number) are shaped into fitness z; rewards without spread carry no signal, so θ is
        restored and the step records no update (None); otherwise `_tell` moves θ (or writes ĝ), the optimizer, if
        any, steps, and the anchored decay, if on, pulls θ toward θ₀ (`anchor_pull`). Returns the step's metrics
        (`es/skipped_update` among them) and the update's seed-chain record (`trl_es.chains.StepRecord["update"]`,
        "learning_rates" added when an optimizer applied it)."""
        fitness = self.rule.fitness(rewards, center)
        if fitness is None:
            self.weights.restore()
            return {"es/update_norm": 0.0, "es/skipped_update": 1.0}, None
        metrics, record = self._tell(members, rewards, fitness, learning_rate)
        learning_rates = self.rule.after_update(self.weights.params)
        if learning_rates is not None:  # the optimizer applied the gradient estimate `_tell` wrote
            record = {**record, "learning_rates": learning_rates}
        return {**metrics, "es/skipped_update": 0.0}, record

    def _tell(
        self, members: list, rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float
    ) -> tuple[dict, dict]:
        """Move θ with the members' shaped `fitness` (and raw `rewards`, NaN for none), or, with `gradient` (the
        `es_optimizer` mode), write −ĝ into the parameters' `.grad` for the optimizer `tell` steps next. Returns the
        step's metrics (`es/update_norm` = ‖Δθ‖₂, or `es/gradient_norm` = ‖ĝ‖₂) and the update's record: what
        `replayer` needs to apply it again."""
        raise NotImplementedError

    def chain_header(self) -> dict:
        """What replaying this space's updates needs beyond the base weights and the noise table (a seed chain's
        `space` header, `trl_es.chains`), JSON-able, with `kind` = `name`."""
        raise NotImplementedError

    @staticmethod
    def check_chain_header(header: dict, parameters: list[str]) -> str | None:
        """The first problem of a `space` header read from a chain file (a field `replayer` reads of the wrong type,
        or naming none of the chain's `parameters`), as a phrase; None when it has none."""
        return None

    @staticmethod
    def replayer(header: dict, weights, load_model: Callable) -> Callable[[dict], None]:
        """A function applying a recorded update (`tell`'s record) to `weights` (a `LocalWeights` holding the
        chain's base, θ of each step captured before its update) bitwise as `tell` did (with an optimizer, its
        gradient only: `trl_es.chains` steps the optimizer); `header` is `chain_header()`'s. Made once per replay."""
        raise NotImplementedError

    def save_state(self, folder: str) -> None:
        """Write the space's own state beyond the weights into a checkpoint folder (none by default)."""

    def load_state(self, folder: str) -> None:
        """Read what `save_state` wrote."""


def read_state(path: str, what: str):
    """The JSON a search space's `save_state` wrote at `path` (`what`: whose state it is, for the errors): a
    FileNotFoundError when it is missing (the checkpoint is not of such a run), a ValueError when it cannot be read."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint was not saved by a {what} run")
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable {what} state: {error}") from error


def names_problem(field: str, names, parameters: list[str]) -> str | None:
    """The problem of `names`, a chain header's list of parameter names at `field`: not a list of names, or naming
    one that is not among the chain's `parameters`; None when it has none."""
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        return f"{field} must be a list of parameter names"
    unknown = sorted(set(names) - set(parameters))
    return f"{field} names {unknown[0]!r}, which is not one of header.parameters" if unknown else None


def step_optimizer(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], learning_rates: list[float]):
    """The `es_optimizer` step, in training and in replay alike: one optimizer step on the gradients the search
    space wrote, at `learning_rates` (one per param group), then the gradients cleared. A FloatingPointError names
    the first parameter of `params` the step made non-finite (the caller restores θ)."""
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for name, p in params.items():
        if not torch.isfinite(p).all():
            raise FloatingPointError(
                f"the optimizer's step made {name!r} non-finite (learning rates {learning_rates}): lower learning_rate"
            )
