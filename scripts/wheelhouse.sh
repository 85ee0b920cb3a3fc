#!/usr/bin/env bash
# Run `make setup`'s pip installs through a cached wheelhouse, so that a fresh clone downloads
# nothing once the same requirement set was installed on this machine before.
#
#   bash scripts/wheelhouse.sh VENV_PYTHON STEP [:: STEP]...
#
# Each STEP is the argument list of one `pip install` (requirements and options, e.g.
# `-c constraints.txt --no-build-isolation torch -e "packages/rl-core[test]"`); the steps run in
# order, each as `VENV_PYTHON -m pip install -q STEP`, plus where its wheels come from:
#   warm  a complete wheelhouse for this key exists: --no-index --find-links <wheelhouse> (pip's
#         configured find-links, e.g. /opt/wheels, stay usable); nothing is downloaded.
#   cold  none exists: `pip wheel` downloads every wheel of the step (and builds any sdist once)
#         into a temporary directory, the step installs from there with --no-index, and after the
#         last step the directory is published as the wheelhouse (one download, as before).
# Both give the venv the same distributions as a plain `pip install STEP`: the resolver sees the
# same requirements with the same versions, and bytecode is compiled at install as before. Should
# a warm install fail, its wheelhouse is discarded and the steps run as plain networked installs
# (one line says so); a failing cold path falls back the same way.
#
# Layout under ${RL_WHEELS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-wheels}:
#   <key>/*.whl                  the wheels of every step except the local projects (editables)
#   <key>/.rl-wheels-complete    written last, in the temporary directory before its atomic rename
#                                to <key>/: a killed run never leaves a wheelhouse that is trusted
#   .tmp.<key>.*/                a cold path in progress (a killed run's is removed after a day)
# <key>: a hash of this script, the interpreter (version, platform, libc), pip's configuration
# (its config files and the PIP_* variables that can change what is resolved), the steps'
# arguments, the content of every file they name (constraints) and the pyproject.toml /
# setup.cfg / setup.py of every local project they name. Not in it: the index's later releases
# of a package no file pins (e.g. setuptools): the wheelhouse keeps the version of its first run.
# The RL_WHEELS_KEEP (default 3) most recently used wheelhouses are kept.
# Environment: RL_WHEELS=0 (plain networked installs, no cache), RL_WHEELS_HOME, RL_WHEELS_KEEP.
set -euo pipefail

if (($# < 2)); then
  echo "usage: bash scripts/wheelhouse.sh VENV_PYTHON STEP [:: STEP]..." >&2
  exit 2
fi
PY=$1
shift
STEPS=("$@")
ROOT="${RL_WHEELS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rl-wheels}"
MARK_NAME=.rl-wheels-complete
SELF="${BASH_SOURCE[0]}"

# each_step FN: FN ARGS... once per step, in order; stops at the first failure.
each_step() {
  local fn=$1 arg step=()
  for arg in "${STEPS[@]}" "::"; do
    if [[ $arg == "::" ]]; then
      if ((${#step[@]})); then "$fn" "${step[@]}" || return 1; fi
      step=()
    else
      step+=("$arg")
    fi
  done
}

plain_step() { "$PY" -m pip install -q "$@"; }

warm_step() { "$PY" -m pip install -q --no-index --find-links "$WH" "$@"; }

cold_step() {
  local arg wheel_args=()
  for arg; do # `pip wheel` takes pip install's options except these
    case $arg in -U | --upgrade) ;; *) wheel_args+=("$arg") ;; esac
  done
  "$PY" -m pip wheel -q -w "$TMP" "${wheel_args[@]}" || return 1
  drop_local_wheels "$@" || return 1
  "$PY" -m pip install -q --no-index --find-links "$TMP" "$@"
}

# The wheels `pip wheel` built from the local projects the step names (our editables): they
# are installed from their sources, never from the wheelhouse.
drop_local_wheels() {
  "$PY" - "$TMP" "$@" <<'EOF'
import pathlib, re, sys, tomllib

def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()

names = set()
for arg in sys.argv[2:]:
    pyproject = pathlib.Path(arg.split("[", 1)[0]) / "pyproject.toml"
    if pyproject.is_file():
        name = tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
        if name:
            names.add(norm(name))
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    if norm(wheel.name.split("-", 1)[0]) in names:
        wheel.unlink()
EOF
}

# Everything that decides which wheels the steps resolve to, one item per line.
key_input() {
  local arg conf path
  echo "rl-wheels 1"
  sha256sum <"$SELF"
  "$PY" -c 'import platform, sys, sysconfig; print(sys.version, sys.implementation.cache_tag, sysconfig.get_platform(), platform.libc_ver())'
  for conf in /etc/pip.conf /etc/xdg/pip/pip.conf "${XDG_CONFIG_HOME:-$HOME/.config}/pip/pip.conf" \
    "$HOME/.pip/pip.conf" "${PIP_CONFIG_FILE:-}"; do
    if [[ -n $conf && -f $conf ]]; then echo "config $conf" && cat "$conf"; fi
  done
  # PIP_* variables, less those that change only pip's output, timeouts, caches and certificates
  env | grep '^PIP_' | grep -Ev '^PIP_(LOG|LOG_FILE|QUIET|VERBOSE|PROGRESS_BAR|NO_COLOR|NO_INPUT|DEFAULT_TIMEOUT|TIMEOUT|RETRIES|CERT|CACHE_DIR|NO_CACHE_DIR|DISABLE_PIP_VERSION_CHECK|ROOT_USER_ACTION)=' |
    LC_ALL=C sort || true
  for arg in "${STEPS[@]}"; do
    printf 'arg %q\n' "$arg"
    path=${arg%%\[*}
    if [[ -f $path ]]; then
      sha256sum <"$path"
    elif [[ -d $path ]]; then
      for conf in pyproject.toml setup.cfg setup.py; do
        if [[ -f $path/$conf ]]; then echo "$conf" && sha256sum <"$path/$conf"; fi
      done
    fi
  done
}

# Move a wheelhouse out of the way (its marker goes with it at once), then delete it.
discard() {
  local gone
  gone=$(mktemp -d "$ROOT/.tmp.discard.XXXXXX")
  mv -T "$1" "$gone/w" 2>/dev/null || true
  rm -rf "$gone"
}

# Keep the RL_WHEELS_KEEP most recently used wheelhouses; drop temporary dirs older than a day.
prune() {
  local keep=${RL_WHEELS_KEEP:-3} n=0 mark
  while IFS= read -r mark; do
    n=$((n + 1))
    if ((n > keep)) && [[ $(dirname "$mark") != "$WH" ]]; then discard "$(dirname "$mark")"; fi
  done < <(ls -1t "$ROOT"/*/"$MARK_NAME" 2>/dev/null || true)
  find "$ROOT" -mindepth 1 -maxdepth 1 -name '.tmp.*' -mmin +1440 -exec rm -rf {} + 2>/dev/null || true
}

if [[ ${RL_WHEELS:-1} == 0 ]]; then
  each_step plain_step
  exit
fi

if ! mkdir -p "$ROOT" 2>/dev/null || [[ ! -w $ROOT ]]; then
  echo "wheelhouse: $ROOT is not writable; installing from the index without a cache" >&2
  each_step plain_step
  exit
fi
KEY=$(key_input | sha256sum | cut -c1-16)
WH="$ROOT/$KEY"

if [[ -f $WH/$MARK_NAME ]]; then
  echo "wheelhouse: installing from $WH (cached, nothing to download)"
  touch "$WH/$MARK_NAME" 2>/dev/null || true # most recently used: kept by prune
  if each_step warm_step; then
    prune
    exit 0
  fi
  echo "wheelhouse: the install from $WH failed; discarding it and falling back to the networked install" >&2
  discard "$WH"
  each_step plain_step
  exit
fi

if [[ -e $WH ]]; then discard "$WH"; fi # a directory without the marker is never trusted
TMP=$(mktemp -d "$ROOT/.tmp.$KEY.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
echo "wheelhouse: no cached wheels for this set yet; downloading them into $WH"
if each_step cold_step; then
  echo "$(date -u +%FT%TZ) $(ls "$TMP" | grep -c '\.whl$') wheels" >"$TMP/$MARK_NAME"
  mv -T "$TMP" "$WH" 2>/dev/null || true # another run published the same key first: keep its copy
  prune
  exit 0
fi
echo "wheelhouse: building the wheelhouse failed; falling back to the networked install" >&2
each_step plain_step
