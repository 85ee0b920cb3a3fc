#!/usr/bin/env bash
# Install SGLang into its own cached virtual environment and build the CPU stub driver library.
#
#   packages/rl-sglang/scripts/setup_sglang_env.sh        # idempotent; ~1 s when cached
#
# Layout under ${RL_SGLANG_HOME:-$HOME/.cache/rl-sglang}:
#   sglang-0.5.23/              venv with sglang==0.5.23 and sglang-router==0.3.2 (its own torch pin)
#   sglang-0.5.23/.rl-sglang-complete   written last, after a successful install and import check
#   cudastub/libcuda.so.1       built from src/rl_sglang/cudastub.c with the system gcc
#   install.log                 pip output of the last install
# Versions: every package of the venv is installed at the version recorded in
# sglang-constraints.txt beside this script (a fresh machine gets what CI tested); `make
# sglang-lock` re-resolves and records them on purpose (RL_SGLANG_UNLOCKED=1 skips the file).
# Environment: RL_SGLANG_HOME (cache root), RL_SGLANG_BASE_PYTHON (interpreter for the venv).
set -euo pipefail

SGLANG_VERSION=0.5.23
ROUTER_VERSION=0.3.2
HOME_DIR="${RL_SGLANG_HOME:-$HOME/.cache/rl-sglang}"
VENV="$HOME_DIR/sglang-$SGLANG_VERSION"
MARKER="$VENV/.rl-sglang-complete"
STUB_DIR="$HOME_DIR/cudastub"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STUB_SRC="$HERE/../src/rl_sglang/cudastub.c"
LOG="$HOME_DIR/install.log"
CONSTRAINTS=(-c "$HERE/sglang-constraints.txt")
[[ "${RL_SGLANG_UNLOCKED:-0}" == 1 ]] && CONSTRAINTS=()

mkdir -p "$HOME_DIR" "$STUB_DIR"
exec 9>"$HOME_DIR/.setup.lock"
flock 9   # one installer at a time (parallel test sessions, make targets)

# 1. The stub libcuda.so.1 (rebuilt when the source is newer than the library).
if [[ ! -f "$STUB_DIR/libcuda.so.1" || "$STUB_SRC" -nt "$STUB_DIR/libcuda.so.1" ]]; then
  if ! command -v gcc >/dev/null; then
    echo "setup_sglang_env: gcc not found; install a C compiler (apt-get install gcc)" >&2
    exit 1
  fi
  gcc -shared -fPIC -O2 -o "$STUB_DIR/libcuda.so.1.tmp" "$STUB_SRC"
  mv -f "$STUB_DIR/libcuda.so.1.tmp" "$STUB_DIR/libcuda.so.1"
fi

# 2. The SGLang venv.
if [[ -f "$MARKER" ]]; then
  exit 0
fi
BASE_PY="${RL_SGLANG_BASE_PYTHON:-$(command -v python3.11 || command -v python3)}"
echo "setup_sglang_env: installing sglang==$SGLANG_VERSION into $VENV (about 15 min, 11 GB; log: $LOG)" >&2
{
  [[ -x "$VENV/bin/python" ]] || "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip==26.3
  "$VENV/bin/python" -m pip install -q "${CONSTRAINTS[@]}" "sglang==$SGLANG_VERSION" "sglang-router==$ROUTER_VERSION"
  # Import check of the packages the generator launches.
  LD_LIBRARY_PATH="$STUB_DIR" SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang, sglang_router"
} >"$LOG" 2>&1 || {
  echo "setup_sglang_env: install failed; last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
}
echo "sglang==$SGLANG_VERSION sglang-router==$ROUTER_VERSION $(date -u +%FT%TZ)" >"$MARKER"
