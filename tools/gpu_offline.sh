#!/usr/bin/env bash
# The `gpu` test tier on a machine without a package registry (e.g. a lent GPU box): uses the machine's own
# python3 with torch/transformers/peft preinstalled, our packages from their source folders, and any wheels
# carried in .whl/ (torchao, megatron-fsdp). CI never runs this; `uvx nox -s "gpu(gpus=N)"` is the normal path.
# Usage: tools/gpu_offline.sh [pytest args...]; writes logs and JUnit under ${OUT:-/tmp/gpu_out}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
for src in packages/*/src; do PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/$src"; done
export PYTHONPATH PYTHONUNBUFFERED=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
export AUTOMODEL_TEST_GPUS="$gpus"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
    python3 -c 'import peft, torchao; print("peft", peft.__version__, "torchao", torchao.__version__)' 2>&1 | tail -1
} | tee "$out/env.txt"
python3 -m pytest packages tests -m gpu -p no:cacheprovider -rA -q --timeout 300 \
    --junit-xml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
