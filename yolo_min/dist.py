"""torchrun plumbing, the only module of yolo_min that knows ranks. Without a process group every
helper is the identity or a no-op, so the same code runs in one process."""

import contextlib
import datetime
import os
import socket
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist


class DistInfo(NamedTuple):
    """This process: rank (0: the main one), world size, local world size (on its node), device."""

    rank: int
    world_size: int
    local_world_size: int
    # Under torchrun: its node's GPU local_rank.
    device: torch.device


def select_device(device):
    """'' -> cuda:0 if available else cpu; 'cpu'; 'cuda'; '0' or 'cuda:1'."""
    given = str(device).strip()
    name = given.lower()
    if not name:
        name = "cuda:0" if torch.cuda.is_available() else "cpu"
    if name.isdigit():
        name = f"cuda:{name}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {given} asks for CUDA, but torch sees no CUDA device")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"--device {given}: not a device (cpu, cuda, 0, cuda:1, 0,1, ...)"
        ) from None


def listed_gpus(device, local_rank, local_world_size, world_size):
    """--device '0,1': under torchrun, the GPU of this local rank ('1' for local rank 1); the list's
    length must be the node's process count. One process: ValueError with the command to use."""
    ids = [gpu.strip() for gpu in str(device).split(",")]
    if not all(gpu.isdigit() for gpu in ids):
        raise ValueError(f"--device {device}: not a list of GPU indices (0,1,...)")
    if world_size == 1:
        script = "your_script.py"
        if sys.argv[0].endswith(".py"):
            script = " ".join(sys.argv)
        raise ValueError(
            f"--device {device}: one process per GPU, started by torchrun: "
            f"torchrun --standalone --nproc_per_node {len(ids)} {script}"
        )
    if len(ids) != local_world_size:
        raise ValueError(
            f"--device {device} lists {len(ids)} GPUs, "
            f"but torchrun started {local_world_size} processes on this node"
        )
    return ids[local_rank]


def _environ_int(name, default=0):
    """The integer in the environment variable name (torchrun's), default when it is unset."""
    return int(os.environ.get(name, default))


def setup(device):
    """This process's DistInfo from torchrun's environment (none: one process) and process group."""
    rank = env_rank()
    local_rank = _environ_int("LOCAL_RANK")
    world_size = _environ_int("WORLD_SIZE", 1)
    local_size = _environ_int("LOCAL_WORLD_SIZE", 1)
    listed = "," in str(device)
    if listed:
        device = listed_gpus(
            device,
            local_rank=local_rank,
            local_world_size=local_size,
            world_size=world_size,
        )
    chosen = select_device(device)
    if world_size > 1 and chosen.type == "cuda":
        n_gpus = torch.cuda.device_count()
        # Every rank stops; rank 0's message is the one shown.
        if n_gpus < local_size:
            raise ValueError(
                f"torchrun started {local_size} processes on a node with {n_gpus} GPU(s): "
                f"--nproc_per_node {n_gpus}, or --device cpu"
            )
        if not listed:
            # Under torchrun each rank owns one GPU: its local rank's, unless listed.
            chosen = torch.device("cuda", local_rank)
        torch.cuda.set_device(chosen)
    if world_size > 1 and not dist.is_initialized():
        # Join torchrun's process group through a store of this group's own: torchrun's agent
        # keeps one store across restarts and across the groups a script makes one after another
        # (YOLO.train, then .val). A key prefix per attempt and group stops a new group from
        # reading the addresses of an old one (pytorch/pytorch#135712).
        options = {
            "rank": rank,
            "world_size": world_size,
            "timeout": datetime.timedelta(minutes=10),
        }
        # A TCPStore with this timeout.
        store, _, _ = next(dist.rendezvous("env://", **options))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        group = store.add(f"yolo_min/attempt{attempt}/groups_of_rank{rank}", 1)
        store = dist.PrefixStore(f"yolo_min/attempt{attempt}/group{group}", store)
        backend = "nccl" if chosen.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, **options)
    return DistInfo(rank, world_size, local_size, device=chosen)


def torchrun_id():
    """Under torchrun, an id of this run that survives its restarts (None without torchrun)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # "none": a static rendezvous, whose rank 0's launcher lives through the restarts.
    if run_id == "none":
        return f"{socket.gethostname()}:{os.getppid()}"
    return run_id


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def _active():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main():
    return not _active() or dist.get_rank() == 0


def barrier():
    if _active():
        dist.barrier()


def all_gather_object(obj):
    """Every rank's `obj`, in rank order."""
    if not _active():
        return [obj]
    out = [obj] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_tensors(tensors):
    """Overwrite each tensor in place with rank 0's (e.g. a model's state_dict values)."""
    if _active():
        for tensor in tensors:
            dist.broadcast(tensor, 0)


def reduce_mean(tensor):
    """The mean of a tensor over the ranks (a copy)."""
    mean = tensor.detach().clone()
    if _active():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return mean


def run_on_main(fn, *args):
    """fn(*args) on rank 0, its result on every rank; a ValueError there is raised on every rank."""
    # Rank 0's result, or the ValueError it raised: every rank gets it, so that no rank is left
    # waiting in a collective for one that gave up.
    box = [None]
    if is_main():
        try:
            box = [fn(*args)]
        except ValueError as error:
            box = [error]
    if _active():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ValueError):
        raise box[0]
    return box[0]


@contextlib.contextmanager
def main_first():
    """The body on each node's local rank 0 first (e.g. to build a cache), then on the others."""
    first = _environ_int("LOCAL_RANK") == 0
    if not first:
        barrier()
    try:
        yield
    finally:
        # The others are released even when the body raises on local rank 0.
        if first:
            barrier()


def env_rank():
    """This process's rank as torchrun set it (0 without torchrun), with or without a group."""
    return _environ_int("RANK")


def print0(*args, **kwargs):
    if is_main():
        print(*args, **kwargs, flush=True)
