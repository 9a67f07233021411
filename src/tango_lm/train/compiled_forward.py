"""`train.compile=true`: the training forward through `torch.compile`, eager again when that fails.

A compiler failure (an operator inductor cannot lower, a Triton build error on an unusual GPU, a
shape Dynamo cannot trace) would otherwise end a run at its first step with pages of trace. It is
logged as one line and the run trains eagerly from then on: the same model, the same numbers (the
compile tests hold compiled and eager losses equal), only slower. Errors that are not the
compiler's (out of memory, a bad batch) propagate as they would eagerly. AOTAutograd compiles the
backward graph at the first backward call, outside the forward's: `with_eager_fallback` runs a
whole step (forward and backward) so that a failure there falls back too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,)  # the compiler's own failures, not the model's
T = TypeVar("T")


def one_line(exc: BaseException) -> str:
    """`Type: first line` of the error behind a compiler failure (a backend's wrapped one if any)."""
    cause = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}"


class CompiledForward:
    """Calls `torch.compile(forward)`; after its first compiler failure, `forward` itself.
    `graphs`: how many graphs the forward needs, one per segment of a rotating narrow width (each
    segment's columns are constants of its graph); Dynamo's recompile limit (8) is raised to admit
    them, where it would otherwise run segments past the eighth eagerly after a warning. Dynamo
    counts the graphs of one code object (`LanguageModel.nll`) over the whole process: the limit
    admits every CompiledForward's so far (a sweep's runs train in one process, and its ninth model
    shape trained eagerly, unsaid, its summary's tokens/s and MFU then eager ones)."""

    graphs_in_process = 0  # asked for by every CompiledForward of this process

    def __init__(self, forward: Callable[..., torch.Tensor], backend: Any = "inductor", graphs: int = 1) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, backend=backend)
        self.failed = False
        CompiledForward.graphs_in_process += graphs
        limit = CompiledForward.graphs_in_process + 1  # + 1: one spare
        self.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.failed:
            try:
                with torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
                    return self.compiled(*args, **kwargs)
            except COMPILER_ERRORS as exc:
                self.fall_back(exc)
        return self.eager(*args, **kwargs)

    def fall_back(self, exc: BaseException) -> None:
        log.warning("train.compile: torch.compile failed, training eagerly from here on: %s", one_line(exc))
        self.failed = True


def with_eager_fallback(step: Callable[[], T], forward: Callable[..., torch.Tensor]) -> T:
    """`step()`, a forward through `forward` and its backward; when `forward` is a `CompiledForward`
    whose backward graph fails to compile (no gradient is written then), the step once more, eagerly."""
    try:
        return step()
    except COMPILER_ERRORS as exc:
        if not isinstance(forward, CompiledForward) or forward.failed:
            raise
        forward.fall_back(exc)
        return step()
