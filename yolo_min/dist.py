"""Process-group plumbing for torchrun. Nothing is read or initialised at import.

`setup()` reads RANK / LOCAL_RANK / WORLD_SIZE (absent: one process, rank 0), picks the device and
backend (nccl on CUDA, gloo on CPU), initialises the group and returns a frozen `DistInfo`.
Every helper below is a no-op (or the identity) when no process group is initialised, so the same
code runs at world size 1. Rank 0 is the main process in every mode.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def select_device(device: str = "") -> torch.device:
    """'' -> cuda:0 if available else cpu; 'cpu'; 'cuda'; '0' or 'cuda:1'. Asking for CUDA without it is an error."""
    device = str(device).strip().lower()
    if device in ("", "auto"):
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.isdigit():
        device = f"cuda:{device}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for CUDA, but torch sees no CUDA device (use --device cpu)")
    return torch.device(device)


def setup(device: str = "", timeout_s: float = 600) -> DistInfo:
    """Initialise the process group when launched by torchrun and return this process's facts."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = select_device(device)
    if world_size > 1 and dev.type == "cuda":
        dev = torch.device("cuda", local_rank)  # under torchrun each rank owns one GPU
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if _active() else 0


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if _active():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order (a one-element list at world size 1)."""
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_tensors(tensors, src: int = 0) -> None:
    """Overwrite each tensor, in place, with rank `src`'s (e.g. every tensor of a model's state_dict)."""
    if _active():
        for t in tensors:
            dist.broadcast(t, src)


def reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; the input is untouched)."""
    t = t.detach().clone()
    if _active():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor over ranks (a copy)."""
    t = t.detach().clone()
    if _active():
        dist.all_reduce(t)
    return t


@contextlib.contextmanager
def main_first(local: bool = True):
    """Run the body on (local) rank 0 first, then on the others: e.g. build a cache once."""
    first = (int(os.environ.get("LOCAL_RANK", "0")) if local else get_rank()) == 0
    if not first:
        barrier()
    yield
    if first:
        barrier()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)
