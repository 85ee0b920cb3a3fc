#!/usr/bin/env bash
# Download, on a machine with internet, the wheels a GPU host lacks for `make test-gpu`, into .whl/
# (about 10 MB). The GPU host is assumed to have python 3.12 with torch (CUDA), transformers,
# safetensors, pytest, hypothesis, pyyaml, xxhash, numpy and packaging, and no internet. Copy the
# repository (with .whl/) there and run:
#
#     make test-gpu PYTHON_GPU=python3
#
# scripts/test_gpu.sh unpacks the wheels into .gpu-site/ (pip --no-index --target), never into the
# host's environment. Override the target with PY_VERSION / PLATFORM for another host.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl
dl() {  # dl PLATFORM NAME==VERSION...
  local platform="$1"; shift
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform "$platform" -d .whl "$@"
}
# megatron-core ships manylinux_2_28 wheels (a small C++ helper); its own deps (torch, numpy,
# packaging) are on the host. zstandard: rl-weightsync's delta transport imports it.
dl manylinux_2_28_x86_64 megatron-core==0.16.1
dl manylinux_2_17_x86_64 zstandard==0.25.0
du -sh .whl
ls .whl
