"""Train a YOLOv5 detection or segmentation model, in one process or many under torchrun.

    python train.py --cfg yolov5n-seg.yaml --data coco128-seg.yaml --epochs 100 --batch-size 16 --imgsz 640
    torchrun --standalone --nproc_per_node 4 train.py --data coco.yaml --batch-size 64   # global batch

The task (detect or segment) comes from the cfg's head. The recipe is yolov5's (SPEC.md §4): SGD with
three parameter groups, gradient accumulation to a nominal batch of 64, warmup, linear or cosine lr,
grad clip 10, EMA, AMP on CUDA, AutoAnchor. Every epoch all ranks validate the EMA (val.evaluate
gathers exact metrics); rank 0 writes last.pt / best.pt atomically. A run lives in runs/train/exp,
exp2, ...; `--resume` continues one exactly, and after a torchrun restart a run resumes by itself.
This file starts no processes: the user or torchrun launches it once per rank.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from val import evaluate, format_table
from yolo_min import dist
from yolo_min.anchors import check_anchors
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config
from yolo_min.losses import DEFAULT_HYP, YOLOLoss, scale_hyp
from yolo_min.models import Model, ModelEMA, de_parallel, load_model, make_divisible, save_checkpoint
from yolo_min.plots import draw_batch, plot_results

NBS = 64  # nominal batch size: gradients accumulate up to it


class ConfigError(ValueError):
    """A bad argument or input file, found before any work; the message is one actionable line."""


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train YOLOv5 detection or segmentation (torchrun for several ranks)")
    p.add_argument("--cfg", default="yolov5n.yaml", help="model cfg (bare name: a shipped one); its head sets the task")
    p.add_argument("--data", default="shapes", help="data yaml, or 'shapes' for the embedded synthetic dataset")
    p.add_argument("--hyp", default="", help="yaml overriding hyperparameters of losses.DEFAULT_HYP")
    p.add_argument("--weights", default="", help="initial weights: a yolo_min or yolov5 checkpoint")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size, split over the ranks")
    p.add_argument("--imgsz", type=int, default=640, help="train and val image size (pixels)")
    p.add_argument("--device", default="", help="cpu, cuda or a GPU index (under torchrun: cuda:LOCAL_RANK or cpu)")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers per rank")
    p.add_argument("--project", default="runs/train")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name instead of making exp2, exp3, ...")
    p.add_argument("--resume", nargs="?", const=True, default=False, help="last.pt of a run, or the newest run")
    p.add_argument("--freeze", nargs="+", type=int, default=[0], help="freeze the first N layers, or the listed layers")
    p.add_argument("--cos-lr", action="store_true", help="cosine lr schedule instead of linear")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA only)")
    p.add_argument("--patience", type=int, default=100, help="early stop after N epochs without improvement (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=["auto", "ram", "off"], default="auto",
                   help="decode images once and keep them in RAM (auto: when they need < 10%% of free memory)")
    p.add_argument("--log-every", type=int, default=10, help="progress line every N iterations")
    p.add_argument("--noautoanchor", action="store_true")
    p.add_argument("--noval", action="store_true", help="validate the final epoch only")
    p.add_argument("--nosave", action="store_true", help="save the final checkpoint only")
    return p


# ---------------------------------------------------------------- recipe parts
def build_optimizer(model: nn.Module, lr: float, momentum: float, decay: float) -> torch.optim.SGD:
    """Nesterov SGD; group 0 biases and group 1 BatchNorm weights without weight decay, group 2 other weights."""
    groups = [[], [], []]
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            norm = isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm))
            groups[0 if name == "bias" else 1 if norm else 2].append(p)
    return torch.optim.SGD([{"params": g, "weight_decay": d, "bias": i == 0, "initial_lr": lr}
                            for i, (g, d) in enumerate(zip(groups, (0.0, 0.0, decay)))],
                           lr=lr, momentum=momentum, nesterov=True)


def lr_factor(epoch: int, epochs: int, lrf: float, cos: bool = False) -> float:
    """lr multiplier of an epoch: 1 -> lrf, linearly or along half a cosine."""
    if cos:
        return (1 - math.cos(epoch * math.pi / epochs)) / 2 * (lrf - 1) + 1
    return (1 - epoch / epochs) * (1 - lrf) + lrf


def warmup(optimizer: torch.optim.Optimizer, ni: int, nw: int, lf: float, hyp: dict, accumulate: float) -> int:
    """Iteration ni of nw warmup iterations: set lr (bias warmup_bias_lr -> scheduled, others 0 -> scheduled)
    and momentum (warmup_momentum -> momentum); return the accumulate of this iteration (1 -> accumulate)."""
    xi = [0, nw]
    for g in optimizer.param_groups:
        g["lr"] = float(np.interp(ni, xi, [hyp["warmup_bias_lr"] if g["bias"] else 0.0, g["initial_lr"] * lf]))
        g["momentum"] = float(np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]]))
    return max(1, round(float(np.interp(ni, xi, [1, accumulate]))))


def forward_loss(model: nn.Module, criterion: YOLOLoss, batch: dict, device: torch.device, amp: bool):
    """(loss to backpropagate, detached loss items) of one batch; uint8 images become float / 255 here."""
    images = batch["images"].to(device, non_blocking=True).float() / 255
    targets = batch["targets"].to(device)
    with torch.autocast(device.type, enabled=amp):
        preds = model(images)
        if batch.get("masks") is not None:
            return criterion(preds, targets, batch["masks"].to(device).float())
        return criterion(preds, targets)


def optimizer_step(model: nn.Module, optimizer, scaler, ema: ModelEMA | None, max_norm: float = 10.0) -> None:
    """Unscale, clip the gradient norm, step, zero the gradients, update the EMA."""
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.update(model)


# ---------------------------------------------------------------- run folder, checkpoints, RNG
def run_path(args: argparse.Namespace, restarted: bool = False) -> Path:
    """The run folder: a resumed checkpoint's, project/name, or the next free name2, name3, ...
    (after a torchrun restart, the last one, which this run made before it was restarted)."""
    if args.resume:
        return Path(args.resume).parent.parent
    n = 1  # project/name, name2, ..., name{n-1} exist
    while (Path(args.project) / (args.name if n == 1 else f"{args.name}{n}")).exists():
        n += 1
    n = 1 if n == 1 or args.exist_ok else n - 1 if restarted else n
    return Path(args.project) / (args.name if n == 1 else f"{args.name}{n}")


def rng_state() -> dict:
    """This process's random states (python, numpy, torch, CUDA) as plain values. (Augmentation has its own
    seeds: EpochSampler hands each sample (seed, epoch, index).)"""
    name, keys, *rest = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), *rest], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, np.uint32), *rest))
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def find_resume(args: argparse.Namespace, restarted: bool) -> tuple[str, dict] | None:
    """(path, checkpoint) to continue from: --resume (a last.pt, or the newest under --project), or
    after a torchrun restart the run folder's last.pt. None: start afresh."""
    if args.resume is True:
        path = max(Path(args.project).glob("*/weights/last.pt"), key=os.path.getmtime, default=None)
        if path is None:
            raise ConfigError(f"--resume: no run with a weights/last.pt under {args.project}")
    elif args.resume:
        path = Path(args.resume)
    elif restarted and (path := run_path(args, restarted) / "weights" / "last.pt").is_file():
        print(f"torchrun restart: resuming from {path}", flush=True)
    else:
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # unpickling: weights_only=True refused
        why = "it holds pickled code or objects, refused" if isinstance(e, pickle.UnpicklingError) else e
        raise ConfigError(f"--resume: cannot read checkpoint {path}: {why}") from None
    if not isinstance(ckpt, dict) or "optimizer" not in ckpt:
        raise ConfigError(f"--resume: {path} is not a yolo_min training checkpoint")
    return str(path), ckpt


def make_run_folder(args: argparse.Namespace, restarted: bool, need: int = 0) -> str:
    """Make the run folder, weights/ and args.yaml (rank 0); fail early if unwritable or under `need` bytes free."""
    path = run_path(args, restarted)
    free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    if free < need:
        raise ConfigError(f"{path}: only {free / 1e6:.1f} MB free on disk, checkpoints need about {need / 1e6:.0f} MB")
    try:
        (path / "weights").mkdir(parents=True, exist_ok=True)
        (path / "args.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))
    except OSError as e:
        raise ConfigError(f"cannot write the run folder {path}: {e}") from None
    return str(path)


def load_inputs(args: argparse.Namespace, world_size: int) -> tuple[dict, dict, Model, YOLODataset, YOLODataset]:
    """Check the arguments, read the data and hyp files, build the model (initial weights, frozen layers)
    and the datasets: (data, hyp, model, train_set, val_set). ConfigError (one line) on any problem."""
    if args.epochs < 1 or args.imgsz < 32 or args.log_every < 1:
        raise ConfigError("--epochs and --log-every must be >= 1 and --imgsz >= 32")
    if args.batch_size < world_size or args.batch_size % world_size:
        raise ConfigError(f"--batch-size {args.batch_size} must be a multiple of the world size {world_size} "
                          "(it is the global batch: each rank takes an equal share)")
    if args.imgsz % 32:
        dist.print0(f"warning: --imgsz {args.imgsz} is not a multiple of 32, using {make_divisible(args.imgsz, 32)}")
        args.imgsz = make_divisible(args.imgsz, 32)
    try:
        if isinstance(args.hyp, str):  # a yaml file ('': none); a resumed run's args hold the dict itself
            args.hyp = yaml.safe_load(Path(args.hyp).read_text()) if args.hyp else {}
        hyp = {**DEFAULT_HYP, **args.hyp}
        if unknown := set(hyp) - set(DEFAULT_HYP):
            raise ConfigError(f"--hyp: unknown keys {sorted(unknown)} (known: losses.DEFAULT_HYP)")
        args.hyp = hyp  # args.yaml and checkpoints carry the values
        data = load_data_config(args.data)
        model = Model(args.cfg, nc=data["nc"])
        if args.weights:  # anchors come from --cfg (then AutoAnchor), everything else whose shape fits is kept
            have, src = model.state_dict(), load_model(args.weights).state_dict()
            keep = {k: v for k, v in src.items()
                    if k in have and v.shape == have[k].shape and not k.endswith("anchors")}
            model.load_state_dict(keep, strict=False)
            dist.print0(f"Transferred {len(keep)}/{len(have)} items from {args.weights}")
        kw = dict(imgsz=args.imgsz, task=model.task, stride=32, cache=None if args.cache == "off" else args.cache, nc=data["nc"])
        train_set = YOLODataset(data["train"], augment=True, hyp=hyp, batch_size=args.batch_size // world_size,
                                prefix="train: ", **kw)
        val_set = YOLODataset(data["val"], rect=True, batch_size=2 * args.batch_size // world_size, prefix="val: ",
                              **kw)
        if model.task == "segment" and not any(len(lb["segments"]) for lb in train_set.labels):
            raise ConfigError(f"{args.data}: a segmentation model ({args.cfg}) needs polygon labels, found boxes only")
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:  # DataError is a ValueError
        raise ConfigError(str(e).splitlines()[0]) from None
    model.names = data["names"]
    frozen = [f"model.{i}." for i in (args.freeze if len(args.freeze) > 1 else range(args.freeze[0]))]
    for k, p in model.named_parameters():
        p.requires_grad = not any(k.startswith(f) for f in frozen)
    return data, hyp, model, train_set, val_set


# ---------------------------------------------------------------- logging
def log_every(loader, every: int, header: str, stats: dict, device: torch.device):
    """Yield (i, batch) from loader; rank 0 prints progress, it/s, ETA, `stats` and peak memory
    (CUDA reserved, or the process's peak RSS) every `every` iterations."""
    n, t0 = len(loader), time.time()
    for i, batch in enumerate(loader):
        yield i, batch
        if dist.is_main() and ((i + 1) % every == 0 or i + 1 == n):
            rate = (i + 1) / (time.time() - t0)
            mem = (torch.cuda.max_memory_reserved(device) if device.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3) / 1e9  # ru_maxrss: kB on Linux
            text = "  ".join(f"{k} {v:.4g}" for k, v in stats.items())
            eta = datetime.timedelta(seconds=round((n - i - 1) / rate))
            print(f"{header} [{i + 1}/{n}]  {rate:.2f} it/s  eta {eta}  {text}  mem {mem:.2f}G", flush=True)


def _test_faults(restarted: bool) -> dict:
    """TEST ONLY (tests/test_reliability.py; never set otherwise): YOLO_MIN_TEST_KILL, _FAIL or _NAN set to
    "epoch:iter:rank" (1-based) make that rank SIGKILL itself (first torchrun try only), raise, or see a NaN loss."""
    return {k: tuple(map(int, v.split(":"))) for k in ("KILL", "FAIL", "NAN")
            if (v := os.environ.get(f"YOLO_MIN_TEST_{k}")) and not (k == "KILL" and restarted)}


def _inject_fault(faults: dict, at: tuple[int, int, int], items: torch.Tensor) -> torch.Tensor:
    """TEST ONLY: the fault of _test_faults planned for (epoch, iteration, rank), if any."""
    if faults.get("KILL") == at:
        os.kill(os.getpid(), signal.SIGKILL)
    if faults.get("FAIL") == at:
        raise RuntimeError(f"test fault: rank {at[2]} fails at epoch {at[0]}, iteration {at[1]}")
    return items * math.nan if faults.get("NAN") == at else items


def _stop_on_sigterm(signum, frame):
    """SIGTERM (kill, a job scheduler) stops a single-process run like Ctrl-C; weights/last.pt stays whole."""
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise KeyboardInterrupt("SIGTERM")


# ---------------------------------------------------------------- training
def main(args: argparse.Namespace) -> dict:
    """Train. Returns {"save_dir", "epochs" (the last epoch run), "best_fitness", "metrics" (best.pt validated
    at the end), "img_s" (training throughput per epoch)}."""
    try:
        info = dist.setup(args.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return train(args, info)
    finally:
        dist.cleanup()


def train(args: argparse.Namespace, info: dist.DistInfo) -> dict:
    rank, world_size, device, master = info.rank, info.world_size, info.device, info.is_main
    cuda = amp = device.type == "cuda"
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    ckpt, faults = None, _test_faults(restarted)
    if resumed := dist.run_on_main(find_resume, args, restarted):  # a resumed run continues with its own arguments
        path, ckpt = resumed
        args = argparse.Namespace(**{**vars(get_args_parser().parse_args([])), **ckpt["args"], "resume": path,
                                     "device": args.device})  # only the hardware may change
    seed_everything(args.seed)  # identical initial weights on every rank
    with dist.main_first():  # local rank 0 first: it builds the label caches (and the shapes dataset)
        data, hyp, model, train_set, val_set = load_inputs(args, world_size)
    need = 3 * 12 * sum(p.numel() for p in model.parameters())  # last.pt, best.pt, .tmp: weights, EMA, momentum
    save_dir = Path(dist.run_on_main(make_run_folder, args, restarted, need))
    last, best, csv_path = save_dir / "weights" / "last.pt", save_dir / "weights" / "best.pt", save_dir / "results.csv"
    seed_everything(args.seed + rank)  # other randomness differs per rank; augmentation is seeded per sample
    task, names = model.task, data["names"]
    loss_names = ["box", "seg", "obj", "cls"] if task == "segment" else ["box", "obj", "cls"]
    kinds = {"box": "B", "mask": "M"} if task == "segment" else {"box": "B"}

    model = model.to(device)
    batch_size = args.batch_size // world_size  # per rank
    accumulate = max(round(NBS / args.batch_size), 1)
    hyp = scale_hyp(hyp, data["nc"], args.imgsz, model.model[-1].nl)
    decay = hyp["weight_decay"] * args.batch_size * accumulate / NBS
    optimizer = build_optimizer(model, hyp["lr0"], hyp["momentum"], decay)
    train_loader, sampler = build_dataloader(train_set, batch_size, args.workers, shuffle=True, rank=rank,
                                             world_size=world_size, seed=args.seed)
    val_loader, _ = build_dataloader(val_set, 2 * batch_size, args.workers, shuffle=False, rank=rank,
                                     world_size=world_size)
    if ckpt is None and not args.noautoanchor:
        check_anchors(train_set, model, hyp["anchor_t"], args.imgsz, seed=args.seed)
    ema = ModelEMA(model)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    start_epoch, best_fitness, best_epoch = 0, 0.0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        ema.ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"]:  # empty when saved without AMP
            scaler.load_state_dict(ckpt["scaler"])
        ema.updates, start_epoch, best_fitness, best_epoch = (ckpt["ema_updates"], ckpt["epoch"] + 1,
                                                              ckpt["best_fitness"], ckpt["best_epoch"])
        if master and csv_path.exists():  # keep the header and the rows of the epochs in the checkpoint
            csv_path.write_text("".join(csv_path.read_text().splitlines(keepends=True)[:start_epoch + 1]))
        if ckpt["rng"]["world_size"] == world_size:
            set_rng_state(ckpt["rng"]["ranks"][rank])
        dist.print0(f"Resuming {save_dir} at epoch {start_epoch + 1}/{args.epochs}")
    if args.sync_bn and cuda and world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    criterion = YOLOLoss(model, hyp, world_size)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if cuda else None)

    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)  # warmup iterations
    dist.print0(f"{task} training: {world_size} rank(s) on {device.type}, batch {args.batch_size} ({batch_size} per "
                f"rank, accumulate {accumulate}), {args.epochs} epochs, results in {save_dir}")
    t_start, img_s, epoch = time.time(), [], start_epoch - 1
    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        lf = lr_factor(epoch, args.epochs, hyp["lrf"], args.cos_lr)
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lf
        last_opt_step = epoch * nb - 1  # every epoch ends with a step, so a resumed run has no stale gradients
        mloss, stats, t_loop = torch.zeros(len(loss_names)), {}, time.time()  # on the CPU: logging never syncs
        for i, batch in log_every(train_loader, args.log_every, f"epoch {epoch + 1}/{args.epochs}", stats, device):
            ni = i + nb * epoch
            if ni <= nw:
                accumulate = warmup(optimizer, ni, nw, lf, hyp, NBS / args.batch_size)
            step = ni - last_opt_step >= accumulate or i == nb - 1
            with model.no_sync() if world_size > 1 and not step else contextlib.nullcontext():  # no all-reduce yet
                loss, items = forward_loss(model, criterion, batch, device, amp)
                items = _inject_fault(faults, (epoch + 1, i + 1, rank), items) if faults else items  # TEST ONLY
                items = dist.reduce_mean(items).cpu()  # the same on every rank, so all ranks stop together
                if not torch.isfinite(items).all():
                    raise FloatingPointError(f"non-finite loss {items.tolist()} at epoch {epoch + 1}, iteration "
                                             f"{i + 1}: training stopped; the last good checkpoint is {last}")
                scaler.scale(loss).backward()
            if step:
                optimizer_step(model, optimizer, scaler, ema)
                last_opt_step = ni
            mloss = (mloss * i + items) / (i + 1)
            stats.update({n: float(v) for n, v in zip(loss_names, mloss)}, instances=len(batch["targets"]))
            if ni == 0 and master:
                draw_batch(batch["images"], batch["targets"], batch["masks"], batch["paths"],
                           fname=save_dir / "train_batch0.jpg", names=names)
            if i == 0 and nb > 1:
                t_loop = time.time()  # throughput leaves out the first batch (worker start-up)
        img_s.append((nb - (nb > 1)) * args.batch_size / (time.time() - t_loop))

        # end of epoch: every rank validates the EMA and gets the same metrics; rank 0 saves
        final, metrics = epoch + 1 == args.epochs, None
        if final or not args.noval:  # BN buffers differ between ranks under DDP: all validate rank 0's EMA
            dist.broadcast_tensors(ema.ema.state_dict().values())
            metrics = evaluate(ema.ema, val_loader, val_set, device=device, half=amp, names=names)
            if metrics["fitness"] >= best_fitness:
                best_fitness, best_epoch = metrics["fitness"], epoch
        rngs = dist.all_gather_object(rng_state())
        if master:
            row = {"epoch": epoch + 1, **{f"train/{n}_loss": float(v) for n, v in zip(loss_names, mloss)},
                   **{f"metrics/{k}({s})": metrics[kind][k] if metrics else "" for kind, s in kinds.items()
                      for k in ("P", "R", "mAP50", "mAP50-95")},
                   **{f"lr/pg{j}": g["lr"] for j, g in enumerate(optimizer.param_groups)}}
            with open(csv_path, "a") as f:
                f.write(("" if f.tell() else ",".join(row) + "\n") + ",".join(map(str, row.values())) + "\n")
            if final or not args.nosave:
                state = {"model_cfg": de_parallel(model).yaml, "model": de_parallel(model).state_dict(),
                         "ema": ema.ema.state_dict(), "ema_updates": ema.updates, "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch, "best_fitness": best_fitness,
                         "best_epoch": best_epoch, "names": names, "task": task, "args": vars(args),
                         "rng": {"world_size": world_size, "ranks": rngs}, "date": datetime.datetime.now().isoformat()}
                save_checkpoint(state, last)
                if metrics is not None and best_epoch == epoch:
                    save_checkpoint(state, best)
            val = "  ".join(f"{k}({s}) P {metrics[k]['P']:.3f} R {metrics[k]['R']:.3f} mAP50 {metrics[k]['mAP50']:.3f} "
                            f"mAP50-95 {metrics[k]['mAP50-95']:.3f}" for k, s in kinds.items()) if metrics else "no val"
            print(f"epoch {epoch + 1}/{args.epochs}: {img_s[-1]:.1f} img/s  {val}", flush=True)
        dist.barrier()  # the checkpoints are on disk before any rank goes on
        if metrics and args.patience and epoch - best_epoch >= args.patience:  # the same decision on every rank
            dist.print0(f"Early stop: no improvement in {args.patience} epochs, the best was epoch {best_epoch + 1}")
            break

    dist.print0(f"{epoch + 1 - start_epoch} epochs in {(time.time() - t_start) / 3600:.3f} hours; validating {best}")
    if master and csv_path.exists():
        plot_results(csv_path)
    ema.ema.load_state_dict(dist.run_on_main(lambda: torch.load(best if best.is_file() else last, map_location="cpu",
                                                                weights_only=True)["ema"]))
    metrics = evaluate(ema.ema, val_loader, val_set, device=device, half=amp, names=names, plots_dir=save_dir)
    dist.print0(format_table(metrics, names) + f"\nResults saved to {save_dir}")
    return {"save_dir": str(save_dir), "epochs": epoch + 1, "best_fitness": best_fitness, "metrics": metrics,
            "img_s": img_s}


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # under torchrun SIGTERM keeps its default: end at once
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        main(get_args_parser().parse_args())
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:  # every rank stops; weights/last.pt holds the last good epoch
        sys.exit(f"train.py: {e}")  # to stderr, exit code 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (_stop_on_sigterm)
        print(f"train.py: stopped by {str(e) or 'SIGINT'}; weights/last.pt holds the last completed epoch",
              file=sys.stderr)
        sys.exit(143 if str(e) == "SIGTERM" else 130)
