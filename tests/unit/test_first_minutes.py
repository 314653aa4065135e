"""What a newcomer sees first: importing trl-es prints nothing they did not ask for."""

import logging
import subprocess
import sys

import pytest

import trl_es  # noqa: F401  (its import installs the filter)


KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


@pytest.mark.slow  # launches a Python process (~15 s of imports)
def test_importing_trl_es_prints_nothing():
    """bitsandbytes (imported by peft, which transformers' Trainer imports when it is installed) printed its
    kernels-community line at the top of `make demo` and of `from trl_es import ESTrainer`."""
    code = "import trl_es; from trl_es import ESConfig, ESTrainer; import trl_es.commands.demo"
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0 and (process.stdout, process.stderr) == ("", ""), process.stderr[-3000:]


def test_only_the_kernels_notice_of_bitsandbytes_is_silenced(caplog):
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning(KERNELS_NOTICE + ": %s. Please make sure you already `pip install kernels`", "No module named")
        logger.warning("another bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["another bitsandbytes warning"]


@pytest.mark.slow  # launches pip
def test_a_built_wheel_carries_every_file_of_the_package(tmp_path):
    """Until a release exists, trl-es installs from a clone or a wheel built from it: every file under trl_es/ (the
    modules, the sandbox's launcher) must be in that wheel. Built from a copy, so the work tree gets no build/."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, tmp_path / name)
    shutil.copytree(root / "trl_es", tmp_path / "trl_es", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", "dist"]
    process = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("trl_es-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    files = {path.relative_to(tmp_path).as_posix() for path in (tmp_path / "trl_es").rglob("*") if path.is_file()}
    assert files and files <= shipped, sorted(files - shipped)
    assert "trl_es/rewards/_sandbox_launcher.py" in shipped and not any(n.startswith("tests/") for n in shipped)


def test_the_demo_says_once_why_a_step_can_leave_the_weights_unchanged(capsys):
    """Half the demo's steps printed "no spread: weights unchanged" (every member scored 0) with no word of why."""
    from trl_es.commands.demo import PrintReward

    printer = PrintReward()
    logs = {"reward": 0.0, "es/population_reward_min": 0.0, "es/population_reward_max": 0.0, "es/time/generate": 9.0,
            "es/time/noise": 0.1, "es/time/update": 0.1}  # fmt: skip
    for step, skipped in enumerate((0, 1, 1), start=1):
        state = type("State", (), {"global_step": step})
        printer.on_log(None, state, None, logs={**logs, "es/skipped_update": skipped})
    lines = capsys.readouterr().out.splitlines()
    assert [line[:8] for line in lines] == ["step   1", "step   2", "  every ", "step   3"]
    assert lines[1].endswith("(no spread: weights unchanged)") and lines[3].endswith("(no spread: weights unchanged)")
    assert lines[2] == (
        "  every member scored the same, so none ranks above another and ES leaves the weights as they were: early "
        "on the model gets few sums right, so steps stay flat until a member answers a sum the others miss"
    )


@pytest.mark.parametrize("count", ["0", "65"])
def test_the_demo_refuses_a_held_out_count_it_does_not_have(capsys, count):
    from trl_es.commands.demo import main

    with pytest.raises(SystemExit):
        main(["--held-out", count])
    assert f"--held-out must be 1..64 problems, got {count}" in capsys.readouterr().err


@pytest.mark.slow  # the real SmolLM2-135M-Instruct: one short ES step
def test_the_demo_starts_with_what_it_measures(tmp_path):
    """`make demo` opened with bitsandbytes' kernels-community line and DeepSpeed's "Setting accelerator to CPU" (DeepSpeed,
    which `make demo` installs for the tests, is imported by accelerate in every Trainer; the demo never uses it)."""
    command = [sys.executable, "-m", "trl_es.cli", "demo", "--steps", "1", "--population", "2", "--held-out", "4",
               "--output-dir", str(tmp_path / "demo")]  # fmt: skip
    process = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.startswith("held-out accuracy before ES: "), process.stdout[:1000]
    assert KERNELS_NOTICE not in process.stderr and "Setting accelerator" not in process.stderr + process.stdout
