#!/usr/bin/env bash
# Create .venv (once) and install specmesh with its test tools (the dev extra). Idempotent.
# torch==2.13.0: pip takes a CPU build (2.13.0+cpu) where its configuration offers one, else
# PyPI's wheel (on Linux x86_64 the CUDA build). SPECMESH_TORCH replaces that pin with any one
# requirement or wheel file; GPU machines also `pip install -e ".[gpu]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>/dev/null || true
python -m pip install -q "${SPECMESH_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[dev]"
