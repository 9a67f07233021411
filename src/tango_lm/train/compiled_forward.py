"""`train.compile=true`: the training forward through `torch.compile`, eager again when that fails.

A compiler failure (an operator inductor cannot lower, a Triton build error on an unusual GPU, a
shape Dynamo cannot trace) would otherwise end a run at its first step with pages of trace. It is
logged as one line and the run trains eagerly from then on: the same model, the same numbers (the
compile tests hold compiled and eager losses equal), only slower. Errors that are not the
compiler's (out of memory, a bad batch) propagate as they would eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,)  # the compiler's own failures, not the model's


def one_line(exc: BaseException) -> str:
    """`Type: first line` of the error behind a compiler failure (a backend's wrapped one if any)."""
    cause = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}"


class CompiledForward:
    """Calls `torch.compile(forward)`; after its first compiler failure, `forward` itself."""

    def __init__(self, forward: Callable[..., torch.Tensor], backend: Any = "inductor") -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, backend=backend)
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except COMPILER_ERRORS as exc:
                log.warning("train.compile: torch.compile failed, training eagerly from here on: %s", one_line(exc))
                self.failed = True
        return self.eager(*args, **kwargs)
