"""YOLOv5 detection and segmentation networks, built from yolov5-style yaml configs.

Holds the building blocks (Conv, Bottleneck, C3, SPPF, Proto), the Detect/Segment heads, the yaml
parser, `Model`, `load_model` (yolo_min checkpoints and real yolov5 `.pt` files) and the atomic
`save_checkpoint`. Parameter and buffer names equal yolov5's, so a yolov5 state_dict loads with
strict=True.
Does not hold the loss (losses.py), NMS (ops.py) or the training loop (train.py; its `ModelEMA`, the
weights' moving average, lives here beside `de_parallel`).
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import threading
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn
import yaml

CFG_DIR = Path(__file__).parent / "cfg"


def autopad(k: int, p: int | None = None) -> int:
    """Padding that keeps the size at stride 1 ('same' for odd k), unless p is given."""
    return k // 2 if p is None else p


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; after `fuse()` the BN is folded into the conv."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None, g: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p), groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c1, H, W) -> (bs, c2, H/s, W/s)."""
        return self.act(self.bn(self.conv(x)) if hasattr(self, "bn") else self.conv(x))


class Bottleneck(nn.Module):
    """1x1 conv to c2*e channels, 3x3 conv to c2, plus the input when shortcut and c1 == c2."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_, c2, 3, 1)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c1, H, W) -> (bs, c2, H, W)."""
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP block: n bottlenecks on one half of the channels, a 1x1 shortcut on the other, then merged."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True):
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c1, H, W) -> (bs, c2, H, W)."""
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools equal pools of 5, 9 and 13."""

    def __init__(self, c1: int, c2: int, k: int = 5):
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c1, H, W) -> (bs, c2, H, W)."""
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Concat(nn.Module):
    """Concatenate a list of maps along `dimension` (channels): [(bs, c_i, H, W)] -> (bs, sum c_i, H, W)."""

    def __init__(self, dimension: int = 1):
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        """[(bs, c_i, H, W)] -> (bs, sum c_i, H, W)."""
        return torch.cat(x, self.d)


class Proto(nn.Module):
    """Mask prototypes: (bs, c1, H/8, W/8) -> (bs, nm, H/4, W/4)."""

    def __init__(self, c1: int, c_: int = 256, c2: int = 32):
        super().__init__()
        self.cv1 = Conv(c1, c_, k=3)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.cv2 = Conv(c_, c_, k=3)
        self.cv3 = Conv(c_, c2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, c1, H/8, W/8) P3 features -> (bs, c2, H/4, W/4) prototypes."""
        return self.cv3(self.cv2(self.upsample(self.cv1(x))))


class Detect(nn.Module):
    """One 1x1 conv per level to na*(5+nc+nm) channels.

    train: list of nl raw maps (bs, na, ny, nx, no), channels [tx, ty, tw, th, obj, cls..., coefs...].
    eval:  (bs, N, no) decoded: xywh in input pixels, obj and cls probabilities, mask coefs raw.
    `anchors` is a buffer (nl, na, 2) in grid units (pixels / stride).
    """

    def __init__(self, nc: int = 80, anchors: list = (), ch: list = (), nm: int = 0):
        super().__init__()
        self.nc, self.nm = nc, nm
        self.no = 5 + nc + nm
        self.nl, self.na = len(anchors), len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self.stride = torch.ones(self.nl)  # set by Model once the strides are measured

    def forward(self, xs: list[torch.Tensor]):
        """xs: nl feature maps (bs, ch[i], H/stride[i], W/stride[i]) -> see the class docstring (train / eval)."""
        raw, decoded = [], []
        for i, x in enumerate(xs):
            bs, _, ny, nx = x.shape
            x = self.m[i](x).view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            raw.append(x)
            if not self.training:
                decoded.append(self._decode(x, i).view(bs, -1, self.no))
        return raw if self.training else torch.cat(decoded, 1)

    def _decode(self, x: torch.Tensor, i: int) -> torch.Tensor:
        _, _, ny, nx, _ = x.shape
        yv, xv = torch.meshgrid(torch.arange(ny, device=x.device), torch.arange(nx, device=x.device), indexing="ij")
        grid = torch.stack((xv, yv), 2).view(1, 1, ny, nx, 2).to(x.dtype) - 0.5
        anchor_px = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2).to(x.dtype)
        xy, wh, conf, coefs = x.split((2, 2, self.nc + 1, self.nm), 4)
        xy = (xy.sigmoid() * 2 + grid) * self.stride[i]
        wh = (wh.sigmoid() * 2) ** 2 * anchor_px
        return torch.cat((xy, wh, conf.sigmoid(), coefs), 4)


class Segment(Detect):
    """Detect plus mask coefficients and a Proto branch on the P3 features.

    train: (raw maps, protos (bs, nm, H/4, W/4)); eval: (decoded (bs, N, 5+nc+nm), protos).
    """

    def __init__(self, nc: int = 80, anchors: list = (), nm: int = 32, npr: int = 256, ch: list = ()):
        super().__init__(nc, anchors, ch, nm=nm)
        self.proto = Proto(ch[0], npr, nm)

    def forward(self, xs: list[torch.Tensor]):
        """xs: nl feature maps (P3 first) -> (Detect output, protos (bs, nm, H/4, W/4))."""
        protos = self.proto(xs[0])
        return super().forward(xs), protos


# The only names a config may use: a table, never eval().
MODULES = {"Conv": Conv, "C3": C3, "SPPF": SPPF, "Concat": Concat, "Upsample": nn.Upsample,
           "nn.Upsample": nn.Upsample, "Detect": Detect, "Segment": Segment}


def make_divisible(x: float, divisor: int = 8) -> int:
    """x rounded up to a multiple of divisor (channel counts after width scaling)."""
    return math.ceil(x / divisor) * divisor


def load_cfg(cfg: str | Path | dict) -> tuple[dict, str]:
    """A model config as a dict, and the name used in error messages. Bare names resolve to cfg/."""
    if isinstance(cfg, dict):
        return deepcopy(cfg), "<dict cfg>"
    path = Path(cfg)
    if not path.exists() and (CFG_DIR / path.name).exists():
        path = CFG_DIR / path.name
    if not path.exists():
        shipped = ", ".join(sorted(p.name for p in CFG_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"model cfg '{cfg}' not found (shipped configs: {shipped})")
    with open(path) as f:
        return yaml.safe_load(f), str(path)


def parse_model(d: dict, ch: int, where: str) -> tuple[nn.Sequential, list[int]]:
    """Build the layer list of a yolov5 cfg dict; returns (layers, indices whose outputs are reused)."""
    for key in ("anchors", "backbone", "head", "nc", "depth_multiple", "width_multiple"):
        if key not in d:
            raise ValueError(f"{where}: missing key '{key}'")
    nc, gd, gw, anchors = d["nc"], d["depth_multiple"], d["width_multiple"], d["anchors"]
    symbols = {"nc": nc, "anchors": anchors, "None": None}
    layers, save, chs = [], [], [ch]
    for i, row in enumerate(d["backbone"] + d["head"]):
        if not (isinstance(row, (list, tuple)) and len(row) == 4):
            raise ValueError(f"{where}: layer {i}: expected [from, repeats, module, args], got {row}")
        f, n, name, args = row
        if name not in MODULES:
            raise ValueError(f"{where}: layer {i}: unknown module '{name}' (known: {', '.join(MODULES)})")
        m = MODULES[name]
        froms = f if isinstance(f, list) else [f]
        if not froms or not all(isinstance(j, int) and (j == -1 or 0 <= j < i) for j in froms):
            raise ValueError(f"{where}: layer {i} ({name}): bad 'from' {f} (must name earlier layers)")
        args = [symbols.get(a, a) if isinstance(a, str) else a for a in args]
        n = max(round(n * gd), 1) if n > 1 else n
        c_in = [chs[j + 1 if j >= 0 else j] for j in froms]  # chs[0] is the image
        if m in (Conv, C3, SPPF):
            c2 = make_divisible(args[0] * gw)
            args = [c_in[0], c2, *args[1:]]
            if m is C3:
                args.insert(2, n)
                n = 1
        elif m is Concat:
            c2 = sum(c_in)
        elif m in (Detect, Segment):
            if m is Segment:
                args[3] = make_divisible(args[3] * gw)
            args.append(c_in)
            c2 = None
        else:
            c2 = c_in[0]
        try:
            module = nn.Sequential(*(m(*args) for _ in range(n))) if n > 1 else m(*args)
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"{where}: layer {i} ({name}): bad args {args}: {e}") from None
        module.i, module.f = i, f
        layers.append(module)
        save.extend(j % i for j in froms if j != -1)
        chs.append(c2)
    return nn.Sequential(*layers), sorted(set(save))


class Model(nn.Module):
    """A YOLOv5 network from a cfg (bare name, path or dict); `nc` overrides the cfg's.

    Input: float images (bs, 3, H, W) in [0, 1], H and W multiples of 32.
    Output: see Detect / Segment. Attributes: task ("detect" | "segment"), stride (nl,), names, yaml.
    """

    def __init__(self, cfg: str | Path | dict = "yolov5n.yaml", nc: int | None = None, ch: int = 3):
        super().__init__()
        self.yaml, where = load_cfg(cfg)
        if nc is not None:
            self.yaml["nc"] = nc
        self.model, self.save = parse_model(self.yaml, ch, where)
        head = self.model[-1]
        if not isinstance(head, Detect):
            raise ValueError(f"{where}: the last layer must be Detect or Segment")
        self.task = "segment" if isinstance(head, Segment) else "detect"
        self.names = self.yaml.get("names") or [str(i) for i in range(head.nc)]
        self.cfg_name = Path(where).stem if where != "<dict cfg>" else self.yaml.get("name", "model")
        s = 256  # measure the strides with one dummy pass, then express anchors in grid units
        with torch.no_grad():
            out = self.forward(torch.zeros(1, ch, s, s))
        maps = out[0] if self.task == "segment" else out
        head.stride = torch.tensor([s / x.shape[-3] for x in maps])
        head.anchors /= head.stride.view(-1, 1, 1)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps, m.momentum = 1e-3, 0.03
        self._init_biases()

    @property
    def stride(self) -> torch.Tensor:
        """Strides of the head's levels, float (nl,): [8, 16, 32]."""
        return self.model[-1].stride

    @property
    def nc(self) -> int:
        """Number of classes."""
        return self.model[-1].nc

    def _init_biases(self) -> None:
        """Objectness prior of ~8 objects per 640 image; class prior 0.6/nc (yolov5's init)."""
        head = self.model[-1]
        for conv, s in zip(head.m, head.stride):
            b = conv.bias.data.view(head.na, -1)
            b[:, 4] += math.log(8 / (640 / s) ** 2)
            b[:, 5:5 + head.nc] += math.log(0.6 / (head.nc - 0.99999))

    def forward(self, x: torch.Tensor):
        """x float (bs, 3, H, W) in [0, 1] -> the head's output (Detect / Segment docstrings: train and eval)."""
        outputs = []
        for m in self.model:
            if m.f != -1:
                x = outputs[m.f] if isinstance(m.f, int) else [x if j == -1 else outputs[j] for j in m.f]
            x = m(x)
            outputs.append(x if m.i in self.save else None)
        return x

    def fuse(self) -> "Model":
        """Fold every BatchNorm into its conv (inference only); outputs are unchanged to ~1e-5."""
        for m in self.modules():
            if isinstance(m, Conv) and hasattr(m, "bn"):
                m.conv = fuse_conv_bn(m.conv, m.bn)
                del m.bn
        return self

    def info(self, imgsz: int = 640) -> str:
        """One summary line: layers, parameters, gradients and GFLOPs at imgsz (2 x MACs)."""
        n_p = sum(p.numel() for p in self.parameters())
        n_g = sum(p.numel() for p in self.parameters() if p.requires_grad)
        layers = len(list(self.modules()))
        try:
            from torch.utils.flop_counter import FlopCounterMode
            p = next(self.parameters())
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                deepcopy(self).eval()(torch.zeros(1, 3, imgsz, imgsz, device=p.device, dtype=p.dtype))
            gflops = f", {counter.get_total_flops() / 1e9:.1f} GFLOPs at {imgsz}"
        except Exception:  # flop counting is informative only
            gflops = ""
        return f"{self.cfg_name} summary: {layers} layers, {n_p:,} parameters, {n_g:,} gradients{gflops}"


def fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new Conv2d with bias equal to bn(conv(x)) in eval mode (BN statistics folded into weights)."""
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                      conv.dilation, conv.groups, bias=True).requires_grad_(False).to(conv.weight.device)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    fused.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
    bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    fused.bias.copy_((bias - bn.running_mean) * scale + bn.bias)
    return fused


def de_parallel(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


class ModelEMA:
    """Exponential moving average of every float tensor of a model's state (weights and BN buffers).
    decay = 0.9999 * (1 - exp(-updates / 2000)): short memory early in training, long later."""

    def __init__(self, model: nn.Module, updates: int = 0, decay: float = 0.9999, tau: float = 2000):
        self.ema = deepcopy(de_parallel(model)).eval().requires_grad_(False)
        self.updates, self.decay, self.tau = updates, decay, tau

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One optimizer step done: ema = d * ema + (1 - d) * model, d growing with `updates`."""
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        state = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.lerp_(state[k].detach(), 1 - d)


# ---------------------------------------------------------------- checkpoints
# yolov5 pickles whole modules. We rebuild only these classes, as plain records, never running their code.
YOLOV5_CLASSES = {
    ("models.yolo", n) for n in ("DetectionModel", "SegmentationModel", "Model", "Detect", "Segment")
} | {("models.common", n) for n in ("Conv", "Bottleneck", "C3", "SPPF", "Concat", "Proto")} | {
    ("torch.nn.modules." + mod, n) for mod, n in (
        ("activation", "SiLU"), ("batchnorm", "BatchNorm2d"), ("container", "ModuleList"),
        ("container", "Sequential"), ("conv", "Conv2d"), ("pooling", "MaxPool2d"),
        ("upsampling", "Upsample"), ("linear", "Identity"))}
SAFE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"), ("__builtin__", "set"),
                ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
                ("torch", "Size")}


class _Record:
    """Stand-in for a pickled yolov5 module: keeps its __dict__, runs nothing."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _Yolov5Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in YOLOV5_CLASSES:
            return type(name, (_Record,), {})
        if (module, name) in SAFE_GLOBALS or (module == "torch" and name.endswith("Storage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load '{module}.{name}': not a known yolov5 or tensor type")


class _RestrictedPickle:
    Unpickler = _Yolov5Unpickler
    load = staticmethod(lambda f, **kw: _Yolov5Unpickler(f, **kw).load())


def _record_state_dict(rec, prefix: str = "") -> dict[str, torch.Tensor]:
    """Collect parameters and persistent buffers of a pickled module tree, yolov5 key names."""
    out = {}
    skip = rec.__dict__.get("_non_persistent_buffers_set", set())
    for k, v in {**rec.__dict__.get("_parameters", {}), **rec.__dict__.get("_buffers", {})}.items():
        if v is not None and k not in skip:
            out[prefix + k] = v.detach()
    for k, child in rec.__dict__.get("_modules", {}).items():
        if child is not None:
            out.update(_record_state_dict(child, f"{prefix}{k}."))
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Model:
    """A float32 eval-mode Model from a yolo_min checkpoint or a yolov5 `.pt` (EMA weights preferred).

    yolo_min checkpoints load with weights_only=True; yolov5 files go through a restricted unpickler
    that refuses anything but tensors, containers and known yolov5 class names.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        ckpt = None
    if ckpt is not None and "model_cfg" in ckpt:  # ours
        model = Model(ckpt["model_cfg"])
        model.load_state_dict(ckpt["ema"] or ckpt["model"])
        model.names = list(ckpt.get("names") or model.names)
    else:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RestrictedPickle)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: {e}") from None
        rec = ckpt.get("ema") or ckpt.get("model") if isinstance(ckpt, dict) else None
        if not isinstance(rec, _Record) or not isinstance(rec.__dict__.get("yaml"), dict):
            raise ValueError(f"{path}: neither a yolo_min checkpoint nor a yolov5 checkpoint")
        model = Model(rec.yaml)
        model.load_state_dict({k: v.float() for k, v in _record_state_dict(rec).items()})
        names = rec.__dict__.get("names")
        model.names = list(names.values()) if isinstance(names, dict) else list(names or model.names)
    return model.to(device).eval()


def save_checkpoint(ckpt: dict, path: str | Path) -> None:
    """torch.save to `path`.tmp, flushed to disk, then renamed over `path`: a crash, a kill or a full disk at
    any moment leaves the previous file whole (a stale .tmp is overwritten by the next save, never read).
    Ctrl-C or SIGTERM during the write takes effect as soon as it is done."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with _signals_held():
        try:
            with open(tmp, "wb") as f:
                torch.save(ckpt, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM until the block ends, then hand them to the usual handlers (main thread only:
    elsewhere Python cannot set handlers). A KeyboardInterrupt inside torch.save would break its zip writer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = [(s, signal.signal(s, lambda signum, frame: held.append(signum))) for s in (signal.SIGINT, signal.SIGTERM)]
    try:
        yield
    finally:
        for s, handler in old:
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)
