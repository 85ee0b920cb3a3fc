#!/usr/bin/env bash
# `make test-gpu`: every `gpu`-marked test, on a machine with CUDA.
#
# PYTHON_GPU picks the interpreter (default: .venv/bin/python if present, else python3). It needs
# torch with CUDA, transformers, safetensors, pytest, hypothesis, pyyaml, xxhash; anything else the
# GPU tests import (megatron-core, zstandard, ...) may come as wheels in .whl/ (see
# scripts/gpu_wheels.sh): they are unpacked into .gpu-site/ with pip --no-index (no network), never
# into the interpreter's own environment. The repository's packages are found via PYTHONPATH and
# their entry points via the metadata scripts/gpu_site.py writes. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_GPU:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "test-gpu: $PY cannot import torch; set PYTHON_GPU to an interpreter with torch (make setup builds .venv)." >&2
  exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "test-gpu: no CUDA device (torch.cuda.is_available() is False with $PY); no GPU test was run."
  exit 0
fi
SITE="$PWD/.gpu-site"
mkdir -p "$SITE"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --upgrade \
    --target "$SITE" .whl/*.whl
fi
"$PY" scripts/gpu_site.py "$SITE"
SRC="$(printf '%s:' "$PWD"/packages/*/src "$PWD"/apps/*/src)"
export PYTHONPATH="$SITE:${SRC%:}${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m pytest -m gpu -q -p no:cacheprovider "$@"
