"""Checkpoints and run folders: what a training run saves, the atomic write, and loading.

A yolo_min checkpoint is plain data (state dicts, numbers, strings; `training_state` lists the keys)
and loads with torch.load(weights_only=True). A yolov5 `.pt` pickles whole modules: `load_model`
reads it with a restricted unpickler that rebuilds known class names as records, running no code.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import random
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import torch
import yaml

from .models import Model, load_cfg

RUN_ID_FILE = ".torchrun_id"  # in a run folder: the torchrun run that made it


class CheckpointError(ValueError):
    """A weights file that cannot be used; the message is one line naming the file."""


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
    path = next_run_dir(args.project, args.name, args.exist_ok)
    path = Path(args.resume).parent.parent if args.resume else path
    path = find_run_dir(args.project, run_id) or path
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
        runs = Path(args.project).glob("*/weights/last.pt")
        path = max(runs, key=os.path.getmtime, default=None)
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
    """Everything a run needs to continue: the model (its config, names, weights and EMA), the
    optimizer and AMP scaler, the last finished epoch (0-based), best (fitness, epoch), the
    arguments and recipe, and every rank's random states."""
    state = {"model_cfg": model.yaml, "names": list(model.names), "task": model.task}
    state |= {"model": model.state_dict(), "ema": ema.ema.state_dict(), "ema_updates": ema.updates}
    state |= {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
    state |= {"epoch": epoch, "best_fitness": best[0], "best_epoch": best[1]}
    state |= {"args": vars(args), "hyp": hyp, "rng": {"world_size": len(rngs), "ranks": rngs}}
    return state | {"date": datetime.datetime.now().isoformat()}


def restore(ckpt: dict, model, ema, optimizer, scaler, rank: int, world_size: int) -> bool:
    """Load what `training_state` saved into freshly built training objects, and this rank's
    random states; False if the saved world size differs (then these are not restored)."""
    model.load_state_dict(ckpt["model"])
    ema.ema.load_state_dict(ckpt["ema"])
    ema.updates = ckpt["ema_updates"]
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["scaler"]:  # empty when saved without a CUDA scaler
        scaler.load_state_dict(ckpt["scaler"])
    if ckpt["rng"]["world_size"] != world_size:
        return False
    set_rng_state(ckpt["rng"]["ranks"][rank])
    return True


def save(state: dict, path: str | Path) -> None:
    """torch.save to path.tmp, fsync, rename over path: a crash, kill or full disk at any moment
    leaves the previous file whole. A stop signal during the write takes effect once it is done
    (a KeyboardInterrupt inside torch.save would break its zip writer)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with _signals_held():
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise SaveError(f"cannot write {path} ({e}); the previous one is intact") from None
            raise


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM until the block ends, then raise them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    signals = (signal.SIGINT, signal.SIGTERM)
    old = [(s, signal.signal(s, lambda signum, _: held.append(signum))) for s in signals]
    try:
        yield
    finally:
        for s, handler in old:
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)


# ---------------------------------------------------------------- loading
def load(path: str | Path) -> dict:
    """A yolo_min training checkpoint, for --resume."""
    ckpt = _read(path)
    if not isinstance(ckpt, dict) or "optimizer" not in ckpt or "hyp" not in ckpt:
        raise CheckpointError(f"{path}: not a yolo_min training checkpoint (or too old to resume)")
    return ckpt


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Model:
    """A float32 eval-mode Model from a yolo_min checkpoint or a yolov5 `.pt` (EMA preferred)."""
    ckpt = _read(path)
    weights = ckpt.get("ema") or ckpt.get("model") if isinstance(ckpt, dict) else None
    try:
        if isinstance(weights, _Record):  # yolov5: a pickled module tree
            cfg, names = weights.__dict__.get("yaml"), weights.__dict__.get("names")
            kind, weights = type(weights).__name__, _record_state_dict(weights)
            cfg = _classifier_cfg(weights) if kind == "ClassificationModel" else cfg
        elif isinstance(weights, dict):
            cfg, names = ckpt.get("model_cfg"), ckpt.get("names")
        else:
            raise CheckpointError("neither a yolo_min nor a yolov5 checkpoint")
        if not isinstance(cfg, dict):  # never a path: a file may not make us open another
            raise CheckpointError("its model config is not a config dict")
        model = Model(cfg)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    except (ValueError, RuntimeError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path}: {str(e).splitlines()[0]}") from None
    names = list(names.values()) if isinstance(names, dict) else names
    model.names = [str(n) for n in names] if isinstance(names, list) else model.names
    return model.to(device).eval()


def _classifier_cfg(state: dict) -> dict:
    """A yolov5 classifier's config, which it does not pickle: yolov5n-cls.yaml at the depth and
    width of its weights (layer 2's bottlenecks / 3, layer 0's channels / 64), and their classes."""
    depth = len({k.split(".")[3] for k in state if k.startswith("model.2.m.")}) / 3
    width, nc = state["model.0.conv.weight"].shape[0] / 64, len(state["model.9.linear.bias"])
    return load_cfg("yolov5n-cls.yaml")[0] | dict(nc=nc, depth_multiple=depth, width_multiple=width)


def _read(path: str | Path):
    """The file's object: torch.load with weights_only=True (yolo_min checkpoints), else through the
    restricted unpickler (yolov5 files); the file is read once."""
    try:
        data = io.BytesIO(Path(path).read_bytes())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass  # not plain data: a yolov5 file, or a refused one
    except Exception as e:
        raise CheckpointError(f"{path}: not a PyTorch checkpoint ({type(e).__name__})") from None
    try:
        data.seek(0)
        return torch.load(data, map_location="cpu", weights_only=False, pickle_module=_Pickle)
    except Exception as e:
        raise CheckpointError(f"{path}: {str(e).splitlines()[0]}") from None


# yolov5 pickles whole modules: only these classes are rebuilt, as plain records
YOLOV5_CLASSES = {
    "models.yolo": ("DetectionModel", "SegmentationModel", "ClassificationModel", "Model")
    + ("Detect", "Segment"),
    "models.common": ("Conv", "Bottleneck", "C3", "SPPF", "Concat", "Proto", "Classify"),
    "torch.nn.modules.activation": ("SiLU",),
    "torch.nn.modules.batchnorm": ("BatchNorm2d",),
    "torch.nn.modules.container": ("ModuleList", "Sequential"),
    "torch.nn.modules.conv": ("Conv2d",),
    "torch.nn.modules.dropout": ("Dropout",),
    "torch.nn.modules.linear": ("Identity", "Linear"),
    "torch.nn.modules.pooling": ("MaxPool2d", "AdaptiveAvgPool2d"),
    "torch.nn.modules.upsampling": ("Upsample",),
}
# and these are the only real globals it may name (exact names: the storages torch writes)
STORAGES = ("Float", "Half", "BFloat16", "Double", "Long", "Int", "Short", "Char", "Byte", "Bool")
SAFE_GLOBALS = {
    "torch": (*(f"{s}Storage" for s in STORAGES), "Size"),
    "torch._utils": ("_rebuild_tensor_v2", "_rebuild_parameter"),
    "collections": ("OrderedDict",),
    "builtins": ("set",),
    "__builtin__": ("set",),  # pickle protocol 2 names builtins so
}


class _Record:
    """Stands in for a pickled yolov5 module: keeps its __dict__, runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in YOLOV5_CLASSES.get(module, ()):
            return type(name, (_Record,), {})
        if name in SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing '{module}.{name}': not a yolov5 or tensor type")


class _Pickle:  # the pickle_module torch.load takes
    Unpickler = _Unpickler

    @staticmethod
    def load(f, **kwargs):
        return _Unpickler(f, **kwargs).load()


def _record_state_dict(rec: _Record, prefix="", seen=None, path=()) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a pickled module tree, with yolov5's key names. Each
    module is visited once (yolov5's modules share their activation); cycles are refused."""
    seen = set() if seen is None else seen
    if id(rec) in path or len(path) > 32:
        raise CheckpointError("its module tree has a cycle or is deeper than 32 levels")
    if id(rec) in seen:
        return {}
    seen.add(id(rec))
    d, out = rec.__dict__, {}
    skip = d.get("_non_persistent_buffers_set", set())
    for k, v in {**d.get("_parameters", {}), **d.get("_buffers", {})}.items():
        if v is not None and k not in skip:
            out[prefix + k] = v.detach()
    for k, child in d.get("_modules", {}).items():
        if isinstance(child, _Record):
            out |= _record_state_dict(child, f"{prefix}{k}.", seen, (*path, id(rec)))
    return out
