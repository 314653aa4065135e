"""The README's Python snippet runs as pasted (on the built-in SmolLM2 and task, offline)."""

import re
import subprocess
import sys

import pytest
from helpers import REPOSITORY


README = REPOSITORY / "README.md"


@pytest.mark.slow  # the real SmolLM2-135M-Instruct, 2 ES steps
def test_the_readme_python_snippet_runs_as_pasted(tmp_path):
    use = README.read_text().split("## Use", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    process = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert process.returncode == 0, process.stderr[-3000:]
    saved = tmp_path / "outputs" / "quickstart"
    assert (saved / "model.safetensors").is_file() and (saved / "es_chain.json").is_file()
