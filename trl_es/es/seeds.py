"""Every seed of a run, derived from the run's `seed` (`ESConfig.seed`) by one stable hash.

A seed is `derive_seed(tag, *parts)`: a 63-bit blake2b hash of the parts. Python's `hash` is salted per process, so
it cannot be used: every process, and a later replay, must derive the same seeds. Each kind of randomness has its
own tag, listed here, so no two of them ever share a stream.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from `parts` (joined as text)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def member_seed(seed: int, step: int, index: int) -> int:
    """seed(t, i): the seed of noise direction `index` at ES step `step` (a `noise_step`)."""
    return derive_seed("es-member", seed, step, index)


def noise_step(step: int, noise_reuse: int) -> int:
    """The step whose noise directions ES step `step` uses: with `noise_reuse` = k, steps k·m … k·m + k − 1 all use
    those of step k·m (EGGROLL's noise reuse; k = 1: every step its own)."""
    return step - step % noise_reuse


def sampling_seed(seed: int, step: int, key: object) -> int:
    """The sampling seed of one member's completions at step `step` (`completion_seed` derives each completion's):
    `key` is the member's index, "center", or "common" (common random numbers: every member samples with the same
    seeds)."""
    return derive_seed("es-sampling", seed, step, key)


def completion_seed(call_seed: int, prompt: int, generation: int) -> int:
    """The sampling seed of one completion: generation `generation` of prompt `prompt` (its index in the step's or
    the evaluation batch's prompts) under `call_seed` (a `sampling_seed` or `eval_seed`). Each completion is sampled
    from its own generator, so its tokens never depend on which other rows share its generate call."""
    return derive_seed("es-completion", call_seed, prompt, generation)


def completion_seeds(call_seed: int, n_prompts: int, n_generations: int) -> list[int]:
    """`completion_seed` of every completion of `n_prompts` prompts × `n_generations`, in prompt-major order."""
    return [completion_seed(call_seed, k, j) for k in range(n_prompts) for j in range(n_generations)]


def environment_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """The seed an agent environment is reset under for episode (prompt, generation) of step `step`: the same for
    every member, so they all face the same episodes (common random numbers). Its `get_reward` runs under
    `environment_reward_seed` of it."""
    return derive_seed("es-environment", seed, step, prompt, generation)


def environment_reward_seed(environment: int) -> int:
    """The seed an environment's `get_reward` runs under, from the `environment_seed` its episode was reset under:
    the same for every member."""
    return derive_seed("es-environment-reward", environment)


def environment_check_seed(seed: int) -> int:
    """The seed the reproducibility check resets each environment under, at the start of a run."""
    return derive_seed("es-environment-check", seed)


def turn_seed(completion: int, turn: int) -> int:
    """The sampling seed of turn `turn` ≥ 1 of an agent episode whose first turn samples with `completion` (its
    `completion_seed`)."""
    return derive_seed("es-turn", completion, turn)


def tool_seed(completion: int, call: int) -> int:
    """The seed a tool runs under: the `call`-th tool call (counted from 1) of the episode whose first turn samples
    with `completion`; a turn's async calls run together under the seed of its last call."""
    return derive_seed("es-tool", completion, call)


def eval_seed(seed: int, step: int, first_problem: int) -> int:
    """The sampling seed of an evaluation batch whose first problem is `first_problem` (its index in the evaluation
    set), at training step `step` (0 for `trl-es eval`). Keyed by the problem, so K processes sample as one does."""
    return derive_seed("es-eval", seed, step, first_problem)


def noise_table_seed(seed: int) -> int:
    """The seed of the shared noise table's values."""
    return derive_seed("es-noise-table", seed)


def window_seed(member: int, name: str) -> int:
    """The seed of the offsets of parameter `name`'s noise windows for member seed `member`."""
    return derive_seed("es-windows", member, name)


def lowrank_seed(member: int, name: str) -> int:
    """The seed of weight `name`'s low-rank factors A, B for member seed `member`."""
    return derive_seed("es-lowrank", member, name)


def rounding_seed(member: int) -> int:
    """The seed of the uniforms that round member seed `member`'s noise to integers (QES's stochastic rounding): its
    noise windows hold ε′, and U = Φ(ε′) (`trl_es.es.qes.integer_noise`)."""
    return derive_seed("es-rounding", member)


def adapter_init_seed(seed: int) -> int:
    """The torch seed of a new PEFT adapter's initial weights (`peft_config`), so a seed chain can rebuild them."""
    return derive_seed("es-adapter-init", seed)


def partition_seed(seed: int) -> int:
    """The seed of CoPES's random partition of the parameters."""
    return derive_seed("copes", seed)


def merge_seed(seed: int, name: str) -> int:
    """The seed of DARE's random pruning of parameter `name` in a Hyper-ES merge."""
    return derive_seed("es-merge", seed, name)


def merge_search_seed(seed: int) -> int:
    """The seed of CMA-ES's sampler in Hyper-ES."""
    return derive_seed("es-merge-search", seed)


def diagnose_direction_seed(seed: int, direction: int) -> int:
    """The noise seed of direction ε_d (d = `direction`) of `trl-es diagnose` (`trl_es.research.diagnose`)."""
    return derive_seed("es-diagnose-direction", seed, direction)


def diagnose_batch_seed(seed: int, round_: int) -> int:
    """The seed of the `round_`-th permutation of the dataset's rows that `trl-es diagnose` cuts the directions'
    prompt batches from."""
    return derive_seed("es-diagnose-batch", seed, round_)


def diagnose_sampling_seed(seed: int, direction: int, key: str) -> int:
    """The sampling seed of direction d's rollouts in `trl-es diagnose`: `key` "common" (θ's, and with common
    coupling θ ± σε_d's too), "plus" or "minus" (θ + σε_d's and θ − σε_d's own, with independent coupling)."""
    return derive_seed("es-diagnose-sampling", seed, direction, key)


def bootstrap_seed(seed: int) -> int:
    """The seed of `trl-es diagnose`'s bootstrap resampling of the directions."""
    return derive_seed("es-diagnose-bootstrap", seed)
