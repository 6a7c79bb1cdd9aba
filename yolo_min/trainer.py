"""Training: the options, the builders, the step loop (`train_one_epoch`) and the epoch loop with
its checkpoints and resume (`fit`), in one process or on every rank under torchrun; train.py and
`yolo_min.YOLO.train` call `main`."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import itertools
import math
import random
import reprlib
import resource
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import yaml
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, cls_augment, datasets, dist, safe_load, validator
from .anchors import check_anchors
from .cli import ConfigError, parse_kwargs
from .datasets import ClassifyDataset, YOLODataset, build_dataloader
from .files import first_line, read_yaml
from .losses import ClassifyLoss, YOLOLoss, scale_hyp
from .metrics import KINDS, metric_names
from .models import CFG_DIR, Model, ModelEMA, amp_dtype, de_parallel
from .plots import draw_later, finish_drawing

# detection: gradients accumulate over this many images before a step
NOMINAL_BATCH = 64
# classify's recipe: no warmup, no accumulation; the others' is hyp.scratch-low
HYP_FILES = {"classify": "hyp.cls.yaml"}
# the options' defaults that depend on the task, unless given
TASK_DEFAULTS = {"classify": {"imgsz": 224, "batch_size": 64, "optimizer": "Adam"}}
DEFAULTS = {"imgsz": 640, "batch_size": 16, "optimizer": "SGD"}
# trainings this process has started (a script may train more than once under one torchrun run)
TRAININGS_STARTED = itertools.count()
OPTIMIZERS = {"SGD": optim.SGD, "Adam": optim.Adam, "AdamW": optim.AdamW, "RMSProp": optim.RMSprop}
IMGSZ_RANGE = (32, 8192)
# the least value of each numeric option (--batch-size: also a multiple of the world size)
LEAST = {"epochs": 1, "batch_size": 1, "log_every": 1, "workers": 0, "patience": 0, "seed": 0}
# each recipe key's valid range (both recipes' keys): "[" and "]" include a bound, "(" and ")" not
HYP_RANGES = {
    "lr0": "(0, 1]",
    # the final lr is lr0 * lrf: never negative, never above lr0
    "lrf": "[0, 1]",
    # SGD's Nesterov momentum needs > 0; Adam's beta1 < 1
    "momentum": "(0, 1)",
    "weight_decay": "[0, 1)",
    "warmup_epochs": "[0, 1000]",
    "warmup_momentum": "[0, 1)",
    "warmup_bias_lr": "[0, 1]",
    "box": "[0, 100]",
    "cls": "[0, 100]",
    # BCE positive weights: a negative one makes the loss negative
    "cls_pw": "(0, 100]",
    "obj": "[0, 100]",
    "obj_pw": "(0, 100]",
    "iou_t": "[0, 1]",
    # the w and h ratios of a match are below it: at 1 nothing matches
    "anchor_t": "(1, 100]",
    "fl_gamma": "[0, 10]",
    "label_smoothing": "[0, 1)",
    # 1: hues turn by up to 180 degrees
    "hsv_h": "[0, 1]",
    # the gains are 1 +- these: above 1 they could turn negative
    "hsv_s": "[0, 1]",
    "hsv_v": "[0, 1]",
    "degrees": "[0, 180]",
    "translate": "[0, 1]",
    # the scale is 1 +- this: at 1 an image could shrink to nothing
    "scale": "[0, 1)",
    "shear": "[0, 45]",
    # larger ones fold the 1280-pixel mosaic canvas over itself
    "perspective": "[0, 0.001]",
    "flipud": "[0, 1]",
    "fliplr": "[0, 1]",
    "mosaic": "[0, 1]",
}
# yolov5's recipe keys that yolo_min does not implement: only 0, their default, is accepted
NOT_IMPLEMENTED = ("mixup", "copy_paste")
# how build_training runs each autocast dtype of amp_dtype (None: fp32)
PRECISIONS = {
    torch.float16: "fp16 autocast + GradScaler, channels_last",
    torch.bfloat16: "bf16 autocast, channels_last",
    None: "fp32",
}
# a training batch of one image fails there (BatchNorm needs two values per channel)
ONE_IMAGE = "BatchNorm cannot train on 1 image when the last feature map is 1x1 pixel"


def get_args_parser():
    # No abbreviations: the Python API takes only whole names, and so does the command line.
    parser = argparse.ArgumentParser(
        description="Train YOLOv5 detection, segmentation, classification", allow_abbrev=False
    )
    # the options in --help's order (args.yaml keeps it)
    add = parser.add_argument
    add("--cfg", default="yolov5n.yaml", help="model cfg; its head sets the task")
    add("--data", default="shapes", help="data yaml or folder, 'shapes', 'shapes-cls'")
    add("--hyp", default="", help="yaml overriding keys of the recipe")
    add("--weights", default="", help="initial weights: yolo_min or yolov5 .pt")
    add("--epochs", type=int, default=100)
    add("--batch-size", type=int, help="global, split over the ranks (16; classify 64)")
    add("--imgsz", type=int, help="train and val image size (640; classify 224)")
    add("--optimizer", choices=OPTIMIZERS, help="SGD (classify: Adam)")
    add("--device", default="", help="cpu, cuda or a GPU index")
    add("--amp", choices=["auto", "on", "off"], default="auto", help=validator.AMP_HELP)
    add("--workers", type=int, default=8, help="dataloader workers per rank")
    add("--project", default="runs/train")
    add("--name", default="exp")
    add("--exist-ok", action="store_true", help="reuse project/name")
    add("--resume", nargs="?", const=True, default=False, help="a last.pt, or newest")
    add("--freeze", nargs="+", type=int, default=[0], help="first N, or listed layers")
    validator.add_switches(
        parser,
        {"--cos-lr": "cosine lr schedule, not linear", "--sync-bn": "SyncBatchNorm across GPUs"},
    )
    add("--patience", type=int, default=100, help="epochs without improvement")
    add("--seed", type=int, default=0)
    add("--cache", choices=["auto", "ram", "off"], default="auto", help="images in RAM")
    add("--log-every", type=int, default=10, help="a progress line every N batches")
    validator.add_switches(
        parser,
        {
            "--noautoanchor": None,
            "--noval": "validate the final epoch only",
            "--nosave": "save the final checkpoint only",
        },
    )
    return parser


# ---------------------------------------------------------------- builders
def load_hyp(changes, task="detect", where="--hyp"):
    """The task's recipe (HYP_FILES) with some values changed: a yaml file ('' none) or a dict.
    ConfigError naming `where` and the key for an unknown key or a value outside its range."""
    recipe = read_yaml(CFG_DIR / HYP_FILES.get(task, "hyp.scratch-low.yaml"))
    if isinstance(changes, str) and changes:
        where = f"{where} {changes}"
        changes = read_yaml(changes, "--hyp")
    if changes == "":
        changes = {}
    if not isinstance(changes, dict):
        raise ConfigError(
            f"{where}: not a mapping of recipe keys to numbers (a {type(changes).__name__})"
        )
    if unknown := sorted(str(k) for k in set(changes) - set(recipe)):
        raise ConfigError(f"{where}: unknown keys {unknown[:5]} (known: {', '.join(recipe)})")
    # each value: a finite number in its key's range (HYP_RANGES), 0 for a key not implemented
    for key, value in changes.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ConfigError(f"{where}: {key} is {reprlib.repr(value)}, not a finite number")
        if key in NOT_IMPLEMENTED and value != 0:
            raise ConfigError(
                f"{where}: {key} is {value:g}: not implemented by yolo_min (only 0 is accepted)"
            )
        bounds = HYP_RANGES.get(key)
        if bounds and not in_range(value, bounds):
            raise ConfigError(f"{where}: {key} is {value:g}, outside its range {bounds}")
    return recipe | {k: float(v) for k, v in changes.items()}


def in_range(value, bounds):
    """Whether value lies in an interval written "[low, high)" (brackets include, parentheses
    exclude a bound)."""
    low, high = (float(b) for b in bounds[1:-1].split(","))
    above = value >= low if bounds[0] == "[" else value > low
    below = value <= high if bounds[-1] == "]" else value < high
    return above and below


def check_args(args, task, world_size):
    """ConfigError naming the option unless the arguments (given or resumed) are usable; fills in
    the task's defaults and rounds --imgsz up to a multiple of 32."""
    defaults = TASK_DEFAULTS.get(task, DEFAULTS)
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k) is None})
    check_numbers(args, world_size)
    # A resumed run's arguments come from its args.yaml, past argparse's choices and types.
    if args.cache not in ("auto", "ram", "off"):
        raise ConfigError(f"--cache {args.cache}: one of auto, ram, off")
    if not all(type(layer) is int for layer in args.freeze):
        raise ConfigError(f"--freeze {args.freeze}: layer numbers must be integers")
    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {args.optimizer}: one of {', '.join(OPTIMIZERS)}")
    args.imgsz = validator.round_imgsz(args.imgsz, 32)


def check_numbers(args, world_size):
    """ConfigError naming the first numeric option out of its range (None: the task's default,
    filled in later)."""
    for name, least in LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be >= {least}")
    # numpy's seeds: below 2**32 (rank r seeds seed + r)
    if args.seed > 2**32 - world_size:
        raise ConfigError(f"--seed {args.seed}: must be < {2**32 - world_size + 1}")
    low, high = IMGSZ_RANGE
    if args.imgsz is not None and not low <= args.imgsz <= high:
        raise ConfigError(f"--imgsz {args.imgsz}: must be in [{low}, {high}]")
    # the global batch
    batch = args.batch_size
    if batch is not None and batch % world_size:
        raise ConfigError(f"--batch-size {batch} must be a multiple of the world size {world_size}")


def frozen_layers(freeze, model):
    """The layers --freeze names (the first N, or the listed ones); ConfigError unless it leaves
    some layer's parameters to train."""
    layers = len(model.model)
    flag = f"--freeze {' '.join(map(str, freeze))}"
    if not freeze or min(freeze) < 0:
        raise ConfigError(f"{flag}: layer numbers are >= 0")
    if len(freeze) > 1 and max(freeze) >= layers:
        raise ConfigError(f"{flag}: the model has {layers} layers (0-{layers - 1})")
    frozen = set(freeze) if len(freeze) > 1 else set(range(freeze[0]))
    if {int(k.split(".")[1]) for k, _ in model.named_parameters()} <= frozen:
        raise ConfigError(
            f"{flag}: the model has {layers} layers (0-{layers - 1}): no parameter would be trained"
        )
    return frozen


def build_model(args, data, ckpt, given=None):
    """The model to train with data's classes: the given one (YOLO.train), else --cfg (resumed:
    its own) with --weights' fitting tensors; then --freeze."""
    if given is None:
        model = Model(ckpt["model_cfg"] if ckpt else args.cfg, nc=data["nc"])
        if args.weights and not ckpt:
            # the anchors stay --cfg's, then AutoAnchor's
            kept = transfer(
                safe_load.load_model(args.weights).state_dict(), model, keep_anchors=False
            )
            dist.print0(f"Transferred {kept}/{len(model.state_dict())} items from {args.weights}")
    elif given.nc == data["nc"]:
        model = given
    else:
        # the classes differ: a new head for the data's, every other weight carried over
        model = Model(given.yaml, nc=data["nc"])
        kept = transfer(given.state_dict(), model, keep_anchors=True)
        dist.print0(
            f"New head (the model's {given.nc} classes -> the data's {data['nc']}): "
            f"transferred {kept}/{len(model.state_dict())} items"
        )
    frozen = frozen_layers(args.freeze, model)
    for k, p in model.named_parameters():
        p.requires_grad = int(k.split(".")[1]) not in frozen
    model.names = data["names"]
    return model


def transfer(state, model, keep_anchors):
    """Load the tensors of state whose name and shape fit model; returns how many."""
    have = model.state_dict()
    fits = {
        k: v
        for k, v in state.items()
        if k in have and v.shape == have[k].shape and (keep_anchors or not k.endswith("anchors"))
    }
    model.load_state_dict(fits, strict=False)
    return len(fits)


def build_loaders(args, hyp, model, data, info):
    """(train, val) DataLoaders of YOLODatasets (mosaic; rect val batches) or ClassifyDatasets;
    ConfigError if training would take batches of one image (batch or images per rank 1) that
    BatchNorm cannot train on at --imgsz."""
    datasets.check_task(data, model.task)
    batch = args.batch_size // info.world_size
    stride = model.max_stride
    # --cache off: any value but auto and ram
    shared = {
        "imgsz": args.imgsz,
        "verbose": info.rank == 0,
        "local_world_size": info.local_world_size,
        "cache": args.cache,
    }
    if model.task == "classify":
        train = ClassifyDataset(data["train"][0], augment=True, prefix="train: ", **shared)
        val = ClassifyDataset(data["val"][0], prefix="val: ", **shared)
    else:
        shared |= {"task": model.task, "stride": stride, "nc": data["nc"], "hyp": hyp}
        train = YOLODataset(
            data["train"], augment=True, batch_size=batch, prefix="train: ", **shared
        )
        val = YOLODataset(data["val"], rect=True, batch_size=2 * batch, prefix="val: ", **shared)
    if model.task == "segment":
        train.check_polygons()
    # BatchNorm cannot train on a batch of one image where the last feature map is 1x1
    one_fails = args.imgsz <= stride
    images = math.ceil(len(train) / info.world_size)
    if one_fails and min(images, batch) <= 1:
        given = f"train: {images} image per rank"
        if batch == 1:
            given = f"--batch-size {batch} per rank"
        raise ConfigError(
            f"{given} at --imgsz {args.imgsz}: {ONE_IMAGE}; "
            f"use at least 2 images per rank, or --imgsz > {args.imgsz}"
        )
    ranks = {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
    }
    loader, _ = build_dataloader(
        train,
        batch,
        workers=args.workers,
        seed=args.seed,
        drop_single=one_fails,
        **ranks,
    )
    if loader.drop_last:
        dist.print0(f"train: the last batch of each epoch, of 1 image, is dropped ({ONE_IMAGE})")
    val_loader, _ = build_dataloader(val, 2 * batch, workers=args.workers, shuffle=False, **ranks)
    return loader, val_loader


def build_optimizer(model, lr, momentum, decay, name="SGD"):
    """Nesterov SGD (Adam: beta1 = momentum); groups: biases, BatchNorm weights (no decay), rest."""
    biases = []
    norm_weights = []
    weights = []
    for module in model.modules():
        norm = isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm))
        for kind, p in module.named_parameters(recurse=False):
            if kind == "bias":
                biases.append(p)
            elif norm:
                norm_weights.append(p)
            else:
                weights.append(p)
    groups = [
        {"params": biases, "initial_lr": lr, "bias": True, "weight_decay": 0.0},
        {"params": norm_weights, "initial_lr": lr, "bias": False, "weight_decay": 0.0},
        {"params": weights, "initial_lr": lr, "bias": False, "weight_decay": decay},
    ]
    if "Adam" in name:
        settings = {"betas": (momentum, 0.999)}
    elif name == "SGD":
        settings = {"momentum": momentum, "nesterov": True}
    else:
        settings = {"momentum": momentum}
    # One kernel for all tensors rather than a loop of small ops: on 2 cores yolov5n-cls's Adam
    # step takes 2.4 ms instead of 6.9, detection's SGD 1.3 instead of 3.3 (bit for bit the same;
    # Adam's differs by float rounding). RMSprop has no such kernel: its ops run on all at once.
    kernel = {"foreach": True} if name == "RMSProp" else {"fused": True}
    return OPTIMIZERS[name](groups, lr=lr, **kernel, **settings)


def lr_factor(epoch, epochs, lrf, cos=False):
    """The lr multiplier of an epoch: 1 -> lrf, linearly or along half a cosine."""
    if cos:
        return (1 - math.cos(epoch * math.pi / epochs)) / 2 * (lrf - 1) + 1
    return (1 - epoch / epochs) * (1 - lrf) + lrf


def warmup(optimizer, iteration, warmup_iters, factor, hyp, accumulate):
    """Warmup: lr (biases: from warmup_bias_lr) and momentum ramp up, over warmup_iters iterations,
    to the epoch's (factor: its lr_factor); returns the accumulation (ramping up to accumulate)."""
    ramp = [0, warmup_iters]
    for group in optimizer.param_groups:
        start = hyp["warmup_bias_lr"] if group["bias"] else 0.0
        group["lr"] = float(np.interp(iteration, ramp, [start, group["initial_lr"] * factor]))
        momenta = [hyp["warmup_momentum"], hyp["momentum"]]
        group["momentum"] = float(np.interp(iteration, ramp, momenta))
    return max(1, round(float(np.interp(iteration, ramp, [1, accumulate]))))


# ---------------------------------------------------------------- one epoch
def forward_loss(model, criterion, batch, device, amp):
    """(loss, loss items) of a batch: the model under autocast to amp (None: fp32), loss in fp32."""
    images = validator.preprocess(batch["images"], device, de_parallel(model).task == "classify")
    labels = [batch[k].to(device) for k in ("targets", "masks") if batch.get(k) is not None]
    with torch.autocast(device.type, amp, enabled=amp is not None):
        preds = model(images)
    # the targets, and a segmentation batch's masks
    return criterion(preds, *labels)


def optimizer_step(model, optimizer, scaler, ema):
    scaler.unscale_(optimizer)
    # yolov5's max_norm
    nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update()


def train_one_epoch(training, setup, epoch, epoch_seconds=None):
    """One epoch over setup's train loader (detection: warmup, NOMINAL_BATCH images a step) ->
    (mean loss items, img/s). epoch_seconds: the mean wall time of this run's finished epochs (with
    their validation and checkpoints; None in its first), for the whole run's eta."""
    # A non-finite loss raises FloatingPointError on every rank at once; no all-reduce until a step.
    args = setup.args
    hyp = setup.hyp
    model, criterion, optimizer, scaler, ema, amp = training
    model.train()
    device = next(model.parameters()).device
    batches = len(setup.loader)
    detect = "warmup_epochs" in hyp
    factor = lr_factor(epoch, args.epochs, hyp["lrf"], args.cos_lr)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor
    warmup_iters = max(round(hyp.get("warmup_epochs", 0) * batches), 100)
    # batches a step once warmup is over
    nominal = NOMINAL_BATCH / args.batch_size
    accumulate = max(round(nominal), 1) if detect else 1
    # every epoch ends with a step: no gradients pending at a checkpoint
    last_step = epoch * batches - 1
    mean = 0.0
    start = time.time()
    for i, batch in enumerate(setup.loader):
        iteration = i + batches * epoch
        # A classifier's crops, flips and colours: drawn per image, made for the whole batch on
        # the training device. A CPU does them here too: made in the workers, they took the
        # cores from the step (on 2 cores the 64 px loop ran about 7% slower; README).
        if de_parallel(model).task == "classify":
            cls_augment.augment_batch(batch, seed=args.seed, epoch=epoch, device=device)
        if detect and iteration <= warmup_iters:
            accumulate = warmup(
                optimizer, iteration, warmup_iters, factor=factor, hyp=hyp, accumulate=nominal
            )
        step = iteration - last_step >= accumulate or i == batches - 1
        # DDP all-reduces the gradients in backward: only at a step
        with model.no_sync() if isinstance(model, DDP) and not step else contextlib.nullcontext():
            loss, items = forward_loss(model, criterion, batch, device=device, amp=amp)
            values = dist.reduce_mean(torch.stack(list(items.values()))).cpu()
            # the same on every rank: all stop together
            if not torch.isfinite(values).all():
                raise FloatingPointError(
                    f"non-finite loss {values.tolist()} at epoch {epoch + 1}, iteration {i + 1}: "
                    "training stopped; the last good checkpoint is "
                    f"{setup.save_dir / 'weights' / 'last.pt'}"
                )
            scaler.scale(loss).backward()
        if step:
            optimizer_step(model, optimizer, scaler, ema=ema)
            last_step = iteration
        mean = (mean * i + values) / (i + 1)
        if iteration == 0 and detect and dist.is_main():
            # train_batch0.jpg: the first training batch with its labels, drawn in a thread
            path = setup.save_dir / "train_batch0.jpg"
            names = de_parallel(model).names
            draw_later(batch["images"], batch["targets"], batch["masks"], fname=path, names=names)
        if i == 0:
            # the throughput leaves out the first batch (workers start)
            t0 = time.time()
        if dist.is_main() and ((i + 1) % args.log_every == 0 or i + 1 == batches):
            rate = (i + 1) / (time.time() - start)
            epoch_left = (batches - i - 1) / rate
            # the first epoch knows only its own training rate
            run_left = epoch_left + (args.epochs - epoch - 1) * (epoch_seconds or batches / rate)
            losses = "  ".join(f"{k} {v:.4g}" for k, v in zip(items, mean.tolist()))
            dist.print0(
                f"epoch {epoch + 1}/{args.epochs} [{i + 1}/{batches}]  {rate:.2f} it/s  "
                f"eta {clock(epoch_left)} (run {clock(run_left)})  {losses}  "
                f"instances {len(batch['targets'])}  mem {peak_memory():.2f}G"
            )
    img_s = (batches - 1) * args.batch_size / (time.time() - t0) if batches > 1 else 0.0
    # train_batch0.jpg is written before the epoch ends
    finish_drawing()
    return dict(zip(items, mean.tolist())), img_s


def peak_memory():
    """This process's peak memory in GB: on CUDA the memory reserved, else the peak RSS."""
    if torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def clock(seconds):
    """A duration as h:mm:ss, to the second."""
    return datetime.timedelta(seconds=round(seconds))


# glibc's mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


@contextlib.contextmanager
def freed_memory_kept():
    """Within: glibc's malloc (Linux) keeps freed memory for the next allocations, however large,
    instead of handing it back to the system; after: its limits as glibc raises them, the surplus
    handed back. Elsewhere a no-op."""
    # glibc maps each block over 32 MB afresh and unmaps it when freed, so every step paid the
    # page faults of its large tensors again: a 224 px classify batch's augmentation took 60 ms
    # instead of 34 (README). A CUDA run's tensors are in torch's caching allocator anyway.
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        yield
        return
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield
    finally:
        # glibc's default count of mapped blocks, and the highest limits its own tuning reaches
        mallopt(M_MMAP_MAX, 65536)
        mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        mallopt(M_TRIM_THRESHOLD, 64 * 2**20)
        trim(0)


# ---------------------------------------------------------------- callbacks
EVENTS = ("on_train_epoch_end", "on_fit_epoch_end", "on_train_end")


class Event(NamedTuple):
    """What a callback is called with, on every rank: the event (EVENTS: after an epoch's training,
    after its validation and checkpoints, at the end), the epoch (1-based), its mean loss items,
    its validation metrics (evaluate's dict; None where not validated), the run folder, the rank."""

    name: str
    epoch: int
    losses: dict
    metrics: dict | None
    save_dir: Path
    rank: int


class CallbackError(RuntimeError):
    """A callback raised: the run stopped on every rank."""


def run_callbacks(callbacks, event):
    """Call the event's callbacks; if one raises on any rank, CallbackError on every rank."""
    if not callbacks:
        return
    failed = None
    for fn in callbacks.get(event.name, []):
        try:
            fn(event)
        except Exception as e:
            failed = (
                f"callback {getattr(fn, '__qualname__', repr(fn))} for {event.name} raised "
                f"{type(e).__name__}: {e} "
                f"(rank {event.rank}, epoch {event.epoch})"
            )
            break
    # every rank learns of a failure on any rank, so none is left waiting in a collective
    failures = [f for f in dist.all_gather_object(failed) if f]
    if failures:
        raise CallbackError(
            f"{failures[0].splitlines()[0]}; "
            "training stopped; weights/last.pt holds the last saved epoch"
        )


# ---------------------------------------------------------------- the run
class Setup(NamedTuple):
    """What `prepare` readies: the arguments (a resumed run's own), the checkpoint it resumes (None:
    a new run), the recipe, the model (on the CPU), the train and val loaders, the run folder."""

    args: argparse.Namespace
    ckpt: dict | None
    hyp: dict
    model: Model
    loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    save_dir: Path


def prepare(args, info, given=None):
    """Everything before the first epoch that bad input can stop: ConfigError (one line) then."""
    try:
        run_id = dist.torchrun_id()
        if run_id:
            # the k-th training of a script finds the folder of its k-th before a restart
            run_id = f"{run_id}/training{next(TRAININGS_STARTED)}"
        check_numbers(args, info.world_size)
        # A resume (--resume, or a torchrun restart): find the run's last.pt, read the run's own
        # arguments, check them; `fit` restores its training state.
        path, ckpt = dist.run_on_main(checkpoint.find_resume, args, run_id) or (None, None)
        if ckpt:
            args = resumed_args(args, path, ckpt)
            with resumed_checks(path):
                check_numbers(args, info.world_size)
        # the same initial weights on every rank
        torch.manual_seed(args.seed)
        # local rank 0 first: it writes the label caches (and shapes)
        with dist.main_first():
            data = datasets.load_data_config(args.data)
            with resumed_checks(path):
                model = build_model(args, data, ckpt, given)
                check_args(args, model.task, info.world_size)
                if ckpt:
                    hyp = load_hyp(ckpt["hyp"], model.task, where="hyp")
                else:
                    hyp = load_hyp(args.hyp, model.task)
            loader, val_loader = build_loaders(args, hyp, model, data=data, info=info)
        # 3 files of 3 fp32 copies
        need = 36 * sum(p.numel() for p in model.parameters())
        save_dir = dist.run_on_main(
            lambda: checkpoint.make_run_dir(args, hyp, run_id, need_bytes=need)
        )
        # results.csv as the checkpoint saved it (the rows of the epochs it holds; `load` checked
        # it is a str), where it holds one: a crash between the checkpoint and its row loses no row
        if ckpt and "results_csv" in ckpt:
            dist.run_on_main(lambda: (save_dir / "results.csv").write_text(ckpt["results_csv"]))
    # DataError and CheckpointError are ValueErrors
    except (ValueError, OSError, RuntimeError, yaml.YAMLError) as e:
        raise ConfigError(first_line(e)) from None
    return Setup(
        args=args,
        ckpt=ckpt,
        hyp=hyp,
        model=model,
        loader=loader,
        val_loader=val_loader,
        save_dir=save_dir,
    )


def resumed_args(cli, path, ckpt):
    """The resumed run's own arguments, checked as the command line's are (their ranges: by
    check_numbers and check_args); only --device and --amp may change."""
    parser = get_args_parser()
    defaults = vars(parser.parse_args([]))
    # a dict: checkpoint.load checked
    stored = ckpt["args"]
    if set(stored) != set(defaults):
        raise ConfigError(
            f"--resume: {path}: not train.py's arguments "
            f"({sorted(map(str, set(stored) ^ set(defaults)))[:5]})"
        )
    try:
        own = parse_kwargs(parser, {k: v for k, v in stored.items() if k != "resume"})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--resume: {path}: its {e}") from None
    if cli.resume and ckpt["epoch"] + 1 >= own.epochs:
        raise ConfigError(f"--resume: {path}: the run is finished; start a new one (--weights)")
    # all else is the run's own
    changed = {"resume": path, "device": cli.device, "amp": cli.amp}
    # a torchrun restart's arguments are the run's own; bare --resume searched --project
    used = set(changed) | ({"project"} if cli.resume is True else set())
    ignored = [k for k, v in vars(cli).items() if v != defaults[k] and k not in used]
    if cli.resume and ignored:
        flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
        dist.print0(f"warning: --resume continues {path} with its own arguments; ignoring {flags}")
    vars(own).update(changed)
    return own


@contextlib.contextmanager
def resumed_checks(path):
    """A ConfigError in the block names the checkpoint (path) whose arguments or hyp it checks."""
    try:
        yield
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"--resume: {path}: its {e}") from None


class Training(NamedTuple):
    """The objects `build_training` makes: the model to train (DDP-wrapped under torchrun), its
    loss, optimizer, AMP scaler (enabled for fp16), EMA, and the autocast dtype (None: fp32)."""

    model: nn.Module
    criterion: nn.Module
    optimizer: optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: ModelEMA
    amp: torch.dtype | None


def build_training(model, hyp, args, info):
    """The model to train, its criterion, optimizer, AMP scaler and EMA (see Training)."""
    if model.task == "classify":
        decay = hyp["weight_decay"]
        criterion = ClassifyLoss(label_smoothing=hyp["label_smoothing"])
    else:
        # detection's decay is for NOMINAL_BATCH images a step
        accumulate = max(round(NOMINAL_BATCH / args.batch_size), 1)
        decay = hyp["weight_decay"] * args.batch_size * accumulate / NOMINAL_BATCH
        loss_hyp = scale_hyp(hyp, model.nc, args.imgsz, model.head.nl)
        criterion = YOLOLoss(model, loss_hyp, info.world_size)
    optimizer = build_optimizer(
        model, hyp["lr0"], hyp["momentum"], decay=decay, name=args.optimizer
    )
    amp = amp_dtype(info.device, args.amp)
    # channels_last: the faster layout under autocast
    model = model.to(memory_format=torch.channels_last if amp else None)
    # fp16 needs loss scaling
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    if info.world_size > 1:
        if args.sync_bn and info.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP starts every rank from rank 0's weights (a model built in a script may differ)
        model = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    return Training(
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scaler=scaler,
        ema=ModelEMA(model),
        amp=amp,
    )


class Best(NamedTuple):
    """The best validation so far: its fitness and epoch (0-based); the later of equal ones."""

    fitness: float
    epoch: int


def fit(args, info, given=None, callbacks=None):
    """Train (the given model, else args'). Returns {save_dir, data, epochs (the last run),
    best_fitness, metrics (best.pt), img_s, model: the trained Model, eval mode, with best.pt's
    weights (else last.pt's)}; callbacks: {event: [functions]} (see EVENTS)."""
    setup = prepare(args, info, given)
    args = setup.args
    training = start_training(setup, info)
    # the EMA of the model: what is validated and saved as the result
    ema = training.ema.ema
    start, best = resume(setup, training, info)
    print_start(setup, info, training.amp)
    # the run's constants; each event replaces its name, epoch, losses and metrics
    event = Event("", 0, losses={}, metrics=None, save_dir=setup.save_dir, rank=info.rank)
    t_start = time.time()
    img_s = []
    epoch = start - 1
    metrics = None
    for epoch in range(start, args.epochs):
        setup.loader.sampler.set_epoch(epoch)
        # the mean wall time of the epochs this run finished
        epoch_seconds = (time.time() - t_start) / (epoch - start) if epoch > start else None
        losses, speed = train_one_epoch(training, setup, epoch, epoch_seconds=epoch_seconds)
        img_s.append(speed)
        event = event._replace(name="on_train_epoch_end", epoch=epoch + 1, losses=losses)
        run_callbacks(callbacks, event)
        final = epoch + 1 == args.epochs
        metrics = None
        if final or not args.noval:
            # BN buffers differ between DDP ranks: all validate rank 0's EMA
            dist.broadcast_tensors(ema.state_dict().values())
            # the plots of the final validation only
            plots = setup.save_dir if final else None
            metrics = validator.evaluate(ema, setup.val_loader, plots_dir=plots, amp=training.amp)
            # equal fitness: the later epoch
            best = max(best, Best(metrics["fitness"], epoch))
        stop = metrics is not None and 0 < args.patience <= epoch - best.epoch
        fitted = event._replace(name="on_fit_epoch_end", metrics=metrics)
        rngs = dist.all_gather_object(checkpoint.rng_state())
        if info.rank == 0:
            save_epoch(setup, training, fitted, best=best, rngs=rngs, last=stop or final)
            print_epoch(epoch, args.epochs, speed, metrics)
        # the checkpoints are on disk before any rank goes on
        dist.barrier()
        run_callbacks(callbacks, fitted)
        if stop:
            dist.print0(
                f"Early stop: no improvement in {args.patience} epochs, "
                f"the best was epoch {best.epoch + 1}"
            )
            break
    dist.print0(f"{epoch + 1 - start} epochs in {(time.time() - t_start) / 60:.1f} minutes")
    # best.pt (else last.pt) is not the model validated last
    if best.epoch != epoch or not metrics:
        metrics = validate_saved(training, setup.val_loader, setup.save_dir)
    table = validator.format_table(metrics, ema.names)
    dist.print0(f"{table}\nResults saved to {setup.save_dir}")
    # the trained model itself (YOLO.train's object) takes the final weights
    trained = de_parallel(training.model).to(memory_format=torch.contiguous_format).eval()
    trained.load_state_dict(ema.state_dict())
    run_callbacks(callbacks, event._replace(name="on_train_end", epoch=epoch + 1, metrics=metrics))
    return {
        "save_dir": str(setup.save_dir),
        "data": args.data,
        "epochs": epoch + 1,
        "best_fitness": best.fitness,
        "metrics": metrics,
        "img_s": img_s,
        "model": trained,
    }


def start_training(setup, info):
    """Seed this rank, move the model to its device, fit its anchors (AutoAnchor: a new detection
    run, unless --noautoanchor) and make it ready to train (see Training)."""
    args = setup.args
    # augmentation has its own seeds, per sample
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(args.seed + info.rank)
    model = setup.model.to(info.device)
    if not setup.ckpt and not args.noautoanchor and model.task != "classify":
        autoanchor(model, setup.loader.dataset, setup.hyp["anchor_t"], args=args)
    return build_training(model, setup.hyp, args, info)


def print_start(setup, info, amp):
    """The run's first lines: its task, ranks, device, batch, epochs and folder; its precision."""
    args = setup.args
    device = info.device.type
    if device == "cuda":
        device += f" ({torch.cuda.get_device_name(info.device)})"
    dist.print0(
        f"{setup.model.task} training: {info.world_size} rank(s) on {device}, batch "
        f"{args.batch_size}, {args.epochs} epochs, in {setup.save_dir}"
    )
    dist.print0(f"precision: {PRECISIONS[amp]} (--amp {args.amp})")


def autoanchor(model, train_set, threshold, args):
    """AutoAnchor on rank 0, in pixels; every rank gets its anchors, in grid units."""
    # the head's buffer (nl, na, 2), in grid units, set in place
    anchors = model.head.anchors
    stride = model.stride.view(-1, 1, 1).to(anchors)
    pixels = (anchors * stride).view(-1, 2).cpu().numpy()
    new = dist.run_on_main(
        lambda: check_anchors(train_set.labels, pixels, threshold, imgsz=args.imgsz, seed=args.seed)
    )
    if new is not None:
        # pixels -> grid units
        anchors[:] = torch.from_numpy(new).to(stride).view_as(anchors) / stride


# ---------------------------------------------------------------- resume and save
def resume(setup, training, info):
    """Restore what `save_epoch` saved into the fresh training objects: the model, EMA, optimizer,
    AMP scaler, and this rank's random states. Returns the epoch to start at (the one after the
    saved one) and the best validation so far (a new run: 0 and Best(0.0, 0))."""
    ckpt = setup.ckpt
    if not ckpt:
        return 0, Best(0.0, 0)
    try:
        exact = checkpoint.restore(
            ckpt,
            de_parallel(training.model),
            training.ema,
            optimizer=training.optimizer,
            scaler=training.scaler,
            rank=info.rank,
            world_size=info.world_size,
        )
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume: {setup.args.resume}: {e}") from None
    if not exact:
        dist.print0(
            f"warning: saved with world size {ckpt['rng']['world_size']}, now {info.world_size}: "
            "random states are not restored (not an exact resume)"
        )
    start = ckpt["epoch"] + 1
    dist.print0(f"Resuming {setup.save_dir} at epoch {start + 1}/{setup.args.epochs}")
    return start, Best(ckpt["best_fitness"], ckpt["best_epoch"])


def save_epoch(setup, training, fitted, best, rngs, last):
    """On rank 0: the epoch's (fitted: its event after validation) last.pt, and best.pt if it
    validated best, with all a resume needs (rngs: every rank's random states), then its
    results.csv row; under --nosave only the run's last epoch's (final or early-stopped). The
    checkpoint holds results.csv as it will be (a resume restores it), and a Ctrl-C or SIGTERM
    meanwhile takes effect after both: results.csv lists the epochs that last.pt holds."""
    epoch = fitted.epoch - 1
    metrics = fitted.metrics
    # results.csv with the epoch's row (a resumed run first drops the rows after its checkpoint)
    names = metric_names(KINDS[setup.model.task])
    row = {"epoch": fitted.epoch} | {f"train/{k}_loss": v for k, v in fitted.losses.items()}
    row |= {f"metrics/{k}": metrics["metrics"][k] if metrics else "" for k in names}
    row |= {f"lr/pg{j}": g["lr"] for j, g in enumerate(training.optimizer.param_groups)}
    results = setup.save_dir / "results.csv"
    lines = results.read_text().splitlines(keepends=True)[: epoch + 1] if results.exists() else []
    lines = lines or [",".join(row) + "\n"]
    text = "".join(lines) + ",".join(map(str, row.values())) + "\n"
    weights = setup.save_dir / "weights"
    with checkpoint.signals_held():
        if last or not setup.args.nosave:
            state = checkpoint.training_state(
                de_parallel(training.model),
                training.ema,
                training.optimizer,
                scaler=training.scaler,
                epoch=epoch,
                best=best,
                args=setup.args,
                hyp=setup.hyp,
                rngs=rngs,
            )
            state["results_csv"] = text
            checkpoint.save(state, weights / "last.pt")
            if metrics and best.epoch == epoch:
                checkpoint.copy(weights / "last.pt", weights / "best.pt")
        results.write_text(text)


def print_epoch(epoch, epochs, img_s, metrics):
    """The line of a finished epoch: its speed and validation metrics."""
    val = "  ".join(f"{k} {v:.3f}" for k, v in metrics["metrics"].items()) if metrics else "no val"
    dist.print0(f"epoch {epoch + 1}/{epochs}: {img_s:.1f} img/s  {val}")


def validate_saved(training, val_loader, save_dir):
    """Load best.pt's (else last.pt's) EMA weights into the training's EMA (rank 0 reads the file)
    and validate them."""
    path = save_dir / "weights" / "best.pt"
    if not path.is_file():
        path = path.with_name("last.pt")
    dist.print0(f"Validating {path}")
    ema = training.ema.ema
    ema.load_state_dict(dist.run_on_main(lambda: checkpoint.load(path)["ema"]))
    return validator.evaluate(ema, val_loader, plots_dir=save_dir, amp=training.amp)


# ---------------------------------------------------------------- entry points
def main(args, model=None, callbacks=None):
    """Train (see `fit`); the process group lives as long as the call."""
    try:
        info = dist.setup(args.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        with freed_memory_kept():
            return fit(args, info, model, callbacks)
    except KeyboardInterrupt as e:
        raise Stopped(e.args[0] if e.args else "SIGINT", stop_note(args.nosave)) from None
    finally:
        checkpoint.release_locks()
        dist.cleanup()


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a training: args (the signal's name, what the run folder holds)."""


def stop_note(nosave):
    """What a stopped training leaves to --resume (rank 0: the run folder it holds)."""
    runs = [lock.parent for lock in checkpoint.HELD_LOCKS]
    if not runs:
        return "no run folder was written"
    if (runs[-1] / "weights" / "last.pt").is_file():
        return "weights/last.pt holds the last completed epoch"
    if nosave:
        return f"--nosave: {runs[-1]} has no weights/last.pt before the final epoch"
    return f"no epoch was completed: {runs[-1]} has no weights/last.pt to resume"


def run(**kwargs):
    """Train from Python with train.py's options: `run(cfg="yolov5n.yaml", epochs=3)` -> fit's."""
    return main(parse_kwargs(get_args_parser(), kwargs))
