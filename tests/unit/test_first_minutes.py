"""What a newcomer sees first: importing trl-es prints nothing they did not ask for."""

import logging
import subprocess
import sys

import trl_es  # noqa: F401  (its import installs the filter)


KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


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
