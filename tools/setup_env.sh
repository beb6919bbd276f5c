#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv and install west
# (editable) with the extras given as arguments, e.g. `tools/setup_env.sh dev tts`.
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup_env] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
extras=$(IFS=,; echo "$*")
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: the CPU wheel lies on the reference machines' disk.
# pip's own exit code is kept; only the mirror's noise about absent index folders is dropped.
pip_install() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip_install "torch==2.13.0"
pip_install -e "$spec"
echo "[setup_env] ready: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
