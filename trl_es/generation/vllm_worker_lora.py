"""The ES worker's LoRA slots (`trl_es.generation.vllm_worker`): low-rank members written into pinned placeholder
adapters (`es_lowrank_init`, `es_lowrank_members`), and adapter mode, where θ is a LoRA adapter's weights and members
go into slots 1.. (`es_adapter_init`, `es_adapter_members`). A mixin of `ESWorkerExtension`, which provides the
shared `_es_load`, `_es_keep_cpu_weights`, `_es_known` and `_es_fingerprint_theta`."""

from __future__ import annotations

import math

import torch

from ..es.lowrank import lowrank_factors
from ..es.weights import LocalWeights
from .vllm_payload import parse_payload
from .vllm_shards import factor_rows, shard_region
from .vllm_worker_state import AdapterState


class LoRASlots:
    """`ESWorkerExtension`'s LoRA-slot calls (module docstring)."""

    def _es_register_slots(self, slots: int, rank: int) -> tuple[list[int], list[int]] | str:
        """Register `slots` pinned zero LoRA adapters of rank `rank` (module docstring); their LoRA ids and their slot
        indices, in id order, or an error."""
        from vllm.lora.request import LoRARequest

        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            return "this vLLM engine runs without LoRA (enable_lora)"
        adapters = manager._adapter_manager
        if slots > adapters.lora_slots:
            return f"{slots} members per call, and the engine has {adapters.lora_slots} LoRA slots"
        ids = list(range(1, slots + 1))
        for lora_id in ids:
            manager.add_dummy_lora(LoRARequest(f"es-member-{lora_id}", lora_id, "es-member"), rank)
            manager.pin_adapter(lora_id)
            adapters.activate_adapter(lora_id)
        return ids, [adapters.lora_index_to_id.index(lora_id) for lora_id in ids]

    def _es_lora_slices(self, module_name: str, shape: tuple[int, int], rank: int):
        """vLLM's stacked LoRA tensors (A: (slots, 1, rank, in), B: (slots, 1, out, rank)) of the HF linear
        `module_name` of weight shape `shape` (a fused layer's slice: q_proj of qkv_proj) and, under tensor
        parallelism, the region of the weight they adapt on this rank (`shard_region`: B's rows of a column-parallel
        layer's, A's columns of a row-parallel one's); or an error."""
        adapters = self.model_runner.lora_manager._adapter_manager
        fused = {
            part: (whole, i)
            for whole, parts in adapters.packed_modules_mapping.items()
            for i, part in enumerate(parts)
        }
        prefix, _, part = module_name.rpartition(".")
        whole, index = fused.get(part, (part, 0))
        layer = adapters.modules.get(f"{prefix}.{whole}")
        if layer is None or not hasattr(layer, "lora_a_stacked") or index >= len(layer.lora_a_stacked):
            return f"vLLM has no LoRA layer for {module_name!r}"
        a, b = layer.lora_a_stacked[index], layer.lora_b_stacked[index]
        held = (b.shape[2], a.shape[3])
        region = shard_region(getattr(layer, "base_layer", layer), shape, held)
        if (region.held_shape if region else shape) != held or a.shape[2] < rank:
            return f"vLLM's LoRA layer for {module_name!r} is {held}, the weight {shape}"
        return a, b, region

    def es_lowrank_init(self, payload: str) -> dict:
        """Register `slots` pinned zero adapters of rank `rank` and find, for each of `names` (the trainer's
        nn.Linear weights), the adapter tensors of its layer: {"adapter_ids"} (LoRA ids, slot order), or {"error"}
        when the engine has no LoRA or a name has no adapter slice of its shape."""
        args = parse_payload(payload, "slots", "rank", "names")
        registered = self._es_register_slots(args["slots"], args["rank"])
        if isinstance(registered, str):
            return {"error": registered}
        state = self._es
        (ids, state.slots), state.lowrank, state.rank = registered, {}, args["rank"]
        for name in args["names"]:
            region = state.weights.regions.get(name)
            shape = region.shape if region else tuple(state.weights.params[name].shape)
            found = self._es_lora_slices(name.rpartition(".")[0], shape, args["rank"])
            if isinstance(found, str):
                return {"error": found}
            state.lowrank[name] = found
        return {"adapter_ids": ids}

    def es_adapter_init(
        self, payload: str, adapter: list[tuple[str, torch.Tensor]], base: list[tuple[str, torch.Tensor]] | None = None
    ) -> dict:
        """Adapter mode (ES trains a LoRA adapter): load the base's weights `base` (the trainer's, by the base model's
        names; None: the base stays as vLLM loaded it from its files), take the adapter's θ (`adapter`, the
        trainer's tensors by name), register `slots` pinned adapters of rank `rank` and find each LoRA pair's
        stacked tensors. `modules`: [[HF linear module, A's name, B's name, scaling], ...]. Slot 0 holds θ (what
        generation outside a members call goes through: `es_adapter_members`). {"fingerprint" of θ, "adapter_ids"}
        or {"error"}."""
        args = parse_payload(payload, "seed", "noise_table_size", "names", "slots", "rank", "modules")
        tensors = dict(adapter)
        missing = sorted(set(args["names"]) - set(tensors))
        if missing:
            return {"error": f"the adapter has no weights named {missing[:3]}"}
        model = self.model_runner.model
        device = next(model.parameters()).device
        repacked = device.type == "cpu"
        if base is not None:  # before the slots: vLLM drops every adapter when it reloads weights
            if repacked:
                self._es_keep_cpu_weights(model)
            self._es_load(base, repacked)
        working = {name: tensor.detach().to(device, copy=True).contiguous() for name, tensor in tensors.items()}
        registered = self._es_register_slots(args["slots"] + 1, args["rank"])
        if isinstance(registered, str):
            return {"error": registered}
        ids, slots = registered
        pairs = []
        for module, a_name, b_name, scaling in args["modules"]:
            rank, fan_in = working[a_name].shape
            found = self._es_lora_slices(module, (working[b_name].shape[0], fan_in), rank)
            if isinstance(found, str):
                return {"error": found}
            pairs.append((a_name, b_name, scaling, *found))
        weights = LocalWeights(working, args["seed"], args["noise_table_size"], storage_device="cpu")
        weights.capture()  # the adapter's weights outside `names` (es_parameter_patterns) stay as they are
        self._es = AdapterState(weights, list(args["names"]), repacked, slots, pairs)
        self._es_write_adapter(slots[0])
        return {"fingerprint": self._es_fingerprint_theta(), "adapter_ids": ids}

    @torch.no_grad()
    def _es_write_adapter(self, slot: int) -> None:
        """LoRA slot `slot` ← the adapter the worker's tensors hold now: A, and B times its scaling (vLLM folds the
        scaling into B as it does when it loads an adapter), cast to vLLM's dtype; ranks beyond the adapter's zero."""
        params = self._es.weights.params
        for a_name, b_name, scaling, a_stacked, b_stacked, region in self._es.pairs:
            a, b = params[a_name], params[b_name] * scaling
            if region is not None:  # this rank's rows of B (column-parallel), columns of A (row-parallel)
                a, b = factor_rows(a.T, region.ranges[1]).T, factor_rows(b, region.ranges[0])
            a_stacked[slot].zero_()
            b_stacked[slot].zero_()
            a_stacked[slot, 0, : len(a)].copy_(a)
            b_stacked[slot, 0, :, : len(a)].copy_(b)

    def es_adapter_members(self, payload: str) -> dict:
        """Adapter mode: slot k+1 ← member k of `members` ([[seed, scale], ...]: θ + scale·ε over `member_names[k]`,
        default every adapter weight; scale 0: θ, the centre), slot 0 ← θ. The worker's tensors hold θ again after."""
        args = parse_payload(payload, "members")
        members, names = args["members"], args.get("member_names") or [None] * len(args["members"])
        if len(members) >= len(self._es.slots) or len(names) != len(members):
            raise ValueError(f"{len(members)} members for {len(self._es.slots) - 1} adapter slots")
        weights = self._es.weights
        for k, ((seed, scale), member_names) in enumerate(zip(members, names, strict=True)):
            if scale == 0:
                weights.center()
            else:
                weights.member(seed, scale, self._es_known(member_names))
            self._es_write_adapter(self._es.slots[k + 1])
        weights.center()
        self._es_write_adapter(self._es.slots[0])
        return {"members": len(members)}

    @torch.no_grad()
    def es_lowrank_members(self, payload: str) -> dict:
        """Write member k of `members` ([[seed, scale], ...], scale = σ·sign; 0 writes zeros: the centre) into adapter
        slot k for every low-rank name; the slots after the last member are zeroed (no members: all of them)."""
        args = parse_payload(payload, "members")
        if len(args["members"]) > len(self._es.slots):
            raise ValueError(f"{len(args['members'])} members for {len(self._es.slots)} adapter slots")
        rank = self._es.rank
        for name, (a_stacked, b_stacked, region) in self._es.lowrank.items():
            shape = region.shape if region else tuple(self._es.weights.params[name].shape)
            for k, slot in enumerate(self._es.slots):
                seed, scale = args["members"][k] if k < len(args["members"]) else (0, 0.0)
                if scale == 0:
                    a_stacked[slot].zero_()
                    b_stacked[slot].zero_()
                    continue
                a, b = lowrank_factors(seed, name, shape, rank, device=a_stacked.device)
                if region is not None:  # A's rows of the shard's rows (column-parallel), B's of its columns (row-)
                    a, b = factor_rows(a, region.ranges[0]), factor_rows(b, region.ranges[1])
                a_stacked[slot, 0, :rank].copy_(b.T)
                b_stacked[slot, 0, :, :rank].copy_(a * (scale / math.sqrt(rank)))
        return {"members": len(args["members"])}
