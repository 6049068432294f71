#!/usr/bin/env bash
# Install grpokit (editable) and what it needs, on a fresh machine or an existing one.
#   bash scripts/setup.sh         runtime dependencies
#   bash scripts/setup.sh test    + the test suite's (pytest, and trl as the parity reference)
#
# torch is handled first and on its own, so that nothing below can swap it:
# * a torch that is already installed is kept (whatever its build: CPU, CUDA, ROCm);
# * otherwise torch==2.13.0 is installed, which on a CPU-only machine resolves to the CPU build.
# Every later install runs under a constraint pinning torch to the installed version, so no
# dependency (transformers, trl, accelerate...) can pull another torch or CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[grpokit setup] no torch found: installing torch==2.13.0"
  "${PIP[@]}" "torch==2.13.0"
fi
torch_version="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_version}" >"$constraints"

target="."
if [ "${1:-}" = "test" ]; then target=".[test]"; fi
echo "[grpokit setup] torch ${torch_version} kept; installing grpokit${target#.}"
"${PIP[@]}" -c "$constraints" -e "$target"
