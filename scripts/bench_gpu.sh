#!/usr/bin/env bash
# `make bench-gpu`: benchmarks/gpu.py on a machine with CUDA, with the same interpreter and
# source/wheel set-up as `make test-gpu` (scripts/test_gpu.sh): PYTHON_GPU picks the interpreter,
# wheels in .whl/ are unpacked into .gpu-site/ (no network), the packages come via PYTHONPATH.
# Without CUDA it prints one line and exits 0. Extra arguments go to benchmarks/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON_GPU:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "bench-gpu: $PY cannot import torch; set PYTHON_GPU to an interpreter with torch." >&2
  exit 2
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
exec timeout 480 "$PY" benchmarks/gpu.py "$@"
