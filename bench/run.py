"""Every speed figure of yolo_min in one table, with a description of the machine it ran on.

    python bench/run.py            # everything: about 40 minutes on 2 CPU cores
    python bench/run.py --quick    # imgsz 320 only, fewer images, no end to end, no DDP

Sections (each also runnable alone, with more detail): bench_data.py (dataloader img/s of one
worker process, 1 thread, next to yolov5's OpenCV pipeline), bench_train.py (train.py's loop against
the model-only step rate with --amp off and auto, peak RSS, for det and seg at 320 (and 640) and
classify at 224 and 64 px; the model-only step in fp32 / bf16 x contiguous / channels_last; end to
end, 3 epochs of coco128, --amp off against auto; torchrun 2x1 against 1x2), bench_loss.py (the
loss's share of a training step), bench_val.py (val.evaluate img/s: model + NMS + matching + AP, and
the model alone, in each layout). Needs ../shared/data (coco128, coco128-seg, coco8). Asserts
nothing: compare the yolo_min column with the last one.
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
YOLOV5_E2E = 1.33  # yolov5 train.py / yolo_min --amp off, end to end (bench_train --e2e --yolov5)


def machine() -> str:
    """CPU model, cores, torch version and threads (and the GPU, if any) in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        first = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
        info = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in first if ":" in ln)}
        ghz = f" @ {float(info['cpu MHz']) / 1000:.1f} GHz" if "cpu MHz" in info else ""
        cpu = info.get("model name", cpu) + ghz
    except (OSError, ValueError):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    cores = f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable)"
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    return f"{cpu}, {cores}, {versions}, {torch.get_num_threads()} threads{gpu}"


def log(msg: str) -> None:
    load = os.getloadavg()[0]
    print(f"[bench {time.strftime('%H:%M:%S')} load {load:.1f}] {msg}", file=sys.stderr, flush=True)


def measure(quick: bool) -> list[tuple[str, str, str, str]]:
    """Run every section; rows (figure, case, yolo_min value, yolov5 reference or target)."""
    sizes = (320,) if quick else (320, 640)
    cases = [f"{t}{s}" for s in sizes for t in ("det", "seg")]
    rows = []

    def add(figure: str, case: str, value: str, ref: str = "-") -> None:
        rows.append((figure, case, value, ref))

    log("dataloader pipelines (1 process, 1 thread)")
    for r in bench_data.data_rates(str(DATA), n=64 if quick else 256, sizes=sizes):
        ref = f"{r['ref']} (yolov5 OpenCV)" if r["ref"] else "-"
        case = f"{TASK[r['task']]} {r['imgsz']}"
        add(f"dataloader {r['mode']} img/s (cpu time)", case, f"{r['cpu']:.0f}", ref)

    log("training loop vs model-only step (child processes), --amp off and auto")
    classify = [("cls224", "auto"), ("cls64", "auto")] + [("cls224", "off")] * (not quick)
    for case, amp in [(c, a) for c in cases for a in ("off", "auto")] + classify:
        r = bench_train.run_case(case, iters=4 if quick else 8, amp=amp)
        name, yolov5 = f"{case[:3]} {case[3:]} --amp {amp}", case == "det320" and amp == "off"
        loop_figure = f"train loop img/s (b{64 if case[:3] == 'cls' else 16}, 2 workers)"
        if "error" in r:
            add(loop_figure, name, "failed", r["error"][-40:])
            continue
        loop, model = r["loop"], r["model_only"]
        add(loop_figure, name, f"{loop:.1f}", "13.3 (yolov5)" * yolov5)
        add("model-only img/s (fwd+loss+bwd+step)", name, f"{model:.1f}", "15.1 (yolov5)" * yolov5)
        add("loop / model-only", name, f"{r['ratio']:.0%}", ">= 95% (yolov5 88%)")
        rss = f"{r['rss_gb']:.2f} GB"
        add("peak RSS of the training process", name, rss, "< 2 GB (yolov5 2.05 GB)" * yolov5)

    log("model-only step: fp32 / bf16 x contiguous / channels_last (child processes)")
    figure = "model-only img/s, " + " / ".join(bench_train.LAYOUTS)
    for case in cases:
        r = bench_train.run_case(case, iters=4 if quick else 8, mode="layouts")
        rates = " / ".join(f"{r[k]:.1f}" for k in bench_train.LAYOUTS) if "error" not in r else ""
        add(figure, f"{case[:3]} {case[3:]}", rates or "failed")

    log("loss share of a training step")
    for amp in ("off", "auto"):
        r = bench_loss.loss_share("yolov5n-seg.yaml", 320, 16, iters=2 if quick else 3, amp=amp)
        add("loss share of fwd+loss+bwd", f"seg 320 b16 --amp {amp}", f"{r['share']:.1%}", "< 20%")

    log("validation (model + NMS + matching + AP) and inference, each layout")
    layouts = list(bench_val.LAYOUTS)
    for r in bench_val.val_rates(sizes=sizes, images=32 if quick else 128, layouts=layouts):
        case = f"{TASK[r['task']]} {r['imgsz']} {r['layout']}"
        add("val img/s (b16, conf 1e-4, 300 det/img)", case, f"{r['img_s']:.1f}")
        model = f"{1000 / r['speed']['inference']:.1f}"
        add("inference img/s (the model alone, in val)", case, model)

    if not quick:
        log("end to end: train.py, 3 epochs of coco128 det 320, --amp off vs auto")
        e = bench_train.end_to_end()
        off, auto = (sum(e[a]) / len(e[a]) if e[a] else float("nan") for a in ("off", "auto"))
        figure = "end to end s (train.py, 3 epochs coco128)"
        add(figure, "det 320 b16 --amp off", f"{off:.0f}", f"yolov5 {YOLOV5_E2E} x this")
        add(figure, "det 320 b16 --amp auto", f"{auto:.0f}")
        implied = f"{YOLOV5_E2E * off / auto:.2f}x vs yolov5 (target >= 2x)"
        add("end to end speed-up, --amp auto / off", "det 320 b16", f"{off / auto:.2f}x", implied)
        log("torchrun: 2 processes x 1 thread vs 1 process x 2 threads")
        d = bench_train.ddp_compare()
        add("train img/s, 1 process x 2 threads", "det 320 b16", f"{d['1x2']:.1f}")
        add("train img/s, torchrun 2 processes x 1 thread", "det 320 b16", f"{d['2x1']:.1f}")
        add("DDP 2x1 / 1x2", "det 320 b16", f"{d['ratio']:.0%}", ">= 90%")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="imgsz 320 only, fewer images, no DDP")
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"bench/run.py: {DATA} is absent: the benchmarks read coco128(-seg) and coco8")
    t0, load0 = time.time(), os.getloadavg()[0]
    with contextlib.redirect_stdout(sys.stderr):  # summaries and warnings: stdout has the table
        rows = measure(args.quick)
    minutes, load1 = (time.time() - t0) / 60, os.getloadavg()[0]
    head = ("figure", "case", "yolo_min", "yolov5 / target")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    kind = "--quick" if args.quick else "full"
    load = f"load average {load0:.1f} at start, {load1:.1f} at end"
    print(f"yolo_min benchmarks ({kind}, {minutes:.1f} min; {load})\n{machine()}\n")
    print(f"| {head[0]:{w[0]}s} | {head[1]:{w[1]}s} | {head[2]:>{w[2]}s} | {head[3]:{w[3]}s} |")
    print(f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 1)}:|{'-' * (w[3] + 2)}|")
    for f, c, v, ref in rows:
        print(f"| {f:{w[0]}s} | {c:{w[1]}s} | {v:>{w[2]}s} | {(ref or '-'):{w[3]}s} |")


if __name__ == "__main__":
    main()
