"""YOLOv5 detection, segmentation and classification networks from yolov5's yaml configs (names
equal yolov5's: its state_dicts load with strict=True), and `ModelEMA`, the weights' moving mean."""

from __future__ import annotations

import math
import reprlib
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import fuse_conv_bn_eval

from .files import read_yaml

CFG_DIR = Path(__file__).parent / "cfg"


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; `fuse()` folds the BN into the conv."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2 if p is None else p, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """1x1 conv to c2*e channels, 3x3 conv to c2, plus the input when shortcut and c1 == c2."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5):
        super().__init__()
        self.cv1 = Conv(c1, int(c2 * e), 1, 1)
        self.cv2 = Conv(int(c2 * e), c2, 3, 1)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C3(nn.Module):
    """CSP block: n bottlenecks on one half of the channels, a 1x1 shortcut on the other, merged."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True):
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools equal pools of 5, 9 and 13."""

    def __init__(self, c1: int, c2: int, k: int = 5):
        super().__init__()
        self.cv1 = Conv(c1, c1 // 2, 1, 1)
        self.cv2 = Conv(c1 // 2 * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        for _ in range(3):
            y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Concat(nn.Module):
    """Concatenate a list of maps along the channels (the config's argument: dimension 1)."""

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, 1)


class Proto(nn.Module):
    """Mask prototypes: P3 features (bs, c1, H/8, W/8) -> (bs, c2, H/4, W/4)."""

    def __init__(self, c1: int, c_: int = 256, c2: int = 32):
        super().__init__()
        self.cv1 = Conv(c1, c_, k=3)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.cv2 = Conv(c_, c_, k=3)
        self.cv3 = Conv(c_, c2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(self.cv2(self.upsample(self.cv1(x))))


class Detect(nn.Module):
    """One 1x1 conv per level to na * (5 + nc + nm) channels; `anchors` (nl, na, 2) in grid units.
    train: nl raw maps (bs, na, ny, nx, no), channels [tx, ty, tw, th, obj, cls..., coefs...];
    eval: (bs, N, no) decoded: xywh in input pixels, obj and class probabilities, raw mask coefs."""

    def __init__(self, nc: int = 80, anchors: list = (), ch: list = (), nm: int = 0):
        super().__init__()
        self.nc, self.nm, self.no = nc, nm, 5 + nc + nm
        self.nl, self.na = len(anchors), len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        # self.stride (nl,): the levels' strides in input pixels, which Model measures

    def forward(self, xs: list[torch.Tensor]):
        raw = []
        # in float32 also under autocast (--amp): the logits of boxes, objectness and classes lose
        # ~0.07 mAP50 in bfloat16 (shapes, 30 epochs: 0.886 vs 0.958); "cpu" also on meta
        with torch.autocast("cuda" if xs[0].is_cuda else "cpu", enabled=False):
            for conv, x in zip(self.m, xs):
                x = conv(x.float()).unflatten(1, (self.na, self.no)).permute(0, 1, 3, 4, 2)
                # (bs, na, ny, nx, no): channels_last (--amp) is laid out so, no copy
                raw.append(x if x.stride(-1) == 1 else x.contiguous())
        if self.training:
            return raw
        return torch.cat([self._decode(x, i) for i, x in enumerate(raw)], 1)

    def _decode(self, x: torch.Tensor, i: int) -> torch.Tensor:
        _, _, ny, nx, _ = x.shape
        grid = torch.stack(torch.meshgrid(torch.arange(nx), torch.arange(ny), indexing="xy"), 2)
        anchor_px = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2).to(x)
        xy, wh, conf, coefs = x.split((2, 2, self.nc + 1, self.nm), 4)
        xy = (xy.sigmoid() * 2 + (grid.to(x) - 0.5)) * self.stride[i]  # grid (ny, nx, 2) [x, y]
        wh = (wh.sigmoid() * 2) ** 2 * anchor_px
        return torch.cat((xy, wh, conf.sigmoid(), coefs), 4).view(len(x), -1, self.no)


class Segment(Detect):
    """Detect plus nm mask coefficients: (Detect's output, protos (bs, nm, H/4, W/4) from P3)."""

    def __init__(self, nc=80, anchors=(), nm: int = 32, npr: int = 256, ch: list = ()):
        super().__init__(nc, anchors, ch, nm=nm)
        self.proto = Proto(ch[0], npr, nm)

    def forward(self, xs: list[torch.Tensor]):
        # the prototypes in float32 too, also under autocast: in bfloat16 the shapes segment job
        # ended 0.08 mAP lower (mask mAP50 0.817 vs 0.893; with them in float32 0.881)
        with torch.autocast("cuda" if xs[0].is_cuda else "cpu", enabled=False):
            return super().forward(xs), self.proto(xs[0].float())


class Classify(nn.Module):
    """1x1 Conv to 1280, average pool, dropout, Linear: (bs, c1, h, w) -> logits (bs, nc)."""

    stride = torch.tensor([32.0])  # of the backbone's last map, as yolov5's classifiers keep it

    def __init__(self, c1: int, nc: int = 1000, dropout: float = 0.0):
        super().__init__()
        self.nc = nc
        self.conv = Conv(c1, 1280)  # EfficientNet-B0's head width
        self.conv.bn.eps, self.conv.bn.momentum = 1e-5, 0.1  # torch's: as yolov5's Classify keeps
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout, inplace=True)
        self.linear = nn.Linear(1280, nc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.drop(self.pool(self.conv(x)).flatten(1)))


# The only names a config may use: a table, never eval().
MODULES = {"Conv": Conv, "C3": C3, "SPPF": SPPF, "Concat": Concat, "Upsample": nn.Upsample}
MODULES |= {"nn.Upsample": nn.Upsample, "Detect": Detect, "Segment": Segment, "Classify": Classify}
TASKS = {Detect: "detect", Segment: "segment", Classify: "classify"}  # from the last layer's type


def amp_dtype(device: torch.device, mode: str = "auto") -> torch.dtype | None:
    """The autocast dtype of --amp {auto,on,off} on device, None: float32."""
    # auto: float16 on CUDA, bfloat16 on a CPU with native bf16 (AVX512-BF16, AMX, Arm BF16);
    # on: also where bf16 is emulated; off, and other devices: float32
    if mode == "off" or device.type not in ("cuda", "cpu"):
        return None
    if device.type == "cuda":
        return torch.float16
    native = any(map(torch.cpu.get_capabilities().get, ("avx512_bf16", "amx_bf16", "bf16")))
    return torch.bfloat16 if native or mode == "on" else None


def make_divisible(x: float, divisor: int = 8) -> int:
    """x rounded up to a multiple of divisor."""
    return math.ceil(x / divisor) * divisor


def load_cfg(cfg: str | Path | dict) -> tuple[dict, str]:
    """A model config as a dict, and its name for error messages. Bare names resolve to cfg/."""
    if isinstance(cfg, dict):
        return deepcopy(cfg), "model cfg"
    path = Path(cfg) if Path(cfg).exists() else CFG_DIR / Path(cfg).name
    if not path.exists():  # one that is not a regular file: read_yaml says so
        shipped = ", ".join(sorted(p.name for p in CFG_DIR.glob("yolov5*.yaml")))
        raise FileNotFoundError(f"model cfg '{cfg}' not found (shipped configs: {shipped})")
    return read_yaml(path, "model cfg"), str(path)


# What a config may hold, checked before anything is built (a checkpoint's config is untrusted)
MAX_LAYERS, MAX_REPEATS, MAX_NUMBER = 50, 16, 10_000  # yolov5x: 10 + 15 layers, repeats <= 12
CFG_CHECKS = {  # the first five are required (anchors too with a Detect or Segment head)
    "nc": lambda v: type(v) is int and _number(v, 0),
    "depth_multiple": lambda v: _number(v, 0, 4),
    "width_multiple": lambda v: _number(v, 0, 4),
    "backbone": lambda v: _rows(v, MAX_LAYERS),
    "head": lambda v: _rows(v, MAX_LAYERS),
    "anchors": lambda v: _rows(v, 8) and all(_rows(r, 20) and all(map(_number, r)) for r in v),
    "ch": lambda v: v == 3,
    "names": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
}
ROW = "[from (-1 or earlier layers), repeats (1-16 after depth_multiple), module, args (scalars)]"


def _number(x, low: float = -MAX_NUMBER, high: float = MAX_NUMBER) -> bool:
    """x is an int or float (no bool) in (low, high]: neither NaN nor inf nor huge."""
    return type(x) in (int, float) and low < x <= high


def _rows(x, most: int) -> bool:
    return isinstance(x, list) and 0 < len(x) <= most


# x's repr cut short: an untrusted object may be huge, or shared lists nested deep
def _short(x) -> str:
    return reprlib.repr(x)[:40]


def parse_model(d: dict, where: str) -> tuple[nn.Sequential, list[int]]:
    """A checked yolov5 cfg dict's layers, and the indices of layers whose outputs are reused."""
    if missing := [k for k in list(CFG_CHECKS)[:5] if not isinstance(d, dict) or k not in d]:
        raise ValueError(f"{where}: missing key '{missing[0]}'")
    if bad := [k for k in d if k not in CFG_CHECKS or not CFG_CHECKS[k](d[k])]:
        why = "is out of range or of the wrong type (or an unknown key)"
        raise ValueError(f"{where}: {_short(bad[0])}: {_short(d[bad[0]])} {why}")
    depth, width = d["depth_multiple"], d["width_multiple"]
    symbols = {"nc": d["nc"], "anchors": d.get("anchors"), "None": None}
    layers, reused, chs = [], [], {-1: 3}  # output channels by layer; -1: the last (the image's)
    for i, row in enumerate(d["backbone"] + d["head"]):
        at = f"{where}: layer {i}"
        src, n, name, args = row if isinstance(row, list) and len(row) == 4 else [None] * 4
        froms = src if isinstance(src, list) else [src]
        ok = froms and all(type(j) is int and -1 <= j < i for j in froms) and isinstance(name, str)
        ok = ok and type(n) is int and 0 < n * depth <= MAX_REPEATS and isinstance(args, list)
        if not ok or not all(a is None or type(a) in (str, bool) or _number(a) for a in args):
            raise ValueError(f"{at}: {_short(row)} is not {ROW}")
        if name not in MODULES:
            raise ValueError(f"{at}: unknown module {_short(name)} (known: {', '.join(MODULES)})")
        m, n = MODULES[name], max(round(n * depth), 1) if n > 1 else n
        try:
            args = [symbols.get(a, a) if isinstance(a, str) else a for a in args]
            c_in = [chs[j] for j in froms]
            c_out = c_in[0]
            if m in (Conv, C3, SPPF):
                c_out = make_divisible(args[0] * width)
                args = [c_in[0], c_out, *args[1:]]
                if m is C3:
                    args, n = [*args[:2], n, *args[2:]], 1
            elif m is Concat:
                c_out, args = sum(c_in), []
            elif m is Classify:
                args = [c_in[0], *args]
            elif m in (Detect, Segment):
                if "anchors" not in d:
                    raise ValueError("missing key 'anchors'")
                if m is Segment:
                    args[3] = make_divisible(args[3] * width)
                args.append(c_in)
            module = nn.Sequential(*(m(*args) for _ in range(n))) if n > 1 else m(*args)
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"{at} ({name}): bad args {_short(args)}: {e}") from None
        module.i, module.f = i, src
        layers.append(module)
        reused.extend(j for j in froms if j != -1)
        chs[i] = chs[-1] = c_out
    return nn.Sequential(*layers), sorted(set(reused))


class Model(nn.Module):
    """A YOLOv5 network from a cfg (see load_cfg). Input: float images (bs, 3, H, W), H and W
    multiples of 32, in [0, 1] (classify: ImageNet mean/std normalised); output: the head's."""

    def __init__(self, cfg: str | Path | dict = "yolov5n.yaml", nc: int | None = None):
        super().__init__()
        self.yaml, where = load_cfg(cfg)
        if nc is not None:
            self.yaml["nc"] = nc
        self.model, self.reused = parse_model(self.yaml, where)
        head = self.head
        if type(head) not in TASKS:
            raise ValueError(f"{where}: the last layer must be Detect, Segment or Classify")
        self.task, self.nc = TASKS[type(head)], head.nc
        self.names = self.yaml.get("names") or [str(i) for i in range(head.nc)]
        if self.task != "classify":  # strides from one dummy pass; then the anchors in grid units
            with torch.no_grad():
                out = self.forward(torch.zeros(1, 3, 256, 256))
            maps = out[0] if self.task == "segment" else out
            head.stride = torch.tensor([256 / x.shape[-3] for x in maps], device="cpu")  # also meta
            head.anchors /= head.stride.view(-1, 1, 1)
            for conv, stride in zip(head.m, head.stride):  # priors: ~8 objects per 640 px, 0.6/nc
                b = conv.bias.data.view(head.na, -1)
                b[:, 4] += math.log(8 / (640 / stride) ** 2)
                b[:, 5 : 5 + head.nc] += math.log(0.6 / (head.nc - 0.99999))
        self.stride = head.stride  # (nl,) float: [8, 16, 32] ([32]: Classify's input)

    @property
    def head(self) -> Detect | Classify:  # or Segment
        return self.model[-1]

    def forward(self, x: torch.Tensor):
        outputs = []
        for m in self.model:
            if isinstance(m.f, list):
                x = [x if j == -1 else outputs[j] for j in m.f]
            elif m.f != -1:
                x = outputs[m.f]
            x = m(x)
            outputs.append(x if m.i in self.reused else None)
        return x

    def fuse(self) -> Model:
        """Fold every BatchNorm into its conv (eval mode, for inference); outputs equal to ~1e-5."""
        for m in self.modules():
            if isinstance(m, Conv) and isinstance(m.bn, nn.BatchNorm2d):
                m.conv, m.bn = fuse_conv_bn_eval(m.conv, m.bn), nn.Identity()
        return self


def de_parallel(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


class ModelEMA:
    """Exponential moving average of every float tensor of a model's state (weights, BN buffers)."""

    def __init__(self, model: nn.Module):
        self.ema = deepcopy(de_parallel(model)).eval().requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """After an optimizer step: ema = d * ema + (1 - d) * model."""
        self.updates += 1
        d = 0.9999 * (1 - math.exp(-self.updates / 2000))  # short memory early in training
        state = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.lerp_(state[k].detach(), 1 - d)
