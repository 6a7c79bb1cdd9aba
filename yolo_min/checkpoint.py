"""Run folders and training checkpoints: what a run saves, how it is restored, the atomic write,
and the checks a checkpoint passes before --resume uses it."""

import contextlib
import os
import random
import shutil
import signal
import socket
import threading
from pathlib import Path

import numpy as np
import torch
import yaml

from .files import FileError, read_text, read_yaml
from .safe_load import CheckpointError, fitting_model, one_line_errors, read_checked

# in a run folder: the torchrun run that made it
RUN_ID_FILE = ".torchrun_id"
# in a run folder while a training writes it: pid, host, torchrun run id
LOCK_FILE = "train.lock"
# the lock files this process took, in the order taken (a dict as an ordered set of paths)
HELD_LOCKS = {}


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, ...); the previous one is intact."""


def next_run_dir(project, name, exist_ok):
    """project/name, or the first free project/name2, name3, ... (project/name with exist_ok)."""
    path = Path(project) / name
    n = 2
    while path.exists() and not exist_ok:
        path = Path(project) / f"{name}{n}"
        n += 1
    return path


def find_run_dir(project, run_id):
    """The run folder that the torchrun run `run_id` made under project before a restart."""
    if not run_id:
        return None
    for mark in Path(project).glob(f"*/{RUN_ID_FILE}"):
        if _read_small(mark) == run_id:
            return mark.parent
    return None


def _read_small(path):
    """A small marker file's text (a run id, a lock); None if it is not such a file."""
    try:
        return read_text(path, 4096)
    except FileError:
        return None


def make_run_dir(args, hyp, run_id, need_bytes):
    """Make the run folder (a resumed or restarted run's own) with weights/, args.yaml and hyp.yaml;
    fail early if it is unwritable or its disk has less than need_bytes free."""
    own = find_run_dir(args.project, run_id)
    # a resumed run's own: its last.pt's run
    if not own and args.resume:
        own = Path(args.resume).parent.parent
    path = own or next_run_dir(args.project, args.name, args.exist_ok)
    # the folder's disk, or that of its nearest parent that exists
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    if free < need_bytes:
        raise ValueError(
            f"{path}: only {free / 1e6:.1f} MB free on disk,"
            f" checkpoints need about {need_bytes / 1e6:.0f} MB"
        )
    try:
        (path / "weights").mkdir(parents=True, exist_ok=True)
        # before anything in it is written: a folder another training writes is not touched
        lock_run(path, run_id)
        (path / "args.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))
        (path / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False))
        (path / RUN_ID_FILE).write_text(run_id or "")
    except OSError as e:
        raise ValueError(f"cannot write the run folder {path}: {e}") from None
    return path


def find_resume(args, run_id):
    """(path, checkpoint) to continue from: --resume (a run's last.pt, or the newest run's under
    --project), or after a torchrun restart this run's own last.pt. None: a new run. The run
    folder is locked (`lock_run`) for this process."""
    own = find_run_dir(args.project, run_id)
    # train.py's options: the keys of a run's args.yaml
    keys = set(vars(args))
    if args.resume is True:
        path = newest_run(args.project, keys) / "weights" / "last.pt"
    elif args.resume:
        path = Path(args.resume)
    elif own and (path := own / "weights" / "last.pt").is_file():
        print(f"torchrun restart: resuming from {path}", flush=True)
    else:
        return None
    if path.exists() and not path.is_file():
        raise ValueError(f"--resume {path}: not a regular file")
    ckpt = load(path)
    lock_run(run_folder(path, keys), run_id)
    return str(path), ckpt


def is_run_dir(path, keys):
    """Whether path is a run folder as train.py makes them: weights/ beside an args.yaml of
    train.py's options (keys)."""
    try:
        stored = read_yaml(path / "args.yaml")
    except FileError:
        return False
    return isinstance(stored, dict) and set(stored) == keys and (path / "weights").is_dir()


def run_folder(last, keys):
    """The run folder of a <run>/weights/last.pt; ValueError unless last is one: --resume writes
    into the folder (args.yaml, results.csv, the checkpoints) and no other."""
    run = last.parent.parent
    in_weights = last.name == "last.pt" and last.parent.name == "weights"
    if not (in_weights and is_run_dir(run, keys)):
        raise ValueError(
            f"--resume {last}: not a run's weights/last.pt (train.py writes <run>/weights/last.pt"
            " beside its <run>/args.yaml); to start from its weights use --weights"
        )
    return run


def newest_run(project, keys):
    """The run under project that was started, resumed or saved last (the newest of its args.yaml
    and weights/last.pt); ValueError if there is none, or if it has no last.pt: an older run is
    never continued in its place."""
    runs = [d for d in Path(project).glob("*") if is_run_dir(d, keys)]
    if not runs:
        raise ValueError(f"--resume: no run with a weights/last.pt under {project}")
    newest = max(runs, key=_last_active)
    if not (newest / "weights" / "last.pt").is_file():
        raise ValueError(
            f"--resume: the newest run under {project}, {newest}, has no weights/last.pt (stopped"
            " before its first epoch ended): start it again, or --resume a run's last.pt"
        )
    return newest


def _last_active(run):
    """When a run folder was last started, resumed (args.yaml) or saved (weights/last.pt)."""
    files = [run / "args.yaml", run / "weights" / "last.pt"]
    return max(f.stat().st_mtime for f in files if f.is_file())


# ---------------------------------------------------------------- run folder locks
def lock_run(run, run_id):
    """Take run's lock file for this process (O_EXCL: one training writes a run folder at a time);
    ValueError naming the holder while it lives. A holder that is gone (its pid no longer alive on
    this host, or this torchrun run before a restart) is replaced; the lock is this process's
    until `release_locks`."""
    # one spelling per folder
    lock = Path(os.path.abspath(run)) / LOCK_FILE
    if lock in HELD_LOCKS:
        return
    mine = f"{os.getpid()}\n{socket.gethostname()}\n{run_id or ''}\n"
    # a lock found stale is removed, then taken once more
    for _ in range(2):
        try:
            # "x": only if no file of that name exists (O_EXCL)
            with open(lock, "x") as f:
                f.write(mine)
        except FileExistsError:
            _remove_if_stale(lock, run_id)
            continue
        except OSError as e:
            raise ValueError(f"cannot write the run folder {run}: {e}") from None
        HELD_LOCKS[lock] = None
        return
    raise ValueError(f"{run} is being locked by another training at the same time ({lock})")


def _remove_if_stale(lock, run_id):
    """Remove a lock file whose holder is gone; ValueError naming a live one."""
    text = _read_small(lock)
    # removed meanwhile: take it
    if text is None:
        return
    # a lock file's lines, as lock_run writes them (missing ones empty)
    lines = text.splitlines() + ["", "", ""]
    pid, host, holder_run = lines[:3]
    # torchrun stops every worker of a run before it restarts them
    restarted = bool(run_id) and holder_run == run_id
    here = host == socket.gethostname() and pid.isdigit() and len(pid) < 10
    # a pid of this process: an earlier process had it (a container's pids repeat)
    gone = here and (int(pid) == os.getpid() or _gone(int(pid)))
    if not (restarted or gone):
        raise ValueError(
            f"{lock.parent} is in use by another training (pid {pid or '?'} on {host or '?'}):"
            f" wait for it to end, or delete {lock} if no training uses the folder"
        )
    print(f"warning: {lock} was left by a training that is gone ({pid} on {host}): taken over")
    # the same file as read: another process may have replaced it in the meantime
    if _read_small(lock) == text:
        lock.unlink(missing_ok=True)


def _gone(pid):
    """Whether no process of this host has the id pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # another user's process
    except PermissionError:
        pass
    return False


def release_locks():
    """Remove the lock files this process took (a run's end, error or stop)."""
    mine = f"{os.getpid()}\n{socket.gethostname()}\n"
    for lock in list(HELD_LOCKS):
        HELD_LOCKS.pop(lock)
        # None: not a small file (gone, ...)
        if (_read_small(lock) or "").startswith(mine):
            lock.unlink(missing_ok=True)


# ---------------------------------------------------------------- what a run saves
def rng_state():
    """This process's random states (python, numpy, torch, CUDA) as plain values."""
    name, keys, *rest = np.random.get_state()
    cuda = []
    if torch.cuda.is_available():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), *rest],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state):
    """Restore what `rng_state` returned."""
    # numpy's key: any sequence of uint32
    np.random.set_state(tuple(state["numpy"]))
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_state(model):
    """What val.py, predict.py and YOLO(path) load: the model's cfg, names, task and weights (on
    the CPU)."""
    return {
        "model_cfg": model.yaml,
        "names": list(model.names),
        "task": model.task,
        "model": cpu_state(model.state_dict()),
    }


def training_state(model, ema, optimizer, scaler, epoch, best, args, hyp, rngs):
    """All a run needs to continue; epoch: the last finished (0-based), best: (fitness, epoch)."""
    # tensors on the CPU: a file written on a GPU loads anywhere with torch.load
    return model_state(model) | {
        "ema": cpu_state(ema.ema.state_dict()),
        "optimizer": cpu_state(optimizer.state_dict()),
        "scaler": scaler.state_dict(),
        "ema_updates": ema.updates,
        "epoch": epoch,
        "best_fitness": best[0],
        "best_epoch": best[1],
        "args": vars(args),
        "hyp": hyp,
        "rng": {"world_size": len(rngs), "ranks": rngs},
    }


def cpu_state(state):
    """A (nested) state_dict with its tensors on the CPU."""
    cpu = {}
    for key, value in state.items():
        if isinstance(value, dict):
            value = cpu_state(value)
        elif torch.is_tensor(value):
            value = value.cpu()
        cpu[key] = value
    return cpu


def restore(ckpt, model, ema, optimizer, scaler, rank, world_size):
    """Load what `training_state` saved into fresh training objects and this rank's random states:
    False if the saved world size differs (not restored), CheckpointError if it does not fit."""
    with one_line_errors("cannot restore its training state: "):
        model.load_state_dict(ckpt["model"])
        ema.ema.load_state_dict(ckpt["ema"])
        ema.updates = ckpt["ema_updates"]
        # its settings replace ours: are they of the same types?
        kinds = _setting_types(optimizer)
        optimizer.load_state_dict(ckpt["optimizer"])
        # a value per parameter: a tensor of its shape, or a scalar (Adam's step)
        ok = all(
            torch.is_tensor(v) and v.shape in (p.shape, ())
            for p, values in optimizer.state.items()
            for v in values.values()
        )
        if not ok or kinds != _setting_types(optimizer):
            raise CheckpointError("its optimizer state does not fit this model's optimizer")
        # empty when saved without a CUDA scaler
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        same_size = ckpt["rng"]["world_size"] == world_size
        if same_size:
            set_rng_state(ckpt["rng"]["ranks"][rank])
    return same_size


def _setting_types(optimizer):
    """The types of each of the optimizer's param groups' settings, but how torch runs its steps
    (foreach, fused: a run saved by an earlier version resumes)."""
    groups = optimizer.param_groups
    return [{k: type(v) for k, v in g.items() if k not in ("foreach", "fused")} for g in groups]


def save(state, path):
    """torch.save atomically: a crash, kill or full disk (SaveError) leaves the old file whole."""
    write_atomically(path, lambda f: torch.save(state, f))


def copy(source, path):
    """The file source at path too, as atomically as save writes (best.pt: the last.pt just saved,
    without serializing its state a second time): a second name of the same file (a hard link;
    save replaces a file, never writes into it), else, where the filesystem has none, a copy."""
    tmp = Path(f"{path}.tmp")
    with signals_held():
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
            os.replace(tmp, path)
            return
        except OSError:
            tmp.unlink(missing_ok=True)
    with open(source, "rb") as f:
        write_atomically(path, lambda out: shutil.copyfileobj(f, out))


def write_atomically(path, write):
    """write(file) to path.tmp, fsynced, then renamed over path; SaveError if that fails."""
    tmp = Path(f"{path}.tmp")
    # SIGINT and SIGTERM take effect once the write is done: a KeyboardInterrupt inside torch.save
    # would break its zip writer
    with signals_held():
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise SaveError(f"cannot write {path} ({e}); the previous one is intact") from None
        finally:
            # what a failed write left
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM that arrive in the block take effect at its end (in the main thread;
    elsewhere Python delivers no signal to handle)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = {
        s: signal.signal(s, lambda signum, frame: held.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)


# what `training_state` saves, by type: a file to --resume from must hold these
RESUME_TYPES = dict.fromkeys("model_cfg model ema optimizer scaler args hyp rng".split(), dict)
RESUME_TYPES |= {"epoch": int, "best_epoch": int, "ema_updates": int, "best_fitness": (int, float)}


def load(path):
    """A yolo_min training checkpoint for --resume, checked as `training_state` saves it."""
    ckpt = read_checked(path)
    with one_line_errors(f"{path}: "):
        ok = (
            type(ckpt) is dict
            and all(isinstance(ckpt.get(k), t) for k, t in RESUME_TYPES.items())
            and min(ckpt["epoch"], ckpt["best_epoch"], ckpt["ema_updates"]) >= 0
            and all(type(v) in (int, float) for v in ckpt["scaler"].values())
            # results_csv: absent before this version
            and isinstance(ckpt.get("results_csv", ""), str)
            and 0 < len(ckpt["rng"]["ranks"]) == ckpt["rng"]["world_size"]
        )
        if not ok:
            raise CheckpointError("its values are not of the types and ranges train.py saves")
        fitting_model(ckpt["model_cfg"], ckpt["model"])
    return ckpt
