#!/usr/bin/env bash
# The test suite on this CPU under the GPU machine's versions: torch 2.11 and triton 3.6 (the
# CUDA build from PyPI, ~3 GB with its CUDA libraries, runs on a CPU too). `make test` runs torch
# 2.13 and triton 3.9; code that only a GPU runs meets 2.11 and 3.6 first on the GPU machine,
# whose sessions are short, and they differ: Dynamo traced AttnRes's checkpointed layers with a
# graph break, and triton timed the launches TANGO_LM_TRITON_AUTOTUNE=0 leaves untimed, only
# there. `make test-gpu-versions`, or
#
#   tools/test_gpu_versions.sh [pytest arguments]   # e.g. -k "triton or compile"
#
# builds $VENV (default .venv-gpu-versions) on first use, then runs pytest as `make test` does.
# Another torch, say one newer than `make test`'s, the same way in a venv of its own, with the
# triton its CUDA build requires (or TRITON_VERSION):
#
#   TORCH_VERSION=2.15.0 tools/test_gpu_versions.sh   # in .venv-torch-2.15.0
#
# numpy < 2.4: triton 3.6's interpreter calls int() on one-element arrays, which numpy 2.4 refuses
# and older numpy warns about, some 15,000 times a run: pytest hides that one warning.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
if [ "$TORCH_VERSION" = 2.11.0 ]; then
    TRITON_VERSION=${TRITON_VERSION:-3.6.0}
fi
if [ "$TORCH_VERSION-${TRITON_VERSION:-}" = 2.11.0-3.6.0 ]; then
    VENV=${VENV:-.venv-gpu-versions}
else
    VENV=${VENV:-.venv-torch-$TORCH_VERSION${TRITON_VERSION:+-triton-$TRITON_VERSION}}
fi
PYTHON=${PYTHON:-python3}
if [ ! -f "$VENV/.installed" ]; then
    pins=$(mktemp)
    trap 'rm -f "$pins"' EXIT  # a failed install exits here; the `exec` below runs no EXIT trap
    printf 'torch==%s\nnumpy<2.4\n%b' "$TORCH_VERSION" "${TRITON_VERSION:+triton==$TRITON_VERSION\n}" >"$pins"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -c "$pins" torch triton numpy
    "$VENV/bin/python" -m pip install -c "$pins" -e '.[test,eval,hf,triton,gdn,serve,tensorboard,wandb,cluster]'
    rm -f "$pins"
    trap - EXIT
    touch "$VENV/.installed"
fi
"$VENV/bin/python" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')"
exec "$VENV/bin/python" -m pytest -n logical --maxprocesses 4 --dist loadfile \
    -W "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning" "$@"
