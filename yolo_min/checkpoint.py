"""Run folders, checkpoints (what a run saves, the atomic write), hardened loading of .pt files."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import random
import shutil
import signal
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
    with _one_line_errors("cannot restore its training state: "):
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


# ---------------------------------------------------------------- loading
MAX_DEPTH = 64  # nesting of a file's objects (a yolov5 module tree: 15)
MAX_TUPLES = 10_000  # tuples in a tuple (a tensor's shape: 1)
# what `training_state` saves, by type: a file to --resume from must hold these
RESUME_TYPES = dict.fromkeys("model_cfg model ema optimizer scaler args hyp rng".split(), dict)
RESUME_TYPES |= dict(epoch=int, best_epoch=int, ema_updates=int, best_fitness=(int, float))


def load(path: str | Path) -> dict:
    """A yolo_min training checkpoint for --resume, checked as `training_state` saves it."""
    ckpt = _read(path)
    with _one_line_errors(f"{path}: "):
        ok = type(ckpt) is dict and all(isinstance(ckpt.get(k), t) for k, t in RESUME_TYPES.items())
        ok = ok and min(ckpt["epoch"], ckpt["best_epoch"], ckpt["ema_updates"]) >= 0
        ok = ok and all(type(v) in (int, float) for v in ckpt["scaler"].values())
        if not ok or not 0 < len(ckpt["rng"]["ranks"]) == ckpt["rng"]["world_size"]:
            raise CheckpointError("its values are not of the types and ranges train.py saves")
        fitting_model(ckpt["model_cfg"], ckpt["model"])
    return ckpt


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Model:
    """A float32 eval-mode Model from a yolo_min or yolov5 checkpoint (EMA preferred)."""
    ckpt = _read(path)
    with _one_line_errors(f"{path}: "):
        weights = ckpt.get("ema") or ckpt.get("model") if isinstance(ckpt, dict) else None
        if isinstance(weights, _Record):  # yolov5: a pickled module tree
            cfg, names = weights.get("yaml"), weights.get("names")
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
    return model.eval()


def fitting_model(cfg, weights: dict) -> Model:
    """cfg's Model on the meta device (allocating nothing) if its tensors fit weights' shapes."""
    if not isinstance(cfg, dict):  # a path: a file may not make us open another
        raise CheckpointError("its model config is not a config dict")
    with torch.device("meta"):
        model = Model(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if shapes != {k: getattr(v, "shape", None) for k, v in weights.items()}:
        raise CheckpointError("its tensors do not fit its model config")
    return model


def _classifier_cfg(state: dict) -> dict:
    """A yolov5 classifier's config (it pickles none): yolov5n-cls.yaml at its weights' sizes."""
    # depth: layer 2's bottlenecks / 3, width: layer 0's channels / 64, and the classes
    depth = len({k.split(".")[3] for k in state if k.startswith("model.2.m.")}) / 3
    width, nc = state["model.0.conv.weight"].shape[0] / 64, len(state["model.9.linear.bias"])
    return load_cfg("yolov5n-cls.yaml")[0] | dict(nc=nc, depth_multiple=depth, width_multiple=width)


@contextlib.contextmanager
def _one_line_errors(prefix: str):
    """Any exception in the block as a CheckpointError: prefix, then one short line."""
    try:
        yield
    except Exception as e:  # whatever a crafted file leads to (RecursionError, MemoryError, ...)
        first = (str(e).strip().splitlines() or [""])[0]
        why = first if isinstance(e, ValueError) else f"{type(e).__name__}: {first}"
        raise CheckpointError(prefix + why[:200]) from None


def _read(path: str | Path):
    """The file's object, read once, if it passes the checks; else CheckpointError (one line)."""
    # a zip of stored members (none inflates) whose pickles pass `check_tuples`, loaded with
    # weights_only=True (else by `_Pickle`), passing `check_tree`
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    members = []  # stays so: not a zip (a legacy torch file, text, ...), or a damaged one
    with contextlib.suppress(Exception):
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    stored = all(m.compress_type == zipfile.ZIP_STORED for m in members)
    if not members or not stored or sum(m.file_size for m in members) > len(data):
        raise CheckpointError(f"{path}: not a PyTorch checkpoint (a zip of stored files)")
    with _one_line_errors(f"{path}: "):
        for m in (m for m in members if m.filename.endswith("data.pkl")):
            check_tuples(archive.read(m))
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # not plain data: a yolov5 file, or a refused one
            obj = torch.load(io.BytesIO(data), map_location="cpu", pickle_module=_Pickle)
        check_tree(obj, len(data))
    return obj


def check_tree(root, max_bytes: int) -> None:
    """Refuse a cycle, nesting over MAX_DEPTH, a tensor not dense on the CPU, with a zero stride or
    more elements than its storage, tensors of over max_bytes in all (a file never expands)."""
    # each object is visited once; tensors are named by the keys above them but `_` ones
    seen, total, todo = set(), 0, [(root, "", ())]  # (object, its name, ids of those above it)
    while todo:
        obj, name, above = todo.pop()
        if id(obj) in above or len(above) > MAX_DEPTH:
            raise CheckpointError(f"'{name}' contains itself or is nested over {MAX_DEPTH} deep")
        if id(obj) in seen or not isinstance(obj, (torch.Tensor, dict, list, tuple, set)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            dense = obj.layout == torch.strided and obj.device.type == "cpu"  # else: stores none
            stored = obj.untyped_storage().nbytes() // obj.element_size() if dense else 0
            n, zero = obj.numel(), any(s == 0 and k > 1 for k, s in zip(obj.shape, obj.stride()))
            if n > stored or zero:
                raise CheckpointError(f"tensor '{name}' declares {n} elements but stores {stored}")
            total += n * obj.element_size()
            continue
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            key = name if str(k).startswith("_") else f"{name}.{str(k)[:40]}".lstrip(".")
            todo.append((v, key, (*above, id(obj))))
    if total > max_bytes:
        raise CheckpointError(f"its tensors hold {total} bytes, more than the file's {max_bytes}")


def check_tuples(pkl: bytes) -> None:
    """Refuse a pickle building a tuple of over MAX_TUPLES tuples, or 1000 times that in all."""
    # hashing such dict keys would hang or crash; shared tuples are counted each time
    # follows the opcodes' stack effects: each stack value is the number of tuples an object holds
    stack, marks, memo, total = [], [], {}, 0
    for op, arg, _ in pickletools.genops(pkl):
        takes, mark = op.stack_before, pickletools.markobject
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if arg is None else arg] = stack[-1]
        elif op.name == "MARK":
            marks.append(len(stack))
        elif op.name in ("GET", "BINGET", "LONG_BINGET", "DUP"):
            stack.append(stack[-1] if arg is None else memo[arg])
        else:  # pop what the op takes (the objects from its mark on, and below), push what it makes
            start = marks.pop() - takes.index(mark) if mark in takes else len(stack) - len(takes)
            tuples = 1 + sum(stack[start:]) if "TUPLE" in op.name else 0
            stack[start:] = [tuples] * len(op.stack_after)
        total += (top := stack[-1] if stack else 0)
        if top > MAX_TUPLES or total > 1000 * MAX_TUPLES:
            raise CheckpointError("its tuples nest too deep or too often to be hashed safely")


# yolov5 pickles whole modules: the classes of these modules are rebuilt as inert records (as is
# its Segment's getattr(Detect, "forward")). The only real globals a file may name are these, by
# exact name (torch.load itself turns the storage classes it knows into inert dtype records).
RECORD_MODULES = ("models.", "torch.nn.modules.")
SAFE_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set")}
SAFE_GLOBALS |= {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter")}


class _Record(dict):
    """Stands in for a pickled yolov5 module: a dict of its attributes; runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.update(state if isinstance(state, dict) else {})


class _Pickle:  # the pickle_module torch.load takes (for zip files: its Unpickler only)
    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            module = "builtins" if module == "__builtin__" else module  # pickle protocol 2's name
            if module.startswith(RECORD_MODULES) or (module, name) == ("builtins", "getattr"):
                return type(name, (_Record,), {})
            if (module, name) in SAFE_GLOBALS:
                return super().find_class(module, name)
            raise CheckpointError(f"refusing '{module}.{name}': not a yolov5 or tensor type")


def _record_state_dict(root: _Record) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a pickled module tree, with yolov5's key names."""
    state, seen, todo = {}, set(), [("", root)]  # visit each module once: yolov5's share a SiLU
    while todo:
        prefix, rec = todo.pop()
        if not isinstance(rec, _Record) or id(rec) in seen:
            continue
        seen.add(id(rec))
        skip = rec.get("_non_persistent_buffers_set", set())
        own = {**rec.get("_parameters", {}), **rec.get("_buffers", {})}  # None: an absent bias, ...
        state |= {prefix + k: v.detach() for k, v in own.items() if v is not None and k not in skip}
        todo += [(f"{prefix}{k}.", child) for k, child in rec.get("_modules", {}).items()]
    return state
