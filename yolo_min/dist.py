"""Process-group plumbing for torchrun. Nothing is read or initialised at import.

`setup()` reads RANK / LOCAL_RANK / WORLD_SIZE (absent: one process, rank 0), picks the device and
backend (nccl on CUDA, gloo on CPU), initialises the group and returns a frozen `DistInfo`.
Every helper below is a no-op (or the identity) when no process group is initialised, so the same
code runs at world size 1. Rank 0 is the main process in every mode.
Holds no launcher (torchrun starts the processes), no global rank state and no training logic.
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
    """This process in the run: global rank, local_rank (its GPU on the node), world_size, torch device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0, the main process (it prints and writes files)."""
        return self.rank == 0


def local_world_size() -> int:
    """Processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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
        timeout = datetime.timedelta(seconds=timeout_s)
        # torchrun's agent keeps one key-value store across restarts: a key prefix per attempt stops a restarted
        # group from reading the addresses of the dead one it replaces (pytorch/pytorch#135712)
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        store.set_timeout(timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"yolo_min/attempt{attempt}", store), rank=rank,
                                world_size=world_size, timeout=timeout)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def cleanup() -> None:
    """Destroy the process group, if one was initialised (call it in a `finally`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def is_main() -> bool:
    """True on rank 0 (and without a process group)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait until every rank gets here (no-op at world size 1)."""
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


def run_on_main(fn, *args):
    """fn(*args) on rank 0 and its result on every rank. A ValueError (a ConfigError, ...) raised there is
    raised on every rank (pickled across), so no rank waits in a collective for one that gave up."""
    out = (None, None)
    if is_main():
        try:
            out = (fn(*args), None)
        except ValueError as e:
            out = (None, e)
    result, error = broadcast_object(out)
    if error is not None:
        raise error
    return result


@contextlib.contextmanager
def main_first():
    """Run the body on local rank 0 first, then on the others: e.g. build a cache once. The others are
    released even when the body raises on rank 0 (they then run it, typically to the same error)."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        barrier()
    try:
        yield
    finally:
        if first:
            barrier()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)
