"""Data-parallel training under torchrun: DDP or FSDP2 (`fully_shard`), chosen by
`train.parallel`, with gloo on CPUs and NCCL on CUDA GPUs.

- The launch: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them the run is one
  process and nothing here touches it (`train.parallel=ddp` on one process is plain training).
- The batch: `train.batch_size` is the *global* micro-batch, so a config means the same training
  on any number of processes; each of N processes takes `batch_size / N` windows of it
  (`WindowLoader`'s rank slice), and N must divide it.
- The model: DDP keeps a full copy per process and averages gradients in backward; FSDP2 shards
  weights, gradients and AdamW's moments over the processes and gathers a block's weights only
  while it runs (each block the schedule applies once is its own unit; looped blocks, embeddings,
  norms and the head form the root unit).
- Checkpoints (train/checkpoint.py): full state dicts gathered to rank 0, in the single-process
  format, or DCP shards that any number of processes read back (`train.checkpoint_format`).

See docs/distributed.md for launch commands.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tango_lm.errors import UserError
from tango_lm.train.device import pick_device
from tango_lm.train.start_vote import StartVote

T = TypeVar("T")


def skips_parameters(arch: str) -> bool:
    """Whether the architecture's forward can leave a parameter without a gradient (an MoE expert
    that got no tokens this step): DDP has to look for such parameters after every backward; FSDP2
    cannot train them."""
    from tango_lm.models.registry import ARCHITECTURES

    return ARCHITECTURES[arch].skips_parameters


_owned_group: list[bool] = []  # non-empty while a process group `setup` formed is alive


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the launch. `parallel` is 'none' for a single process whatever
    the config says."""

    parallel: str = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, writes metrics and writes checkpoint files."""
        return self.rank == 0


def launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) without torchrun."""
    try:
        return (
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")),
        )
    except ValueError:
        raise UserError("RANK, LOCAL_RANK and WORLD_SIZE must be integers; launch with torchrun") from None


def is_main_process() -> bool:
    """True on rank 0 (and without torchrun): where a command should print its results."""
    return launch_env()[0] == 0


def check_launch(run: Any, world_size: int) -> None:
    """UserError for a config that cannot run on `world_size` processes (checked before anything
    is written or any process group is formed)."""
    cfg = run.train
    if cfg.parallel == "fsdp" and world_size < 2:
        raise UserError("train.parallel=fsdp needs torchrun with 2 or more processes; use train.parallel=none")
    if cfg.parallel == "none" and world_size > 1:
        raise UserError(
            f"{world_size} processes were launched but train.parallel=none would train {world_size} copies "
            "into one out_dir; set train.parallel=ddp or train.parallel=fsdp"
        )
    if cfg.batch_size % world_size:
        raise UserError(
            f"train.batch_size={cfg.batch_size} (the global micro-batch) does not split evenly over {world_size} "
            f"processes; set train.batch_size to a multiple of {world_size} or launch a number of processes "
            "that divides it"
        )
    if cfg.parallel == "fsdp" and skips_parameters(run.model.arch):
        # FSDP2 reduce-scatters the gradients a rank has; ranks whose batches skipped different
        # experts would send collectives of different sizes.
        raise UserError(
            f"model.arch={run.model.arch} leaves some parameters without a gradient in a step, which "
            "train.parallel=fsdp cannot reduce; use train.parallel=ddp"
        )
    if cfg.parallel == "fsdp" and run.model.active_width is not None:
        raise UserError(
            "model.active_width (rotating narrow-width training) does not work with train.parallel=fsdp; "
            "use train.parallel=ddp or remove active_width"
        )


def setup(run: Any, start_vote: StartVote | None = None) -> DistEnv:
    """Check the launch, pick this process's device and, under torchrun, join the process group
    (gloo on CPU, NCCL on CUDA; each process takes GPU `LOCAL_RANK`), once every process's checks
    passed (`start_vote`, train/start_vote.py)."""
    rank, local_rank, world_size = launch_env()
    check_launch(run, world_size)
    device = pick_device(run.train.device, "train.device")
    if world_size == 1:
        return DistEnv(device=device)
    backend = "gloo"
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UserError(
                f"process {local_rank} on this node has no GPU of its own ({count} visible); "
                f"set torchrun --nproc-per-node to at most {count}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    if not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:  # WORLD_SIZE set by hand, or by a scheduler, without a rendezvous address
            raise UserError(
                f"WORLD_SIZE={world_size} but {' and '.join(missing)} not set; launch with torchrun "
                "(it sets them), or unset WORLD_SIZE to train in one process"
            )
        if start_vote is not None:
            start_vote.passed()
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        _owned_group.append(True)
    env = DistEnv(run.train.parallel, rank, local_rank, world_size, device)
    # Forming a group is a rendezvous; joining the caller's is not. Either way every process has
    # checked the run directory (train/run_dir.py) before rank 0 writes into it: a process that
    # checked it later found rank 0's files and stopped alone, leaving the others hung.
    barrier(env)
    return env


def teardown() -> None:
    """Leave the process group `setup` formed (one formed by the caller stays)."""
    if _owned_group and dist.is_initialized():
        dist.destroy_process_group()
    _owned_group.clear()


# -- collectives (no-ops on one process) ---------------------------------------------------------
def barrier(env: DistEnv) -> None:
    if env.active:
        dist.barrier()


def all_reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    """Element-wise sums over all processes (float64)."""
    if not env.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def mean_over_ranks(env: DistEnv, value: float) -> float:
    """The mean of `value` over processes: with equal token counts per process, the mean of the
    per-process mean losses is the global batch's mean loss."""
    if not env.active:
        return value
    return all_reduce_sum(env, [value])[0] / env.world_size


def mean_over_ranks_on_device(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    """`mean_over_ranks` of each element of a float64 tensor on `env.device`, left on the device:
    one collective for them all, and no wait for the host (the caller reads the result once)."""
    if not env.active:
        return values
    summed = values.clone()
    dist.all_reduce(summed)
    return summed / env.world_size


# What a collective says when the process at the other end is gone (gloo's transport; NCCL's
# remote errors). Not every DistError: NCCL out of memory or a port in use are this process's own.
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "Connection was likely closed",  # the rendezvous store's
    "Read timeout",
    "Write timeout",
    "Timed out waiting",
    "ncclRemoteError",
    "remote process exited",
)


def lost_contact(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another process stopped (on its own error,
    or killed): only under a launch of several processes."""
    return launch_env()[2] > 1 and isinstance(exc, RuntimeError) and any(words in str(exc) for words in PEER_GONE)


def check_same_step(env: DistEnv, step: int, ckpt_root: Any) -> None:
    """Every process resumed from the same step: one that found another checkpoint (or none, its
    out_dir not on the disk the others share) would train on another data position and learning
    rate and average wrong gradients into the run."""
    if not env.active:
        return
    steps = [int(s) for s in all_reduce_sum(env, [step if r == env.rank else 0 for r in range(env.world_size)])]
    if len(set(steps)) > 1:
        found = ", ".join(f"process {r}: step {s}" for r, s in enumerate(steps))
        raise UserError(
            f"the processes found different latest checkpoints in {ckpt_root} ({found}); put "
            "train.out_dir on a disk every process shares"
        )


def on_rank_0(
    env: DistEnv, action: Callable[[], T], what: str, errors: tuple[type[BaseException], ...] = (UserError,)
) -> T | None:
    """`action()` on rank 0 alone (what only it writes or reads), and every process told whether it
    raised one of `errors`: rank 0 then stops with its own error, the others with "rank 0 could not
    {what}", each in one line, not at the next collective's broken pipe. Rank 0's result; None elsewhere."""
    failure: BaseException | None = None
    result = None
    if env.is_main:
        try:
            result = action()
        except errors as exc:
            failure = exc
    if broadcast_int(env, int(failure is not None)):
        raise failure or UserError(f"rank 0 could not {what}; its error says why")
    return result


def broadcast_int(env: DistEnv, value: int) -> int:
    """Rank 0's `value` on every process."""
    if not env.active:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=env.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def grad_norm_tensor(norm: torch.Tensor) -> torch.Tensor:
    """The clipped-gradient norm as a plain tensor (under FSDP2 it is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# -- wrapping ------------------------------------------------------------------------------------
class NLLForward(nn.Module):
    """DDP syncs the gradients of what runs through its `forward`; this makes `model.nll` it.
    Holds no parameters of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.nll(inputs, targets)


def wrap_ddp(model: nn.Module, env: DistEnv, arch: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        NLLForward(model),
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=skips_parameters(arch),
    )


def shard_fsdp(model: nn.Module) -> None:
    """`fully_shard` in place: each block the backbone applies exactly once is a unit of its own,
    the root takes the rest. A looped block runs several times per forward, so it stays in the
    root unit (gathered for the whole forward) rather than relying on re-gathering per use; so do
    the layers of an architecture whose layers return no tensors (`layers_return_tensors`)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from tango_lm.models.registry import ARCHITECTURES

    backbone = getattr(model, "backbone", None)
    layers, schedule = getattr(backbone, "layers", None), getattr(backbone, "schedule", None)
    arch = ARCHITECTURES.get(getattr(getattr(model, "config", None), "arch", ""))
    per_layer = arch is None or arch.layers_return_tensors
    if per_layer and isinstance(layers, nn.ModuleList) and schedule is not None:
        for index, layer in enumerate(layers):
            if list(schedule).count(index) == 1:
                fully_shard(layer)
    fully_shard(model)
    # Training and evaluation call `model.nll`, not `forward`: gather the root's weights for it.
    register_fsdp_forward_method(model, "nll")


def grad_sync(ddp: nn.Module | None, enabled: bool) -> contextlib.AbstractContextManager:
    """DDP: skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if ddp is None or enabled:
        return contextlib.nullcontext()
    return ddp.no_sync()


# -- state dicts for checkpoints -----------------------------------------------------------------
def _full_options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


@contextlib.contextmanager
def _no_phantom_step(optimizer: torch.optim.Optimizer) -> Any:
    """torch.distributed.checkpoint's state-dict helpers give an optimizer without state (no update
    applied yet: every step so far skipped as non-finite) one by running a step at lr 0: AdamW then
    counted a step never taken, and bias-corrected every later one for it. Its step count is set
    back to 0 here, in the optimizer and in the state dicts appended to the list this yields: step
    0 with the zero moments that step left is exactly AdamW's fresh state."""
    empty, out = not optimizer.state, []
    yield out
    if empty:
        for state in [*optimizer.state.values(), *(s for d in out for s in d.values())]:
            if isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the order `Optimizer.state_dict()` numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_model_state(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """The whole model's weights. Under FSDP every process must call this (it gathers); the
    result is on rank 0 (other ranks get an empty dict)."""
    if env.parallel != "fsdp":
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> dict[str, Any]:
    """The optimizer state in `Optimizer.state_dict()`'s format (parameters numbered in group
    order) whatever the parallelism, so a checkpoint resumes on any number of processes. Under
    FSDP every process must call this; the result is on rank 0."""
    if env.parallel != "fsdp":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _no_phantom_step(optimizer) as out:
        named = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
        out.append(named.get("state", {}) if named else {})
    if not named:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    state = sorted(((index[n], s) for n, s in named["state"].items()), key=lambda item: item[0])
    return {
        "state": dict(state),
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Load whole-model weights (every process passes the same full dict)."""
    if env.parallel != "fsdp":
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_full_options())


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], env: DistEnv
) -> None:
    """Inverse of `full_optimizer_state` (every process passes the same full dict). ValueError for
    a state of other parameters (PyTorch's fused AdamW read a moment of the wrong shape out of
    bounds: a native crash, after the resume had begun)."""
    check_optimizer_shapes(optimizer, state)
    if env.parallel != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _param_names(model, optimizer)
    if len(state["param_groups"]) != len(optimizer.param_groups) or sum(
        len(g["params"]) for g in state["param_groups"]
    ) != len(names):
        raise ValueError("the saved optimizer has a different set of parameters")
    named = {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    # A state saved before any update is empty: loading it must not leave the helper's lr-0 step.
    with _no_phantom_step(optimizer) if not named["state"] else contextlib.nullcontext():
        set_optimizer_state_dict(model, optimizer, named, options=_full_options())


def check_optimizer_shapes(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """ValueError unless `state` (a full optimizer state dict) holds as many parameters per group
    as `optimizer` and each per-parameter tensor (AdamW's moments) has its parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = state.get("param_groups")
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
        len(g["params"]) for g in optimizer.param_groups
    ]:
        raise ValueError("the saved optimizer has a different set of parameters")
    for index, saved in (state.get("state") or {}).items():
        if not 0 <= int(index) < len(params) or not isinstance(saved, dict):
            raise ValueError(f"the saved optimizer's state {index!r} is of no parameter of this model")
        shape = tuple(params[int(index)].shape)  # a DTensor's is the full one, as saved
        for key, value in saved.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise ValueError(
                    f"the saved optimizer's {key} of parameter {int(index)} has shape {tuple(value.shape)}, not {shape}"
                )


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict]]:
    """(tensors, param_groups): this process's weights and optimizer-state tensors keyed by
    parameter name, for DCP (shards under FSDP, full tensors otherwise), and the optimizer's
    hyperparameter groups (plain values, stored in train_state.pt so DCP holds tensors only)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    with _no_phantom_step(optimizer) as out:
        optim = get_optimizer_state_dict(model, optimizer)
        out.append(optim["state"])
    return {"model": get_model_state_dict(model), "optimizer": optim["state"]}, optim["param_groups"]


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, Any], param_groups: list[dict]
) -> None:
    """Put what `sharded_state` returned (after DCP filled it in) back into model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, tensors["model"])
    set_optimizer_state_dict(model, optimizer, {"state": tensors["optimizer"], "param_groups": param_groups})


__all__ = [
    "DistEnv",
    "NLLForward",
    "all_reduce_sum",
    "barrier",
    "broadcast_int",
    "check_launch",
    "full_model_state",
    "full_optimizer_state",
    "grad_norm_tensor",
    "grad_sync",
    "is_main_process",
    "launch_env",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_sharded_state",
    "mean_over_ranks",
    "mean_over_ranks_on_device",
    "setup",
    "shard_fsdp",
    "sharded_state",
    "teardown",
    "wrap_ddp",
]
