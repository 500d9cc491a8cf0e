#!/usr/bin/env bash
# The one prepared GPU check, for a lent GPU machine without a package registry (docs/testing.md):
#   1. env.txt    the device, driver and library versions;
#   2. tier.log   the `gpu` test tier (pytest -m gpu) and its JUnit report tier.xml;
#   3. bench.log  benchmarks/gpu/bench_h200.py on Llama-3.1-8B widths (8 layers): plain transformers,
#                 hand-written fully_shard, FSDP2Manager eager / compiled / compiled + FP8, LoRA at seq 4096;
#                 full training at seq 8192 with selective checkpointing; the loss eager against
#                 compiled; what the process holds outside torch's allocator (CUDA context, NCCL), against
#                 the planner's figure; its numbers in bench.json;
#   4. calibration.log  tools/gpu_calibration.py: the planner's time model calibrated on the eager run,
#                 its error on the others (not in the rehearsal: a CPU has nothing to calibrate against);
#   5. plan_time.log  benchmarks/bench_plan_time.py --no-suggest: `automodel plan` for a 405B model on
#                 1,024 H100s, fresh processes, on the kind of host users plan from (not in the rehearsal:
#                 tests/benchmarks runs that benchmark's commands);
#   6. summary.txt each step's exit code and seconds.
# It uses the machine's own python3 (torch, transformers, peft, safetensors preinstalled), our packages
# from their source folders, and the wheels carried in .whl/ for what the image lacks (torchao,
# megatron-fsdp, ...; 64 MiB travels in all). At most 7 minutes; at most 8 files under $OUT.
#
# --rehearse runs the same steps on CPU with a tiny model, so any machine can tell that the script works:
# the tier's tests skip ("needs CUDA"), each CUDA-only benchmark variant prints one "skipped: needs CUDA"
# line. CI runs the rehearsal (tests/benchmarks/test_gpu_check.py, in the default e2e session).
#
# Usage: OUT=/some/folder tools/gpu_check.sh [--rehearse]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu_check}"
python="${PYTHON:-python3}"
rehearse=0
if [[ "${1:-}" == "--rehearse" ]]; then rehearse=1; fi
mkdir -p "$out"
: >"$out/summary.txt"

if [[ $rehearse == 0 ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
for src in packages/*/src; do PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/$src"; done
export PYTHONPATH PYTHONUNBUFFERED=1

# step NAME SECONDS COMMAND...: run it with a time limit, its output to NAME.log, one line to summary.txt.
status=0
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    printf '%s: exit %d after %d s (limit %d s)\n' "$name" "$rc" $(( $(date +%s) - start )) "$limit" \
        | tee -a "$out/summary.txt"
    if [[ $rc != 0 ]]; then status=1; fi
}

{
    if [[ $rehearse == 1 ]]; then echo "rehearsal on CPU"; else nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
    "$python" - <<'PY'
import importlib
for name in ("torch", "transformers", "peft", "safetensors", "torchao", "datasets", "megatron_fsdp"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except ImportError:
        print(name, "absent")
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count())
PY
} >"$out/env.txt" 2>&1

if [[ $rehearse == 1 ]]; then
    tier_args=(-m gpu -rs)  # collected and skipped: the line per test says why
    bench_args=(--tiny --device cpu --layers 2 --seq 32 --lora-seq 16 --batch 1 --steps 1 --warmup 1)
else
    tier_args=(-m gpu -rA)
    bench_args=(--layers 8 --seq 8192 --lora-seq 4096 --batch 2 --steps 3 --warmup 2 --ac selective)
fi
step tier 100 "$python" -m pytest packages tests "${tier_args[@]}" -p no:cacheprovider -q --timeout 90 \
    --junit-xml="$out/tier.xml"
step bench 180 "$python" benchmarks/gpu/bench_h200.py "${bench_args[@]}" --json "$out/bench.json"
tail -n 15 "$out/bench.log"
if [[ $rehearse == 0 ]]; then
    step calibration 60 "$python" tools/gpu_calibration.py "$out/bench.json"
    cat "$out/calibration.log"
    step plan_time 60 "$python" benchmarks/bench_plan_time.py --repeats 3 --no-suggest
    cat "$out/plan_time.log"
fi
exit "$status"
