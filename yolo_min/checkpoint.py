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
import pickletools
import random
import shutil
import signal
import threading
import zipfile
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
    """Load what `training_state` saved into fresh training objects and this rank's random states:
    False if the saved world size differs (not restored), CheckpointError if it does not fit."""
    try:
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
        if ckpt["rng"]["world_size"] != world_size:
            return False
        set_rng_state(ckpt["rng"]["ranks"][rank])
    except Exception as e:
        raise CheckpointError(f"cannot restore its training state: {_why(e)}") from None
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
MAX_DEPTH = 64  # nesting of a file's objects (a yolov5 module tree: 15)
MAX_TUPLES = 10_000  # tuples in a tuple (a tensor's shape: 1)
# what `training_state` saves, by type: a file to --resume from must hold these
RESUME_TYPES = dict.fromkeys("model_cfg model ema optimizer scaler args hyp rng".split(), dict)
RESUME_TYPES |= dict(epoch=int, best_epoch=int, ema_updates=int, best_fitness=(int, float))


def load(path: str | Path) -> dict:
    """A yolo_min training checkpoint for --resume, checked as `training_state` saves it."""
    ckpt = _read(path)
    if not isinstance(ckpt, dict) or "optimizer" not in ckpt or "hyp" not in ckpt:
        raise CheckpointError(f"{path}: not a yolo_min training checkpoint (or too old to resume)")
    try:
        ok = all(isinstance(ckpt[k], t) for k, t in RESUME_TYPES.items())
        ok = ok and min(ckpt["epoch"], ckpt["best_epoch"], ckpt["ema_updates"]) >= 0
        ok = ok and all(type(v) in (int, float) for v in ckpt["scaler"].values())
        if not ok or not 0 < len(ckpt["rng"]["ranks"]) == ckpt["rng"]["world_size"]:
            raise CheckpointError("its values are not of the types and ranges train.py saves")
        fitting_model(ckpt["model_cfg"], ckpt["model"])
    except Exception as e:
        raise CheckpointError(f"{path}: {_why(e)}") from None
    return ckpt


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Model:
    """A float32 eval-mode Model from a yolo_min checkpoint or a yolov5 `.pt` (EMA preferred), given
    memory once its config fits the file's tensors (`fitting_model`). Problems: CheckpointError."""
    ckpt = _read(path)
    try:
        weights = ckpt.get("ema") or ckpt.get("model") if isinstance(ckpt, dict) else None
        if isinstance(weights, _Record):  # yolov5: a pickled module tree
            cfg, names = weights.__dict__.get("yaml"), weights.__dict__.get("names")
            kind, weights = type(weights).__name__, _record_state_dict(weights)
            cfg = _classifier_cfg(weights) if kind == "ClassificationModel" else cfg
        elif isinstance(weights, dict):
            cfg, names = ckpt.get("model_cfg"), ckpt.get("names")
        else:
            raise CheckpointError("neither a yolo_min nor a yolov5 checkpoint")
        model = fitting_model(cfg, weights).to_empty(device=device)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        names = list(names.values()) if isinstance(names, dict) else names or model.names
        if not isinstance(names, list) or [type(n) for n in names] != [str] * model.nc:
            raise CheckpointError(f"its names are not {model.nc} class names")
        model.names = names  # yolov5 classifiers pickle none: "0", "1", ...
    except Exception as e:  # whatever a crafted file leads to: one line
        raise CheckpointError(f"{path}: {_why(e)}") from None
    return model.eval()


def fitting_model(cfg, weights: dict) -> Model:
    """cfg's Model on the meta device (nothing allocated) if its tensors' names and shapes are those
    of weights; else refused, as a cfg that is not a dict (a file may not make us open another)."""
    if not isinstance(cfg, dict):
        raise CheckpointError("its model config is not a config dict")
    with torch.device("meta"):
        model = Model(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if shapes != {k: getattr(v, "shape", None) for k, v in weights.items()}:
        raise CheckpointError("its tensors do not fit its model config")
    return model


def _classifier_cfg(state: dict) -> dict:
    """A yolov5 classifier's config, which it does not pickle: yolov5n-cls.yaml at the depth and
    width of its weights (layer 2's bottlenecks / 3, layer 0's channels / 64), and their classes."""
    depth = len({k.split(".")[3] for k in state if k.startswith("model.2.m.")}) / 3
    width, nc = state["model.0.conv.weight"].shape[0] / 64, len(state["model.9.linear.bias"])
    return load_cfg("yolov5n-cls.yaml")[0] | dict(nc=nc, depth_multiple=depth, width_multiple=width)


def _read(path: str | Path):
    """The file's object: torch.load with weights_only=True (yolo_min checkpoints), else through the
    restricted unpickler (yolov5 files). The file is read once; it must be torch's zip of stored
    members (none inflates), and its objects pass `check_tree`. Any problem: CheckpointError."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except Exception:  # not a zip (a legacy torch file, text, ...), or a damaged one
        members = []
    stored = all(m.compress_type == zipfile.ZIP_STORED for m in members)
    if not members or not stored or sum(m.file_size for m in members) > len(data):
        raise CheckpointError(f"{path}: not a PyTorch checkpoint (a zip of stored files)")
    try:
        for m in (m for m in members if m.filename.endswith("data.pkl")):
            check_tuples(archive.read(m))
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # not plain data: a yolov5 file, or a refused one
            kw = dict(weights_only=False, pickle_module=_Pickle)
            obj = torch.load(io.BytesIO(data), map_location="cpu", **kw)
        check_tree(obj, len(data))
    except Exception as e:  # whatever a crafted file leads to (RecursionError, MemoryError, ...)
        raise CheckpointError(f"{path}: {_why(e)}") from None
    return obj


def check_tree(root, max_bytes: int) -> None:
    """Refuse, visiting each object once: a cycle, nesting over MAX_DEPTH, a tensor not dense on the
    CPU, with a zero stride or more elements than its storage holds, tensors of over max_bytes in
    all (a weights file never expands). Tensors are named by the keys above them but `_` ones."""
    seen, total = set(), 0

    def visit(obj, name: str, above: tuple) -> None:
        nonlocal total
        if id(obj) in above or len(above) > MAX_DEPTH:
            raise CheckpointError(f"'{name}' contains itself or is nested over {MAX_DEPTH} deep")
        if id(obj) in seen or not isinstance(obj, (torch.Tensor, dict, list, tuple, set, _Record)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            dense = obj.layout == torch.strided and obj.device.type == "cpu"  # else: stores none
            stored = obj.untyped_storage().nbytes() // obj.element_size() if dense else 0
            n, zero = obj.numel(), any(s == 0 and k > 1 for k, s in zip(obj.shape, obj.stride()))
            if n > stored or zero:
                raise CheckpointError(f"tensor '{name}' declares {n} elements but stores {stored}")
            total += n * obj.element_size()
            return
        items = vars(obj) if isinstance(obj, _Record) else obj
        for k, v in items.items() if isinstance(items, dict) else enumerate(items):
            key = name if str(k).startswith("_") else f"{name}.{str(k)[:40]}".lstrip(".")
            visit(v, key, (*above, id(obj)))

    visit(root, "", ())
    if total > max_bytes:
        raise CheckpointError(f"its tensors hold {total} bytes, more than the file's {max_bytes}")


def check_tuples(pkl: bytes) -> None:
    """Refuse a pickle pushing a tuple of over MAX_TUPLES tuples (shared ones counted each time) or
    1000 times that in all: hashing them would hang or crash. Follows its opcodes' stack effects."""
    stack, memo, total, mark = [], {}, 0, pickletools.markobject
    for op, arg, _ in pickletools.genops(pkl):
        before = op.stack_before
        if "PUT" in op.name or op.name == "MEMOIZE":
            memo[len(memo) if arg is None else arg] = stack[-1]
            continue
        if "GET" in op.name or op.name == "DUP":
            stack.append(stack[-1] if op.name == "DUP" else memo[arg])
        else:  # pop the items above a mark and the mark, then those below it; push the results
            items = []
            while mark in before and (item := stack.pop()) is not None:
                items.append(item)
            items += [stack.pop() for _ in before[: before.index(mark) if mark in before else None]]
            tuples = 1 + sum(items) if "TUPLE" in op.name else 0
            stack += [None if x is mark else tuples for x in op.stack_after]
        total += (top := stack[-1] or 0 if stack else 0)
        if top > MAX_TUPLES or total > 1000 * MAX_TUPLES:
            raise CheckpointError("its tuples nest too deep or too often to be hashed safely")


def _why(e: Exception) -> str:
    """An exception as one short line (a crafted file may put anything in a message)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return (first if isinstance(e, ValueError) else f"{type(e).__name__}: {first}")[:200]


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
    "builtins": ("getattr",),  # yolov5's Segment pickles getattr(Detect, "forward"): a record
    "__builtin__": ("getattr",),
}
# and these are the only real globals it may name, by exact name (torch.load itself turns the
# storage classes it knows, FloatStorage..., into inert dtype records; other "Storage"s come here)
SAFE_GLOBALS = {
    "torch": ("Size",),
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
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return lambda obj, attr: None  # yolov5's Segment.detect = Detect.forward: no data
        if name in SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing '{module}.{name}': not a yolov5 or tensor type")


class _Pickle:  # the pickle_module torch.load takes (for zip files: its Unpickler only)
    Unpickler = _Unpickler


def _record_state_dict(rec: _Record, prefix="", seen=None) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a pickled module tree (without cycles: `check_tree`),
    with yolov5's key names. Each module is visited once (yolov5's modules share their SiLU)."""
    seen = set() if seen is None else seen
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
            out |= _record_state_dict(child, f"{prefix}{k}.", seen)
    return out
