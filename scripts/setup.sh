#!/usr/bin/env bash
# Create .venv (once) and install specmesh with its test tools. Idempotent; CPU torch by default.
# GPU machines: SPECMESH_TORCH="torch==2.9.1" or any CUDA build, and `pip install -e ".[gpu]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>/dev/null || true
python -m pip install -q "${SPECMESH_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[dev]"
