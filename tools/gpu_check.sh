#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and no network, from a checkout (nothing installed:
# the sources run with PYTHONPATH=src), `tools/gpu_check.sh` or `make gpu-check` runs
#
#   cuda-tests    every `cuda`-marked test: the Triton kernels against float64 (each autotune
#                 configuration alone, and the rest untimed: TANGO_LM_TRITON_AUTOTUNE=0), fla's delta rule
#                 against the chunked form (where fla-core is installed), every architecture
#                 and head on the GPU against the CPU float64 model, bf16 loss, cached and static decoding
#                 (failed, not skipped, when triton is installed and the kernels do not import);
#   train-bench   `tango-lm bench --suite train` at the 70M tier of the TANGO paper's Table 3;
#   kernel-bench  TANGO's mixing alone (tools/gate_average_bench.py): Triton vs the sliced SDPA vs
#                 SDPA's math backend, TFLOP/s per causal FLOP and the share of a measured bf16 peak;
#   relu2-bench   GAU's squared-ReLU attention alone (tools/relu2_attention_bench.py): Triton vs the
#                 composition, the same measures;
#
# each under its own time limit (a failure or a time-out does not stop the others; the limits add
# up to 475 s, under 9.5 minutes with each one's 20 s grace and the start), then prints one summary table (tools/gpu_check_summary.py) and exits 1 if
# any section failed or timed out. Logs and JSON reports go to $GPU_CHECK_OUT (default
# runs/gpu-check/<UTC time>). To add a suite, add one `section` line below; for a one-line result
# in the table, add a formatter to gpu_check_summary.py.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${GPU_CHECK_OUT:-runs/gpu-check/$(date -u +%Y%m%d-%H%M%S)}

if ! said=$("$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')" 2>&1); then
    # torch's own last line: a CUDA torch that fails to import is not "no GPU"
    echo "error: $PYTHON: $(printf '%s\n' "$said" | tail -n 1); run tools/gpu_check.sh on a GPU machine" >&2
    exit 2
fi
mkdir -p "$OUT"
: >"$OUT/sections.tsv"
failed=0

section() {  # section NAME LIMIT_S SHELL_COMMAND: run it under `timeout`, output in $OUT/NAME.log
    local name=$1 limit=$2 command=$3 start=$SECONDS status=ok rc
    echo "== $name (limit ${limit} s): $command"
    timeout --kill-after=20 "$limit" bash -c "$command" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status="failed ($rc)"; fi
    [ "$status" = ok ] || failed=1
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$OUT/sections.tsv"
    tail -n 20 "$OUT/$name.log"
}

# -- sections: name, time limit in seconds, command ------------------------------------------------
# pytest-xdist, where installed: the cuda tests' time is mostly compiling (inductor, CUDA graphs,
# Triton autotuning), which is CPU work that 8 processes share out over one GPU. `load`, not
# `loadfile`: test_cuda_models.py alone holds half the tests (Triton's compile cache is on disk, shared).
PARALLEL=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8 --dist load")
# The Triton tests skip when the kernels' modules do not import (a triton they do not build with):
# with triton installed, that is this section's failure, not a pass with the kernels untested.
KERNELS_IMPORT="import tango_lm.ops.tango_mix_triton, tango_lm.ops.windowed_triton, tango_lm.ops.relu2_attention_triton"
# TANGO_LM_TRITON_AUTOTUNE=0: each of the tests' ~300 small launch shapes would have its admitted
# configurations compiled and timed (~0.1 s each, on one GPU shared by the workers); they take the
# first admitted one instead, and the tests named every_configuration run every configuration alone.
section cuda-tests "${CUDA_TESTS_LIMIT:-195}" \
    "{ ! $PYTHON -c 'import triton' 2>/dev/null || $PYTHON -c '$KERNELS_IMPORT'; } && TANGO_LM_TRITON_AUTOTUNE=0 TORCHINDUCTOR_COMPILE_THREADS=2 $PYTHON -m pytest -m cuda -p no:cacheprovider -o addopts= -v -rfE --durations=15 $PARALLEL tests"  # each test by name (a time-out still shows which passed), the slowest 15
section train-bench "${TRAIN_BENCH_LIMIT:-175}" \
    "$PYTHON -m tango_lm.cli bench --suite train --d-model 512 --seq-len 1024 --depth 4 --batch-size 16 --tango-width 28480 --vocab-size 50257 --steps 8 --warmup 3 --json >$OUT/train-bench.json"
section kernel-bench "${KERNEL_BENCH_LIMIT:-60}" \
    "$PYTHON tools/gate_average_bench.py --batch 16 --heads 16 --seq-len 1024 --width 1780 --head-dim 32 --json $OUT/kernel-bench.json"
section relu2-bench "${RELU2_BENCH_LIMIT:-45}" \
    "$PYTHON tools/relu2_attention_bench.py --batch 16 --seq-len 1024 --qk-dim 128 --width 7152 --json $OUT/relu2-bench.json"

"$PYTHON" tools/gpu_check_summary.py "$OUT" || failed=1
exit "$failed"  # 1 when a section failed or ran out of time (the table says which)
