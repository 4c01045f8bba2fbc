"""Processes, devices and model wrapping for torchrun (one process per GPU, any number of nodes).

Without torchrun's environment (RANK/WORLD_SIZE) the trainer runs as a single process and no
process group is created. Backend: nccl on CUDA, gloo on CPU; a second gloo group carries the
stop flag of a signal so that agreeing on it never waits for the GPU.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from dflash.runtime.devices import resolve_device
from dflash.runtime.signals import check_stop, stop_requested
from torch import nn


@dataclass
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    control_group: Any = None
    """A gloo group for small CPU-side agreements (the stop flag)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None) -> DistInfo:
    """Join torchrun's process group when there is one, and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)  # None: this rank's GPU (LOCAL_RANK) when CUDA is available, else cpu
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30), **kwargs)
    if world_size > 1:
        info.control_group = dist.new_group(backend="gloo") if dev.type == "cuda" else dist.group.WORLD
    return info


def shutdown_distributed(*, wait: bool = True) -> None:
    """Leave the process group, after a last barrier with the peers when `wait` (a finished run);
    a stopped or failed run leaves at once: a peer may never come to that barrier."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def wrap_model(model: nn.Module, parallel: str, info: DistInfo) -> nn.Module:
    """DDP (replicated) or FSDP2 (sharded); as is on one process.

    FSDP shards the whole drafter as one unit: its forward projects the fused context through
    every layer's k/v before any layer runs, so a per-layer unit would be used outside its own
    forward. Parameters are gathered for the forward and the backward; gradients and the AdamW
    state (3/4 of the training memory of the weights) stay sharded. The head's modules
    (`DraftHead.sharded_units`: DFlash2's candidate selector, DSpark's Markov embedding and
    projection and its confidence head, XPress's refiner, LiLiCorr's correlator) are units of their
    own: the loss calls them after the drafter's forward, on the drafter's states, so their own
    calls gather their parameters (they are not left to the drafter's unit staying gathered after
    its forward) and their backward reduce-scatters their gradients. Like the drafter's unit they
    stay gathered until that backward: the held-out evaluation calls them once per anchor chunk, a
    number that differs between ranks, and a gather per call would wait forever.
    """
    if not info.distributed:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in model.head.sharded_units(model):
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The frozen embedding and lm_head are buffers: identical on every rank, never re-broadcast.
    ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=ids, broadcast_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo, *,
               with_optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state dicts on the CPU, keyed by parameter name.

    Collective: every rank calls it; rank 0 gets the result, other ranks empty dicts (with
    cpu_offload only rank 0 keeps a copy). The keys do not depend on the wrapping or the world
    size, so any run can load them.
    """
    # Imported here: torch.distributed.checkpoint is slow to import and only sharded runs need it.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=full)
    optim_state = get_optimizer_state_dict(model, optimizer, options=full) if with_optimizer else {}
    return model_state, optim_state


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict[str, Any],
                    optim_state: dict[str, Any] | None) -> None:
    """Load full state dicts (from `full_state`) into a possibly wrapped or sharded model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def all_reduce_sum(values: list[float] | torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a vector over ranks (returns a float64 CPU tensor)."""
    t = torch.as_tensor(values, dtype=torch.float64)
    if info.distributed:
        work = t.to(info.device) if info.device.type == "cuda" else t
        dist.all_reduce(work)
        t = work.cpu()
    return t


def all_gather_rows(rows: list[list[float]], info: DistInfo) -> list[list[float]]:
    """Every rank's rows, concatenated in rank order (through the CPU control group)."""
    if not info.distributed:
        return list(rows)
    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, rows, group=info.control_group)
    return [row for part in parts for row in part]


def any_rank(flag: int, info: DistInfo) -> int:
    """The largest of one small integer over ranks, through the CPU control group (`wait_for_peers`)."""
    if not info.distributed:
        return flag
    t = torch.tensor([flag], dtype=torch.int64)
    wait_for_peers(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.control_group, async_op=True))
    return int(t.item())


def barrier(info: DistInfo) -> None:
    if info.distributed:
        wait_for_peers(dist.barrier(group=info.control_group, async_op=True))


PEER_POLL_SECONDS = 0.05
PEER_STOP_GRACE_SECONDS = 3.0
"""How long a rank at an agreement point still waits for its peers once a stop was requested:
they come within it when they stop too (the step's agreement, then the checkpoint)."""


def wait_for_peers(work: Any) -> None:
    """Wait for a collective of the CPU agreement points in Python, looking every 50 ms, not inside
    gloo (where no signal handler runs until the group's 30-minute timeout): a peer that does not
    come (it waits for a part, or is gone) cannot hold a stop. Once a stop was requested and the
    peers have not come within PEER_STOP_GRACE_SECONDS, raises `StopWaiting` (`check_stop`); a
    signal that stops at once (`stop_at_once`: startup, the export) raises in the sleep."""
    stop_seen = None
    while not work.is_completed():
        if stop_requested():
            stop_seen = stop_seen or time.monotonic()
            if time.monotonic() - stop_seen >= PEER_STOP_GRACE_SECONDS:
                check_stop("the other ranks at a collective agreement point (a rank that waits for data, or is gone)")
        time.sleep(PEER_POLL_SECONDS)
    work.wait()  # the collective's own error, if any
