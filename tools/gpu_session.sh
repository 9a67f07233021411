#!/usr/bin/env bash
# One command on a lent GPU machine (the device tool's `run`: at most 10 minutes, the reply keeps
# the output's last 12,000 characters, and at most 8 files come back from $OUT): runs one part,
# packs everything it wrote into ONE file, $OUT/<part>.tar.gz (logs, JSON reports, the tables), and
# ends its output with the part's summary table, so the table is in the reply and nothing is lost.
#
#   OUT=... bash tools/gpu_session.sh check     # tools/gpu_check.sh (limits of 475 s in all; under 570 s)
#   OUT=... BUDGET_S=240 ARCHS=tango,loop-transformer SUITES=train-70m-t4096 bash tools/gpu_session.sh suites
#
# A session's plan (15 minutes of device time): `check` in one call (timeout_s=600), then
# `suites`, one suite per call, with BUDGET_S = what the session has left less a minute, at most
# 540 (docs/benchmarks.md, "On a lent machine"). The part runs under `timeout` (570 s) so that the
# packing always happens before the device tool's 10-minute limit. Exit code: the part's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
part=${1:-}
if [ "$part" != check ] && [ "$part" != suites ]; then
    echo "usage: OUT=DIR bash tools/gpu_session.sh check|suites" >&2
    exit 2
fi
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
    echo "error: set OUT to an existing folder (the one whose files come back)" >&2
    exit 2
fi
if [ "$part" = suites ]; then
    # Without a budget each suite takes its own 10-15 minute timeout: past the device tool's limit,
    # which kills the command before its table or its packing (nothing comes back).
    BUDGET_S=${BUDGET_S:-540}
    if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]] || [ "$BUDGET_S" -gt 540 ] || [ "$BUDGET_S" -lt 120 ]; then
        echo "error: BUDGET_S must be 120-540 seconds (one command runs at most 600; got $BUDGET_S)" >&2
        exit 2
    fi
    export BUDGET_S
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # packed into $OUT below; nothing left in the machine's /tmp
if [ "$part" = check ]; then
    GPU_CHECK_OUT="$work/gpu-check" timeout --kill-after=10 570 bash tools/gpu_check.sh 2>&1 | tee "$work/gpu-check.out"
else
    timeout --kill-after=10 570 bash tools/gpu_suites.sh "$work/suites" 2>&1 | tee "$work/suites.out"
fi
rc=${PIPESTATUS[0]}
{ date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi -L 2>/dev/null; echo "exit $rc"; } >"$work/session.txt"
tar czf "$OUT/$part.tar.gz" -C "$work" .
echo "packed $(find "$work" -type f | wc -l) files into $OUT/$part.tar.gz (exit $rc)"
exit "$rc"
