"""Training: the options, the builders, the step loop (`train_one_epoch`) and the epoch loop with
its checkpoints and resume (`fit`), in one process or on every rank under torchrun; train.py and
`yolo_min.YOLO.train` call `train`."""

from __future__ import annotations

import argparse
import contextlib
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

from . import checkpoint, datasets, dist, safe_load, validator
from .anchors import check_anchors
from .cli import ConfigError, parse_kwargs
from .datasets import ClassifyDataset, YOLODataset, build_dataloader
from .files import read_yaml
from .losses import ClassifyLoss, YOLOLoss, scale_hyp
from .metrics import KINDS, metric_names
from .models import CFG_DIR, Model, ModelEMA, amp_dtype, de_parallel
from .plots import draw_batch

NOMINAL_BATCH = 64  # detection: gradients accumulate over this many images before a step
HYP_FILES = {"classify": "hyp.cls.yaml"}  # no warmup, no accumulation; else hyp.scratch-low
TASK_DEFAULTS = {"classify": dict(imgsz=224, batch_size=64, optimizer="Adam")}  # unless given
DEFAULTS = dict(imgsz=640, batch_size=16, optimizer="SGD")
# trainings this process has started (a script may train more than once under one torchrun run)
TRAININGS_STARTED = itertools.count()
OPTIMIZERS = dict(SGD=optim.SGD, Adam=optim.Adam, AdamW=optim.AdamW, RMSProp=optim.RMSprop)
IMGSZ_RANGE = (32, 8192)
# the least value of each numeric option (--batch-size: also a multiple of the world size)
LEAST = dict(epochs=1, batch_size=1, log_every=1, workers=0, patience=0, seed=0)
# each recipe key's valid range (both recipes' keys): "[" and "]" include a bound, "(" and ")" not
HYP_RANGES = {
    "lr0": "(0, 1]",
    "lrf": "[0, 1]",  # the final lr is lr0 * lrf: never negative, never above lr0
    "momentum": "(0, 1)",  # SGD's Nesterov momentum needs > 0; Adam's beta1 < 1
    "weight_decay": "[0, 1)",
    "warmup_epochs": "[0, 1000]",
    "warmup_momentum": "[0, 1)",
    "warmup_bias_lr": "[0, 1]",
    "box": "[0, 100]",
    "cls": "[0, 100]",
    "cls_pw": "(0, 100]",  # BCE positive weights: a negative one makes the loss negative
    "obj": "[0, 100]",
    "obj_pw": "(0, 100]",
    "iou_t": "[0, 1]",
    "anchor_t": "(1, 100]",  # the w and h ratios of a match are below it: at 1 nothing matches
    "fl_gamma": "[0, 10]",
    "label_smoothing": "[0, 1)",
    "hsv_h": "[0, 1]",  # 1: hues turn by up to 180 degrees
    "hsv_s": "[0, 1]",  # the gains are 1 +- these: above 1 they could turn negative
    "hsv_v": "[0, 1]",
    "degrees": "[0, 180]",
    "translate": "[0, 1]",
    "scale": "[0, 1)",  # the scale is 1 +- this: at 1 an image could shrink to nothing
    "shear": "[0, 45]",
    "perspective": "[0, 0.001]",  # larger ones fold the 1280-pixel mosaic canvas over itself
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


def get_args_parser() -> argparse.ArgumentParser:
    description = "Train YOLOv5 detection, segmentation, classification"
    # No abbreviations: the Python API takes only whole names, and so does the command line.
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--cfg", default="yolov5n.yaml", help="model cfg; its head sets the task")
    p.add_argument("--data", default="shapes", help="data yaml or folder, 'shapes', 'shapes-cls'")
    p.add_argument("--hyp", default="", help="yaml overriding keys of the recipe")
    p.add_argument("--weights", default="", help="initial weights: yolo_min or yolov5 .pt")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, help="global, split over the ranks (16; classify 64)")
    p.add_argument("--imgsz", type=int, help="train and val image size (640; classify 224)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), help="SGD (classify: Adam)")
    p.add_argument("--device", default="", help="cpu, cuda or a GPU index")
    p.add_argument("--amp", choices=["auto", "on", "off"], default="auto", help=validator.AMP_HELP)
    p.add_argument("--workers", type=int, default=8, help="dataloader workers per rank")
    p.add_argument("--project", default="runs/train")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name")
    p.add_argument("--resume", nargs="?", const=True, default=False, help="a last.pt, or newest")
    p.add_argument("--freeze", nargs="+", type=int, default=[0], help="first N, or listed layers")
    p.add_argument("--cos-lr", action="store_true", help="cosine lr schedule, not linear")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across GPUs")
    p.add_argument("--patience", type=int, default=100, help="epochs without improvement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=["auto", "ram", "off"], default="auto", help="images in RAM")
    p.add_argument("--log-every", type=int, default=10, help="a progress line every N batches")
    p.add_argument("--noautoanchor", action="store_true")
    p.add_argument("--noval", action="store_true", help="validate the final epoch only")
    p.add_argument("--nosave", action="store_true", help="save the final checkpoint only")
    return p


# ---------------------------------------------------------------- builders
def load_hyp(changes: str | dict, task: str = "detect", where: str = "--hyp") -> dict:
    """The task's recipe (HYP_FILES) with some values changed: a yaml file ('' none) or a dict.
    ConfigError naming `where` and the key for an unknown key or a value outside its range."""
    recipe = read_yaml(CFG_DIR / HYP_FILES.get(task, "hyp.scratch-low.yaml"))
    if isinstance(changes, str) and changes:
        where = f"{where} {changes}"
        changes = read_yaml(changes, "--hyp")
    if changes == "":
        changes = {}
    if not isinstance(changes, dict):
        kind = type(changes).__name__
        raise ConfigError(f"{where}: not a mapping of recipe keys to numbers (a {kind})")
    if unknown := sorted(str(k) for k in set(changes) - set(recipe)):
        raise ConfigError(f"{where}: unknown keys {unknown[:5]} (known: {', '.join(recipe)})")
    for k, v in changes.items():
        check_hyp_value(k, v, where)
    return recipe | {k: float(v) for k, v in changes.items()}


def check_hyp_value(key: str, value, where: str = "--hyp") -> None:
    """ConfigError unless value is a finite number in key's range (HYP_RANGES), 0 for a key that
    is not implemented."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} is {reprlib.repr(value)}, not a finite number")
    if key in NOT_IMPLEMENTED and value != 0:
        why = "not implemented by yolo_min (only 0 is accepted)"
        raise ConfigError(f"{where}: {key} is {value:g}: {why}")
    bounds = HYP_RANGES.get(key)
    if bounds and not in_range(value, bounds):
        raise ConfigError(f"{where}: {key} is {value:g}, outside its range {bounds}")


def in_range(value: float, bounds: str) -> bool:
    """Whether value lies in an interval written "[low, high)" (brackets include, parentheses
    exclude a bound)."""
    low, high = (float(b) for b in bounds[1:-1].split(","))
    above = value >= low if bounds[0] == "[" else value > low
    below = value <= high if bounds[-1] == "]" else value < high
    return above and below


def check_args(args: argparse.Namespace, task: str, world_size: int) -> None:
    """ConfigError naming the option unless the arguments (given or resumed) are usable; fills in
    the task's defaults and rounds --imgsz up to a multiple of 32."""
    defaults = TASK_DEFAULTS.get(task, DEFAULTS)
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k) is None})
    check_numbers(args, world_size)
    if args.cache not in ("auto", "ram", "off") or not all(type(f) is int for f in args.freeze):
        raise ConfigError("--cache must be auto, ram or off, and --freeze integers")
    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {args.optimizer}: one of {', '.join(OPTIMIZERS)}")
    args.imgsz = validator.round_imgsz(args.imgsz, 32)


def check_numbers(args: argparse.Namespace, world_size: int) -> None:
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
    batch = args.batch_size
    if batch is not None and batch % world_size:  # the global batch
        size = f"--batch-size {batch} must be a multiple of the world size {world_size}"
        raise ConfigError(size)


def check_freeze(freeze: list[int], model: Model) -> None:
    """ConfigError unless --freeze (the first N layers, or the listed ones) leaves some layer's
    parameters to train."""
    layers = len(model.model)
    trained = {int(k.split(".")[1]) for k, _ in model.named_parameters()}
    flag = f"--freeze {' '.join(map(str, freeze))}"
    if not freeze or min(freeze) < 0:
        raise ConfigError(f"{flag}: layer numbers are >= 0")
    if len(freeze) > 1 and max(freeze) >= layers:
        raise ConfigError(f"{flag}: the model has {layers} layers (0-{layers - 1})")
    frozen = set(freeze) if len(freeze) > 1 else set(range(freeze[0]))
    if trained <= frozen:
        why = f"the model has {layers} layers (0-{layers - 1}): no parameter would be trained"
        raise ConfigError(f"{flag}: {why}")


def build_model(args, data: dict, ckpt: dict | None, given: Model | None = None) -> Model:
    """The model to train with data's classes: the given one (YOLO.train), else --cfg (resumed:
    its own) with --weights' fitting tensors; then --freeze."""
    if given is not None and given.nc == data["nc"]:
        model = given
    elif given is not None:
        # the classes differ: a new head for the data's, every other weight carried over
        model = Model(given.yaml, nc=data["nc"])
        kept = transfer(given.state_dict(), model, keep_anchors=True)
        where = f"the model's {given.nc} classes -> the data's {data['nc']}"
        dist.print0(f"New head ({where}): transferred {kept}/{len(model.state_dict())} items")
    else:
        model = Model(ckpt["model_cfg"] if ckpt else args.cfg, nc=data["nc"])
    if args.weights and not ckpt and given is None:
        # the anchors stay --cfg's, then AutoAnchor's
        kept = transfer(safe_load.load_model(args.weights).state_dict(), model, keep_anchors=False)
        dist.print0(f"Transferred {kept}/{len(model.state_dict())} items from {args.weights}")
    check_freeze(args.freeze, model)
    frozen = args.freeze if len(args.freeze) > 1 else range(args.freeze[0])
    for k, p in model.named_parameters():
        p.requires_grad = int(k.split(".")[1]) not in frozen
    model.names = data["names"]
    return model


def transfer(state: dict, model: nn.Module, keep_anchors: bool) -> int:
    """Load the tensors of state whose name and shape fit model; returns how many."""
    have = model.state_dict()
    fits = {k: v for k, v in state.items() if k in have and v.shape == have[k].shape}
    if not keep_anchors:
        fits = {k: v for k, v in fits.items() if not k.endswith("anchors")}
    model.load_state_dict(fits, strict=False)
    return len(fits)


def build_loaders(args, hyp: dict, model: Model, data: dict, info) -> tuple:
    """(train, val) DataLoaders of YOLODatasets (mosaic; rect val batches) or ClassifyDatasets."""
    datasets.check_task(data, model.task)
    batch, kw = args.batch_size // info.world_size, dict(imgsz=args.imgsz, verbose=info.rank == 0)
    if model.task == "classify":
        train = ClassifyDataset(data["train"][0], augment=True, prefix="train: ", **kw)
        val = ClassifyDataset(data["val"][0], prefix="val: ", **kw)
    else:  # --cache off: any value but auto and ram
        kw |= dict(task=model.task, stride=int(model.stride.max()), nc=data["nc"], hyp=hyp)
        kw |= dict(local_world_size=info.local_world_size, cache=args.cache)
        train = YOLODataset(data["train"], augment=True, batch_size=batch, prefix="train: ", **kw)
        val = YOLODataset(data["val"], rect=True, batch_size=2 * batch, prefix="val: ", **kw)
    if model.task == "segment":
        train.check_polygons()
    # BatchNorm cannot train on a batch of one image where the last feature map is 1x1
    one_fails = args.imgsz <= int(model.stride.max())
    check_batch_of_one(math.ceil(len(train) / info.world_size), batch, args.imgsz, one_fails)
    ranks = dict(rank=info.rank, world_size=info.world_size, local_world_size=info.local_world_size)
    kw = dict(seed=args.seed, drop_single=one_fails, **ranks)
    loader, _ = build_dataloader(train, batch, args.workers, True, **kw)
    if loader.drop_last:
        dist.print0(f"train: the last batch of each epoch, of 1 image, is dropped ({ONE_IMAGE})")
    return loader, build_dataloader(val, 2 * batch, args.workers, False, **ranks)[0]


def check_batch_of_one(images: int, batch: int, imgsz: int, one_fails: bool) -> None:
    """ConfigError if training would take batches of one image (batch or images per rank 1) where
    BatchNorm cannot (one_fails)."""
    if not one_fails or min(images, batch) > 1:
        return
    if batch == 1:
        given = f"--batch-size {batch} per rank"
    else:
        given = f"train: {images} image per rank"
    fix = f"use at least 2 images per rank, or --imgsz > {imgsz}"
    raise ConfigError(f"{given} at --imgsz {imgsz}: {ONE_IMAGE}; {fix}")


def build_optimizer(model: nn.Module, lr: float, momentum: float, decay: float, name="SGD"):
    """Nesterov SGD (Adam: beta1 = momentum); groups: biases, BatchNorm weights (no decay), rest."""
    groups = [[], [], []]
    for m in model.modules():
        for kind, p in m.named_parameters(recurse=False):
            norm = isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm))
            groups[0 if kind == "bias" else 1 if norm else 2].append(p)
    kw = [dict(weight_decay=0.0, bias=True), dict(weight_decay=0.0), dict(weight_decay=decay)]
    groups = [dict(params=g, initial_lr=lr, bias=False) | k for g, k in zip(groups, kw)]
    kw = dict(betas=(momentum, 0.999)) if "Adam" in name else dict(momentum=momentum)
    kw |= dict(nesterov=True) if name == "SGD" else {}
    return OPTIMIZERS[name](groups, lr=lr, **kw)


def lr_factor(epoch: int, epochs: int, lrf: float, cos: bool = False) -> float:
    """The lr multiplier of an epoch: 1 -> lrf, linearly or along half a cosine."""
    if cos:
        return (1 - math.cos(epoch * math.pi / epochs)) / 2 * (lrf - 1) + 1
    return (1 - epoch / epochs) * (1 - lrf) + lrf


def warmup(optimizer, it: int, warmup_iters: int, lf: float, hyp: dict, accumulate: float) -> int:
    """Warmup: lr (biases: from warmup_bias_lr) and momentum ramp up; returns the accumulation."""
    xi = [0, warmup_iters]
    for g in optimizer.param_groups:
        start = hyp["warmup_bias_lr"] if g["bias"] else 0.0
        g["lr"] = float(np.interp(it, xi, [start, g["initial_lr"] * lf]))
        g["momentum"] = float(np.interp(it, xi, [hyp["warmup_momentum"], hyp["momentum"]]))
    return max(1, round(float(np.interp(it, xi, [1, accumulate]))))


# ---------------------------------------------------------------- one epoch
def forward_loss(model, criterion: YOLOLoss, batch: dict, device, amp: torch.dtype | None):
    """(loss, loss items) of a batch: the model under autocast to amp (None: fp32), loss in fp32."""
    images = validator.preprocess(batch["images"], device, de_parallel(model).task == "classify")
    labels = [batch[k].to(device) for k in ("targets", "masks") if batch.get(k) is not None]
    with torch.autocast(device.type, amp, enabled=amp is not None):
        preds = model(images)
    return criterion(preds, *labels)  # the targets, and a segmentation batch's masks


def optimizer_step(model, optimizer, scaler, ema: ModelEMA | None) -> None:
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), 10.0)  # yolov5's max_norm
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update(model)


def train_one_epoch(
    model, criterion, optimizer, scaler, ema, loader, epoch, args, hyp, save_dir, epoch_seconds=None
):
    """One epoch (detection: warmup, NOMINAL_BATCH images a step) -> (mean loss items, img/s).
    epoch_seconds: the mean wall time of this run's finished epochs (with their validation and
    checkpoints; None in its first), for the whole run's eta."""
    # a non-finite loss raises FloatingPointError on every rank at once; no all-reduce until a step
    model.train()
    device, n, detect = next(model.parameters()).device, len(loader), "warmup_epochs" in hyp
    amp = amp_dtype(device, args.amp)
    lf = lr_factor(epoch, args.epochs, hyp["lrf"], args.cos_lr)
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * lf
    warmup_iters = max(round(hyp.get("warmup_epochs", 0) * n), 100)
    nominal_accumulate = NOMINAL_BATCH / args.batch_size  # batches a step once warmup is over
    accumulate = max(round(nominal_accumulate), 1) if detect else 1
    last_step = epoch * n - 1  # every epoch ends with a step: no gradients pending at a checkpoint
    mean, start = 0.0, time.time()
    for i, batch in enumerate(loader):
        it = i + n * epoch
        if detect and it <= warmup_iters:
            accumulate = warmup(optimizer, it, warmup_iters, lf, hyp, nominal_accumulate)
        step = it - last_step >= accumulate or i == n - 1
        # DDP all-reduces the gradients in backward: only at a step
        with model.no_sync() if isinstance(model, DDP) and not step else contextlib.nullcontext():
            loss, items = forward_loss(model, criterion, batch, device, amp)
            values = dist.reduce_mean(torch.stack(list(items.values()))).cpu()
            if not torch.isfinite(values).all():  # the same on every rank: all stop together
                where = f"at epoch {epoch + 1}, iteration {i + 1}: training stopped; the last good"
                last = f"checkpoint is {save_dir / 'weights' / 'last.pt'}"
                raise FloatingPointError(f"non-finite loss {values.tolist()} {where} {last}")
            scaler.scale(loss).backward()
        if step:
            optimizer_step(model, optimizer, scaler, ema)
            last_step = it
        mean = (mean * i + values) / (i + 1)
        if it == 0 and detect and dist.is_main():
            labels = (batch["images"], batch["targets"], batch["masks"])
            draw_batch(*labels, fname=save_dir / "train_batch0.jpg", names=de_parallel(model).names)
        if i == 0:
            t0 = time.time()  # the throughput leaves out the first batch (workers start)
        if dist.is_main() and ((i + 1) % args.log_every == 0 or i + 1 == n):
            rate = (i + 1) / (time.time() - start)
            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak RSS, GB
            mem = torch.cuda.max_memory_reserved() / 1e9 if torch.cuda.is_initialized() else mem
            epoch_left = (n - i - 1) / rate
            # the first epoch knows only its own training rate
            run_left = epoch_left + (args.epochs - epoch - 1) * (epoch_seconds or n / rate)
            eta = f"eta {clock(epoch_left)} (run {clock(run_left)})"
            text = "  ".join(f"{k} {v:.4g}" for k, v in zip(items, mean.tolist()))
            text += f"  instances {len(batch['targets'])}  mem {mem:.2f}G"
            progress = f"epoch {epoch + 1}/{args.epochs} [{i + 1}/{n}]  {rate:.2f} it/s  {eta}"
            print(f"{progress}  {text}", flush=True)
    img_s = (n - 1) * args.batch_size / (time.time() - t0) if n > 1 else 0.0
    return dict(zip(items, mean.tolist())), img_s


def clock(seconds: float) -> datetime.timedelta:
    """A duration as h:mm:ss, to the second."""
    return datetime.timedelta(seconds=round(seconds))


# ---------------------------------------------------------------- resume
def resumed_args(cli, path: str, ckpt: dict) -> argparse.Namespace:
    """The resumed run's own arguments, checked as the command line's are (their ranges: by
    check_args); only --device and --amp may change."""
    parser = get_args_parser()
    defaults = vars(parser.parse_args([]))
    stored = ckpt["args"]  # a dict: checkpoint.load checked
    if set(stored) != set(defaults):
        differ = sorted(map(str, set(stored) ^ set(defaults)))[:5]
        raise ConfigError(f"--resume: {path}: not train.py's arguments ({differ})")
    try:
        own = parse_kwargs(parser, {k: v for k, v in stored.items() if k != "resume"})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--resume: {path}: its {e}") from None
    if cli.resume and ckpt["epoch"] + 1 >= own.epochs:
        raise ConfigError(f"--resume: {path}: the run is finished; start a new one (--weights)")
    changed = {"resume": path, "device": cli.device, "amp": cli.amp}  # all else is the run's own
    # a torchrun restart's arguments are the run's own; bare --resume searched --project
    used = set(changed) | ({"project"} if cli.resume is True else set())
    ignored = [k for k, v in vars(cli).items() if v != defaults[k] and k not in used]
    if cli.resume and ignored:
        flags = ", ".join("--" + k.replace("_", "-") for k in ignored)
        dist.print0(f"warning: --resume continues {path} with its own arguments; ignoring {flags}")
    return argparse.Namespace(**(vars(own) | changed))


def restore_training(ckpt: dict, training: dict, args, info) -> tuple[int, tuple]:
    """Load a checkpoint into the training objects (model, ema, optimizer, scaler) and this rank's
    random states. Returns (the epoch to start at, best (fitness, epoch))."""
    try:
        exact = checkpoint.restore(ckpt, **training, rank=info.rank, world_size=info.world_size)
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume: {args.resume}: {e}") from None
    if not exact:
        sizes = f"saved with world size {ckpt['rng']['world_size']}, now {info.world_size}"
        dist.print0(f"warning: {sizes}: random states are not restored (not an exact resume)")
    return ckpt["epoch"] + 1, (ckpt["best_fitness"], ckpt["best_epoch"])


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


def run_callbacks(callbacks: dict, event: Event) -> None:
    """Call the event's callbacks; if one raises on any rank, CallbackError on every rank."""
    if not callbacks:
        return
    failed = None
    for fn in callbacks.get(event.name, []):
        try:
            fn(event)
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            failed = f"callback {name} for {event.name} raised {type(e).__name__}: {e}"
            failed += f" (rank {event.rank}, epoch {event.epoch})"
            break
    # every rank learns of a failure on any rank, so none is left waiting in a collective
    failures = [f for f in dist.all_gather_object(failed) if f]
    if failures:
        kept = "training stopped; weights/last.pt holds the last saved epoch"
        raise CallbackError(f"{failures[0].splitlines()[0]}; {kept}")


# ---------------------------------------------------------------- the run
def prepare(args, info, given: Model | None = None) -> tuple:
    """Everything before the first epoch that bad input can stop: ConfigError (one line) then.
    Returns (args, resumed checkpoint or None, hyp, model, train loader, val loader, save_dir)."""
    try:
        ckpt, run_id = None, dist.torchrun_id()
        if run_id:
            # the k-th training of a script finds the folder of its k-th before a restart
            run_id = f"{run_id}/training{next(TRAININGS_STARTED)}"
        check_numbers(args, info.world_size)
        if resumed := dist.run_on_main(checkpoint.find_resume, args, run_id):
            args, ckpt = resumed_args(args, *resumed), resumed[1]
        with resumed_checks(args.resume if ckpt else None):
            check_numbers(args, info.world_size)
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        with dist.main_first():  # local rank 0 first: it writes the label caches (and shapes)
            data = datasets.load_data_config(args.data)
            with resumed_checks(args.resume if ckpt else None):
                model = build_model(args, data, ckpt, given)
                check_args(args, model.task, info.world_size)
                if ckpt:
                    hyp = load_hyp(ckpt["hyp"], model.task, where="hyp")
                else:
                    hyp = load_hyp(args.hyp, model.task)
            loader, val_loader = build_loaders(args, hyp, model, data, info)
        need = 36 * sum(p.numel() for p in model.parameters())  # 3 files of 3 fp32 copies
        save_dir = dist.run_on_main(checkpoint.make_run_dir, args, hyp, run_id, need)
        if ckpt:
            dist.run_on_main(checkpoint.restore_results, ckpt, save_dir)
    except (ValueError, OSError, RuntimeError, yaml.YAMLError) as e:  # DataError, CheckpointError
        raise ConfigError(str(e).splitlines()[0]) from None
    return args, ckpt, hyp, model, loader, val_loader, save_dir


@contextlib.contextmanager
def resumed_checks(path: str | None):
    """A ConfigError in the block names the checkpoint (path) whose arguments or hyp it checks."""
    try:
        yield
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"--resume: {path}: its {e}") from None


def build_training(model: Model, hyp: dict, args, info) -> tuple:
    """(the model to train: DDP-wrapped under torchrun, criterion, optimizer, AMP scaler, EMA)."""
    if model.task == "classify":
        decay, criterion = hyp["weight_decay"], ClassifyLoss(label_smoothing=hyp["label_smoothing"])
    else:  # detection's decay is for NOMINAL_BATCH images a step
        accumulate = max(round(NOMINAL_BATCH / args.batch_size), 1)
        decay = hyp["weight_decay"] * args.batch_size * accumulate / NOMINAL_BATCH
        loss_hyp = scale_hyp(hyp, model.nc, args.imgsz, model.head.nl)
        criterion = YOLOLoss(model, loss_hyp, info.world_size)
    optimizer = build_optimizer(model, hyp["lr0"], hyp["momentum"], decay, args.optimizer)
    amp = amp_dtype(info.device, args.amp)  # channels_last: the faster layout under autocast
    model = model.to(memory_format=torch.channels_last if amp else None)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)  # fp16 needs loss scaling
    if info.world_size > 1:
        if args.sync_bn and info.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP starts every rank from rank 0's weights (a model built in a script may differ)
        model = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    ema = ModelEMA(model)
    return model, criterion, optimizer, scaler, ema


def fit(args, info, given: Model | None = None, callbacks: dict | None = None) -> dict:
    """Train (the given model, else args'). Returns {save_dir, data, epochs (the last run),
    best_fitness, metrics (best.pt), img_s, model: the trained Model, eval mode, with best.pt's
    weights (else last.pt's)}; callbacks: {event: [functions]} (see EVENTS)."""
    callbacks = callbacks or {}
    args, ckpt, hyp, model, loader, val_loader, save_dir = prepare(args, info, given)
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(args.seed + info.rank)  # augmentation has its own seeds, per sample
    model, amp, task = model.to(info.device), amp_dtype(info.device, args.amp), model.task
    if not ckpt and not args.noautoanchor and task != "classify":
        autoanchor(model, loader.dataset, hyp["anchor_t"], args)
    model, criterion, optimizer, scaler, ema = build_training(model, hyp, args, info)
    start, best = 0, (0.0, 0)  # best: (fitness, epoch)
    if ckpt:  # what `checkpoint.training_state` saves at the end of each epoch, below
        training = dict(model=de_parallel(model), ema=ema, optimizer=optimizer, scaler=scaler)
        start, best = restore_training(ckpt, training, args, info)
        dist.print0(f"Resuming {save_dir} at epoch {start + 1}/{args.epochs}")
    device = info.device.type
    if device == "cuda":
        device += f" ({torch.cuda.get_device_name(info.device)})"
    where = f"{info.world_size} rank(s) on {device}, batch {args.batch_size}"
    dist.print0(f"{task} training: {where}, {args.epochs} epochs, in {save_dir}")
    dist.print0(f"precision: {PRECISIONS[amp]} (--amp {args.amp})")
    t_start, img_s, epoch, metrics, losses = time.time(), [], start - 1, None, {}
    for epoch in range(start, args.epochs):
        loader.sampler.set_epoch(epoch)
        done = epoch - start
        epoch_seconds = (time.time() - t_start) / done if done else None
        step = (model, criterion, optimizer, scaler, ema, loader, epoch, args, hyp, save_dir)
        step += (epoch_seconds,)
        losses, speed = train_one_epoch(*step)
        img_s.append(speed)
        event = Event("on_train_epoch_end", epoch + 1, losses, None, save_dir, info.rank)
        run_callbacks(callbacks, event)
        metrics = None
        if epoch + 1 == args.epochs or not args.noval:  # BN buffers differ between DDP ranks:
            dist.broadcast_tensors(ema.ema.state_dict().values())  # all validate rank 0's EMA
            plots = save_dir if epoch + 1 == args.epochs else None  # as the final validation's
            metrics = validator.evaluate(ema.ema, val_loader, plots_dir=plots, amp=amp)
            best = max(best, (metrics["fitness"], epoch))  # equal fitness: the later epoch
        stop = metrics and args.patience and epoch - best[1] >= args.patience
        rngs = dist.all_gather_object(checkpoint.rng_state())
        if info.rank == 0:
            saves = stop or epoch + 1 == args.epochs or not args.nosave
            opt = (optimizer, scaler, epoch, best, args, hyp, rngs)
            state = checkpoint.training_state(de_parallel(model), ema, *opt) if saves else None
            row = (save_dir, epoch, losses, metrics, optimizer, task)  # results_text's arguments
            save_epoch(state, bool(metrics) and best[1] == epoch, row)
            print_epoch(epoch, args.epochs, speed, metrics)
        dist.barrier()  # the checkpoints are on disk before any rank goes on
        run_callbacks(callbacks, event._replace(name="on_fit_epoch_end", metrics=metrics))
        if stop:
            best_epoch = f"the best was epoch {best[1] + 1}"
            dist.print0(f"Early stop: no improvement in {args.patience} epochs, {best_epoch}")
            break
    dist.print0(f"{epoch + 1 - start} epochs in {(time.time() - t_start) / 60:.1f} minutes")
    if best[1] != epoch or not metrics:  # best.pt (else last.pt) is not the model validated last
        metrics = validate_saved(ema, val_loader, save_dir, amp)
    dist.print0(validator.format_table(metrics, ema.ema.names) + f"\nResults saved to {save_dir}")
    # the trained model itself (YOLO.train's object) takes the final weights
    trained = de_parallel(model).to(memory_format=torch.contiguous_format).eval()
    trained.load_state_dict(ema.ema.state_dict())
    end = Event("on_train_end", epoch + 1, losses, metrics, save_dir, info.rank)
    run_callbacks(callbacks, end)
    out = dict(save_dir=str(save_dir), data=args.data, epochs=epoch + 1, best_fitness=best[0])
    return out | dict(metrics=metrics, img_s=img_s, model=trained)


def save_epoch(state: dict | None, is_best: bool, row: tuple) -> None:
    """An epoch's last.pt (and best.pt) from state (None: no checkpoint this epoch), then its
    results.csv row (row: results_text's arguments). The checkpoint holds results.csv as it will be
    (a resume restores it), and a Ctrl-C or SIGTERM meanwhile takes effect after both:
    results.csv lists the epochs that last.pt holds."""
    save_dir = row[0]
    text = results_text(*row)
    with checkpoint.signals_held():
        if state is not None:
            state["results_csv"] = text
            checkpoint.save(state, save_dir / "weights" / "last.pt")
        if state is not None and is_best:
            checkpoint.save(state, save_dir / "weights" / "best.pt")
        (save_dir / "results.csv").write_text(text)


def validate_saved(ema: ModelEMA, val_loader, save_dir: Path, amp) -> dict:
    """Load best.pt's (else last.pt's) EMA weights into ema (rank 0 reads the file) and validate."""
    path = save_dir / "weights" / "best.pt"
    if not path.is_file():
        path = path.with_name("last.pt")
    dist.print0(f"Validating {path}")
    ema.ema.load_state_dict(dist.run_on_main(lambda: checkpoint.load(path)["ema"]))
    return validator.evaluate(ema.ema, val_loader, plots_dir=save_dir, amp=amp)


def autoanchor(model: Model, train_set, thr: float, args) -> None:
    """AutoAnchor on rank 0, in pixels; every rank gets its anchors, in grid units."""
    stride = model.stride.view(-1, 1, 1).to(model.head.anchors)
    pixels = (model.head.anchors * stride).view(-1, 2).cpu().numpy()
    new = dist.run_on_main(check_anchors, train_set.labels, pixels, thr, args.imgsz, args.seed)
    if new is not None:
        new = torch.from_numpy(new).to(stride).view_as(model.head.anchors)
        model.head.anchors[:] = new / stride  # pixels -> grid units


def results_text(save_dir: Path, epoch: int, losses: dict, metrics, optimizer, task) -> str:
    """results.csv with epoch's row (a resumed run first drops the rows after its checkpoint)."""
    names = metric_names(KINDS[task])
    row = {"epoch": epoch + 1} | {f"train/{k}_loss": v for k, v in losses.items()}
    row |= {f"metrics/{k}": metrics["metrics"][k] if metrics else "" for k in names}
    row |= {f"lr/pg{j}": g["lr"] for j, g in enumerate(optimizer.param_groups)}
    path = save_dir / "results.csv"
    lines = path.read_text().splitlines(keepends=True)[: epoch + 1] if path.exists() else []
    lines = lines or [",".join(row) + "\n"]
    return "".join(lines) + ",".join(map(str, row.values())) + "\n"


def print_epoch(epoch: int, epochs: int, img_s: float, metrics: dict | None) -> None:
    """The line of a finished epoch: its speed and validation metrics."""
    val = "  ".join(f"{k} {v:.3f}" for k, v in metrics["metrics"].items()) if metrics else "no val"
    print(f"epoch {epoch + 1}/{epochs}: {img_s:.1f} img/s  {val}", flush=True)


def main(args: argparse.Namespace, model: Model | None = None, callbacks=None) -> dict:
    """Train (see `fit`); the process group lives as long as the call."""
    try:
        info = dist.setup(args.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return fit(args, info, model, callbacks)
    except KeyboardInterrupt as e:
        raise Stopped(e.args[0] if e.args else "SIGINT", stop_note(args.nosave)) from None
    finally:
        checkpoint.release_locks()
        dist.cleanup()


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a training: args (the signal's name, what the run folder holds)."""


def stop_note(nosave: bool) -> str:
    """What a stopped training leaves to --resume (rank 0: the run folder it holds)."""
    runs = checkpoint.held_runs()
    if not runs:
        return "no run folder was written"
    if (runs[-1] / "weights" / "last.pt").is_file():
        return "weights/last.pt holds the last completed epoch"
    if nosave:
        return f"--nosave: {runs[-1]} has no weights/last.pt before the final epoch"
    return f"no epoch was completed: {runs[-1]} has no weights/last.pt to resume"


def run(**kwargs) -> dict:
    """Train from Python with train.py's options: `run(cfg="yolov5n.yaml", epochs=3)` -> fit's."""
    return main(parse_kwargs(get_args_parser(), kwargs))
