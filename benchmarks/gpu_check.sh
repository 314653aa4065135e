#!/usr/bin/env bash
# The GPU checks in one run (benchmarks/gpu_check.py). Here, once: `bash benchmarks/gpu_check.sh download` puts the
# wheels the GPU machine lacks (TRL, datasets and theirs; the versions of this environment) and SmolLM2's tokenizer
# into .gpu/ (git-ignored). There, with .gpu carried: `bash benchmarks/gpu_check.sh` installs them and runs the
# checks, writing gpu_check.json and gpu_check.md into $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = download ]; then
  mkdir -p .gpu/wheels
  python=.venv/bin/python
  pins=$($python -m pip list --format=freeze 2>/dev/null | grep -iE '^(trl|datasets|dill|multiprocess|pyarrow)==')
  $python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels $pins
  rm -rf .gpu/tokenizer && cp -r "$($python -c 'from trl_es.util.models import smollm2_tokenizer_dir as d; print(d())')" .gpu/tokenizer
  du -sh .gpu
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 benchmarks/gpu_check.py --out "${OUT:-gpu_check_out}" "$@"
