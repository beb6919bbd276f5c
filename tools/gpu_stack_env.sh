#!/usr/bin/env bash
# The lent GPU machines' versions of torch and transformers, here, for the tests: their image runs
# torch 2.11.0+cu130, transformers 5.17.0 and huggingface-hub 1.33.0 (the device tool's KINDS.md),
# while .venv holds newer releases. Code that only the GPU suite meets (torch.compile's tracing,
# transformers' internals that west patches) can break on the older pair with every test here green:
# torch 2.11's dynamo could not trace the autocast check of the frozen-MLP Function, so every
# compiled decoder layer broke its graph there, and only a run under 2.11 showed it.
#
# Builds REPO/.venv-gpu-stack (ignored by git, so the device tool does not carry it): torch 2.11.0
# (its CUDA build from PyPI, about 4.5 GB with its CUDA libraries; without a GPU it runs on the CPU),
# transformers 5.17.0, huggingface-hub 1.33.0 and httpx, layered over .venv for everything else.
#
#   bash tools/setup_env.sh dev tts && bash tools/gpu_stack_env.sh
#   .venv-gpu-stack/bin/python -m pytest -q -n 2 --dist loadfile tests
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
base=$repo/.venv
env=$repo/.venv-gpu-stack
[ -x "$base/bin/python" ] || { echo "gpu_stack_env: $base is missing: run tools/setup_env.sh dev tts first" >&2; exit 2; }
python=$("$base/bin/python" -c 'import sys; print(sys.base_prefix)')/bin/python3
"$python" -m venv "$env"
# pip's notes about what .venv provides (the layering below) are not errors here
quiet() { grep -Ev "is ignored: it is neither|dependency resolver|which is not installed|which is incompatible" >&2 || true; }
"$env/bin/python" -m pip install -q torch==2.11.0 2> >(quiet)
"$env/bin/python" -m pip install -q --no-deps transformers==5.17.0 huggingface-hub==1.33.0 2> >(quiet)
"$env/bin/python" -m pip install -q httpx 2> >(quiet)
# everything else from .venv, after this environment's own packages; the checkout itself first
# (.venv's editable install of west is a .pth hook, which a path listed here does not run)
site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$repo" "$base_site" >"$site/zz_west_base.pth"
"$env/bin/python" - <<'EOF'
import torch, transformers, huggingface_hub, west
print(f"[gpu_stack_env] torch {torch.__version__}, transformers {transformers.__version__}, "
      f"huggingface-hub {huggingface_hub.__version__}, west from {west.__path__[0]}")
EOF
