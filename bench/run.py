"""Every speed figure of yolo_min in one table, with a description of the machine it ran on.

    python bench/run.py            # everything: about 13 minutes on 2 CPU cores
    python bench/run.py --quick    # imgsz 320 only, fewer images, no DDP: about 4 minutes

Sections (each also runnable alone, with more detail): bench_data.py (dataloader img/s of one worker
process, 1 thread, next to yolov5's OpenCV pipeline), bench_train.py (train.py's loop against the
model-only step rate, peak RSS, torchrun 2x1 against 1x2), bench_loss.py (the loss's share of a
training step), bench_val.py (val.evaluate img/s: model + NMS + matching + AP). Needs ../shared/data
(coco128, coco128-seg, coco8). Asserts nothing: compare the yolo_min column with the last one.
Timings are wall clock (the dataloader's also CPU time): run it on an otherwise idle machine.
"""
import argparse
import contextlib
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_data  # noqa: E402
import bench_loss  # noqa: E402
import bench_train  # noqa: E402
import bench_val  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TASK = {"detect": "det", "segment": "seg", "det": "det", "seg": "seg"}


def machine() -> str:
    """CPU model, cores, torch version and threads (and the GPU, if any) in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        info = dict(ln.split(":", 1) for ln in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in ln)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu = info.get("model name", cpu) + (f" @ {float(info['cpu MHz']) / 1000:.1f} GHz" if "cpu MHz" in info else "")
    except (OSError, ValueError):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), Python "
            f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(quick: bool) -> list[tuple[str, str, str, str]]:
    """Run every section; rows (figure, case, yolo_min value, yolov5 reference or target)."""
    sizes = (320,) if quick else (320, 640)
    rows = []
    log("dataloader pipelines (1 process, 1 thread)")
    for r in bench_data.data_rates(str(DATA), n=64 if quick else 256, sizes=sizes):
        ref = f"{r['ref']} (yolov5 OpenCV)" if r["ref"] else "-"
        rows.append((f"dataloader {r['mode']} img/s (cpu time)", f"{TASK[r['task']]} {r['imgsz']}",
                     f"{r['cpu']:.0f}", ref))

    log("training loop vs model-only step (child processes)")
    for case in [f"{t}{s}" for s in sizes for t in ("det", "seg")]:
        r = bench_train.run_case(case, iters=4 if quick else 8)
        name = f"{case[:3]} {case[3:]}"
        if "error" in r:
            rows.append(("train loop img/s (b16, 2 workers)", name, "failed", r["error"].splitlines()[-1][:40]))
            continue
        det320 = case == "det320"
        rows += [("train loop img/s (b16, 2 workers)", name, f"{r['loop']:.1f}", "13.3 (yolov5)" if det320 else "-"),
                 ("model-only img/s (fwd+loss+bwd+step)", name, f"{r['model_only']:.1f}",
                  "15.1 (yolov5)" if det320 else "-"),
                 ("loop / model-only", name, f"{r['loop'] / r['model_only']:.0%}", ">= 95% (yolov5 88%)"),
                 ("peak RSS of the training process", name, f"{r['rss_gb']:.2f} GB",
                  "< 2 GB (yolov5 2.05 GB)" if det320 else "-")]

    log("loss share of a training step")
    r = bench_loss.loss_share("yolov5n-seg.yaml", 320, 16, iters=2 if quick else 3)
    rows.append(("loss share of fwd+loss+bwd", "seg 320 b16", f"{r['share']:.1%}", "< 15%"))

    log("validation (model + NMS + matching + AP)")
    for r in bench_val.val_rates(sizes=sizes, device="cpu", images=32 if quick else 128):
        rows.append(("val img/s (b16, conf 1e-4, 300 det/img)", f"{TASK[r['task']]} {r['imgsz']}",
                     f"{r['img_s']:.1f}", "-"))

    if not quick:
        log("torchrun: 2 processes x 1 thread vs 1 process x 2 threads")
        d = bench_train.ddp_compare()
        rows += [("train img/s, 1 process x 2 threads", "det 320 b16", f"{d['1x2']:.1f}", "-"),
                 ("train img/s, torchrun 2 processes x 1 thread", "det 320 b16", f"{d['2x1']:.1f}", "-"),
                 ("DDP 2x1 / 1x2", "det 320 b16", f"{d['ratio']:.0%}", ">= 90%")]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="imgsz 320 only, fewer images, no DDP")
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"bench/run.py: {DATA} is absent: the benchmarks read coco128, coco128-seg and coco8 from it")
    t0, load0 = time.time(), os.getloadavg()[0]
    with contextlib.redirect_stdout(sys.stderr):  # dataset summaries and warnings: stdout holds the table only
        rows = measure(args.quick)
    minutes, load1 = (time.time() - t0) / 60, os.getloadavg()[0]
    head = ("figure", "case", "yolo_min", "yolov5 / target")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print(f"yolo_min benchmarks ({'--quick' if args.quick else 'full'}, {minutes:.1f} min; load average "
          f"{load0:.1f} at start, {load1:.1f} at end)\n{machine()}\n")
    print(f"| {head[0]:{w[0]}s} | {head[1]:{w[1]}s} | {head[2]:>{w[2]}s} | {head[3]:{w[3]}s} |")
    print(f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 1)}:|{'-' * (w[3] + 2)}|")
    for f, c, v, ref in rows:
        print(f"| {f:{w[0]}s} | {c:{w[1]}s} | {v:>{w[2]}s} | {ref:{w[3]}s} |")


if __name__ == "__main__":
    main()
