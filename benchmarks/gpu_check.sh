#!/bin/bash
# The device checks of a session lent a GPU, as one prepared command (about 5 minutes on an H100):
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=540)
# It uses the machine's own python3 and torch (the device image's, which may be older than
# pyproject.toml's floor: the versions are printed first, so a failure there says which). pyzmq is
# not needed: no coordinator is started. A dry run here: GPU_CHECK_ARGS="--device cpu --tiny" PATH=.venv/bin:$PATH
# bash benchmarks/gpu_check.sh. What it prints is also written to $OUT/gpu_check.txt.
#   1. benchmarks/gpu_sync.py: a 124M bf16 GPT, plain, sentinel and full in rotating rounds; host
#      syncs per optimizer step counted by CUDA; four bad steps on the device (reproduced and
#      transient, both modes: the microscope's CUDA random states, the GPU's UUID in the event)
#   2. the same with 4 micro-batches per optimizer step (still one sync a step), no bad steps
#   3. the unit tests that take a CUDA path where CUDA is there (capture, replay on another device)
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/gpu_check.txt"
status=0
read -ra extra <<< "${GPU_CHECK_ARGS:-}"  # a dry run on a CPU: GPU_CHECK_ARGS="--device cpu --tiny"
{
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader || true
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    echo "== gpu_sync.py (124M, both modes, bad steps)"
    timeout 240 python3 benchmarks/gpu_sync.py --rounds 6 --steps 8 "${extra[@]}" || status=1
    echo "== gpu_sync.py --accum 4"
    timeout 150 python3 benchmarks/gpu_sync.py --accum 4 --rounds 4 --steps 4 --no-fault "${extra[@]}" || status=1
    echo "== CUDA paths of the unit tests"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_capture.py tests/unit/test_replay_device.py || status=1
    echo "== exit $status"
    exit "$status"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
