#!/usr/bin/env bash
# One command on a lent GPU machine (the device tool's `run`: at most 10 minutes, the reply keeps
# the output's last 12,000 characters, and at most 8 files come back from $OUT): runs one part,
# packs everything it wrote into ONE file, $OUT/<part>.tar.gz (logs, JSON reports, the tables), and
# ends its output with the part's summary table, so the table is in the reply and nothing is lost.
#
#   OUT=... bash tools/gpu_session.sh check     # tools/gpu_check.sh (under 8 minutes)
#   OUT=... BUDGET_S=300 SUITES="train-70m-t4096 decode-70m" bash tools/gpu_session.sh suites
#
# A session's plan (15 minutes of device time): `check` in one call, then `suites` with what is
# left as BUDGET_S (docs/benchmarks.md, "On a GPU"). Exit code: the part's.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
if [ "$part" != check ] && [ "$part" != suites ]; then
    echo "usage: OUT=DIR bash tools/gpu_session.sh check|suites" >&2
    exit 2
fi
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
    echo "error: set OUT to an existing folder (the one whose files come back)" >&2
    exit 2
fi
work=$(mktemp -d)
if [ "$part" = check ]; then
    GPU_CHECK_OUT="$work/gpu-check" tools/gpu_check.sh 2>&1 | tee "$work/gpu-check.out"
else
    bash tools/gpu_suites.sh "$work/suites" 2>&1 | tee "$work/suites.out"
fi
rc=${PIPESTATUS[0]}
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi -L 2>/dev/null; echo "exit $rc"; } >"$work/session.txt"
tar czf "$OUT/$part.tar.gz" -C "$work" .
echo "packed $(find "$work" -type f | wc -l) files into $OUT/$part.tar.gz (exit $rc)"
exit "$rc"
