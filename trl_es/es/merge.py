"""Hyper-ES: CMA-ES over layer-wise merge coefficients of task vectors, merged with DARE-TIES.

Given a base model θ_base and K fine-tuned models θ_1..θ_K of the same architecture, the task vectors are
τ_k = θ_k − θ_base. A candidate is a coefficient matrix c of shape (K, L), one column per layer group (one group
per transformer layer, plus one for everything else); the merged weights of a tensor in group l are

    θ = θ_base + DARE-TIES(τ_1..τ_K; weights c[:, l], density d)

with peft's `dare_ties` (Yu et al. 2024, "Language Models are Super Mario"; Yadav et al. 2023, "TIES-Merging"):
each τ_k is pruned at random to a fraction d of its entries and rescaled by 1/d (DARE), a sign is elected per
entry from the sum of the pruned τ_k, and the merged delta is the mean of c_k·τ_k over the k whose sign agrees
(TIES disjoint merge). So with c = 1 everywhere the delta is the plain DARE-TIES merge, and with K = 1 and d = 1
it is exactly c·τ. The sign is elected before weighting, so a negative c_k reverses τ_k's kept entries.

`MergeSearch` runs CMA-ES (Hansen 2016, the `cma` package) over the flattened K·L coefficients to maximize a
reward; evaluating a candidate (generating with its merged weights, scoring it) is left to the caller.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping

import numpy as np
import torch

from .params import layer_index
from .seeds import merge_search_seed, merge_seed
from .space import SearchSpace, UpdateRule, one_member, read_state, register
from .weights import TrainerWeights, weights_hash


MERGE_EXTRA = "es_search_space='merge' needs cma and peft: pip install 'trl-es[merge]'"


def _import(module: str):
    """cma or peft's merge utilities, imported when Hyper-ES first needs them (the `merge` extra)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(MERGE_EXTRA) from error


def task_vectors(
    base: Mapping[str, torch.Tensor], tuned: list[Mapping[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """τ_k = θ_k − θ_base in float32, one dict per tuned model, keyed like `base`."""
    vectors = []
    for k, theta in enumerate(tuned):
        unmatched = sorted(set(base).symmetric_difference(theta))
        if unmatched:
            name = unmatched[0]
            where = "base" if name in base else f"tuned model {k}"
            raise ValueError(f"parameter {name!r} is only in the {where}: task vectors need identical parameter names")
        for name, value in base.items():
            if theta[name].shape != value.shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(theta[name].shape)} in tuned model {k} "
                    f"but {tuple(value.shape)} in the base"
                )
        vectors.append({name: theta[name].float() - value.float() for name, value in base.items()})
    return vectors


def layer_groups(names: list[str]) -> dict[str, int]:
    """Parameter name → layer group: group i is the i-th smallest transformer layer index `layers.<n>.` found in
    the names, and the last group holds every other parameter (embeddings, final norm, lm_head) if there is any."""
    layers = sorted({layer for name in names if (layer := layer_index(name)) is not None})
    index = {layer: i for i, layer in enumerate(layers)}
    return {name: index.get(layer_index(name), len(layers)) for name in names}


@torch.no_grad()
def merge(
    base: Mapping[str, torch.Tensor],
    vectors: list[Mapping[str, torch.Tensor]],
    coefficients: torch.Tensor,
    groups: Mapping[str, int],
    density: float = 0.5,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """θ = θ_base + dare_ties(τ_1..τ_K; c[:, groups[name]], density) for every tensor of `base`, in its dtype.

    `coefficients` is c, of shape (K, L) with L = max(groups) + 1. DARE's pruning draws from torch's RNG, forked
    and seeded with `merge_seed(seed, name)`, so a merge is the same on every process and call (on one device
    type: CPU and CUDA draw different masks) and every candidate of a search is merged with the same masks.
    """
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    shape = (len(vectors), max(groups.values()) + 1)
    if tuple(coefficients.shape) != shape:
        raise ValueError(f"coefficients must have shape (K, L) = {shape}, got {tuple(coefficients.shape)}")
    merged = {}
    for name, theta in base.items():
        if name not in groups:
            raise ValueError(f"parameter {name!r} has no layer group")
        mix = coefficients[:, groups[name]].to(device=theta.device, dtype=torch.float32)  # c[:, l], one per τ_k
        devices = [] if theta.device.type == "cpu" else [theta.device]
        with torch.random.fork_rng(devices=devices, device_type=theta.device.type):
            torch.manual_seed(merge_seed(seed, name))
            delta = _import("peft.utils.merge_utils").dare_ties([vector[name] for vector in vectors], mix, density)
        merged[name] = (theta.float() + delta).to(theta.dtype)
    return merged


class _Randn:
    """randn(*shape) for CMA-ES from its own numpy generator, so sampling neither reads nor seeds numpy's global
    RNG."""

    def __init__(self, seed: int):
        self.generator = np.random.default_rng(seed)

    def __call__(self, *shape: int) -> np.ndarray:
        return self.generator.standard_normal(shape)


class MergeSearch:
    """CMA-ES maximizing a reward over merge coefficients c ∈ R^{K×L}, started at c = `init` everywhere.

    The default `init` = 1 starts from the plain DARE-TIES merge of all K task vectors (for K = 1, the tuned model
    itself): peft's TIES step averages the agreeing c_k·τ_k, so c_k ≈ 1 is the natural scale, and `sigma0` = 0.2
    explores ±20% of it per layer group. `popsize` None uses CMA-ES's default 4 + ⌊3 ln(K·L)⌋. The search is
    deterministic in `seed`: the same tells give the same asks. So its state is data — the settings and the rewards
    told after each ask — and loading it replays them (`state_dict`): nothing is unpickled.
    """

    STATE_FORMAT = "trl-es-cma-replay/1"

    def __init__(
        self,
        n_vectors: int,
        n_groups: int,
        init: float = 1.0,
        sigma0: float = 0.2,
        popsize: int | None = None,
        seed: int = 0,
    ):
        self.shape = (n_vectors, n_groups)
        self.settings = {"shape": list(self.shape), "init": init, "sigma0": sigma0, "popsize": popsize, "seed": seed}
        self.history: list[list[float] | None] = []  # per ask: the rewards told for it (None: not told)
        options = {"seed": math.nan, "randn": _Randn(merge_search_seed(seed)), "verbose": -9}
        if popsize is not None:
            options["popsize"] = popsize
        self.es = _import("cma").CMAEvolutionStrategy([init] * (n_vectors * n_groups), sigma0, options)

    def ask(self) -> list[torch.Tensor]:
        """The next population of candidate coefficient matrices (K × L, float64)."""
        self.history.append(None)
        return [torch.from_numpy(np.array(x)).reshape(self.shape) for x in self.es.ask()]

    def tell(self, candidates: list[torch.Tensor], rewards: list[float]) -> None:
        """Update the distribution with the rewards of the asked `candidates` (CMA-ES minimizes −reward)."""
        if len(candidates) != len(rewards):
            raise ValueError(f"got {len(candidates)} candidates but {len(rewards)} rewards")
        if not all(math.isfinite(reward) for reward in rewards):
            raise ValueError(f"rewards must be finite (no NaN or inf), got {list(rewards)}")
        if not self.history or self.history[-1] is not None:
            raise ValueError("tell follows an ask: these candidates were not asked for")
        solutions = [candidate.detach().cpu().double().reshape(-1).numpy() for candidate in candidates]
        self.es.tell(solutions, [-float(reward) for reward in rewards])
        self.history[-1] = [float(reward) for reward in rewards]

    def mean(self) -> torch.Tensor:
        """The current mean of the search distribution (K × L, float64)."""
        return torch.from_numpy(np.array(self.es.mean)).reshape(self.shape)

    def best(self) -> tuple[torch.Tensor, float]:
        """The best candidate told so far and its reward."""
        if self.es.result.xbest is None:
            raise RuntimeError("no candidate has been told yet")
        return torch.from_numpy(np.array(self.es.result.xbest)).reshape(self.shape), -float(self.es.result.fbest)

    def state_dict(self) -> dict:
        """The search as JSON-able data: its settings and, per ask, the rewards told (None: asked, not told)."""
        history = [None if rewards is None else list(rewards) for rewards in self.history]
        return {"format": self.STATE_FORMAT, "settings": dict(self.settings), "history": history}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue as the search `state` describes: a search with its settings, replayed ask by ask (the same
        asks, since the search is deterministic). Every field is checked first; a ValueError names what is wrong."""
        if not isinstance(state, Mapping) or state.get("format") != self.STATE_FORMAT:
            raise ValueError(f"not a CMA-ES search state of format {self.STATE_FORMAT!r}")
        settings, history = state.get("settings"), state.get("history")
        if not isinstance(settings, Mapping) or set(settings) != set(self.settings):
            raise ValueError(f"the state's settings must have the keys {sorted(self.settings)}")
        shape = settings["shape"]
        if shape != list(self.shape):
            size = shape[0] * shape[1] if _is_pair_of_ints(shape) else shape
            raise ValueError(f"state has {size} coefficients, this search has {self.shape[0]}×{self.shape[1]}")
        if not isinstance(history, list) or not all(_is_reward_list(entry) for entry in history):
            raise ValueError("the state's history must be a list of None or lists of finite rewards")
        changed = [
            SETTING_FIELDS[key] for key in ("init", "sigma0", "popsize", "seed") if settings[key] != self.settings[key]
        ]
        if changed:
            raise ValueError(
                f"the Hyper-ES search was checkpointed with other {', '.join(changed)} than this run's "
                f"({ {k: settings[k] for k in SETTING_FIELDS} } vs { {k: self.settings[k] for k in SETTING_FIELDS} }): "
                "resume with the checkpoint's settings, or start a new search from its weights with model=<checkpoint>"
            )
        replayed = MergeSearch(*shape, settings["init"], settings["sigma0"], settings["popsize"], settings["seed"])
        for rewards in history:
            candidates = replayed.ask()
            if rewards is not None:
                replayed.tell(candidates, rewards)
        self.__dict__.update(replayed.__dict__)


SETTING_FIELDS = {"init": "merge_init", "sigma0": "merge_sigma", "popsize": "population_size", "seed": "seed"}
"""The ESConfig field behind each CMA-ES setting."""


def _is_pair_of_ints(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)


def _is_reward_list(entry) -> bool:
    return entry is None or (
        isinstance(entry, list) and all(type(r) in (int, float) and math.isfinite(r) for r in entry)
    )


@register
class MergeSpace(SearchSpace):
    """Hyper-ES: the members are CMA-ES's candidate coefficients c; member c evaluates `merge(θ_start, τ, c)` written
    into the weights (a `LocalWeights`); `tell` gives CMA-ES the members' rewards (a member without one counts as
    the worst) and θ becomes the best merge found so far. The search state is checkpointed as JSON in
    `merge_search.json` (`MergeSearch.state_dict`)."""

    name = "merge"
    backend = TrainerWeights  # merges are written into the trainer's tensors
    STATE_FILE = "merge_search.json"
    PICKLED_STATE_FILE = "merge_search.pt"  # what trl-es wrote before it stopped pickling: refused

    def __init__(
        self,
        weights,
        tuned: Mapping[str, Mapping[str, torch.Tensor]],
        density: float = 0.5,
        init: float = 1.0,
        sigma0: float = 0.2,
        popsize: int | None = None,
        seed: int = 0,
        rule: UpdateRule | None = None,
    ):
        super().__init__(weights, rule)
        self.density, self.seed = density, seed
        self.base = {name: p.detach().to("cpu", copy=True) for name, p in weights.params.items()}
        self.models = [{"path": path, "sha256": weights_hash(named)} for path, named in tuned.items()]
        for path, named in tuned.items():
            missing = [name for name in self.base if name not in named]
            if missing:
                raise ValueError(
                    f"merge model {path!r} lacks {missing[:3]}: it is not a fine-tuned version of this model"
                )
        self.vectors = task_vectors(
            self.base, [{name: named[name].detach() for name in self.base} for named in tuned.values()]
        )
        self.groups = layer_groups(list(self.base))
        self.search = MergeSearch(len(self.vectors), max(self.groups.values()) + 1, init, sigma0, popsize, seed)

    @classmethod
    def check_config(cls, args, refuse) -> None:
        if not args.merge_models:
            refuse("merge_models", "Hyper-ES merges task vectors: give at least one fine-tuned model")
        if not 0 < args.merge_density <= 1:
            refuse("merge_density", "DARE keeps a share in (0, 1] of each task vector")
        if not args.merge_sigma > 0:
            refuse("merge_sigma", "CMA-ES needs a step size > 0")
        if args.es_optimizer:
            refuse("es_optimizer", "Hyper-ES moves θ by CMA-ES, not by a gradient estimate")
        if args.sigma_decay != 1:
            refuse("sigma_decay", "Hyper-ES's CMA-ES adapts its own step size (from merge_sigma)")
        if args.noise_reuse != 1:
            refuse("noise_reuse", "Hyper-ES's members are CMA-ES's samples, not noise directions to reuse")
        if args.fitness_top_k is not None:
            refuse("fitness_top_k", "Hyper-ES's CMA-ES weighs its samples by rank itself")
        if args.es_anchor_decay:
            refuse("es_anchor_decay", "Hyper-ES writes each step's θ as a merge of the starting weights (CMA-ES's "
                   "best), which would overwrite a pull toward them: use es_anchor_decay=0")  # fmt: skip
        if args.use_vllm:
            refuse("es_search_space", "a merge is written into the trainer's tensors, which vLLM does not read: "
                   "use 'full' or 'copes' with use_vllm, or use_vllm=False")  # fmt: skip

    @classmethod
    def check_setup(cls, args, zero_stage) -> None:
        if zero_stage == 3:
            raise ValueError("es_search_space='merge' holds the base and task vectors whole: use ZeRO-2 or none")

    @classmethod
    def from_config(cls, args, model, weights, load_model) -> MergeSpace:
        """From ESConfig: the task vectors of `merge_models`, loaded with `load_model`."""
        _import("cma"), _import("peft.utils.merge_utils")  # the extra's error now, not after loading the models
        tuned = {path: dict(load_model(path).named_parameters()) for path in args.merge_models}
        settings = (args.merge_density, args.merge_init, args.merge_sigma, args.population_size, args.seed)
        return cls(weights, tuned, *settings, rule=UpdateRule.from_config(args))

    def _ask(self, step: int, sigma: float) -> list[torch.Tensor]:
        return self.search.ask()  # the same on every process: CMA-ES is seeded, and adapts its own step size

    def merged(self, coefficients: torch.Tensor) -> dict[str, torch.Tensor]:
        return merge(self.base, self.vectors, coefficients, self.groups, self.density, self.seed)

    @contextlib.contextmanager
    def evaluating(self, members: list[torch.Tensor | None]):
        route = one_member(members)
        (member,) = members
        if member is None:
            self.weights.center()
        else:
            self.weights.write(self.merged(member))
        yield route

    def _tell(self, members: list[torch.Tensor], rewards: torch.Tensor, fitness: torch.Tensor, learning_rate: float):
        rewards = rewards.clone()
        rewards[rewards.isnan()] = rewards[~rewards.isnan()].min()
        self.search.tell(members, rewards.tolist())
        best, best_reward = self.search.best()
        self.weights.write(self.merged(best), member=False)
        metrics = {"es/update_norm": self.weights.distance(), "es/merge_best_reward": best_reward}
        return metrics, {"coefficients": best.tolist()}

    def chain_header(self) -> dict:
        """The merge settings and the merged models: where they were, and the SHA-256 of their weights (replay
        refuses other ones)."""
        return {"kind": self.name, "density": self.density, "seed": self.seed, "models": self.models}

    @staticmethod
    def check_chain_header(header: dict, parameters: list[str]) -> str | None:
        models = header.get("models")
        listed = isinstance(models, list) and models and all(isinstance(model, dict) for model in models)
        if not listed or not all(isinstance(m.get("path"), str) and isinstance(m.get("sha256"), str) for m in models):
            return "header.space.models must list the merged models, each with its path and sha256"
        density, seed = header.get("density"), header.get("seed")
        if type(density) not in (int, float) or not 0 < density <= 1:
            return "header.space.density must be a number in (0, 1]"
        return None if type(seed) is int else "header.space.seed must be an integer"

    @staticmethod
    def replayer(header: dict, weights, load_model):
        """θ of a step is the merge of the chain's base (the weights held now) with the recorded coefficients."""
        tuned = {}
        for entry in header["models"]:
            named = dict(load_model(entry["path"]).named_parameters())
            if weights_hash(named) != entry["sha256"]:
                raise ValueError(f"merge model {entry['path']!r} is not the one the run merged (its weights differ)")
            tuned[entry["path"]] = named
        space = MergeSpace(weights, tuned, header["density"], seed=header["seed"])

        def replay(update: dict) -> None:
            coefficients = torch.tensor(update["coefficients"], dtype=torch.float64)
            weights.write(space.merged(coefficients), member=False)

        return replay

    def save_state(self, folder: str) -> None:
        with open(os.path.join(folder, self.STATE_FILE), "w", encoding="utf-8") as file:
            json.dump(self.search.state_dict(), file)

    def load_state(self, folder: str) -> None:
        path = os.path.join(folder, self.STATE_FILE)
        if not os.path.isfile(path) and os.path.isfile(os.path.join(folder, self.PICKLED_STATE_FILE)):
            raise ValueError(
                f"{folder} holds the Hyper-ES search as {self.PICKLED_STATE_FILE}, a pickle written by an older "
                "trl-es, which is not loaded (unpickling can run any code): restart the search from the "
                "checkpoint's weights with resume_from_checkpoint=None and model=<the checkpoint>"
            )
        self.search.load_state_dict(read_state(path, "Hyper-ES search"))
