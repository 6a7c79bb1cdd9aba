"""Validation throughput: images/s of val.evaluate (model + NMS + matching + AP) on coco128 / coco128-seg.

    python bench/bench_val.py [--device cpu] [--sizes 320 640] [--tasks detect segment] [--batch-size 16]

Random-weight YOLOv5n models score about 2e-4 at best, so the default --conf-thres 1e-4 makes NMS keep
max_det=300 detections per image, the load a trained model gives at conf 0.001. Needs ../shared/data.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import val  # noqa: E402
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config  # noqa: E402
from yolo_min.dist import select_device  # noqa: E402
from yolo_min.models import Model  # noqa: E402


def val_rates(tasks=("detect", "segment"), sizes=(320, 640), device: str = "", batch_size: int = 16,
              workers: int = 2, conf_thres: float = 1e-4, images: int = 128) -> list[dict]:
    """One row per (task, imgsz): {"task", "imgsz", "img_s", "seconds", "images", "speed"} where speed is
    val.evaluate's ms per image (preprocess, inference, nms) and img_s covers data + model + NMS + AP."""
    dev = select_device(device)
    data_root = ROOT.parent / "shared" / "data"
    rows = []
    for task in tasks:
        data = load_data_config(str(data_root / ("coco128-seg.yaml" if task == "segment" else "coco128.yaml")))
        torch.manual_seed(0)
        model = Model("yolov5n-seg.yaml" if task == "segment" else "yolov5n.yaml").to(dev).eval()
        for imgsz in sizes:
            ds = YOLODataset(data["val"], imgsz=imgsz, task=task, rect=True, batch_size=batch_size, nc=80)
            ds.im_files, ds.labels = ds.im_files[:images], ds.labels[:images]
            loader, _ = build_dataloader(ds, batch_size, workers, shuffle=False)
            val.evaluate(model, [next(iter(loader))], ds, conf_thres=conf_thres, device=dev)  # warm-up
            t = time.perf_counter()
            res = val.evaluate(model, loader, ds, conf_thres=conf_thres, device=dev)
            dt = time.perf_counter() - t
            rows.append(dict(task=task, imgsz=imgsz, img_s=res["images"] / dt, seconds=dt, images=res["images"],
                             speed=res["speed"]))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="")
    p.add_argument("--sizes", type=int, nargs="+", default=[320, 640])
    p.add_argument("--tasks", nargs="+", default=["detect", "segment"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--conf-thres", type=float, default=1e-4)
    p.add_argument("--images", type=int, default=128, help="first N images of coco128")
    args = p.parse_args()
    print(f"device {select_device(args.device)}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"conf {args.conf_thres}")
    for r in val_rates(args.tasks, args.sizes, args.device, args.batch_size, args.workers, args.conf_thres,
                       args.images):
        s, dt, n = r["speed"], r["seconds"], r["images"]
        print(f"{r['task']:8s} {r['imgsz']:4d}: {r['img_s']:7.1f} images/s  ({dt:.1f}s for {n} images; "
              f"ms/image: pre {s['preprocess']:.1f}, model {s['inference']:.1f}, NMS {s['nms']:.1f}, "
              f"data+matching+AP {1000 * dt / n - sum(s.values()):.1f})")


if __name__ == "__main__":
    main()
