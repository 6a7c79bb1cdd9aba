"""Run folders and training checkpoints: what a run saves, how it is restored, the atomic write,
and the checks a checkpoint passes before --resume uses it."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import yaml

from .safe_load import CheckpointError, fitting_model, one_line_errors, read_checked

RUN_ID_FILE = ".torchrun_id"  # in a run folder: the torchrun run that made it


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, ...); the previous one is intact."""


def next_run_dir(project: str | Path, name: str, exist_ok: bool = False) -> Path:
    """project/name, or the first free project/name2, name3, ... (project/name with exist_ok)."""
    path, n = Path(project) / name, 2
    while path.exists() and not exist_ok:
        path, n = Path(project) / f"{name}{n}", n + 1
    return path


def find_run_dir(project: str | Path, run_id: str | None) -> Path | None:
    """The run folder that the torchrun run `run_id` made under project before a restart."""
    marks = Path(project).glob(f"*/{RUN_ID_FILE}") if run_id else ()
    return next((m.parent for m in marks if m.read_text() == run_id), None)


def make_run_dir(args, hyp: dict, run_id: str | None, need_bytes: int) -> Path:
    """Make the run folder (a resumed or restarted run's own) with weights/, args.yaml and hyp.yaml;
    fail early if it is unwritable or its disk has less than need_bytes free."""
    own = find_run_dir(args.project, run_id) or args.resume and Path(args.resume).parent.parent
    path = own or next_run_dir(args.project, args.name, args.exist_ok)  # own: its last.pt's run
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    if free < need_bytes:
        need = f"checkpoints need about {need_bytes / 1e6:.0f} MB"
        raise ValueError(f"{path}: only {free / 1e6:.1f} MB free on disk, {need}")
    try:
        (path / "weights").mkdir(parents=True, exist_ok=True)
        (path / "args.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))
        (path / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False))
        (path / RUN_ID_FILE).write_text(run_id or "")
    except OSError as e:
        raise ValueError(f"cannot write the run folder {path}: {e}") from None
    return path


def find_resume(args, run_id: str | None) -> tuple[str, dict] | None:
    """(path, checkpoint) to continue from: --resume (a last.pt, or the newest under --project),
    or after a torchrun restart this run's own last.pt. None: a new run."""
    own = find_run_dir(args.project, run_id)
    if args.resume is True:
        path = max(Path(args.project).glob("*/weights/last.pt"), key=os.path.getmtime, default=None)
        if path is None:
            raise ValueError(f"--resume: no run with a weights/last.pt under {args.project}")
    elif args.resume:
        path = Path(args.resume)
    elif own and (path := own / "weights" / "last.pt").is_file():
        print(f"torchrun restart: resuming from {path}", flush=True)
    else:
        return None
    return str(path), load(path)


# ---------------------------------------------------------------- what a run saves
def rng_state() -> dict:
    """This process's random states (python, numpy, torch, CUDA) as plain values."""
    name, keys, *rest = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), *rest]}
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return state | {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, np.uint32), *rest))
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(model, ema, optimizer, scaler, epoch, best, args, hyp, rngs) -> dict:
    """All a run needs to continue; epoch: the last finished (0-based), best: (fitness, epoch)."""
    # tensors on the CPU: a file written on a GPU loads anywhere with torch.load
    state = dict(model_cfg=model.yaml, names=list(model.names), task=model.task)
    state |= dict(model=_cpu(model.state_dict()), ema=_cpu(ema.ema.state_dict()))
    state |= dict(optimizer=_cpu(optimizer.state_dict()), scaler=scaler.state_dict())
    state |= dict(ema_updates=ema.updates, epoch=epoch, best_fitness=best[0], best_epoch=best[1])
    return state | dict(args=vars(args), hyp=hyp, rng=dict(world_size=len(rngs), ranks=rngs))


def _cpu(state: dict) -> dict:
    """A (nested) state_dict with its tensors on the CPU."""
    cpu = {k: _cpu(v) if isinstance(v, dict) else v for k, v in state.items()}
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in cpu.items()}


def restore(ckpt: dict, model, ema, optimizer, scaler, rank: int, world_size: int) -> bool:
    """Load what `training_state` saved into fresh training objects and this rank's random states:
    False if the saved world size differs (not restored), CheckpointError if it does not fit."""
    with one_line_errors("cannot restore its training state: "):
        model.load_state_dict(ckpt["model"])
        ema.ema.load_state_dict(ckpt["ema"])
        ema.updates = ckpt["ema_updates"]
        kinds = [{k: type(v) for k, v in g.items()} for g in optimizer.param_groups]
        optimizer.load_state_dict(ckpt["optimizer"])  # its settings replace ours: same types?
        state = [(p, v) for p, s in optimizer.state.items() for v in s.values()]
        ok = all(torch.is_tensor(v) and v.shape in (p.shape, ()) for p, v in state)  # Adam: step
        if not ok or kinds != [{k: type(v) for k, v in g.items()} for g in optimizer.param_groups]:
            raise CheckpointError("its optimizer state does not fit this model's optimizer")
        if ckpt["scaler"]:  # empty when saved without a CUDA scaler
            scaler.load_state_dict(ckpt["scaler"])
        if same_size := ckpt["rng"]["world_size"] == world_size:
            set_rng_state(ckpt["rng"]["ranks"][rank])
    return same_size


def save(state: dict, path: str | Path) -> None:
    """torch.save atomically: a crash, kill or full disk (SaveError) leaves the old file whole."""
    tmp = Path(f"{path}.tmp")  # written, fsynced, then renamed over path
    # SIGINT and SIGTERM take effect once the write is done: a KeyboardInterrupt inside torch.save
    # would break its zip writer
    held, signals = [], (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in signals}
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise SaveError(f"cannot write {path} ({e}); the previous one is intact") from None
    finally:
        tmp.unlink(missing_ok=True)  # what a failed write left
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)


# what `training_state` saves, by type: a file to --resume from must hold these
RESUME_TYPES = dict.fromkeys("model_cfg model ema optimizer scaler args hyp rng".split(), dict)
RESUME_TYPES |= dict(epoch=int, best_epoch=int, ema_updates=int, best_fitness=(int, float))


def load(path: str | Path) -> dict:
    """A yolo_min training checkpoint for --resume, checked as `training_state` saves it."""
    ckpt = read_checked(path)
    with one_line_errors(f"{path}: "):
        ok = type(ckpt) is dict and all(isinstance(ckpt.get(k), t) for k, t in RESUME_TYPES.items())
        ok = ok and min(ckpt["epoch"], ckpt["best_epoch"], ckpt["ema_updates"]) >= 0
        ok = ok and all(type(v) in (int, float) for v in ckpt["scaler"].values())
        if not ok or not 0 < len(ckpt["rng"]["ranks"]) == ckpt["rng"]["world_size"]:
            raise CheckpointError("its values are not of the types and ranges train.py saves")
        fitting_model(ckpt["model_cfg"], ckpt["model"])
    return ckpt
