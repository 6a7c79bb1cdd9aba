"""torchrun plumbing, the only module of yolo_min that knows ranks. Without a process group every
helper is the identity or a no-op, so the same code runs in one process."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import NamedTuple

import torch
import torch.distributed as dist


class DistInfo(NamedTuple):
    """This process: rank (0: the main one), world size, local world size (on its node), device."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device  # under torchrun: its node's GPU local_rank


def select_device(device: str = "") -> torch.device:
    """'' -> cuda:0 if available else cpu; 'cpu'; 'cuda'; '0' or 'cuda:1'."""
    device = str(device).strip().lower() or ("cuda:0" if torch.cuda.is_available() else "cpu")
    device = f"cuda:{device}" if device.isdigit() else device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for CUDA, but torch sees no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device (cpu, cuda, 0, cuda:1, ...)") from None


def setup(device: str = "") -> DistInfo:
    """This process's DistInfo from torchrun's environment (none: one process) and process group."""
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dev = select_device(device)
    if world_size > 1 and dev.type == "cuda":
        if (n := torch.cuda.device_count()) < local_size:  # every rank stops; rank 0 says why
            why = f"torchrun started {local_size} processes on a node with {n} GPU(s)"
            raise ValueError(f"{why}: --nproc_per_node {n}, or --device cpu")
        dev = torch.device("cuda", local_rank)  # under torchrun each rank owns one GPU
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        # torchrun's agent keeps one store across restarts: a key prefix per attempt stops a
        # restarted group from reading the addresses of the dead one (pytorch/pytorch#135712)
        kw = dict(rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10))
        store, _, _ = next(dist.rendezvous("env://", **kw))  # a TCPStore with this timeout
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"yolo_min/attempt{attempt}", store)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, **kw)
    return DistInfo(rank, world_size, local_size, dev)


def torchrun_id() -> str | None:
    """Under torchrun, an id of this run that survives its restarts (None without torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # "none": a static rendezvous, whose rank 0's launcher lives through the restarts
    return f"{socket.gethostname()}:{os.getppid()}" if run_id == "none" else run_id


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    return not _active() or dist.get_rank() == 0


def barrier() -> None:
    if _active():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order."""
    out = [obj] * (dist.get_world_size() if _active() else 1)
    if _active():
        dist.all_gather_object(out, obj)
    return out


def broadcast_tensors(tensors) -> None:
    """Overwrite each tensor in place with rank 0's (e.g. a model's state_dict values)."""
    for t in tensors if _active() else ():
        dist.broadcast(t, 0)


def reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over the ranks (a copy)."""
    t = t.detach().clone()
    if _active():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def run_on_main(fn, *args):
    """fn(*args) on rank 0, its result on every rank; a ValueError there is raised on every rank."""
    # so that no rank is left waiting in a collective for one that gave up
    box = [None]  # rank 0's result, or the ValueError it raised
    if is_main():
        try:
            box = [fn(*args)]
        except ValueError as e:
            box = [e]
    if _active():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ValueError):
        raise box[0]
    return box[0]


@contextlib.contextmanager
def main_first():
    """The body on each node's local rank 0 first (e.g. to build a cache), then on the others."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        barrier()
    try:
        yield
    finally:  # the others are released even when the body raises on local rank 0
        if first:
            barrier()


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)
