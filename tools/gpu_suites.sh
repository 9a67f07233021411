#!/usr/bin/env bash
# The benchmark suites on one GPU, eager and compiled, each under its own timeout, then one table.
#
#   bash tools/gpu_suites.sh [OUT_DIR]        (default OUT_DIR: gpu-suites-<date>)
#
# Runs from the repository root with PYTHONPATH=src (no install, no network). Each suite writes
# OUT_DIR/<name>.json (its `tango-lm bench --json` report) and OUT_DIR/<name>.log; a suite that
# fails or runs past its timeout is marked in the table and the others still run. Timeouts are in
# seconds and can be overridden: TIMEOUT_TRAIN=1200 bash tools/gpu_suites.sh. All of them take far
# longer than one command on a lent GPU machine may run (10 minutes): SUITES="train-70m decode-70m"
# runs only the suites named (a name it does not know is an error), ARCHS=tango,loop-transformer
# only those architectures in the train and decode suites, and BUDGET_S=570 holds the whole script to 570 seconds: each suite's
# timeout is cut to the time left (less 45 s: the 30 s a stopped suite has to print its report, and
# the table), a suite with under a minute left is skipped ("SKIPPED (budget)" in the table), so the
# script ends with its table before the machine's own limit kills it. Exit code 1 when a suite failed
# or timed out, as the table says.
#
# - train-70m / train-160m: every architecture at the 70M / 160M tier of seed 000 Table 3
#   (d = 512 / 768, T = 1024, depth 4, batch 16, V = 50257, bf16 autocast), eager and through
#   torch.compile side by side (`--compile`), MFU against the measured bf16 matmul peak.
# - train-70m-t4096: the 70M tier at T = 4096 (batch 4: the same 16,384 tokens per step), where
#   issue 12's TANGO-vs-Loop targets are also set.
# - decode-small: the default decode suite (d = 256), eager and static (CUDA-graph) steps.
# - decode-70m / decode-160m: the 70M / 160M presets, prompt 512, 256 new tokens, batch 1 and 16,
#   eager and static steps; the heads on dense-142m (onóna one projection vs Standard).
# - windowed: windowed vs full TANGO time per token as T grows (eager).
# - memory: whole-step peak memory, onóna vs Standard on dense-142m, 32 x 1024, eager and compiled.
set -u
cd "$(dirname "$0")/.." || exit 2
NAMES=" train-70m train-160m train-70m-t4096 decode-small decode-70m decode-160m windowed memory "
for name in ${SUITES:-}; do  # a misspelt name ran nothing and printed an empty table, exit 0
    if [[ "$NAMES" != *" $name "* ]]; then
        echo "error: unknown suite '$name' in SUITES; the suites are:$NAMES" >&2
        exit 2
    fi
done
OUT=${1:-gpu-suites-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
rm -f "$OUT"/*.rc  # an earlier run's outcomes into a reused OUT are not this run's
PY=${PYTHON:-python3}
BENCH=(env PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m tango_lm.cli bench --device cuda --json)
TRAIN70=(--suite train --d-model 512 --seq-len 1024 --depth 4 --batch-size 16 --tango-width 28480 --vocab-size 50257
         --steps 8 --warmup 3 --compile)
TRAIN160=(--suite train --d-model 768 --seq-len 1024 --depth 4 --batch-size 16 --tango-width 52176 --vocab-size 50257
          --steps 8 --warmup 3 --compile)
# ARCHS=tango,loop-transformer: only these architectures in the train and decode suites (each
# compiled model takes its compile time at the start of a train suite: all eight do not fit a call)
ARCH_ARGS=()
if [ -n "${ARCHS:-}" ]; then ARCH_ARGS=(--archs "$ARCHS"); fi
# ${A[@]+"${A[@]}"}: an empty array expands to nothing under set -u on bash before 4.4 too
TRAIN70+=(${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"})
TRAIN160+=(${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"})
DECODE_BIG=(--suite decode --prompt-len 512 --new-tokens 256 --decode-batches 1,16 --depth 4 --repeats 3
            --head-backbone dense-142m --compile ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"})

run() {  # run NAME TIMEOUT ARGS...: one suite, its JSON to OUT/NAME.json, its log to OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  if [ -n "${SUITES:-}" ] && [[ " $SUITES " != *" $name "* ]]; then return 0; fi
  if [ -n "${BUDGET_S:-}" ]; then
    local left=$((BUDGET_S - SECONDS - 45))
    if [ "$left" -lt 60 ]; then
      echo "$name skipped: ${left}s left of BUDGET_S=${BUDGET_S}" | tee "$OUT/$name.log"
      echo skipped > "$OUT/$name.rc"
      return 0
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
  fi
  echo "== $name (timeout ${limit}s): tango-lm bench $*" | tee "$OUT/$name.log"
  local start=$SECONDS
  # SIGTERM at the limit (the bench then prints what it measured), SIGKILL 30 s later if it is stuck
  timeout --kill-after=30 "$limit" "${BENCH[@]}" "$@" > "$OUT/$name.json" 2>> "$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/$name.log"
  echo "$rc" > "$OUT/$name.rc"
}

run train-70m "${TIMEOUT_TRAIN:-900}" "${TRAIN70[@]}"
run train-160m "${TIMEOUT_TRAIN:-900}" "${TRAIN160[@]}"
run train-70m-t4096 "${TIMEOUT_TRAIN:-900}" "${TRAIN70[@]}" --seq-len 4096 --batch-size 4
run decode-small "${TIMEOUT_DECODE:-600}" --suite decode --compile ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"}
run decode-70m "${TIMEOUT_DECODE:-900}" "${DECODE_BIG[@]}" --decode-tier 70m
run decode-160m "${TIMEOUT_DECODE:-900}" "${DECODE_BIG[@]}" --decode-tier 160m
run windowed "${TIMEOUT_WINDOWED:-600}" --suite windowed
run memory "${TIMEOUT_MEMORY:-900}" --suite memory --memory-batch-size 32 --memory-seq-len 1024 --compile

PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" "$PY" tools/gpu_suites_table.py "$OUT"
table=$?
# 1 when a suite failed or ran out of time (its .rc other than 0 or skipped), as the table says
for rc_file in "$OUT"/*.rc; do
    [ -e "$rc_file" ] || continue
    case "$(cat "$rc_file")" in 0 | skipped) ;; *) exit 1 ;; esac
done
exit "$table"
