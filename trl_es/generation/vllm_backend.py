"""vLLM generation: members are evaluated by a vLLM engine (`trl_es.generation.vllm_engine`) that rebuilds their
weights from seeds.

`use_vllm=True` with `vllm_mode="colocate"` starts an in-process `vllm.LLM` as TRL's GRPOTrainer does; with
`vllm_mode="server"` the trainer talks to `trl-es vllm-serve` (vLLM's own `vllm serve` with the ES worker
extension). Either way only seeds and scalars travel per member, never weights (`trl_es.generation.vllm_worker`
does the perturbing inside vLLM's workers). Two objects share the engine: `VLLMGeneration` generates through it,
`VLLMWeights` (the weights backend) writes the members into its workers.

Sampling follows the trainer's `GenerationConfig` (greedy when `do_sample=False`); every completion is its own
request with its own seed (`trl_es.es.seeds.completion_seed`), so common random numbers hold as on the transformers
path. The sampled completions are not the same tokens as `generate` would sample.

Low-rank members (`es_search_space="lowrank"`, colocate mode) are LoRA adapters of the engine, one slot per member
of a call (`VLLMWeights.lowrank_members`), so one `generate` carries the whole population. So are the members of a
LoRA adapter ES trains (`peft_config`, `es_adapter_only`; `VLLMWeights.members`): the engine holds the adapter's
base, slot 0 the adapter's θ, slots 1.. the step's members.
"""

from __future__ import annotations

import contextlib
import warnings

from transformers import GenerationConfig

from ..es.noise import Region
from ..es.weights import LocalWeights, weights_hash
from .base import Generation
from .vllm_engine import Colocated, Servers
from .vllm_plan import EnginePlan, base_weights


def sampling_settings(generation_config: GenerationConfig, eos_token_ids: list[int], extra: dict) -> dict:
    """vLLM `SamplingParams` fields equivalent to the trainer's `GenerationConfig`, plus `extra` (keys of
    `generation_kwargs` that GenerationConfig does not know, passed to SamplingParams as in TRL's vLLM mode)."""
    config = generation_config
    return {
        "temperature": config.temperature if config.do_sample else 0.0,
        "top_p": config.top_p if config.top_p is not None else 1.0,
        "top_k": config.top_k or 0,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": config.repetition_penalty or 1.0,
        "max_tokens": config.max_new_tokens,
        "min_tokens": config.min_new_tokens or 0,
        "stop_token_ids": list(eos_token_ids),
        **extra,
    }


class VLLMGeneration(Generation):
    """Generation through a vLLM engine; tokenization and the completions' form are `Generation`'s. vLLM returns no
    full next-token distribution, so no token entropy. Inside `VLLMWeights.lowrank_members`, each row goes through
    its member's adapter (`route`)."""

    def __init__(
        self, engine, model, tokenizer, generation_config, eos_token_ids, chat_template_kwargs, generation_kwargs=None
    ):
        """`generation_kwargs`: ESConfig's; the keys GenerationConfig does not know go to vLLM's SamplingParams."""
        super().__init__(model, tokenizer, generation_config, eos_token_ids, chat_template_kwargs)
        known = set(GenerationConfig().to_dict())
        extra = {k: v for k, v in (generation_kwargs or {}).items() if k not in known}
        self.settings = sampling_settings(generation_config, eos_token_ids, extra)
        self.engine = engine
        self.row_adapters: list[int] | int | None = None  # `route`
        self.default_adapter: int | None = None  # `use_default_adapter`

    def route(self, targets: list[int] | int | None) -> None:
        """The LoRA adapter (or server) each row of the next generate calls goes through: row b through
        `targets[b]`, every row through `targets` when it is one id, or none chosen (None): the default adapter."""
        self.row_adapters = targets

    def use_default_adapter(self, adapter: int) -> None:
        """The LoRA adapter every call goes through outside a members' `route` (an adapter run's θ, in slot 0)."""
        self.default_adapter = adapter

    @property
    def max_model_length(self) -> int | None:
        """vLLM's `max_model_len` in colocate mode; the model's context for a server."""
        if isinstance(self.engine, Colocated):
            return self.engine.llm.llm_engine.model_config.max_model_len
        return super().max_model_length

    def generate_ids(self, rows, seeds, record_entropy=False, max_new_tokens=None, images=None):
        """One completion per row, as the transformers backend's `generate_ids`: each row is its own request, sampled
        with its own seed (vLLM keeps a generator per seeded request), so its tokens never depend on which rows share
        the call; `images[r]`, row r's images (colocate mode: `collapse_images`). No token entropy."""
        if record_entropy:
            raise ValueError(
                "token entropy needs the full next-token distribution, which vLLM does not return: "
                "use_vllm=False for log_completion_entropy and eval entropy"
            )
        self.check_images(images)
        if len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} sampling seeds for {len(rows)} rows")
        settings = self.settings if max_new_tokens is None else {**self.settings, "max_tokens": max_new_tokens}
        greedy = settings["temperature"] == 0
        row_settings = [settings if greedy else {**settings, "seed": seed} for seed in seeds]
        adapters = self.row_adapters if self.row_adapters is not None else self.default_adapter
        if images and any(images):
            placeholders = [
                self.collapse_images(row, row_images) for row, row_images in zip(rows, images, strict=True)
            ]
            outputs = self.engine.generate(placeholders, row_settings, images=images, expanded=rows)
        elif adapters is None:
            outputs = self.engine.generate(rows, row_settings)
        else:  # inside a members' context: each row through its member's adapter (an adapter's θ: slot 0)
            adapters = [adapters] * len(rows) if isinstance(adapters, int) else adapters
            if len(adapters) != len(rows):
                raise ValueError(f"the members route {len(adapters)} rows, the call has {len(rows)}")
            outputs = self.engine.generate(rows, row_settings, adapters)
        return [ids for ids, _ in outputs], [reason == "length" for _, reason in outputs], None

    def collapse_images(self, row: list[int], images: list) -> list[int]:
        """`row` with each image's tokens (the processor's expansion of its image token, in order) back to the one
        image token vLLM expands itself: vLLM takes token prompts with their images unexpanded."""
        processor, collapsed, start = self.processor, list(row), 0
        token = processor.image_token_id
        for index, image in enumerate(images):
            span = processor(text=processor.image_token, images=[image], add_special_tokens=False)["input_ids"][0]
            at = next((i for i in range(start, len(collapsed) - len(span) + 1) if collapsed[i : i + len(span)] == span),
                      None)  # fmt: skip
            if at is None:
                raise ValueError(f"a prompt's ids do not hold the processor's tokens for its image {index}")
            collapsed[at : at + len(span)] = [token]
            start = at + 1
        return collapsed


class VLLMWeights:
    """The weights backend (`trl_es.es.weights`) of vLLM generation: members are built inside vLLM's workers from
    their seeds; the trainer's own tensors (`local`) stay at θ and take the same updates, checked against vLLM's by
    the update's norm. vLLM receives θ at `start`, from the trainer's tensors or, when resuming a served run, from
    the checkpoint's files. Satisfies `AdapterWeights`: low-rank members as the engine's LoRA adapters."""

    def __init__(self, local: LocalWeights, generation: VLLMGeneration, args, plan: EnginePlan):
        self.local, self.generation, self.params = local, generation, local.params
        self.engine = generation.engine
        self.started, self.checkpoint = False, None
        self.member_names: set[str] = set()  # the names vLLM holds a member's values in (`member`, `center`)
        self.lowrank_names, self.lowrank_rank = plan.lowrank_targets, args.lowrank_rank
        # an adapter's members: LoRA slots 1.. (the population and the centre, in one call), its θ in slot 0
        self.adapter, self.adapter_slots, self.adapter_ids = plan.adapter, plan.lora_slots, []
        self.base_from_files = plan.base_from_files
        # several full-ES members in one call: an adapter's in LoRA slots 1.., or one member per server
        self.batches_members = self.adapter is not None or isinstance(self.engine, Servers)
        self.member_slots = len(self.engine.servers) if isinstance(self.engine, Servers) else self.adapter_slots

    def start(self) -> None:
        """Give vLLM θ (colocate: the trainer's tensors; server: the files of the checkpoint when resuming, else of
        the served model), checked bitwise against the trainer's θ, and the run's noise table."""
        if self.started:
            return
        local, model = self.local, self.generation.model
        dtype = next(iter(local.params.values())).dtype  # θ's: vLLM's own dtype may be narrower (bf16)
        payload = {
            "seed": local.seed,
            "noise_table_size": local.table_size,
            "dtype": str(dtype).removeprefix("torch."),
            "names": list(local.params),
            "path": self.checkpoint,
        }
        if self.adapter is not None:
            self._start_adapter(payload)
            return
        if not isinstance(self.engine, Colocated):  # a server reads θ from its files
            results = self.engine.rpc("es_init", payload)
        else:
            results = self.engine.rpc("es_init", payload, [(n, p.detach()) for n, p in model.named_parameters()])
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise ValueError(f"vLLM cannot hold this model's ES parameters: {errors[0]}")
        self.regions = [{n: Region.from_json(r) for n, r in result["regions"].items()} for result in results]
        self.members_in_place = all(r.get("in_place") for r in results)
        if not self.members_in_place:
            warnings.warn(
                "vLLM's weights cannot be written in place for this model or parallel layout: each member is copied "
                "in through vLLM's loader (on CPU a whole-model reload, ~1 s per 135M parameters)",
                stacklevel=2,
            )
        if self.lowrank_names is not None:
            payload = {"slots": self.adapter_slots, "rank": self.lowrank_rank, "names": self.lowrank_names}
            answers = self.engine.rpc("es_lowrank_init", payload)
            errors = [r["error"] for r in answers if "error" in r]
            if errors:
                raise ValueError(f"vLLM cannot hold the low-rank members as LoRA adapters: {errors[0]}")
            self.adapter_ids = answers[0]["adapter_ids"]
        if self.fingerprints([r["fingerprint"] for r in results]) is not None:
            served = getattr(self.engine, "model", None)
            raise ValueError(
                f"vLLM ({getattr(self.engine, 'url', 'in process')}) serves {served!r}, whose weights differ from "
                f"the trainer's model ({model.name_or_path!r}): serve the trainer's starting model"
            )
        self.started = True

    def _start_adapter(self, payload: dict) -> None:
        """Adapter mode: vLLM's workers take the trainer's base weights (a base changed in memory, e.g. with an
        adapter merged into it, is the one vLLM evaluates; a quantized base is quantized by vLLM from its files,
        `start_engine`), the adapter's θ (the trainer's tensors, every LoRA A/B weight) and its LoRA slots;
        generation goes through slot 0 (θ) from then on."""
        model = self.generation.model
        names = {name for _, a, b, _ in self.adapter for name in (a, b)}
        tensors = [(n, p.detach()) for n, p in model.named_parameters() if n in names]
        rank = max(int(p.shape[0]) for n, p in tensors if ".lora_A." in n)
        payload = {k: payload[k] for k in ("seed", "noise_table_size", "names")}
        payload |= {"slots": self.adapter_slots, "rank": rank, "modules": self.adapter}
        base = None if self.base_from_files else base_weights(model)
        results = self.engine.rpc("es_adapter_init", payload, tensors, base)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise ValueError(f"vLLM cannot hold this adapter's members: {errors[0]}")
        if any(r["fingerprint"] != self.local.fingerprint() for r in results):
            raise RuntimeError("vLLM's copy of the adapter differs from the trainer's")
        self.adapter_ids, self.members_in_place = results[0]["adapter_ids"], True
        self.generation.use_default_adapter(self.adapter_ids[0])
        self.started = True

    def loaded(self, checkpoint: str) -> None:
        """The trainer's weights were loaded from `checkpoint`: vLLM takes them at the next `start`."""
        self.started, self.checkpoint = False, checkpoint

    def release(self) -> None:
        self.local.release()

    def capture(self) -> None:
        self.local.capture()

    def _changed(self, method: str, payload: dict) -> list:
        """An rpc that changes vLLM's weights; its prefix cache (keyed by tokens, not weights) is dropped."""
        results = self.engine.rpc(method, payload)
        self.engine.reset_prefix_cache()
        return results

    def member(self, seed: int, scale: float, names: list[str] | None = None) -> set[str]:
        self._changed("es_perturb", {"seed": seed, "scale": scale, "names": names})
        written, self.member_names = self.member_names | set(names or self.params), set(names or self.params)
        return written

    def center(self) -> set[str]:
        self._changed("es_restore", {})
        written, self.member_names = self.member_names, set()
        return written

    def restore(self) -> None:
        self.local.restore()
        self.center()

    def update(self, coefficients: dict[int, float], decay: float = 0.0, names: list[str] | None = None) -> float:
        """The update on both sides; their norms must agree, and a served engine (which other clients could reach)
        must then hold the trainer's weights bitwise (fingerprints compared)."""
        norm = self.local.update(coefficients, decay, names)
        self._mirror(norm, {"coefficients": [[s, c] for s, c in coefficients.items()], "decay": decay, "names": names})
        return norm

    def lowrank_update(self, norm: float, coefficients: dict[int, float], names: list[str], rank: int) -> None:
        """vLLM takes the low-rank update the trainer's tensors took (`apply_lowrank_update`, norm `norm`)."""
        payload = {"coefficients": [[s, c] for s, c in coefficients.items()], "decay": 0.0, "names": names}
        self._mirror(norm, payload | {"rank": rank})

    def _mirror(self, norm: float, payload: dict) -> None:
        """vLLM applies the update of `payload` (`es_update`; every server), checked against the trainer's norm."""
        for result in self._changed("es_update", payload):
            if abs(result["update_norm"] - norm) > 1e-5 * max(norm, 1e-12):
                raise RuntimeError(
                    f"vLLM's update (‖Δθ‖ = {result['update_norm']}) differs from the trainer's ({norm}): its weights "
                    "no longer follow the trainer's"
                )
        if not isinstance(self.engine, Colocated) and self.fingerprints(self.engine_fingerprints()) is not None:
            raise RuntimeError(
                f"the weights served at {self.engine.url} differ from the trainer's after the update: another client "
                "changed them. Training stops; resume from the last checkpoint once the server is yours alone."
            )

    @contextlib.contextmanager
    def lowrank_members(self, members: list[tuple[int, float]]):
        """Within the context, LoRA adapter k holds member k = (seed, σ·sign; scale 0: the centre θ) over the low-rank
        weights (`trl_es.generation.vllm_worker`); yields the `Route` (`trl_es.es.space`) that says which member each
        row of the next `generate_ids` calls evaluates. The adapters are zeroed on exit."""
        if len(members) > len(self.adapter_ids):
            raise ValueError(
                f"{len(members)} members in one generate call, and vLLM was started with {len(self.adapter_ids)} "
                "adapter slots"
            )
        try:
            self._changed("es_lowrank_members", {"members": [[seed, scale] for seed, scale in members]})
            yield self._route(self.adapter_ids[: len(members)])
        finally:
            self.generation.route(None)
            self._changed("es_lowrank_members", {"members": []})

    @contextlib.contextmanager
    def members(self, members: list[tuple[int, float, list[str] | None]]):
        """Within the context, member k = (seed, σ·sign, the names it perturbs; scale 0: θ), built inside vLLM's
        workers from its seed, is in LoRA slot k+1 (adapter mode) or on server k (several servers: `Servers`);
        yields the `Route` of the next generate calls' rows, as `lowrank_members` does. The servers hold θ again
        after."""
        if len(members) > self.member_slots:
            raise ValueError(f"{len(members)} members in one generate call, and vLLM has {self.member_slots} slots")
        if isinstance(self.engine, Servers):
            yield from self._members_on_servers(members)
            return
        payload = {"members": [[seed, scale] for seed, scale, _ in members], "member_names": [n for *_, n in members]}
        self._changed("es_adapter_members", payload)
        try:
            yield self._route(self.adapter_ids[1 : len(members) + 1])
        finally:
            self.generation.route(None)

    def _members_on_servers(self, members: list[tuple[int, float, list[str] | None]]):
        """Member k written into server k (`members`), all at once; each server back to θ on exit."""
        engine = self.engine
        calls = {
            k: ("es_restore", {}) if scale == 0 else ("es_perturb", {"seed": seed, "scale": scale, "names": names})
            for k, (seed, scale, names) in enumerate(members)
        }
        try:
            engine.change_each(calls)
            yield self._route(list(range(len(members))))
        finally:
            self.generation.route(None)
            engine.change_each({k: ("es_restore", {}) for k in calls})

    def _route(self, targets: list[int]):
        """Row b of the next calls through `targets[row_members[b]]`: member m's LoRA adapter id, or its server."""

        def route(row_members) -> None:
            rows = [row_members] if isinstance(row_members, int) else list(row_members)
            if not all(0 <= m < len(targets) for m in rows):
                raise ValueError(f"row_members must lie in [0, {len(targets)}), got {sorted(set(rows))}")
            chosen = [targets[m] for m in rows]
            self.generation.route(chosen[0] if isinstance(row_members, int) else chosen)

        return route

    def fingerprint(self) -> str:
        return self.engine_fingerprints()[0]

    def engine_fingerprints(self) -> list[str]:
        """Each worker's fingerprint of the weights it holds (in colocate mode, this process's worker's)."""
        return [result["fingerprint"] for result in self.engine.rpc("es_fingerprint", {})]

    def fingerprints(self, fingerprints: list[str]) -> int | None:
        """The first worker whose `fingerprints` entry is not the trainer's θ over what that worker holds (all of θ,
        or under tensor parallelism its regions, `self.regions`); None when every one is."""
        for worker, (fingerprint, regions) in enumerate(zip(fingerprints, self.regions, strict=True)):
            held = {name: regions[name].cut(p.detach()) if name in regions else p for name, p in self.params.items()}
            if fingerprint != weights_hash(held):
                return worker
        return None
