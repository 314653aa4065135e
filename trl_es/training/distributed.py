"""Several processes: who evaluates which member, the one all-reduce per step, and θ under DeepSpeed ZeRO-3.

Every process reads the same prompts and regenerates every member's noise from its seed. The step's slots (the
unperturbed centre when `es_baseline="center"`, then members 0..N−1) are dealt round-robin over the engines: with G
engines, engine g evaluates slots g, g+G, g+2G, … An engine is one process, or with a tensor-parallel vLLM engine
(`vllm_tensor_parallel_size` = T in colocate mode) the T consecutive processes that hold its shards, which evaluate
the same slots together and make the same generate calls (vLLM's external launcher runs one program on all of them).
Each evaluated slot is summarised in one row of float64 numbers (`trl_es.training.population`), which the engine's
first process contributes; the rows of all processes are summed with one all-reduce (each row has one non-zero
contributor, so the sum is exact), and every process then applies the identical update. What crosses the wire per
step: seeds never, N rows of scalars.

Under ZeRO-3, θ is partitioned across processes: a step gathers it (`full_parameters`), and after the update each
process copies its slice back into its partition (`write_shards`). ZeRO-1/2 partition optimizer state and
gradients, which ES does not have, so they run unwrapped; so does FSDP (θ whole on every process, taken from
process 0 once: `share_weights`).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate.utils import parse_flag_from_env

from ..util.compat import process_group_store


def fsdp_version() -> int | None:
    """The FSDP version Accelerate's launcher was given (`distributed_type: FSDP`), None without FSDP: read from the
    variables the launcher sets, which transformers' loading reads too."""
    if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return None
    return int(os.environ.get("FSDP_VERSION", "1"))


def check_fsdp_launch(args) -> None:
    """A ValueError, before any weights load, for an FSDP launch Accelerate cannot run on this device: FSDP1 with
    `sync_module_states` (TRL's fsdp1 config; implied by `cpu_ram_efficient_loading`) on CPU."""
    syncs = parse_flag_from_env("FSDP_SYNC_MODULE_STATES") or parse_flag_from_env("FSDP_CPU_RAM_EFFICIENT_LOADING")
    if fsdp_version() == 1 and syncs and args.device.type in ("cpu", "mps"):
        raise ValueError(
            f"FSDP1 with sync_module_states cannot run on {args.device.type} (Accelerate initializes FSDP1's "
            "parameters on an accelerator): launch with TRL's fsdp2 config (--accelerate_config fsdp2), which ES "
            "runs the same way (docs/scaling.md)"
        )


def engine_size(args) -> int:
    """Processes per generation engine: a colocated vLLM engine's tensor-parallel size, else 1 (module docstring)."""
    return args.vllm_tensor_parallel_size if args.use_vllm and args.vllm_mode == "colocate" else 1


def local_slots(n_slots: int, process_index: int, num_processes: int) -> list[int]:
    """The slots process `process_index` of `num_processes` evaluates (round-robin; none when index ≥ n_slots)."""
    return list(range(process_index, n_slots, num_processes))


LIVENESS_SECONDS = 5.0
"""How long the processes left after a failed all-reduce wait for each other to say they are alive (`unanswering`)."""


def unanswering(step: int, seconds: float = LIVENESS_SECONDS) -> list[int] | None:
    """After the all-reduce of `step` failed: the processes that do not say they are alive within `seconds`, each
    survivor writing a key of its own to the process group's store (`process_group_store`) — the lost ones, hung,
    dead or on a machine that is gone. None where the store cannot tell (it lived in process 0, or torch has none)."""
    store = process_group_store()
    if store is None:
        return None
    prefix, deadline = f"trl-es/alive/{step}/", time.monotonic() + seconds
    try:
        store.set(f"{prefix}{dist.get_rank()}", "1")
        missing = list(range(dist.get_world_size()))
        while missing and time.monotonic() < deadline:
            missing = [rank for rank in missing if not store.check([f"{prefix}{rank}"])]
            time.sleep(0.1 if missing else 0)
    except (RuntimeError, OSError):  # the store's server (in process 0) is gone
        return None
    return missing


def all_reduce_summaries(
    summaries: torch.Tensor, failed: bool, device: torch.device, timeout_s: float
) -> tuple[torch.Tensor, list[int]]:
    """Sum every process's (slots, width) summaries and learn which processes failed, in one all-reduce.

    Returns the summed summaries and the indices of the processes that reported a failure. In one process this is
    the identity. Bytes exchanged per process: 8·(slots·width + K). Waiting longer than `timeout_s` raises a
    RuntimeError (given here because Trainer does not pass `ddp_timeout` to gloo process groups on CPU).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return summaries, [0] if failed else []
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = torch.zeros(world, dtype=torch.float64)
    flags[rank] = float(failed)
    packed = torch.cat([summaries.flatten(), flags]).to(device)
    dist.all_reduce(packed, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    packed = packed.cpu()
    failed_ranks = [r for r in range(world) if packed[summaries.numel() + r] != 0]
    return packed[: summaries.numel()].view_as(summaries), failed_ranks


class Processes:
    """The trainer's processes (an Accelerate `accelerator`), grouped into engines of `engine_size` processes (a
    tensor-parallel vLLM engine's; module docstring), and, under ZeRO-3, its partitioned θ."""

    def __init__(self, accelerator, zero_stage: int | None, timeout_s: float, n_slots: int, engine_size: int = 1):
        self.accelerator, self.zero_stage, self.timeout_s = accelerator, zero_stage, timeout_s
        if accelerator.num_processes % engine_size:
            raise ValueError(
                f"vllm_tensor_parallel_size ({engine_size}) must divide the number of processes "
                f"({accelerator.num_processes}): each vLLM engine spans that many processes"
            )
        self.engine, self.engines = accelerator.process_index // engine_size, accelerator.num_processes // engine_size
        self.leads_engine = accelerator.process_index % engine_size == 0
        if self.engines > n_slots:
            warnings.warn(
                f"{self.engines} engines (processes / vllm_tensor_parallel_size) for {n_slots} evaluations per step "
                f"(population and centre): {self.engines - n_slots} will only wait. Use at most {n_slots} or a larger "
                "population_size."
            )

    def slots(self, n_slots: int) -> list[int]:
        """The slots this process's engine evaluates."""
        return local_slots(n_slots, self.engine, self.engines)

    def engine_rows(self, rows: list) -> list:
        """This process's engine's share of `rows` (every `engines`-th, from its index): an evaluation's problems."""
        return rows[self.engine :: self.engines]

    def reduce(self, totals: torch.Tensor) -> torch.Tensor:
        """The sum over the engines of their `totals` (each engine's first process contributes its own)."""
        mine = totals if self.leads_engine else torch.zeros_like(totals)
        return self.accelerator.reduce(mine.to(self.accelerator.device), "sum").cpu()

    def exchange(self, summaries: torch.Tensor, error: Exception | None, step: int) -> torch.Tensor:
        """The one all-reduce of the step; raises this process's `error`, or an error naming the processes that
        failed, after every process has heard of it (so none waits for the others)."""
        accelerator = self.accelerator
        mine = summaries if self.leads_engine else torch.zeros_like(summaries)  # the engine's rows, counted once
        try:
            summaries, failed = all_reduce_summaries(mine, error is not None, accelerator.device, self.timeout_s)
        except RuntimeError as exc:  # torch.distributed timeouts and lost peers are RuntimeErrors
            lost = unanswering(step)
            if lost is None:
                who = "another process hung, died or was killed (which one is unknown: process 0's store is gone)"
            elif lost:
                who = f"process(es) {lost} did not answer (hung, died or killed, or their machine is gone)"
            else:
                who = "every process answered afterwards: one of them was slower than ddp_timeout"
            raise RuntimeError(
                f"ES step {step + 1}: process {accelerator.process_index} of {accelerator.num_processes} gave up waiting "
                f"for the other processes' rewards (ddp_timeout={self.timeout_s} s): {who}. This process's weights are "
                "restored to the start of the step; resume from the last checkpoint."
            ) from exc
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"ES step {step + 1}: process(es) {failed} failed while evaluating their members (their traceback says "
                "why); the weights are restored on every process."
            )
        return summaries

    def prepare(self, model: torch.nn.Module, model_wrapped: torch.nn.Module) -> torch.nn.Module:
        """The model as training runs it: under ZeRO-3 an inference engine (TRL's `prepare_deepspeed`, as for GRPO's
        reference model) that partitions θ, otherwise the model itself on the device. Never DistributedDataParallel,
        whose gradient buckets would cost a second copy of θ, nor a training engine, whose optimizer holds state."""
        if self.zero_stage != 3:
            model.to(self.accelerator.device)
            return model_wrapped
        if model_wrapped is not model:
            return model_wrapped
        from trl.models.utils import prepare_deepspeed

        return prepare_deepspeed(model, self.accelerator)

    def fsdp_launch(self) -> bool:
        """Whether Accelerate launched FSDP: its plugin, or its launcher's variables (`fsdp_version`)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)  # absent when Accelerate set up no FSDP
        return plugin is not None or fsdp_version() is not None

    @torch.no_grad()
    def share_weights(self, model: torch.nn.Module) -> None:
        """Every process takes process 0's parameters and buffers, as FSDP's `sync_module_states` does: with FSDP's
        `cpu_ram_efficient_loading`, transformers loads the weights on process 0 only and zeros elsewhere (quantized
        models excepted: every process loads those)."""
        if self.accelerator.num_processes == 1:
            return
        for tensor in [*model.parameters(), *model.buffers()]:
            shared = tensor.data.to(self.accelerator.device)  # NCCL sends accelerator tensors only
            dist.broadcast(shared, src=0)
            tensor.data.copy_(shared)

    def full_parameters(self, model: torch.nn.Module, model_wrapped: torch.nn.Module):
        """Context in which every process holds all of θ. Under ZeRO-3 θ is gathered: through the engine with TRL's
        `unwrap_model_for_generation` (which also lifts ZeRO-3's forward hooks), or, before the engine exists, with
        DeepSpeed's `GatheredParameters` (parameters partitioned at load by `zero.Init`). Otherwise nothing to do."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        if model_wrapped is not model:
            from trl.models.utils import unwrap_model_for_generation

            return unwrap_model_for_generation(model_wrapped, self.accelerator)
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()))

    @torch.no_grad()
    def write_shards(self, params) -> None:
        """ZeRO-3: copy this process's slice of each (gathered, changed) parameter into its partition, which is what
        remains when θ is released. DeepSpeed partitions the flattened parameter evenly by rank."""
        rank = self.accelerator.process_index
        for p in params:
            if not hasattr(p, "ds_tensor"):
                continue
            size = p.ds_tensor.numel()
            start, end = rank * size, min((rank + 1) * size, p.ds_numel)
            if end > start:
                p.ds_tensor.data[: end - start].copy_(p.data.view(-1)[start:end])
