#!/usr/bin/env bash
# What zerocc checks and measures on a GPU machine, in one go, each step under a time limit,
# each step's whole output in OUT_DIR/<step>.log and its tail printed:
#
#   install    the wheels carried in .whl/ into /tmp/site (a GPU image without a package
#              registry lacks pydantic: `pip download --no-deps --only-binary=:all:
#              --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic
#              pydantic-core annotated-types typing-inspection`), then zerocc, editable,
#              without fetching its dependencies
#   versions   GPU, driver, torch, CUDA, Triton, NCCL
#   tests      the tests marked cuda / two_gpus, tests/backends/kernels launched for real, the
#              16-bit rounding of the Inductor backend (its Triton case too), float8 matmuls
#   kernels    bench/adamw_bandwidth.py: the fused AdamW kernel's bandwidth against a copy and torch
#   compare    bench/compare.py --gpu: zerocc (eager and Inductor backends) beside FSDP2 and
#              unsharded torch, eager and compiled (SYSTEMS overrides the list)
#   host       bench/host_update.py (the host's update loop against torch and a copy) and
#              bench/host_memory.py --device cuda (host memory of offloaded steps, pinned)
#   offload    bench/offload.py --gpu: a 1.3B GPT offloaded (issue 22's run), plain, with
#              offload.defer_updates and offload.grads: device, measured and predicted
#              (OFFLOAD_SYSTEMS overrides the list)
#   7b         examples/gpt/7b-offload.yaml, 3 steps on one GPU (issue 22's 7B run): trains, or
#              stops before allocating with the memory check's error; the peak resident set
#              of the rank and the metrics of each step (OUT_DIR/7b-metrics.jsonl)
#   float8     bench/compare.py --gpu on a 1.3B GPT (24 × 2048, 8 sequences of 1024): zerocc
#              stage 3 on Inductor and torch.compile, each in bf16 and with float8 matmuls
#              (torchao's rowwise recipe; issue 51's tokens/s: fp8 >= 1.2x bf16 and >= torch's)
#              (FLOAT8_SYSTEMS overrides the list; tensorwise: *-fp8-tensorwise)
#
# Usage: bench/gpu.sh OUT_DIR [STEP ...]   (default: every step, in the order above)
# LIMIT_<STEP>=SECONDS changes a step's time limit; OFFLOAD_ARGS adds bench/offload.py arguments
# (--rounds 2, say) for a session short of device time.
set -u
out=${1:?usage: bench/gpu.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
here=$(cd "$(dirname "$0")" && pwd)
systems=${SYSTEMS:-zerocc-z3 zerocc-z3-inductor fsdp2-z3 fsdp2-z3-compiled torch torch-compiled}
float8=${FLOAT8_SYSTEMS:-zerocc-z3-inductor zerocc-z3-inductor-fp8-rowwise torch-compiled torch-compiled-fp8-rowwise}
offload=${OFFLOAD_SYSTEMS:-zerocc-z3-opt-par-cpu-rc zerocc-z3-opt-par-cpu-rc-next zerocc-z3-opt-cpu-delayed zerocc-z3-opt-par-cpu-rc-gdev}

step() {  # step NAME SECONDS COMMAND...: run it, keep its output, print how it ended
    local limit_of=LIMIT_${1^^}  # LIMIT_OFFLOAD=200 etc. override a step's limit
    local name=$1 limit=${!limit_of:-$2}
    shift 2
    echo "== $name (limit ${limit}s, $(date +%T))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? at $(date +%T)"
    tail -n "${TAIL:-25}" "$out/$name.log"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(install versions tests kernels compare host offload 7b float8)
for s in "${steps[@]}"; do
    case $s in
    install)
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        step install 120 bash -c 'set -e; if ls .whl/*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
                .whl/*.whl; fi
            python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || {
                echo "pip could not install zerocc; linking its source into /tmp/site"
                mkdir -p /tmp/site/zerocc && ln -sf "$PWD"/zerocc/* /tmp/site/zerocc/
                ln -sfn "$PWD/passes" /tmp/site/zerocc/passes
                ln -sfn "$PWD/backends" /tmp/site/zerocc/backends; }
            python3 -c "import zerocc, zerocc.compiler.passes; print(zerocc.__file__)"' ;;
    versions)
        step versions 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv; python3 -c "import torch, triton; print(torch.__version__, \
            torch.version.cuda, triton.__version__, torch.cuda.nccl.version())"' ;;
    tests)
        step tests 420 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_cuda.py \
            tests/backends/kernels tests/backends/test_eager_casts.py \
            tests/test_float8.py::test_on_a_gpu_the_float8_kernels_train_as_torchao_does ;;
    kernels)
        step kernels 120 python3 "$here/adamw_bandwidth.py" --sizes 24 26 28 --out "$out" ;;
    compare)
        # shellcheck disable=SC2086  # the system names are words
        step compare 540 python3 "$here/compare.py" --gpu --systems $systems \
            --out "$out" ;;
    host)
        step host 300 bash -c "python3 '$here/host_update.py' --sizes 24 26 --out '$out' && \
            python3 '$here/host_memory.py' --device cuda --layers 24 --out '$out'" ;;
    offload)
        # shellcheck disable=SC2086  # the system names are words
        step offload 540 python3 "$here/offload.py" --gpu --systems $offload --out "$out" \
            ${OFFLOAD_ARGS:-} ;;
    7b)
        step 7b 300 python3 -c 'import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
print(f"peak resident set of a rank: {peak:.1f} GiB; exit {code}")
sys.exit(code)' python3 -m zerocc train "$here/../examples/gpt/7b-offload.yaml" --nproc 1 --steps 3 \
            --metrics "$out/7b-metrics.jsonl" ;;
    float8)
        # shellcheck disable=SC2086  # the system names are words
        step float8 540 python3 "$here/compare.py" --gpu --systems $float8 --layers 24 \
            --embd 2048 --heads 16 --batch 8 --out "$out" ;;
    *)
        echo "unknown step $s (install, versions, tests, kernels, compare, host, offload, 7b," \
            "float8)" >&2
        exit 2 ;;
    esac
done
