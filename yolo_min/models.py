"""YOLOv5 detection, segmentation and classification networks from yolov5's yaml configs (names
equal yolov5's: its state_dicts load with strict=True), and `ModelEMA`, the weights' moving mean.

The heads keep yolov5's attribute names, which the rest of yolo_min reads: nc classes, nm mask
coefficients, nl levels, na anchors per level, no outputs per anchor (5 + nc + nm)."""

import math
import reprlib
from collections import OrderedDict
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import fuse_conv_bn_eval

from .files import read_yaml

CFG_DIR = Path(__file__).parent / "cfg"


class Conv(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; `fuse()` folds the BN into the conv."""

    def __init__(self, in_channels, out_channels, kernel_size=1, stride=1, padding=None):
        # "Same" padding for odd kernels unless the config gives one.
        if padding is None:
            padding = kernel_size // 2
        conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False
        )
        bn = nn.BatchNorm2d(out_channels, eps=1e-3, momentum=0.03)
        super().__init__(OrderedDict(conv=conv, bn=bn, act=nn.SiLU()))

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        # A cat's backward hands each input a channel slice of its gradient, strided in
        # channels_last, and the classifier's pool an NCHW one: on a CPU, SiLU's and BatchNorm's
        # backward run about 8x slower on those than on a dense channels_last gradient (bench/).
        if y.requires_grad and y.is_cpu and y.is_contiguous(memory_format=torch.channels_last):
            y.register_hook(lambda grad: grad.contiguous(memory_format=torch.channels_last))
        return y


class Bottleneck(nn.Module):
    """1x1 conv, 3x3 conv, both keeping the channels (as in C3), plus the input when shortcut."""

    def __init__(self, channels, shortcut):
        super().__init__()
        self.cv1 = Conv(channels, channels)
        self.cv2 = Conv(channels, channels, kernel_size=3)
        self.add = shortcut

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP block: `repeats` bottlenecks on one half of the channels, a 1x1 shortcut on the other,
    merged by a 1x1 conv."""

    def __init__(self, in_channels, out_channels, repeats, shortcut=True):
        super().__init__()
        hidden = out_channels // 2
        self.cv1 = Conv(in_channels, hidden)
        self.cv2 = Conv(in_channels, hidden)
        self.cv3 = Conv(2 * hidden, out_channels)
        self.m = nn.Sequential(*(Bottleneck(hidden, shortcut) for _ in range(repeats)))

    def forward(self, x):
        bottlenecks = self.m(self.cv1(x))
        shortcut = self.cv2(x)
        return self.cv3(torch.cat((bottlenecks, shortcut), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools equal pools of 5, 9 and 13."""

    def __init__(self, in_channels, out_channels, kernel_size=5):
        super().__init__()
        hidden = in_channels // 2
        self.cv1 = Conv(in_channels, hidden)
        self.cv2 = Conv(hidden * 4, out_channels)
        self.m = nn.MaxPool2d(kernel_size=kernel_size, stride=1, padding=kernel_size // 2)

    def forward(self, x):
        pooled = [self.cv1(x)]
        for _ in range(3):
            pooled.append(self.m(pooled[-1]))
        return self.cv2(torch.cat(pooled, 1))


class Concat(nn.Module):
    """Concatenate a list of maps along the channels (the config's argument: dimension 1)."""

    def forward(self, x):
        return torch.cat(x, 1)


class Proto(nn.Sequential):
    """Mask prototypes: P3 features (bs, in_channels, H/8, W/8) -> (bs, num_masks, H/4, W/4)."""

    def __init__(self, in_channels, hidden, num_masks):
        layers = OrderedDict(
            cv1=Conv(in_channels, hidden, kernel_size=3),
            upsample=nn.Upsample(scale_factor=2, mode="nearest"),
            cv2=Conv(hidden, hidden, kernel_size=3),
            cv3=Conv(hidden, num_masks),
        )
        super().__init__(layers)


def _autocast_off(x):
    """A context with autocast off on x's device type ("cpu" also for the meta device)."""
    device_type = "cuda" if x.is_cuda else "cpu"
    return torch.autocast(device_type, enabled=False)


class Detect(nn.Module):
    """One 1x1 conv per level to na * no channels; `anchors` (nl, na, 2) in grid units.
    train: nl raw maps (bs, na, ny, nx, no), channels [tx, ty, tw, th, obj, cls..., coefs...];
    eval: (bs, N, no) decoded: xywh in input pixels, obj and class probabilities, raw mask coefs."""

    def __init__(self, num_classes, anchors, in_channels, num_masks=0):
        super().__init__()
        self.nc = num_classes
        self.nm = num_masks
        self.no = 5 + num_classes + num_masks
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in in_channels)
        # Model measures self.stride (nl,), the levels' strides in input pixels.

    def forward(self, features):
        raw = []
        # In float32 also under autocast (--amp): in bfloat16 the logits of boxes, objectness and
        # classes lose ~0.07 mAP50 (shapes, 30 epochs: 0.886 vs 0.958).
        with _autocast_off(features[0]):
            for conv, x in zip(self.m, features):
                x = conv(x.float())
                # (bs, na, ny, nx, no). A channels_last map (--amp) is laid out so already: views
                # from (bs, ny, nx, na * no), which backward turns into a channels_last gradient
                # in one copy. A contiguous one is copied, its gradient stays contiguous.
                if x.is_contiguous(memory_format=torch.channels_last):
                    x = x.permute(0, 2, 3, 1).unflatten(3, (self.na, self.no))
                    x = x.permute(0, 3, 1, 2, 4)
                else:
                    x = x.unflatten(1, (self.na, self.no)).permute(0, 1, 3, 4, 2).contiguous()
                raw.append(x)
        if self.training:
            return raw
        return torch.cat([self._decode(x, level) for level, x in enumerate(raw)], 1)

    def _decode(self, x, level):
        """Level `level`'s raw map (bs, na, ny, nx, no) -> (bs, na * ny * nx, no) decoded."""
        _, _, ny, nx, _ = x.shape
        # grid (ny, nx, 2) holds each cell's [x, y].
        grid = torch.stack(torch.meshgrid(torch.arange(nx), torch.arange(ny), indexing="xy"), 2)
        stride = self.stride[level]
        # The anchors (na, 1, 1, 2) in input pixels.
        anchors_px = (self.anchors[level] * stride)[:, None, None].to(x)
        xy, wh, scores, coefs = x.split((2, 2, self.nc + 1, self.nm), 4)
        offset = grid.to(x) - 0.5
        xy = (xy.sigmoid() * 2 + offset) * stride
        wh = (wh.sigmoid() * 2) ** 2 * anchors_px
        return torch.cat((xy, wh, scores.sigmoid(), coefs), 4).view(len(x), -1, self.no)


class Segment(Detect):
    """Detect plus nm mask coefficients: (Detect's output, protos (bs, nm, H/4, W/4) from P3)."""

    def __init__(self, num_classes, anchors, num_masks, proto_channels, in_channels):
        super().__init__(num_classes, anchors, in_channels, num_masks=num_masks)
        self.proto = Proto(in_channels[0], proto_channels, num_masks)

    def forward(self, features):
        # The prototypes in float32 too, also under autocast: in bfloat16 the shapes segment job
        # ended 0.08 mAP lower (mask mAP50 0.817 vs 0.893; with them in float32 0.881).
        with _autocast_off(features[0]):
            return super().forward(features), self.proto(features[0].float())


class Classify(nn.Sequential):
    """1x1 Conv to 1280, average pool, dropout, Linear: (bs, c, h, w) -> logits (bs, nc)."""

    # The stride of the backbone's last map, which yolov5's classifiers keep.
    stride = torch.tensor([32.0])

    def __init__(self, in_channels, num_classes=1000, dropout=0.0):
        # EfficientNet-B0's head width, with torch's BatchNorm defaults, as yolov5's Classify has.
        conv = Conv(in_channels, 1280)
        conv.bn.eps = 1e-5
        conv.bn.momentum = 0.1
        layers = OrderedDict(
            conv=conv,
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            drop=nn.Dropout(dropout, inplace=True),
            linear=nn.Linear(1280, num_classes),
        )
        super().__init__(layers)
        self.nc = num_classes


# A config may use only these names: a table, never eval().
MODULES = {
    "Conv": Conv,
    "C3": C3,
    "SPPF": SPPF,
    "Concat": Concat,
    "Upsample": nn.Upsample,
    "nn.Upsample": nn.Upsample,
    "Detect": Detect,
    "Segment": Segment,
    "Classify": Classify,
}
# The task follows from the last layer's type.
TASKS = {Detect: "detect", Segment: "segment", Classify: "classify"}


def amp_dtype(device, mode):
    """The autocast dtype of --amp {auto,on,off} on device, None: float32."""
    # auto: float16 on CUDA, bfloat16 on a CPU with native bf16 (AVX512-BF16, AMX, Arm BF16);
    # on: also where bf16 is emulated; off, and other devices: float32.
    if mode == "off" or device.type not in ("cuda", "cpu"):
        return None
    if device.type == "cuda":
        return torch.float16
    capabilities = torch.cpu.get_capabilities()
    native = any(map(capabilities.get, ("avx512_bf16", "amx_bf16", "bf16")))
    if native or mode == "on":
        return torch.bfloat16
    return None


def make_divisible(x, divisor=8):
    """x rounded up to a multiple of divisor."""
    return math.ceil(x / divisor) * divisor


def load_cfg(cfg):
    """A model config as a dict, and its name for error messages. Bare names resolve to cfg/."""
    if isinstance(cfg, dict):
        return deepcopy(cfg), "model cfg"
    path = Path(cfg)
    if not path.exists():
        path = CFG_DIR / path.name
    # a path that is not a regular file: read_yaml says so
    if not path.exists():
        shipped = ", ".join(sorted(p.name for p in CFG_DIR.glob("yolov5*.yaml")))
        raise FileNotFoundError(f"model cfg '{cfg}' not found (shipped configs: {shipped})")
    return read_yaml(path, "model cfg"), str(path)


# What a config may hold, checked before anything is built: a checkpoint's config is untrusted.
# yolov5x has 10 + 15 layers and repeats of at most 12.
MAX_LAYERS = 50
MAX_REPEATS = 16
MAX_NUMBER = 10_000


def _number(x, low=-MAX_NUMBER, high=MAX_NUMBER):
    """x is an int or float (no bool) in (low, high]: neither NaN nor inf nor huge."""
    return type(x) in (int, float) and low < x <= high


def _rows(x, most):
    return isinstance(x, list) and 0 < len(x) <= most


def _anchor_rows(x):
    """At most 8 levels of at most 10 anchors (w, h pairs), all numbers."""
    return _rows(x, 8) and all(_rows(row, 20) and all(map(_number, row)) for row in x)


def _scalar(x):
    """A layer argument: None, a str, a bool or a number."""
    return x is None or type(x) in (str, bool) or _number(x)


# The first five are required (anchors too with a Detect or Segment head).
CFG_CHECKS = {
    "nc": lambda v: type(v) is int and _number(v, 0),
    "depth_multiple": lambda v: _number(v, 0, 4),
    "width_multiple": lambda v: _number(v, 0, 4),
    "backbone": lambda v: _rows(v, MAX_LAYERS),
    "head": lambda v: _rows(v, MAX_LAYERS),
    "anchors": _anchor_rows,
    "ch": lambda v: v == 3,
    "names": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
}
ROW = "[from (-1 or earlier layers), repeats (1-16 after depth_multiple), module, args (scalars)]"


def _short(x):
    """x's repr cut short: an untrusted object may be huge, or shared lists nested deep."""
    return reprlib.repr(x)[:40]


def _check_keys(cfg, where):
    """Raise ValueError unless cfg is a dict with the required keys, each value as CFG_CHECKS."""
    for key in list(CFG_CHECKS)[:5]:
        if not isinstance(cfg, dict) or key not in cfg:
            raise ValueError(f"{where}: missing key '{key}'")
    for key, value in cfg.items():
        check = CFG_CHECKS.get(key)
        if check is None or not check(value):
            why = "is out of range or of the wrong type (or an unknown key)"
            raise ValueError(f"{where}: {_short(key)}: {_short(value)} {why}")


def _check_row(row, index, depth_multiple, at):
    """The sources (a list) of layer `index`'s row [from, repeats, module, args]; ValueError unless
    the row is as ROW says."""
    if not isinstance(row, list) or len(row) != 4:
        raise ValueError(f"{at}: {_short(row)} is not {ROW}")
    source, repeats, name, args = row
    sources = source if isinstance(source, list) else [source]
    sources_ok = all(type(j) is int and -1 <= j < index for j in sources)
    repeats_ok = type(repeats) is int and 0 < repeats * depth_multiple <= MAX_REPEATS
    args_ok = isinstance(args, list) and all(map(_scalar, args))
    if not (sources and sources_ok and isinstance(name, str) and repeats_ok and args_ok):
        raise ValueError(f"{at}: {_short(row)} is not {ROW}")
    return sources


def _layer_args(module_class, args, in_channels, width_multiple):
    """(the constructor's args, the output channels) of a layer of module_class reading maps of
    in_channels; args: the config's, its symbols (nc, anchors) resolved."""
    # One input's channels, or a Concat's: their sum.
    out_channels = sum(in_channels)
    if module_class in (Conv, C3, SPPF):
        out_channels = make_divisible(args[0] * width_multiple)
        args = [in_channels[0], out_channels, *args[1:]]
    elif module_class is Concat:
        args = []
    elif module_class is Classify:
        args = [in_channels[0], *args]
    elif module_class in (Detect, Segment):
        if module_class is Segment:
            args[3] = make_divisible(args[3] * width_multiple)
        args.append(in_channels)
    return args, out_channels


def parse_model(cfg, where):
    """A checked yolov5 cfg dict's layers, and the indices of layers whose outputs are reused."""
    _check_keys(cfg, where)
    depth_multiple = cfg["depth_multiple"]
    width_multiple = cfg["width_multiple"]
    symbols = {"nc": cfg["nc"], "anchors": cfg.get("anchors"), "None": None}
    layers = []
    reused = []
    # channels maps each layer to its output channels; -1 is the last layer so far (at first, the
    # image).
    channels = {-1: 3}
    for index, row in enumerate(cfg["backbone"] + cfg["head"]):
        at = f"{where}: layer {index}"
        sources = _check_row(row, index=index, depth_multiple=depth_multiple, at=at)
        source, repeats, name, args = row
        if name not in MODULES:
            raise ValueError(f"{at}: unknown module {_short(name)} (known: {', '.join(MODULES)})")
        module_class = MODULES[name]
        if repeats > 1:
            repeats = max(round(repeats * depth_multiple), 1)
        # The arguments are scalars: only the strings among them can be symbols.
        args = [symbols.get(a, a) for a in args]
        in_channels = [channels[j] for j in sources]
        try:
            if module_class in (Detect, Segment) and "anchors" not in cfg:
                raise ValueError("missing key 'anchors'")
            args, out_channels = _layer_args(
                module_class, args, in_channels=in_channels, width_multiple=width_multiple
            )
            # C3 repeats its bottlenecks itself.
            if module_class is C3:
                args.insert(2, repeats)
                repeats = 1
            if repeats > 1:
                layer = nn.Sequential(*(module_class(*args) for _ in range(repeats)))
            else:
                layer = module_class(*args)
        except (TypeError, ValueError, IndexError) as error:
            raise ValueError(f"{at} ({name}): bad args {_short(args)}: {error}") from None
        layer.index = index
        layer.source = source
        layers.append(layer)
        reused.extend(j for j in sources if j != -1)
        channels[index] = channels[-1] = out_channels
    return nn.Sequential(*layers), sorted(set(reused))


class Model(nn.Module):
    """A YOLOv5 network from a cfg (see load_cfg). Input: float images (bs, 3, H, W), H and W
    multiples of 32, in [0, 1] (classify: ImageNet mean/std normalised); output: the head's."""

    def __init__(self, cfg="yolov5n.yaml", nc=None):
        super().__init__()
        self.yaml, where = load_cfg(cfg)
        if nc is not None:
            self.yaml["nc"] = nc
        self.model, self.reused = parse_model(self.yaml, where)
        head = self.head
        if type(head) not in TASKS:
            raise ValueError(f"{where}: the last layer must be Detect, Segment or Classify")
        self.task = TASKS[type(head)]
        self.nc = head.nc
        self.names = self.yaml.get("names") or [str(i) for i in range(head.nc)]
        if self.task != "classify":
            self._measure_strides()
            self._init_biases()
        # The strides (nl,), float: [8, 16, 32] for detection, [32] for Classify's input.
        self.stride = head.stride

    @property
    def head(self):
        """The last layer: a Detect (or Segment, a Detect) or a Classify head."""
        return self.model[-1]

    @property
    def max_stride(self):
        """The largest stride, an int (input pixels): the input's sides are multiples of it."""
        return int(self.stride.max())

    def _measure_strides(self):
        """The head's strides from one dummy pass; then its anchors from pixels to grid units."""
        head = self.head
        with torch.no_grad():
            out = self.forward(torch.zeros(1, 3, 256, 256))
        maps = out[0] if self.task == "segment" else out
        # The strides live on the CPU, also when the model is built on the meta device.
        head.stride = torch.tensor([256 / x.shape[-3] for x in maps], device="cpu")
        head.anchors /= head.stride.view(-1, 1, 1)

    def _init_biases(self):
        """yolov5's priors: objectness for ~8 objects per 640x640 image, class scores 0.6 / nc."""
        head = self.head
        class_prior = math.log(0.6 / (head.nc - 0.99999))
        for conv, stride in zip(head.m, head.stride):
            bias = conv.bias.data.view(head.na, -1)
            cells = (640 / stride) ** 2
            bias[:, 4] += math.log(8 / cells)
            bias[:, 5 : 5 + head.nc] += class_prior

    def forward(self, x):
        outputs = []
        for layer in self.model:
            if isinstance(layer.source, list):
                x = [x if j == -1 else outputs[j] for j in layer.source]
            elif layer.source != -1:
                x = outputs[layer.source]
            x = layer(x)
            # Only the outputs that later layers read are kept.
            outputs.append(x if layer.index in self.reused else None)
        return x

    def fuse(self):
        """Fold every BatchNorm into its conv (eval mode, for inference); outputs equal to ~1e-5."""
        for module in self.modules():
            if isinstance(module, Conv) and isinstance(module.bn, nn.BatchNorm2d):
                module.conv = fuse_conv_bn_eval(module.conv, module.bn)
                module.bn = nn.Identity()
        return self


def de_parallel(model):
    """The plain model inside a DDP wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


class ModelEMA:
    """Exponential moving average of every float tensor of a model's state (weights, BN buffers).
    The model's tensors are paired with the average's once, here: move or convert it first."""

    def __init__(self, model):
        model = de_parallel(model)
        self.ema = deepcopy(model).eval().requires_grad_(False)
        self.updates = 0
        # Paired once: two state_dicts a step cost yolov5n-cls 6 times the arithmetic (1.5 ms).
        sources = model.state_dict(keep_vars=True)
        averages = self.ema.state_dict(keep_vars=True)
        floats = [k for k, v in averages.items() if v.dtype.is_floating_point]
        self.averages = [averages[k] for k in floats]
        self.sources = [sources[k] for k in floats]

    @torch.no_grad()
    def update(self):
        """After an optimizer step: ema = decay * ema + (1 - decay) * model."""
        self.updates += 1
        # The decay ramps up from 0, so that the average forgets fast early in training.
        decay = 0.9999 * (1 - math.exp(-self.updates / 2000))
        # All tensors in one call: the same arithmetic as one lerp_ each, with less overhead.
        torch._foreach_lerp_(self.averages, self.sources, 1 - decay)
