#!/usr/bin/env bash
# What zerocc checks and measures on a GPU machine, in one go, each step under a time limit,
# each step's whole output in OUT_DIR/<step>.log and its tail printed:
#
#   versions   GPU, driver, torch, CUDA, Triton, NCCL
#   tests      the tests marked cuda / two_gpus, and tests/kernels launched for real
#   kernels    bench/kernels.py: the fused AdamW kernel's bandwidth against a copy and torch
#   compare    bench/compare.py --gpu: zerocc (eager and Inductor backends) beside FSDP2 and
#              unsharded torch, eager and compiled (SYSTEMS overrides the list)
#   host       bench/host_update.py (the host's update loop against torch and a copy) and
#              bench/host_memory.py --device cuda (host memory of offloaded steps, pinned)
#   offload    bench/offload.py --gpu: a 1.3B GPT offloaded (issue 22's run), plain, with
#              offload.pipeline and offload.grads: device, measured and predicted
#              (OFFLOAD_SYSTEMS overrides the list)
#
# Usage: bench/gpu.sh OUT_DIR [STEP ...]   (default: every step, in the order above)
set -u
out=${1:?usage: bench/gpu.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
here=$(cd "$(dirname "$0")" && pwd)
systems=${SYSTEMS:-zerocc-z3 zerocc-z3-inductor fsdp2-z3 fsdp2-z3-compiled torch torch-compiled}
offload=${OFFLOAD_SYSTEMS:-zerocc-z3-opt-par-cpu-rc zerocc-z3-opt-par-cpu-rc-next zerocc-z3-opt-cpu-delayed zerocc-z3-opt-par-cpu-rc-gdev}

step() {  # step NAME SECONDS COMMAND...: run it, keep its output, print how it ended
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, $(date +%T))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? at $(date +%T)"
    tail -n "${TAIL:-25}" "$out/$name.log"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(versions tests kernels compare host offload)
for s in "${steps[@]}"; do
    case $s in
    versions)
        step versions 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv; python3 -c "import torch, triton; print(torch.__version__, \
            torch.version.cuda, triton.__version__, torch.cuda.nccl.version())"' ;;
    tests)
        step tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
            tests/kernels ;;
    kernels)
        step kernels 120 python3 "$here/kernels.py" --sizes 24 26 28 --out "$out" ;;
    compare)
        # shellcheck disable=SC2086  # the system names are words
        step compare 540 python3 "$here/compare.py" --gpu --systems $systems \
            --out "$out" ;;
    host)
        step host 300 bash -c "python3 '$here/host_update.py' --sizes 24 26 --out '$out' && \
            python3 '$here/host_memory.py' --device cuda --layers 24 --out '$out'" ;;
    offload)
        # shellcheck disable=SC2086  # the system names are words
        step offload 540 python3 "$here/offload.py" --gpu --systems $offload --out "$out" ;;
    *)
        echo "unknown step $s (versions, tests, kernels, compare, host, offload)" >&2
        exit 2 ;;
    esac
done
