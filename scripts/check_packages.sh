#!/usr/bin/env bash
# Build the sdist and wheel of every distribution (packages/*, apps/*) into DIST (default dist/)
# and check them as the index would: `twine check --strict`, LICENSE in every archive, py.typed in
# every wheel. What tests/test_packaging.py checks in `make test`, as one command for a release:
#
#     bash scripts/check_packages.sh [DIST]
#
# Needs build and twine (pip install 'rlpost-core[dev]'); PYTHON overrides the interpreter
# (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
DIST="${1:-dist}"
rm -rf "$DIST"
mkdir -p "$DIST"
for project in packages/*/ apps/*/; do
  [ -f "$project/pyproject.toml" ] || continue
  "$PYTHON" -m build -q -o "$DIST" "$project" >/dev/null
done
"$PYTHON" -m twine check --strict "$DIST"/*
"$PYTHON" - "$DIST" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

dist = Path(sys.argv[1])
bad = []
for wheel in sorted(dist.glob("*.whl")):
    names = zipfile.ZipFile(wheel).namelist()
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        bad.append(f"{wheel.name}: no LICENSE")
    if not any(n.endswith("/py.typed") for n in names):
        bad.append(f"{wheel.name}: no py.typed")
for sdist in sorted(dist.glob("*.tar.gz")):
    if not any(n.count("/") == 1 and n.endswith("/LICENSE") for n in tarfile.open(sdist).getnames()):
        bad.append(f"{sdist.name}: no LICENSE")
if bad:
    sys.exit("\n".join(bad))
print(f"{len(list(dist.iterdir()))} archives in {dist}: LICENSE and py.typed present")
EOF
