"""Loading weights files that may be hostile: yolo_min checkpoints and yolov5 `.pt` files, read
without running pickled code (a restricted unpickler), with checks on the zip, the pickles and the
object tree, into a `Model`."""

import contextlib
import io
import pickle
import pickletools
import zipfile
from pathlib import Path

import torch

from .files import first_line
from .models import Model, load_cfg


class CheckpointError(ValueError):
    """A weights file that cannot be used; the message is one line naming the file."""


# The deepest nesting of a file's objects (a yolov5 module tree: 15).
MAX_DEPTH = 64
# The most tuples in a tuple (a tensor's shape: 1).
MAX_TUPLES = 10_000
# The objects check_tree looks into (and tensors, which it checks).
CONTAINERS = (torch.Tensor, dict, list, tuple, set)


def load_model(path, device="cpu"):
    """A float32 eval-mode Model from a yolo_min or yolov5 checkpoint (EMA preferred)."""
    checkpoint = read_checked(path)
    with one_line_errors(f"{path}: "):
        weights = None
        if isinstance(checkpoint, dict):
            weights = checkpoint.get("ema") or checkpoint.get("model")
        if isinstance(weights, _Record):
            # yolov5: a pickled module tree.
            cfg = weights.get("yaml")
            names = weights.get("names")
            kind = type(weights).__name__
            weights = _record_state_dict(weights)
            if kind == "ClassificationModel":
                cfg = _classifier_cfg(weights)
        elif isinstance(weights, dict):
            cfg = checkpoint.get("model_cfg")
            names = checkpoint.get("names")
        else:
            raise CheckpointError("neither a yolo_min nor a yolov5 checkpoint")
        model = fitting_model(cfg, weights).to_empty(device=device)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        model.names = _class_names(names, model)
    return model.eval()


def _class_names(names, model):
    """A checkpoint's class names (a list, or a dict's values) if they are model.nc strings; none:
    the model's "0", "1", ... (yolov5 classifiers pickle none)."""
    if isinstance(names, dict):
        names = list(names.values())
    elif not names:
        names = model.names
    fits = isinstance(names, list) and len(names) == model.nc
    if not (fits and all(type(name) is str for name in names)):
        raise CheckpointError(f"its names are not {model.nc} class names")
    return names


def fitting_model(cfg, weights):
    """cfg's Model on the meta device (allocating nothing) if its tensors fit weights' shapes."""
    # A path is refused: a file may not make us open another.
    if not isinstance(cfg, dict):
        raise CheckpointError("its model config is not a config dict")
    with torch.device("meta"):
        model = Model(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    found = {k: getattr(v, "shape", None) for k, v in weights.items()}
    if found != shapes:
        raise CheckpointError("its tensors do not fit its model config")
    return model


def _classifier_cfg(state):
    """A yolov5 classifier's config (it pickles none): yolov5n-cls.yaml at its weights' sizes."""
    # Depth: layer 2's bottlenecks / 3; width: layer 0's channels / 64; and the classes.
    bottlenecks = {k.split(".")[3] for k in state if k.startswith("model.2.m.")}
    depth = len(bottlenecks) / 3
    width = state["model.0.conv.weight"].shape[0] / 64
    nc = len(state["model.9.linear.bias"])
    cfg = load_cfg("yolov5n-cls.yaml")[0]
    return cfg | {"nc": nc, "depth_multiple": depth, "width_multiple": width}


@contextlib.contextmanager
def one_line_errors(prefix):
    """Any exception in the block as a CheckpointError: prefix, then one short line."""
    try:
        yield
    except Exception as error:
        # Whatever a crafted file leads to (RecursionError, MemoryError, ...) ends here.
        why = first_line(str(error).strip())
        if not isinstance(error, ValueError):
            why = f"{type(error).__name__}: {why}"
        raise CheckpointError(prefix + why[:200]) from None


def read_checked(path):
    """The file's object, read once, if it passes the checks; else CheckpointError (one line)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read it ({error.strerror})") from None
    # No members: not a zip (a legacy torch file, text, ...), or a damaged one.
    members = []
    with contextlib.suppress(Exception):
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    # A zip of stored members: none inflates, so together they are no larger than the file.
    stored = all(m.compress_type == zipfile.ZIP_STORED for m in members)
    if not (members and stored and sum(m.file_size for m in members) <= len(data)):
        raise CheckpointError(f"{path}: not a PyTorch checkpoint (a zip of stored files)")
    with one_line_errors(f"{path}: "):
        for member in members:
            if member.filename.endswith("data.pkl"):
                check_tuples(archive.read(member))
        # Plain data loads with weights_only=True; a yolov5 file (or a refused one) does not, and
        # is loaded by the restricted `_Pickle`.
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            obj = torch.load(io.BytesIO(data), map_location="cpu", pickle_module=_Pickle)
        check_tree(obj, len(data))
    return obj


def check_tree(root, max_bytes):
    """Refuse a cycle, nesting over MAX_DEPTH, a tensor not dense on the CPU, with a zero stride or
    more elements than its storage, tensors of over max_bytes in all (a file never expands)."""
    # Each object is visited once. Tensors are named by the keys above them.
    seen = set()
    total = 0
    # (an object, its name, the ids of the objects above it)
    todo = [(root, "", ())]
    while todo:
        obj, name, above = todo.pop()
        if id(obj) in above:
            raise CheckpointError(f"'{name}' contains itself")
        if len(above) > MAX_DEPTH:
            raise CheckpointError(f"'{name}' is nested over {MAX_DEPTH} deep")
        if id(obj) in seen or not isinstance(obj, CONTAINERS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += _tensor_bytes(obj, name)
            continue
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        above_item = (*above, id(obj))
        todo += [(value, _item_name(name, key), above_item) for key, value in items]
    if total > max_bytes:
        raise CheckpointError(f"its tensors hold {total} bytes, more than the file's {max_bytes}")


def _tensor_bytes(tensor, name):
    """The bytes of a tensor's elements, if it stores them all, densely, on the CPU."""
    # Any other tensor stores none of the file's data.
    stored = 0
    if tensor.layout == torch.strided and tensor.device.type == "cpu":
        stored = tensor.untyped_storage().nbytes() // tensor.element_size()
    zero_stride = any(
        stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())
    )
    if tensor.numel() > stored:
        raise CheckpointError(
            f"tensor '{name}' declares {tensor.numel()} elements but stores {stored}"
        )
    if zero_stride:
        raise CheckpointError(f"tensor '{name}' repeats its elements (a zero stride)")
    return tensor.nbytes


def _item_name(name, key):
    """The name of the item at key of the object called name: "name.key" (key cut to 40
    characters), or name for a key starting with "_" (a module's _modules, _parameters, ...)."""
    key = str(key)
    if key.startswith("_"):
        return name
    return f"{name}.{key[:40]}".lstrip(".")


# The opcodes that memoize the object on top of the stack, and those that push a copy of one.
MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
COPY_PUSHES = ("GET", "BINGET", "LONG_BINGET", "DUP")


def check_tuples(pkl):
    """Refuse a pickle building a tuple of over MAX_TUPLES tuples, or 1000 times that in all."""
    # Hashing such dict keys would hang or crash; shared tuples are counted each time. This
    # follows the opcodes' stack effects: each stack value is the number of tuples an object holds.
    stack = []
    marks = []
    memo = {}
    total = 0
    mark = pickletools.markobject
    for opcode, arg, _ in pickletools.genops(pkl):
        if opcode.name in MEMO_PUTS:
            key = len(memo) if arg is None else arg
            memo[key] = stack[-1]
        elif opcode.name == "MARK":
            marks.append(len(stack))
        elif opcode.name in COPY_PUSHES:
            stack.append(stack[-1] if arg is None else memo[arg])
        else:
            # Pop what the opcode takes (the objects from its mark on, and those below), push
            # what it makes.
            takes = opcode.stack_before
            start = len(stack) - len(takes)
            if mark in takes:
                start = marks.pop() - takes.index(mark)
            tuples = 0
            if "TUPLE" in opcode.name:
                tuples = 1 + sum(stack[start:])
            stack[start:] = [tuples] * len(opcode.stack_after)
        top = stack[-1] if stack else 0
        total += top
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


class _Pickle:
    """The pickle_module torch.load takes (for zip files it uses only its Unpickler)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            # Pickle protocol 2's name of the builtins.
            if module == "__builtin__":
                module = "builtins"
            if module.startswith(RECORD_MODULES) or (module, name) == ("builtins", "getattr"):
                return type(name, (_Record,), {})
            if (module, name) in SAFE_GLOBALS:
                return super().find_class(module, name)
            raise CheckpointError(f"refusing '{module}.{name}': not a yolov5 or tensor type")


def _record_state_dict(root):
    """Parameters and persistent buffers of a pickled module tree, with yolov5's key names."""
    state = {}
    # Each module is visited once: yolov5's share a SiLU.
    seen = set()
    todo = [("", root)]
    while todo:
        prefix, record = todo.pop()
        if not isinstance(record, _Record) or id(record) in seen:
            continue
        seen.add(id(record))
        non_persistent = record.get("_non_persistent_buffers_set", set())
        tensors = {**record.get("_parameters", {}), **record.get("_buffers", {})}
        for key, tensor in tensors.items():
            # None: an absent bias, ...
            if tensor is not None and key not in non_persistent:
                state[prefix + key] = tensor.detach()
        todo += [(f"{prefix}{key}.", child) for key, child in record.get("_modules", {}).items()]
    return state
