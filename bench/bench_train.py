"""Benchmark: train.py's whole training loop against the model-only step rate, YOLOv5n det, seg
and cls.

Each case (task x imgsz) runs in a fresh child process:
  model-only  forward + loss + backward + optimizer step on 16-image batches taken from the same
              dataset beforehand (no data loading, no EMA, no logging), 8 steps after 3 warm-up
              ones and at least 1 s.
  full loop   train.main on coco128 (or coco128-seg), batch 16, 2 workers, 2 epochs of 8
              iterations (the first of each, waiting for the workers, is left out); no validation.
Classify (cls224, cls64): batches of 64, Adam; data: coco128's photos as an ImageFolder (1024
copies, 3 classes) at 224, the embedded shapes-cls (1200 crops of 37-70 px) at 64.
The two alternate (model-only, loop, model-only, ... --rounds loops, model-only), so a machine that
speeds up or slows down meanwhile affects both sides alike. --amp off / auto: both sides in float32
(contiguous) or as train.py --amp auto runs (bfloat16 autocast and channels_last on a CPU with
native bf16). Prints the median img/s of both, the median over the rounds of the loop's rate over
the model-only runs that bracket it, and the peak RSS of the training process during the loops.
Asserts nothing. Figures on a shared machine move by +-7% between runs (single rounds by more):
--repeat N runs each case N times, --rounds more loops in each.
--layouts: model-only only, fp32 / bf16 x contiguous / channels_last, interleaved in one process.
--interleaved (cls cases): step by step in one process, a model-only step then a loop step (the
next training batch from the loader, its augmentation, the step with EMA), at least 40 pairs:
median ms of each and the median ratio of the pairs, immune to the machine's drift; the real
loop's logging, loss sync and epoch ends are left out.
--e2e: end to end, `train.py` as a user runs it (3 epochs of coco128 det at 320, batch 16, 2
workers, validation and checkpoints), --amp off against auto, alternating, wall time of each
(--repeat rounds); --yolov5 DIR adds yolov5's own train.py, same job, to the alternation (run it
with a Python that has yolov5's requirements; offline, yolov5 wants a font: any .ttf copied to
~/.config/Ultralytics/Arial.ttf). yolov5 reads a copy of coco128 made in a temporary folder: it
writes labels/*.cache beside the images, and ../shared must stay unchanged.
--cls-e2e: the same for classify, 10 epochs of shapes-cls at 64, batch 64, 2 workers: wall time and
the last epoch's top-1 of each run; --yolov5 DIR adds yolov5's classify/train.py (yolov5n-cls from
scratch) on a copy of the same ImageFolder; it augments only with albumentations installed
(1.4.x: its RandomResizedCrop call), else it trains unaugmented with a warning.
--ddp adds det at 320 under torchrun, 2 processes x 1 thread (1 worker each), against 1 x 2 threads.

    python bench/bench_train.py [--cases det320 seg320 det640 seg640 cls224 cls64] [--amp off auto]
                                [--iters 8] [--repeat 1] [--rounds 2] [--layouts]
                                [--interleaved] [--e2e] [--cls-e2e] [--yolov5 DIR] [--ddp]
"""

import argparse
import ctypes
import itertools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))
LAYOUTS = {  # name: (--amp, channels_last)
    "fp32": ("off", False),
    "fp32 channels_last": ("off", True),
    "bf16": ("on", False),
    "bf16 channels_last": ("on", True),
}


def data_yaml(task: str, folder: Path, val: str = "coco8{seg}/images/val", root=DATA) -> Path:
    """coco128(-seg) for training, coco8(-seg) val for the (short) validation, under root (DATA or
    copy_data's copy) by absolute path (yolov5 would read a relative one from its datasets/)."""
    seg = "-seg" if task == "seg" else ""
    names = (DATA / "coco128.yaml").read_text().split("names:", 1)[1]
    path = folder / f"bench{seg}{'' if root == DATA else '-copy'}.yaml"
    images = f"train: coco128{seg}/images/train2017\nval: {val.format(seg=seg)}"
    path.write_text(f"path: {root}\n{images}\nnames:{names}")
    return path


def copy_data(names: list[str], folder: Path) -> Path:
    """folder/data, a copy of the folders `names` of DATA (but their annotations/): what yolov5
    reads, as it writes labels/*.cache beside the images and ../shared must stay unchanged."""
    root = folder / "data"
    for name in names:
        shutil.copytree(DATA / name, root / name, ignore=shutil.ignore_patterns("annotations"))
    return root


def cls_folder(folder: Path, imgsz: int) -> Path:
    """Classify data: an ImageFolder of coco128's photos (8 copies of each, 3 classes by index)
    made under folder or, below 128 px, the embedded shapes-cls (crops of 37-70 px)."""
    if imgsz < 128:
        from yolo_min import shapes

        return shapes.ensure("shapes-cls")
    photos = sorted((DATA / "coco128" / "images" / "train2017").glob("*.jpg"))
    for split, copies in (("train", 8), ("val", 1)):
        for k, (c, f) in enumerate((c, f) for c in range(copies) for f in photos):
            # copies: the dataset reads each real file once, links to one file as one image
            copy = folder / "cls" / split / f"class{k % 3}" / f"{c}_{f.name}"
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, copy)
    return folder / "cls"


def step_setup(task: str, imgsz: int, data: Path, n_batches: int, batch=16, device="cpu"):
    """(model on device, criterion, optimizer, batches): what model_only steps through."""
    from yolo_min import trainer
    from yolo_min.datasets import ClassifyDataset, YOLODataset, build_dataloader, load_data_config
    from yolo_min.losses import ClassifyLoss, YOLOLoss, scale_hyp
    from yolo_min.models import Model

    torch.manual_seed(0)
    if task == "cls":  # classify/train.py's recipe: Adam, label smoothing, batch 64
        hyp = trainer.load_hyp("", "classify")
        model = Model("yolov5n-cls.yaml", nc=3).to(device).train()
        crit = ClassifyLoss(label_smoothing=hyp["label_smoothing"])
        opt = trainer.build_optimizer(model, hyp["lr0"], hyp["momentum"], 5e-5, "Adam")
        ds = ClassifyDataset(Path(data) / "train", imgsz, augment=True, verbose=False)
        batches = [b for _, b in zip(range(n_batches), build_dataloader(ds, 64, 0)[0])]
        return model, crit, opt, batches
    hyp = trainer.load_hyp("")
    cfg = "yolov5n-seg.yaml" if task == "seg" else "yolov5n.yaml"
    model = Model(cfg, nc=80).to(device).train()  # on device first: the loss keeps its tensors
    crit = YOLOLoss(model, scale_hyp(hyp, 80, imgsz))
    opt = trainer.build_optimizer(model, 0.01, 0.937, 5e-4)
    kw = dict(augment=True, hyp=hyp, batch_size=batch, nc=80, verbose=False)
    kw |= dict(task="segment" if task == "seg" else "detect")
    ds = YOLODataset(load_data_config(str(data))["train"], imgsz, **kw)
    batches = [b for _, b in zip(range(n_batches), build_dataloader(ds, batch, 0)[0])]
    return model, crit, opt, batches


def train_step(setup, batch, device, dtype, scaler, ema=None):
    """train.py's step on one batch: forward and loss (autocast to dtype), backward, the
    optimizer step (with the EMA's update if one is given)."""
    from yolo_min import trainer

    model, criterion, optimizer, _ = setup
    loss, _ = trainer.forward_loss(model, criterion, batch, device, dtype)
    scaler.scale(loss).backward()
    trainer.optimizer_step(model, optimizer, scaler, ema)


def model_only(setup, iters: int, amp="off", channels_last=False, device="cpu", min_seconds=0.0):
    """img/s of forward + loss + backward + step on pre-made batches (3 warm-up steps first), at
    least `iters` steps and `min_seconds` s, the forward under train.py's autocast for --amp `amp`
    on device (CUDA: fp16 with a GradScaler), the model in channels_last or not, freed memory
    kept as the trainer keeps it."""
    from yolo_min import trainer
    from yolo_min.models import amp_dtype

    model, _, _, batches = setup
    model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    device = torch.device(device)
    dtype = amp_dtype(device, amp)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with trainer.freed_memory_kept():
        # After the loop's malloc_trim, the first two steps fault their memory in again (a 224 px
        # classify step: 500-600 ms against 300).
        for k in range(3):
            train_step(setup, batches[k % len(batches)], device, dtype, scaler)
        sync()
        t0 = time.perf_counter()
        steps = 0
        while steps < iters or time.perf_counter() - t0 < min_seconds:
            train_step(setup, batches[(steps + 1) % len(batches)], device, dtype, scaler)
            steps += 1
        sync()
    return steps * len(batches[0]["images"]) / (time.perf_counter() - t0)


def peak_rss_gb(reset: bool = False) -> float:
    """Peak RSS of this process in GB since the last reset (Linux: VmHWM, reset via clear_refs)."""
    try:
        if reset:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give back what model-only freed (glibc)
            Path("/proc/self/clear_refs").write_text("5")
        status = open("/proc/self/status")
        return next(int(ln.split()[1]) for ln in status if ln.startswith("VmHWM")) / 1e6
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB; since the start


def one_case(task: str, imgsz: int, iters: int, amp: str = "off", rounds: int = 2) -> dict:
    """Model-only and the full loop (2 epochs) alternate, model-only first and last: {"case",
    "amp", "loop", "model_only" (median img/s of each), "ratio" (the median over the rounds of
    the loop's rate over the mean of the model-only runs before and after it), "rss_gb" (the
    loops' peak RSS)}."""
    from yolo_min import trainer
    from yolo_min.models import amp_dtype

    loops, models, rss = [], [], 0.0
    channels_last = amp_dtype(torch.device("cpu"), amp) is not None  # as train.py decides
    cfg = {"seg": "yolov5n-seg.yaml", "cls": "yolov5n-cls.yaml"}.get(task, "yolov5n.yaml")
    batch = "64" if task == "cls" else "16"
    with tempfile.TemporaryDirectory() as tmp:
        data = cls_folder(Path(tmp), imgsz) if task == "cls" else data_yaml(task, Path(tmp))
        setup = step_setup(task, imgsz, data, min(iters + 1, 8))
        for r in range(rounds + 1):
            # a second at least: a 64 px classify step is 40 ms, and noise comes in bursts
            models.append(model_only(setup, iters, amp, channels_last, min_seconds=1.0))
            if r == rounds:
                break
            peak_rss_gb(reset=True)
            args = ["--cfg", cfg, "--data", str(data), "--imgsz", str(imgsz), "--amp", amp]
            args += ["--batch-size", batch, "--workers", "2", "--epochs", "2", "--noval"]
            args += ["--noautoanchor", "--log-every", "100", "--project", tmp]
            epochs = trainer.main(trainer.get_args_parser().parse_args(args))["img_s"]
            loops.append(statistics.mean(epochs))
            rss = max(rss, peak_rss_gb())
    # each loop against the model-only runs that bracket it: a drift of the machine's speed
    # cancels, and the median leaves out a round that a burst of noise hit
    ratios = [loop / statistics.mean(models[r : r + 2]) for r, loop in enumerate(loops)]
    return {
        "case": f"{task}{imgsz}",
        "amp": amp,
        "loop": statistics.median(loops),
        "model_only": statistics.median(models),
        "ratio": statistics.median(ratios),
        "rss_gb": rss,
    }


def layouts_case(task: str, imgsz: int, iters: int, rounds: int = 2) -> dict:
    """Model-only img/s of each of LAYOUTS (mean of `rounds`, interleaved): {"case", name: rate}."""
    with tempfile.TemporaryDirectory() as tmp:
        data = cls_folder(Path(tmp), imgsz) if task == "cls" else data_yaml(task, Path(tmp))
        setup = step_setup(task, imgsz, data, min(iters + 1, 8))
        rates = {name: [] for name in LAYOUTS}
        for _ in range(rounds):
            for name, (amp, channels_last) in LAYOUTS.items():
                rates[name].append(model_only(setup, iters, amp, channels_last))
    return {"case": f"{task}{imgsz}"} | {k: statistics.mean(v) for k, v in rates.items()}


def interleaved_case(imgsz: int, steps: int, amp: str = "auto") -> dict:
    """Classify: a model-only step on a pre-made batch, then a loop step (the next batch from the
    training loader, augmented as train_one_epoch does, the optimizer step with EMA), alternating
    `steps` times in one process; an epoch's last, smaller batch is left out: {"case", "amp",
    "model_only", "loop" (median ms a step), "ratio" (the median of model-only step / loop step
    over the pairs)}. A pair's two steps run a few ms apart: the machine's drift cancels."""
    from yolo_min import cls_augment, trainer
    from yolo_min.datasets import ClassifyDataset, build_dataloader
    from yolo_min.models import ModelEMA, amp_dtype

    device = torch.device("cpu")
    dtype = amp_dtype(device, amp)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with tempfile.TemporaryDirectory() as tmp:
        data = cls_folder(Path(tmp), imgsz)
        setup = step_setup("cls", imgsz, data, 8)
        model, _, _, batches = setup
        model.to(memory_format=torch.channels_last if dtype else torch.contiguous_format)
        ema = ModelEMA(model)
        # as train.py --cache auto: in RAM where they fit, then batched by this process
        train = ClassifyDataset(Path(data) / "train", imgsz, True, verbose=False, cache="auto")
        loader, sampler = build_dataloader(train, 64, 2)

        def loop_batches():
            for epoch in itertools.count():
                sampler.set_epoch(epoch)
                for batch in loader:
                    if len(batch["indices"]) == 64:
                        cls_augment.augment_batch(batch, seed=0, epoch=epoch, device=device)
                        yield batch

        pairs = []
        with trainer.freed_memory_kept():
            source = loop_batches()
            for k in range(steps + 1):
                t0 = time.perf_counter()
                train_step(setup, batches[k % len(batches)], device, dtype, scaler)
                t1 = time.perf_counter()
                train_step(setup, next(source), device, dtype, scaler, ema)
                # the first pair warms up
                if k:
                    pairs.append((t1 - t0, time.perf_counter() - t1))
    model_ms, loop_ms = (1000 * statistics.median(side) for side in zip(*pairs))
    ratio = statistics.median(model / loop for model, loop in pairs)
    return {
        "case": f"cls{imgsz}",
        "amp": amp,
        "model_only": model_ms,
        "loop": loop_ms,
        "ratio": ratio,
    }


def run_case(case: str, iters: int = 8, amp: str = "off", mode: str = "loop", rounds=2) -> dict:
    """One case ("det320", "seg640", ...) in a fresh child process: one_case's (mode "layouts":
    layouts_case's, "interleaved": interleaved_case's) dict, or {"case", "error"} if it failed."""
    cmd = [sys.executable, __file__, "--one", case, "--iters", str(iters), "--amp", amp]
    cmd += ["--rounds", str(rounds), *([f"--{mode}"] if mode != "loop" else [])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"case": case, "error": r.stderr[-500:]}


def end_to_end(amps=("off", "auto"), rounds: int = 1, epochs: int = 3, yolov5=None) -> dict:
    """Wall time (s) of `python train.py --data coco128.yaml --imgsz 320 --batch-size 16
    --workers 2 --epochs 3 --amp X` for each X (alternating, `rounds` times): {X: [seconds...],
    "errors": [...]}. Everything a user waits for: start-up, AutoAnchor, epochs, validation.
    yolov5: a yolov5 checkout, whose train.py (CPU: fp32) joins the alternation as "yolov5"."""
    out = {"errors": [], **{a: [] for a in amps}}
    val = "coco128/images/train2017"  # as coco128.yaml
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.py", "--imgsz", "320", "--batch-size", "16"]
        common += ["--workers", "2", "--epochs", str(epochs)]
        ours = ["--data", str(data_yaml("det", Path(tmp), val=val))]
        runs = {a: (ROOT, [*ours, "--amp", a]) for a in amps}
        if yolov5:  # from scratch, as ours; yolov5 trains in fp32 on a CPU
            copy = data_yaml("det", Path(tmp), val=val, root=copy_data(["coco128"], Path(tmp)))
            extra = ["--data", str(copy), "--cfg", "yolov5n.yaml", "--weights", ""]
            runs["yolov5"] = (yolov5, [*extra, "--device", "cpu"])
            out["yolov5"] = []
        for r in range(rounds):
            for name, (cwd, extra) in runs.items():
                cmd = [sys.executable, *common, *extra, "--project", tmp, "--name", f"{name}{r}"]
                t0 = time.perf_counter()
                p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
                if p.returncode:
                    out["errors"].append(f"{name}: {p.stderr[-300:]}")
                else:
                    out[name].append(time.perf_counter() - t0)
    return out


# yolov5n-cls from scratch as yolov5 made it: yolov5n's first 10 layers, a Classify head for nc
# classes (its classify/train.py takes a .pt file, a torchvision name or, older, a hub download)
YOLOV5_CLS = (
    "import sys, torch; from models.yolo import ClassificationModel, DetectionModel; "
    "m = ClassificationModel(model=DetectionModel('models/yolov5n.yaml'), nc=int(sys.argv[2])); "
    "torch.save({'model': m}, sys.argv[1])"
)
# the last epoch's line: ours `epoch 10/10: 812.3 img/s  top1_acc 0.953  ...`, yolov5's progress
# bar `10/10  0G  train_loss  val_loss  top1  top5: 100%|...` once validated (numbers in %.3g)
TOP1 = {
    "ours": r"epoch {n}/{n}: .*?top1_acc (\S+)",
    "yolov5": r"{n}/{n}\s+\S+\s+[\d.e+-]+\s+[\d.e+-]+\s+([\d.e+-]+)\s+[\d.e+-]+:",
}


def yolov5_cls_model(yolov5: str, folder: Path, nc: int) -> Path:
    """folder/yolov5n-cls.pt, yolov5's own yolov5n-cls untrained, made with yolov5's code."""
    path = folder / "yolov5n-cls.pt"
    cmd = [sys.executable, "-c", YOLOV5_CLS, str(path), str(nc)]
    p = subprocess.run(cmd, cwd=yolov5, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"yolov5n-cls.pt: {p.stderr[-300:]}")
    return path


def cls_end_to_end(amps=("off", "auto"), rounds: int = 1, epochs: int = 10, yolov5=None) -> dict:
    """Wall time (s) and last-epoch top-1 of `python train.py --cfg yolov5n-cls.yaml --data
    shapes-cls --imgsz 64 --epochs 10 --batch-size 64 --workers 2 --amp X` for each X
    (alternating, `rounds` times): {X: [(seconds, top1)...], "errors": [...]}. yolov5: a yolov5
    checkout, whose classify/train.py (CPU: fp32; its yolov5n-cls from scratch, Adam as ours)
    joins the alternation as "yolov5" on a copy of the ImageFolder."""
    from yolo_min import shapes

    out = {"errors": [], **{a: [] for a in amps}}
    data = shapes.ensure("shapes-cls")
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--epochs", str(epochs), "--batch-size", "64", "--workers", "2"]
        ours = ["train.py", "--cfg", "yolov5n-cls.yaml", "--data", str(data), "--imgsz", "64"]
        runs = {a: (ROOT, [*ours, "--amp", a], TOP1["ours"]) for a in amps}
        if yolov5:  # from scratch: --pretrained False re-initialises what the .pt holds
            copy = Path(shutil.copytree(data, Path(tmp) / "shapes-cls"))
            model = yolov5_cls_model(yolov5, Path(tmp), len(list((copy / "train").iterdir())))
            theirs = ["classify/train.py", "--data", str(copy), "--img", "64"]
            theirs += ["--model", str(model), "--pretrained", "False", "--device", "cpu"]
            runs["yolov5"] = (yolov5, theirs, TOP1["yolov5"])
            out["yolov5"] = []
        # yolov5's torch.load of the pickled model above: torch >= 2.6 loads weights only
        pickled = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
        for r in range(rounds):
            for name, (cwd, extra, top1) in runs.items():
                env = pickled if name == "yolov5" else None
                cmd = [sys.executable, *extra, *common, "--project", tmp, "--name", f"{name}{r}"]
                t0 = time.perf_counter()
                p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
                seconds = time.perf_counter() - t0
                # yolov5 logs and draws its progress bars on stderr
                hits = re.findall(top1.format(n=epochs), p.stdout + p.stderr)
                if p.returncode or not hits:
                    out["errors"].append(f"{name}: {p.stderr[-300:]}")
                else:
                    out[name].append((seconds, float(hits[-1])))
    return out


def ddp_compare() -> dict:
    """train.py det 320, 2 epochs of coco128 (mean img/s of the epochs): {"1x2": 1 process x 2
    threads, "2x1": 2 processes x 1 thread under torchrun (gloo), "ratio": 2x1 / 1x2, "errors"}."""
    out = {"errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.py", "--data", str(data_yaml("det", Path(tmp))), "--imgsz", "320"]
        common += ["--batch-size", "16", "--epochs", "2", "--noval", "--noautoanchor"]
        common += ["--log-every", "100"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += ["--nproc_per_node", "2"]
        one = [sys.executable, *common, "--workers", "2", "--project", f"{tmp}/a"]
        two = [*torchrun, *common, "--workers", "1", "--project", f"{tmp}/b"]
        for name, cmd, env in (("1x2", one, {}), ("2x1", two, {"OMP_NUM_THREADS": "1"})):
            r = subprocess.run(
                cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True
            )
            m = [float(x) for x in re.findall(r"epoch \d/2: (\S+) img/s", r.stdout)]
            out[name] = statistics.mean(m) if m else float("nan")
            if not m:
                out["errors"].append(f"{name}: {r.stderr[-300:]}")
    out["ratio"] = out["2x1"] / out["1x2"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=["det320", "seg320", "det640", "seg640"])
    p.add_argument("--amp", nargs="+", default=["off", "auto"], help="train.py --amp values")
    p.add_argument("--iters", type=int, default=8, help="model-only steps timed, per measurement")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case")
    p.add_argument("--rounds", type=int, default=2, help="loop runs in a case, between model-only")
    p.add_argument("--layouts", action="store_true", help="model-only fp32/bf16 x layouts only")
    p.add_argument("--interleaved", action="store_true", help="cls: model-only / loop step pairs")
    p.add_argument("--e2e", action="store_true", help="end to end: 3 epochs det 320, off vs auto")
    p.add_argument("--cls-e2e", action="store_true", help="end to end: 10 epochs shapes-cls 64")
    p.add_argument("--yolov5", help="--e2e, --cls-e2e: time this yolov5 checkout alongside")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one case, prints a RESULT line
    args = p.parse_args()
    if args.one:
        task, imgsz = args.one[:3], int(args.one[3:])
        if args.layouts:
            res = layouts_case(task, imgsz, args.iters)
        elif args.interleaved:
            res = interleaved_case(imgsz, max(args.iters, 40), args.amp[0])
        else:
            res = one_case(task, imgsz, args.iters, args.amp[0], args.rounds)
        print("RESULT " + json.dumps(res), flush=True)
        return
    if not DATA.exists():
        sys.exit(f"{DATA} is absent: the benchmark needs ../shared/data (coco128, coco8)")
    threads, load = torch.get_num_threads(), os.getloadavg()[0]
    print(f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} CPUs, load {load:.1f}")
    cases = [c for c in args.cases for _ in range(args.repeat)]
    mode = "layouts" if args.layouts else "interleaved" if args.interleaved else "loop"
    if args.layouts:
        print("model-only img/s: " + ", ".join(LAYOUTS))
    elif args.interleaved:
        print(f"{'case':8s} {'amp':5s} {'loop ms':>8s} {'model-only ms':>14s} {'model/loop':>11s}")
    else:
        head = f"{'case':8s} {'amp':5s} {'loop img/s':>11s} {'model-only img/s':>17s}"
        print(f"{head} {'loop/model':>11s} {'peak RSS':>9s}")
    for case in cases:
        for amp in ["on"] if args.layouts else args.amp:
            res = run_case(case, args.iters, amp, mode, args.rounds)
            if "error" in res:
                print(f"{case:8s} failed: {res['error']}")
            elif args.layouts:
                rates = "  ".join(f"{res[k]:7.2f}" for k in LAYOUTS)
                print(f"{case:8s} {rates}  (load {os.getloadavg()[0]:.1f})", flush=True)
            elif args.interleaved:
                times = f"{res['loop']:8.2f} {res['model_only']:14.2f} {res['ratio']:11.1%}"
                print(f"{case:8s} {amp:5s} {times}  (load {os.getloadavg()[0]:.1f})", flush=True)
            else:
                load = os.getloadavg()[0]
                rates = f"{res['loop']:11.2f} {res['model_only']:17.2f} {res['ratio']:11.1%}"
                print(f"{case:8s} {amp:5s} {rates} {res['rss_gb']:8.2f}G  (load {load:.1f})")
    if args.e2e:
        e = end_to_end(args.amp, args.repeat, yolov5=args.yolov5)
        for name in [*args.amp, *(["yolov5"] if args.yolov5 else [])]:
            mean = statistics.mean(e[name] or [float("nan")])
            runs = " ".join(f"{t:.1f}" for t in e[name])
            print(f"end to end, {name}: {mean:.1f} s ({runs})")
        print("".join(f"  failed: {err}\n" for err in e["errors"]), end="")
    if args.cls_e2e:
        e = cls_end_to_end(args.amp, args.repeat, yolov5=args.yolov5)
        for name in [*args.amp, *(["yolov5"] if args.yolov5 else [])]:
            if not e[name]:
                print(f"cls end to end, {name}: no run finished")
                continue
            seconds = statistics.mean(t for t, _ in e[name])
            top1 = statistics.mean(a for _, a in e[name])
            runs = " ".join(f"{t:.1f} s {a:.3f}" for t, a in e[name])
            print(f"cls end to end, {name}: {seconds:.1f} s, top-1 {top1:.3f} ({runs})")
        print("".join(f"  failed: {err}\n" for err in e["errors"]), end="")
    if args.ddp:
        print("torchrun (CPU, gloo):")
        d = ddp_compare()
        print(f"  det 320, 1 process x 2 threads   {d['1x2']:7.2f} img/s")
        print(f"  det 320, 2 processes x 1 thread  {d['2x1']:7.2f} img/s")
        errors = "".join(f"\n  failed: {e}" for e in d["errors"])
        print(f"  ratio 2x1 / 1x2: {d['ratio']:.1%}" + errors)


if __name__ == "__main__":
    main()
