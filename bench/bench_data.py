"""Data pipeline speed: images/s of one worker process (1 thread), training (mosaic) and
validation (rect).

Run: python bench/bench_data.py [--data-dir ../shared/data] [--n 256] [--profile]
Prints our figures next to the reference yolov5 OpenCV pipeline measured on the 2-core CI machine.
Each figure is __getitem__ + collate over batches of 16, after a warm-up batch (files in page
cache). img/s is given by process CPU time (what one worker does with a core to itself; robust to
other load on the machine) and by wall time (equal on an idle machine).
"""

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_min.datasets import YOLODataset, collate, load_data_config  # noqa: E402
from yolo_min.trainer import load_hyp  # noqa: E402

REFERENCE = {
    ("train", "detect", 320): 87,
    ("train", "detect", 640): 67,
    ("train", "segment", 320): 72,
    ("train", "segment", 640): 45,
    ("val", "detect", 640): 300,
    ("val", "segment", 640): 300,
}


def rate(ds, n: int, bs: int = 16) -> tuple[float, float]:
    """(img/s by CPU time, img/s by wall time)."""
    collate([ds[i % len(ds)] for i in range(bs)])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, n, bs):
        collate([ds[i % len(ds)] for i in range(s, s + bs)])
    return n / (time.process_time() - c0), n / (time.perf_counter() - t0)


def data_rates(
    data_dir: str, n: int = 256, modes=("train", "val"), sizes=(320, 640), profile: bool = False
) -> list[dict]:
    """One row per (pipeline, task, imgsz) on coco128 / coco128-seg: {"mode", "task", "imgsz",
    "cpu", "wall", "ref"} (img/s of one process with 1 thread; ref = yolov5's OpenCV figure or
    None)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # restored below: the caller may time other things in this process
    random.seed(0)
    try:
        return _data_rates(data_dir, n, modes, sizes, profile)
    finally:
        torch.set_num_threads(threads)


def _data_rates(data_dir: str, n: int, modes, sizes, profile: bool) -> list[dict]:
    rows = []
    for mode in modes:
        for task, name in (("detect", "coco128.yaml"), ("segment", "coco128-seg.yaml")):
            cfg = load_data_config(f"{data_dir}/{name}")
            for imgsz in sizes:
                kw = dict(augment=mode == "train", hyp=load_hyp(""), rect=mode == "val")
                kw |= dict(batch_size=16, nc=cfg["nc"], verbose=False)
                ds = YOLODataset(cfg["train"], imgsz=imgsz, task=task, **kw)
                if profile and (mode, task, imgsz) == ("train", "segment", 640):
                    cProfile.runctx("rate(ds, n)", globals(), locals(), "/tmp/bench_data.prof")
                    pstats.Stats("/tmp/bench_data.prof").sort_stats("tottime").print_stats(15)
                cpu, wall = rate(ds, n)
                ref = REFERENCE.get((mode, task, imgsz))
                rows.append(dict(mode=mode, task=task, imgsz=imgsz, cpu=cpu, wall=wall, ref=ref))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data")
    )
    ap.add_argument("--n", type=int, default=256, help="images per measurement")
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the 640 segment training pipeline"
    )
    args = ap.parse_args()
    rows = data_rates(args.data_dir, args.n, profile=args.profile)
    print(
        f"\n{'pipeline':8s} {'task':8s} {'imgsz':>5s} {'yolo_min img/s (cpu)':>21s} {'(wall)':>7s} "
        f"{'yolov5 OpenCV img/s':>20s}"
    )
    for r in rows:
        print(
            f"{r['mode']:8s} {r['task']:8s} {r['imgsz']:5d} {r['cpu']:21.1f} {r['wall']:7.1f} "
            f"{r['ref'] if r['ref'] else '-':>20}"
        )


if __name__ == "__main__":
    main()
