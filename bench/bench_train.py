"""Benchmark: train.py's whole training loop against the model-only step rate, YOLOv5n det and seg.

Each case (task x imgsz) runs in a fresh child process:
  model-only  forward + loss + backward + optimizer step on 16-image batches taken from the same
              dataset beforehand (no data loading, no EMA, no logging), 8 steps after a warm-up one.
  full loop   train.main on coco128 (or coco128-seg), batch 16, 2 workers, 2 epochs of 8 iterations
              (the first of each, waiting for the workers, is left out); validation on coco8 at the end.
The two alternate (model-only, loop, model-only, loop, model-only), so a machine that speeds up or
slows down meanwhile affects both sides alike.
Prints img/s of both, their ratio and the peak RSS of the training process during the loop. Asserts
nothing. Figures on a shared machine move by +-7% between runs: --repeat N runs each case N times.
--ddp adds det at 320 under torchrun, 2 processes x 1 thread (1 worker each), against 1 process x 2 threads.

    python bench/bench_train.py [--cases det320 seg320 det640 seg640] [--iters 8] [--repeat 1] [--ddp]
"""
import argparse
import ctypes
import json
import os
import re
import resource
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


def data_yaml(task: str, folder: Path) -> Path:
    """coco128(-seg) for training, coco8(-seg) val for the (short) validation."""
    seg = "-seg" if task == "seg" else ""
    names = (DATA / "coco128.yaml").read_text().split("names:", 1)[1]
    path = folder / f"bench{seg}.yaml"
    path.write_text(f"path: {DATA}\ntrain: coco128{seg}/images/train2017\nval: coco8{seg}/images/val\nnames:{names}")
    return path


def model_only(task: str, imgsz: int, data: Path, iters: int) -> float:
    """img/s of forward + loss + backward + step on pre-made batches (one warm-up step first)."""
    import train
    from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config
    from yolo_min.losses import DEFAULT_HYP, YOLOLoss, scale_hyp
    from yolo_min.models import Model

    torch.manual_seed(0)
    model = Model("yolov5n-seg.yaml" if task == "seg" else "yolov5n.yaml", nc=80).train()
    crit = YOLOLoss(model, scale_hyp(DEFAULT_HYP, 80, imgsz))
    opt = train.build_optimizer(model, 0.01, 0.937, 5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    ds = YOLODataset(load_data_config(str(data))["train"], imgsz, augment=True, batch_size=16, nc=80,
                     task="segment" if task == "seg" else "detect")
    batches = [b for _, b in zip(range(min(iters + 1, 8)), build_dataloader(ds, 16, 0)[0])]
    for k in range(iters + 1):
        if k == 1:
            t0 = time.perf_counter()
        loss, _ = train.forward_loss(model, crit, batches[k % len(batches)], torch.device("cpu"), False)
        scaler.scale(loss).backward()
        train.optimizer_step(model, opt, scaler, None)
    return iters * 16 / (time.perf_counter() - t0)


def peak_rss_gb(reset: bool = False) -> float:
    """Peak RSS of this process in GB since the last reset (Linux: VmHWM, reset through clear_refs)."""
    try:
        if reset:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give back what the model-only run freed (glibc)
            Path("/proc/self/clear_refs").write_text("5")
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM")) / 1e6
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB; since the process started


def one_case(task: str, imgsz: int, iters: int, rounds: int = 2) -> dict:
    """Model-only and the full loop (2 epochs) alternate, model-only first and last: {"case", "loop",
    "model_only" (mean img/s of each), "rss_gb" (the loops' peak RSS)}."""
    import train

    loops, models, rss = [], [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        data = data_yaml(task, Path(tmp))
        for r in range(rounds + 1):
            models.append(model_only(task, imgsz, data, iters))
            if r == rounds:
                break
            peak_rss_gb(reset=True)
            out = train.main(train.get_args_parser().parse_args(
                ["--cfg", "yolov5n-seg.yaml" if task == "seg" else "yolov5n.yaml", "--data", str(data), "--imgsz",
                 str(imgsz), "--batch-size", "16", "--workers", "2", "--epochs", "2", "--noval", "--noautoanchor",
                 "--log-every", "100", "--project", tmp]))
            loops += out["img_s"]
            rss = max(rss, peak_rss_gb())
    return {"case": f"{task}{imgsz}", "loop": statistics.mean(loops), "model_only": statistics.mean(models),
            "rss_gb": rss}


def run_case(case: str, iters: int = 8) -> dict:
    """One case ("det320", "seg640", ...) in a fresh child process: {"case", "loop", "model_only" (img/s),
    "rss_gb" (peak RSS of the training process)}, or {"case", "error"} when it failed."""
    r = subprocess.run([sys.executable, __file__, "--one", case, "--iters", str(iters)], capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"case": case, "error": r.stderr[-500:]}


def ddp_compare() -> dict:
    """train.py det 320, 2 epochs of coco128 (mean img/s of the epochs): {"1x2": img/s of 1 process x 2 threads, "2x1": 2 processes x 1
    thread under torchrun (gloo), "ratio": 2x1 / 1x2, "errors": [...]}."""
    out = {"errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        common = ["train.py", "--data", str(data_yaml("det", Path(tmp))), "--imgsz", "320", "--batch-size", "16",
                  "--epochs", "2", "--noval", "--noautoanchor", "--log-every", "100"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        for name, cmd, env in (
                ("1x2", [sys.executable, *common, "--workers", "2", "--project", f"{tmp}/a"], {}),
                ("2x1", [*torchrun, *common, "--workers", "1", "--project", f"{tmp}/b"], {"OMP_NUM_THREADS": "1"})):
            r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
            m = [float(x) for x in re.findall(r"epoch \d/2: (\S+) img/s", r.stdout)]
            out[name] = statistics.mean(m) if m else float("nan")
            if not m:
                out["errors"].append(f"{name}: {r.stderr[-300:]}")
    out["ratio"] = out["2x1"] / out["1x2"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["det320", "seg320", "det640", "seg640"])
    p.add_argument("--iters", type=int, default=8, help="model-only steps timed, before and after the loop")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one case, prints a RESULT line
    args = p.parse_args()
    if args.one:
        task, imgsz = args.one[:3], int(args.one[3:])
        print("RESULT " + json.dumps(one_case(task, imgsz, args.iters)), flush=True)
        return
    if not DATA.exists():
        sys.exit(f"{DATA} is absent: the benchmark needs ../shared/data (coco128, coco8)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; batch 16, 2 workers")
    print(f"{'case':8s} {'loop img/s':>11s} {'model-only img/s':>17s} {'loop/model':>11s} {'peak RSS':>9s}")
    for case in [c for c in args.cases for _ in range(args.repeat)]:
        res = run_case(case, args.iters)
        if "error" in res:
            print(f"{case:8s} failed: {res['error']}")
            continue
        print(f"{case:8s} {res['loop']:11.2f} {res['model_only']:17.2f} {res['loop'] / res['model_only']:11.1%} "
              f"{res['rss_gb']:8.2f}G", flush=True)
    if args.ddp:
        print("torchrun (CPU, gloo):")
        d = ddp_compare()
        print(f"  det 320, 1 process x 2 threads   {d['1x2']:7.2f} img/s")
        print(f"  det 320, 2 processes x 1 thread  {d['2x1']:7.2f} img/s")
        print(f"  ratio 2x1 / 1x2: {d['ratio']:.1%}" + "".join(f"\n  failed: {e}" for e in d["errors"]))


if __name__ == "__main__":
    main()
