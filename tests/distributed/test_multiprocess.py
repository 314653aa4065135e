"""K processes give the same model as one: real `accelerate launch` with 2 CPU processes (gloo), and faults.

The launch line is the one that really starts two CPU processes (checked on a 2-core machine): `--multi_gpu` with
`use_cpu=True` in the config; DeepSpeed runs from the shipped `examples/accelerate/deepspeed_zero*.yaml` with
`DS_ACCELERATOR=cpu`. Each launch costs ~20 s of start-up (imports, gloo), so a launch runs several runs of the
harness (`multiprocess_es.py`), a failing one last: the 2-process launch shared with the regression guard
(conftest.py), a killed run, its resume followed by a hung run, ZeRO-2, and ZeRO-3 followed by its resume (and
`trl-es es` resolving TRL's short name zero3).
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPOSITORY, TESTS, free_port, machine_launch, two_machines
from multiprocess_es import guard_runs, launch, rank_hashes
from transformers import AutoModelForCausalLM

from trl_es.cli import main as cli


pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
CONFIGS = REPOSITORY / "examples" / "accelerate"
EXTENSIONS = REPOSITORY / "build" / "torch_extensions"


def run_script(out_dir: Path, runs: list[dict], backend=("--multi_gpu",)):
    """The harness launched with 2 processes (DeepSpeed on CPU: its communication op is JIT-built once into build/)."""
    env = {}
    if "deepspeed" in " ".join(backend):
        env = {
            "DS_ACCELERATOR": "cpu",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(EXTENSIONS)),
        }
    return launch(out_dir, runs, backend=backend, env=env)


def results(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("rank")[1]): json.loads(p.read_text()) for p in out_dir.glob("result-rank*.json")}


def rank_weights(out_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / f"weights-rank{rank}.pt")


def assert_equal_weights(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


REWARD_METRICS = (
    "reward",
    "reward_std",
    "rewards/upper_vocab_share/mean",
    "es/center_reward",
    "es/population_reward_min",
    "es/population_reward_max",
    "es/population_reward_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "es/population_diversity",
)
EVAL_METRICS = ("eval_pass@1", "eval_reward")


def same(a: dict, b: dict, keys) -> bool:
    """Equal values under `keys`, NaN equal to NaN."""
    return all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys)


def evaluation(run: dict) -> dict:
    (entry,) = [entry for entry in run["log_history"] if "eval_pass@1" in entry]  # eval_steps=3: the last step
    return entry


def test_two_processes_give_the_one_process_weights_and_logged_rewards(model_dir, one_process, two_processes):
    # 5 members + the centre on 2 processes: 3 evaluations each (N is not a multiple of K)
    tmp_path, one_process = two_processes / "logged", one_process / "logged"
    reference, runs = results(one_process)[0], results(tmp_path)
    assert {r: run["num_processes"] for r, run in runs.items()} == {0: 2, 1: 2}
    expected = rank_weights(one_process, 0)
    start = AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight
    assert not torch.equal(expected["model.embed_tokens.weight"], start)  # training moved the weights
    for rank in (0, 1):
        assert_equal_weights(rank_weights(tmp_path, rank), expected)
    steps = [entry for entry in runs[0]["log_history"] if "reward" in entry]
    reference_steps = [entry for entry in reference["log_history"] if "reward" in entry]
    assert len(steps) == len(reference_steps) == 3
    assert len({entry["reward"] for entry in steps}) > 1  # the rewards move, so equality means something
    for entry, ref in zip(steps, reference_steps, strict=False):
        assert same(entry, ref, REWARD_METRICS)
        # ‖Δθ‖, distances and entropies are float reductions: equal up to the thread count's summation order.
        assert entry["es/update_norm"] == pytest.approx(ref["es/update_norm"], rel=1e-5)
        assert entry["completions/mean_token_entropy"] == pytest.approx(ref["completions/mean_token_entropy"], 1e-5)
    # evaluation: the processes split the eval prompts and all-reduce the sums
    assert same(evaluation(runs[0]), evaluation(reference), EVAL_METRICS)
    assert evaluation(runs[0])["eval_mean_token_entropy"] == pytest.approx(
        evaluation(reference)["eval_mean_token_entropy"], rel=1e-5
    )
    # the model is saved once, by the main process, and equals the weights of every rank
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_equal_weights(dict(saved.named_parameters()), expected)
    # its seed chain, written by the 2-process run, replays to the same weights
    from trl_es import load_chain

    replayed = load_chain(str(tmp_path)).apply(AutoModelForCausalLM.from_pretrained(model_dir))
    assert_equal_weights(dict(replayed.named_parameters()), expected)


def test_two_processes_give_the_one_process_adapter_on_an_8bit_base(one_process, two_processes):
    """QLoRA with ES: every process ends with the 1-process run's weights — the adapter it trained and the int8 base
    it never changed."""
    expected = rank_weights(one_process / "qlora", 0)
    assert results(two_processes / "qlora")[0]["num_processes"] == 2
    adapter = [name for name in expected if "lora_" in name]
    int8 = [name for name, p in expected.items() if p.dtype == torch.int8]
    assert adapter and int8
    for rank in (0, 1):
        assert_equal_weights(rank_weights(two_processes / "qlora", rank), expected)
    rewards = [e["reward"] for e in results(one_process / "qlora")[0]["log_history"] if "reward" in e]
    assert len(rewards) == 3 and len(set(rewards)) > 1  # members differ: the adapter is perturbed and moves


def test_two_processes_give_the_one_process_integers_with_qes(one_process, two_processes):
    """QES on the 8-bit model's int8 weights: each process evaluates its share of the members and applies the same
    integer update, so every process ends with the 1-process run's integers bitwise."""
    expected = rank_weights(one_process / "qes", 0)
    assert results(two_processes / "qes")[0]["num_processes"] == 2
    # the QLoRA run's base: the same 8-bit model, its integers never changed (names past peft's prefix)
    start = {n.removeprefix("base_model.model."): p for n, p in rank_weights(one_process / "qlora", 0).items()}
    int8 = [name for name, p in expected.items() if p.dtype == torch.int8]
    assert int8 and any(name in start and not torch.equal(expected[name], start[name]) for name in int8)
    for rank in (0, 1):
        assert_equal_weights(rank_weights(two_processes / "qes", rank), expected)


def test_two_processes_give_the_one_process_weights_with_bf16(one_process, two_processes):
    """Members computed in bfloat16 (bf16=True), θ in float32: 2 processes end with the 1-process run's weights."""
    expected = rank_weights(one_process / "bf16", 0)
    assert all(p.dtype == torch.float32 for p in expected.values())
    assert any(not torch.equal(p, rank_weights(one_process / "logged", 0)[n]) for n, p in expected.items())
    for rank in (0, 1):
        assert_equal_weights(rank_weights(two_processes / "bf16", rank), expected)


def test_two_processes_give_the_one_process_vision_language_model(tiny_vlm_dir, one_process, two_processes):
    """The tiny VLM on a picture per prompt: every process reads the same rows, images included, and evaluates its
    share of the members (6 slots dealt round-robin), so both end with the 1-process run's weights and log its
    rewards and evaluation (the eval rows, with their images, split across the processes). The main process saves
    the model with its processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Processor

    expected, reference = rank_weights(one_process / "vlm", 0), results(one_process / "vlm")[0]
    start = dict(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).named_parameters())
    moved = {name for name, p in expected.items() if not torch.equal(p, start[name])}
    assert moved and all(name.startswith("model.text_model.") for name in moved)  # the language model trained
    runs = results(two_processes / "vlm")
    assert {r: run["num_processes"] for r, run in runs.items()} == {0: 2, 1: 2}
    for rank in (0, 1):
        assert_equal_weights(rank_weights(two_processes / "vlm", rank), expected)
    steps, reference_steps = ([e for e in run["log_history"] if "reward" in e] for run in (runs[0], reference))
    assert len(steps) == 3 and len({entry["reward"] for entry in steps}) > 1
    for entry, ref in zip(steps, reference_steps, strict=True):  # entropies: finite, summed in another order
        assert same(entry, ref, REWARD_METRICS)
        entropy = entry["completions/mean_token_entropy"]
        assert 0 < entropy == pytest.approx(ref["completions/mean_token_entropy"], rel=1e-5)
    evaluated, reference_evaluated = evaluation(runs[0]), evaluation(reference)
    assert same(evaluated, reference_evaluated, EVAL_METRICS)
    entropy = evaluated["eval_mean_token_entropy"]
    assert 0 < entropy == pytest.approx(reference_evaluated["eval_mean_token_entropy"], rel=1e-5)
    assert isinstance(AutoProcessor.from_pretrained(two_processes / "vlm"), Idefics3Processor)
    saved = AutoModelForImageTextToText.from_pretrained(two_processes / "vlm")
    assert_equal_weights(dict(saved.named_parameters()), expected)


def write_recipe(folder: Path, model_dir: str) -> None:
    """The reference run's settings as a `trl-es es` recipe, with the prompts as a local JSONL file."""
    (folder / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"Count to {n}:"}) for n in range(1, 9)))
    (folder / "recipe.yaml").write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: prompts.jsonl\n"
        "reward_funcs: [multiprocess_es.upper_vocab_share]\noutput_dir: cli-out\npopulation_size: 5\n"
        "es_baseline: center\nsigma: 0.01\nlearning_rate: 0.01\nper_device_train_batch_size: 4\nnum_generations: 1\n"
        "max_completion_length: 6\ngeneration_kwargs: {do_sample: false}\nmax_steps: 3\nseed: 0\n"
        "save_strategy: 'no'\nreport_to: none\nuse_cpu: true\n"
    )


def test_cli_refuses_an_unknown_accelerate_config_before_launching(tmp_path, model_dir):
    """(TRL's short names are resolved by the SLURM example's run below: `--accelerate_config zero2`.)"""
    write_recipe(tmp_path, model_dir)
    with pytest.raises(SystemExit, match="Accelerate config zero9 is neither a file"):
        cli(["es", "--config", str(tmp_path / "recipe.yaml"), "--accelerate_config", "zero9"])


def test_a_reward_error_on_one_process_stops_every_process_with_weights_restored(two_processes):
    runs = results(two_processes / "raise")  # the shared launch's last run
    assert runs[1]["error"] == "RuntimeError: reward server unreachable"
    assert "process(es) [1] failed" in runs[0]["error"]
    assert runs[0]["restored"] and runs[1]["restored"]  # θ as at the start of the failed step, bitwise


def run_on_two_machines(out_dir: Path, runs: list[dict], backend=("--multi_gpu",), env=None) -> list:
    """The harness on two "machines" of one process each: two `accelerate launch` at once with `--num_machines 2`
    and machine ranks 0 and 1 (what each machine of a cluster runs, here both on 127.0.0.1); each launcher's
    `Finished`, machine 0's first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port, script = free_port(), str(Path(__file__).with_name("multiprocess_es.py"))
    commands = [machine_launch(m, port, script, str(out_dir), json.dumps(runs), backend=backend) for m in (0, 1)]
    return two_machines(commands, [env or {}] * 2, timeout=900)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, model_dir, guard_models) -> Path:
    """Two machines of one process each: a run whose process on machine 1 kills itself at step 1 (after
    checkpoint-1); then both machines relaunched: the run resumed to its end, the regression guard's default and
    low-rank scenarios, and last a run whose process 1 hangs past ddp_timeout."""
    out = tmp_path_factory.mktemp("killed")
    save = {"save_strategy": "steps", "save_steps": 1, "ddp_timeout": 120}
    first, second = run_on_two_machines(
        out, [{"name": "killed", "model": model_dir, "overrides": save, "fault": "kill"}]
    )
    assert second.returncode != 0 and "SIGKILL" in second.stderr
    assert first.returncode != 0, first.stderr[-3000:]
    (out / "stopped_after.txt").write_text(str(first.ended - second.ended))  # machine 0 after machine 1 ended
    checkpoint = out / "killed" / "checkpoint-1"
    assert sorted(p.name for p in (out / "killed").glob("checkpoint-*")) == ["checkpoint-1"]
    AutoModelForCausalLM.from_pretrained(checkpoint)  # loadable
    runs = [
        {"name": "resumed", "model": model_dir, "overrides": {"resume_from_checkpoint": str(checkpoint)}},
        *guard_runs(guard_models, scenarios=("full", "lowrank")),
        {"name": "hung", "model": model_dir, "overrides": {"ddp_timeout": 5}, "fault": "hang"},  # process 1 sleeps
    ]
    first, second = run_on_two_machines(out, runs)
    assert first.returncode != 0 and (out / "hung" / "result-rank0.json").is_file(), first.stderr[-3000:]
    return out


def test_a_process_killed_on_one_machine_stops_the_other_naming_it_and_the_relaunch_resumes(killed, one_process):
    """Machine 1's process is killed mid-step: machine 0's process stops within seconds (not ddp_timeout), its error
    naming process 1 and its weights restored; checkpoint-1 loads, and both machines relaunched from it end on the
    1-process weights bitwise."""
    stopped = results(killed / "killed")[0]
    assert "process(es) [1] did not answer" in stopped["error"] and stopped["restored"]
    assert float((killed / "stopped_after.txt").read_text()) < 60  # ddp_timeout is 120 s
    for rank in (0, 1):
        assert_equal_weights(rank_weights(killed / "resumed", rank), rank_weights(one_process / "logged", 0))


def test_two_machines_give_the_one_process_weights(killed, one_process):
    """Two launchers as two machines (--num_machines 2, machine ranks 0 and 1): the regression guard's default and
    low-rank scenarios end on the 1-process weights bitwise, on both machines."""
    hashes = rank_hashes(killed)
    reference = json.loads((one_process / "hashes-rank0.json").read_text())
    assert hashes == {scenario: reference[scenario] for scenario in ("full", "lowrank")}


def test_a_hung_process_gives_a_timeout_error_naming_the_rank(killed):
    run = results(killed / "hung")[0]
    assert "process 0 of 2 gave up waiting" in run["error"] and "ddp_timeout=5" in run["error"]
    assert "process(es) [1] did not answer" in run["error"]
    assert run["restored"]


@pytest.mark.parametrize("stage", [3])  # ZeRO-2: over two machines, from the SLURM example (below)
def test_deepspeed_zero_two_processes_give_the_one_process_weights(tmp_path, model_dir, one_process, stage):
    zero = ("--config_file", str(CONFIGS / f"deepspeed_zero{stage}.yaml"))  # the shipped examples
    runs = [{"name": "zero", "model": model_dir, "overrides": {"save_strategy": "steps", "save_steps": 2}}]
    if stage == 3:  # then, in the same launch, resume from the checkpoint saved at step 2 under ZeRO-3
        checkpoint = str(tmp_path / "zero" / "checkpoint-2")
        runs.append({"name": "resumed", "model": model_dir, "overrides": {"resume_from_checkpoint": checkpoint}})
    result = run_script(tmp_path, runs, backend=zero)
    assert result.returncode == 0, result.stderr[-3000:]
    runs, reference = results(tmp_path / "zero"), results(one_process / "logged")[0]
    assert {r: run["zero3_partitioned"] for r, run in runs.items()} == {0: stage == 3, 1: stage == 3}
    for run in runs.values():  # no gradients, no optimizer state; ZeRO-3's engine only partitions parameters
        assert run["gradients"] == run["optimizer_state"] == 0
        assert run["engine_optimizer"] == ("DeepSpeedZeRoOffload" if stage == 3 else "NoneType")
    steps = [entry["reward"] for entry in runs[0]["log_history"] if "reward" in entry]
    assert steps == [entry["reward"] for entry in reference["log_history"] if "reward" in entry]
    assert same(evaluation(runs[0]), evaluation(reference), EVAL_METRICS)  # θ gathered under ZeRO-3
    expected = rank_weights(one_process / "logged", 0)
    for rank in (0, 1):
        assert_equal_weights(rank_weights(tmp_path / "zero", rank), expected)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "zero")  # HF names and full tensors, gathered
    assert_equal_weights(dict(saved.named_parameters()), expected)
    if stage == 3:
        assert_equal_weights(rank_weights(tmp_path / "resumed", 0), expected)


def trl_accelerate_config(name: str, folder: Path) -> Path:
    """TRL's own accelerate config `name` (trl/accelerate_configs), for 2 CPU processes without mixed precision."""
    from importlib import resources

    import yaml

    config = yaml.safe_load(resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml").read_text())
    config.update(num_processes=2, use_cpu=True, mixed_precision="no")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fsdp2_two_processes_give_the_one_process_weights(tmp_path, model_dir, one_process):
    """TRL's own fsdp2 config: ES runs FSDP's processes unwrapped, θ whole on each. The config's
    `fsdp_cpu_ram_efficient_loading` has transformers load the weights on process 0 only (zeros on the others, which
    trained silently on zeros before): ES shares process 0's weights first, so both end with the 1-process run's."""
    config = trl_accelerate_config("fsdp2", tmp_path)
    result = run_script(tmp_path, [{"name": "fsdp", "model": model_dir}], backend=("--config_file", str(config)))
    assert result.returncode == 0, result.stderr[-3000:]
    runs, reference = results(tmp_path / "fsdp"), results(one_process / "logged")[0]
    assert {r: run["num_processes"] for r, run in runs.items()} == {0: 2, 1: 2}
    steps = [entry["reward"] for entry in runs[1]["log_history"] if "reward" in entry]
    assert steps == [entry["reward"] for entry in reference["log_history"] if "reward" in entry]
    expected = rank_weights(one_process / "logged", 0)
    for rank in (0, 1):
        assert_equal_weights(rank_weights(tmp_path / "fsdp", rank), expected)


def test_the_slurm_example_runs_deepspeed_zero2_over_two_nodes(tmp_path, model_dir, one_process):
    """examples/slurm/es_node.sh, as `srun` starts it on each of 2 nodes (SLURM's variables set for node 0 and node
    1, `scontrol` answering the node list: a stand-in for the SLURM controller, which this host has not), with
    TRL's `zero2` short name (`trl-es es --accelerate_config zero2`: DeepSpeed ZeRO-2 through Accelerate's
    multi-node DeepSpeed launcher): the recipe ends on the 1-process weights bitwise."""
    write_recipe(tmp_path, model_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[1-2]" ] && printf "127.0.0.1\\nlocalhost\\n"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    node = {
        "PATH": os.pathsep.join((str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"])),
        "PYTHONPATH": os.pathsep.join(map(str, (TESTS, Path(__file__).parent, REPOSITORY))),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "PROCESSES_PER_NODE": "1",
        "MAIN_PORT": str(free_port()),
        "RECIPE": str(tmp_path / "recipe.yaml"),
        "ACCELERATE_CONFIG": "zero2",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(EXTENSIONS)),
    }
    script = ["bash", str(REPOSITORY / "examples" / "slurm" / "es_node.sh"), "--mixed_precision", "no"]  # TRL's: bf16
    nodes = two_machines([script, script], [{**node, "SLURM_NODEID": str(n)} for n in (0, 1)], cwd=tmp_path)
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr[-3000:] + nodes[1].stderr[-3000:]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "cli-out")
    assert_equal_weights(dict(saved.named_parameters()), rank_weights(one_process / "logged", 0))
