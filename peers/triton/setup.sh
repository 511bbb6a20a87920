#!/usr/bin/env bash
# Create (once) the peer's venv, keyed by requirements.txt; print its path.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BASE_PY="${PYTHON:-python3.11}"
command -v "$BASE_PY" >/dev/null || BASE_PY=python3
KEY="$(sha256sum "$HERE/requirements.txt" | cut -c1-12)"
VENV="${BATCHTIDE_CACHE:-$HOME/.cache/batchtide}/peer-triton-$KEY"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  echo "creating the Triton peer venv in $VENV (about 6 GB: PyPI's torch is the CUDA build)" >&2
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt" >&2
  touch "$VENV/.complete"
fi
echo "$VENV"
