"""Validation throughput: images/s of val.evaluate (model + NMS + matching + AP) on coco128(-seg).

    python bench/bench_val.py [--device cpu] [--sizes 320 640] [--tasks detect segment]
                              [--batch-size 16] [--layouts fp32 "bf16 channels_last"]

Random-weight YOLOv5n models score about 2e-4 at best, so the default --conf-thres 1e-4 makes NMS
keep max_det=300 detections per image, the load a trained model gives at conf 0.001. Layouts: the
model in float32 or under autocast (val.py --amp off / on), contiguous or channels_last (val.py
--amp auto on a CPU with native bf16 is "bf16 channels_last"). Needs ../shared/data.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yolo_min import validator  # noqa: E402
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config  # noqa: E402
from yolo_min.dist import select_device  # noqa: E402
from yolo_min.models import Model, amp_dtype  # noqa: E402

LAYOUTS = {  # name: (--amp, channels_last)
    "fp32": ("off", False),
    "fp32 channels_last": ("off", True),
    "bf16": ("on", False),
    "bf16 channels_last": ("on", True),
}


class FirstBatch(list):
    """A loader's first batch, with its dataset: what evaluate reads (a warm-up)."""

    def __init__(self, loader):
        super().__init__([next(iter(loader))])
        self.dataset = loader.dataset


def val_rates(
    tasks=("detect", "segment"),
    sizes=(320, 640),
    device: str = "",
    batch_size: int = 16,
    workers: int = 2,
    conf_thres: float = 1e-4,
    images: int = 128,
    layouts=("fp32", "bf16 channels_last"),
) -> list[dict]:
    """One row per (task, imgsz, layout): {"task", "imgsz", "layout", "img_s", "seconds", "images",
    "speed"}: speed is val.evaluate's ms per image (preprocess, inference, nms), img_s covers data
    + model + NMS + AP. The layouts of a (task, imgsz) run one after the other on the same data."""
    dev = select_device(device)
    data_root = ROOT.parent / "shared" / "data"
    rows = []
    for task in tasks:
        yaml = "coco128-seg.yaml" if task == "segment" else "coco128.yaml"
        data = load_data_config(str(data_root / yaml))
        torch.manual_seed(0)
        model = Model("yolov5n-seg.yaml" if task == "segment" else "yolov5n.yaml").to(dev).eval()
        for imgsz in sizes:
            kw = dict(task=task, rect=True, batch_size=batch_size, nc=80, verbose=False)
            ds = YOLODataset(data["val"], imgsz=imgsz, **kw)
            ds.im_files, ds.labels = ds.im_files[:images], ds.labels[:images]
            loader, _ = build_dataloader(ds, batch_size, workers, shuffle=False)
            nms = validator.VAL_NMS | dict(conf_thres=conf_thres)
            for layout in layouts:
                amp, channels_last = LAYOUTS[layout]
                dtype = amp_dtype(dev, amp)
                model.to(
                    memory_format=torch.channels_last if channels_last else torch.contiguous_format
                )
                validator.evaluate(model, FirstBatch(loader), nms, amp=dtype)  # warm-up
                t = time.perf_counter()
                res = validator.evaluate(model, loader, nms, amp=dtype)
                dt = time.perf_counter() - t
                row = dict(task=task, imgsz=imgsz, layout=layout, img_s=res["images"] / dt)
                rows.append(row | dict(seconds=dt, images=res["images"], speed=res["speed"]))
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
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args()
    dev, threads = select_device(args.device), torch.get_num_threads()
    print(f"device {dev}, torch {torch.__version__}, threads {threads}, conf {args.conf_thres}")
    kw = dict(batch_size=args.batch_size, workers=args.workers, conf_thres=args.conf_thres)
    kw |= dict(images=args.images, layouts=args.layouts)
    for r in val_rates(args.tasks, args.sizes, args.device, **kw):
        s, dt, n = r["speed"], r["seconds"], r["images"]
        rest = 1000 * dt / n - sum(s.values())
        ms = f"pre {s['preprocess']:.1f}, model {s['inference']:.1f}, NMS {s['nms']:.1f}"
        print(
            f"{r['task']:8s} {r['imgsz']:4d} {r['layout']:18s}: {r['img_s']:7.1f} images/s "
            f"({dt:.1f}s for {n} images; ms/image: {ms}, data+matching+AP {rest:.1f})"
        )


if __name__ == "__main__":
    main()
