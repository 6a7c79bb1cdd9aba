"""Loading weights files that may be hostile: yolo_min checkpoints and yolov5 `.pt` files, read
without running pickled code (a restricted unpickler), with checks on the zip, the pickles and the
object tree, into a `Model`."""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
import zipfile
from pathlib import Path

import torch

from .models import Model, load_cfg


class CheckpointError(ValueError):
    """A weights file that cannot be used; the message is one line naming the file."""


MAX_DEPTH = 64  # nesting of a file's objects (a yolov5 module tree: 15)
MAX_TUPLES = 10_000  # tuples in a tuple (a tensor's shape: 1)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Model:
    """A float32 eval-mode Model from a yolo_min or yolov5 checkpoint (EMA preferred)."""
    ckpt = read_checked(path)
    with one_line_errors(f"{path}: "):
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
def one_line_errors(prefix: str):
    """Any exception in the block as a CheckpointError: prefix, then one short line."""
    try:
        yield
    except Exception as e:  # whatever a crafted file leads to (RecursionError, MemoryError, ...)
        first = (str(e).strip().splitlines() or [""])[0]
        why = first if isinstance(e, ValueError) else f"{type(e).__name__}: {first}"
        raise CheckpointError(prefix + why[:200]) from None


def read_checked(path: str | Path):
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
    with one_line_errors(f"{path}: "):
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
