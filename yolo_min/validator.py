"""Validation: COCO-exact box (and mask) mAP, or top-1/5 accuracy. `evaluate` is the loop that
training runs every epoch on every rank; `main` validates a checkpoint (val.py, `YOLO.val`),
sharded over the ranks under torchrun."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from . import datasets, dist, metrics, ops, plots
from .checkpoint import next_run_dir
from .cli import ConfigError, parse_kwargs
from .models import amp_dtype, de_parallel, make_divisible
from .safe_load import load_model

# the official COCO category ids of the 80 YOLO classes (COCO numbers 91, 11 of them unused)
COCO91_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
MASK_CHUNK = 32  # masks assembled at once at full resolution (bounds memory)
AMP_HELP = "auto: fp16 on CUDA, bf16 on a CPU with it (predict.py: fp32); on; off: exact fp32"
VAL_NMS = dict(conf_thres=0.001, iou_thres=0.6, multi_label=True, max_det=300)  # yolov5's val.py
STAGES = ("preprocess", "inference", "nms")  # the "speed" of evaluate and predict, ms per image
# the numeric options of val.py and predict.py: (type, lowest, highest or None for no bound)
LIMITS = {
    "imgsz": (int, 32, 8192),
    "batch_size": (int, 1, None),
    "workers": (int, 0, None),
    "max_det": (int, 1, None),
    "conf_thres": (float, 0.0, 1.0),
    "iou_thres": (float, 0.0, 1.0),
    "line_width": (int, 1, None),
}


def preprocess(images: torch.Tensor, device: torch.device, normalize=False) -> torch.Tensor:
    """uint8 (bs, 3, H, W) -> float in [0, 1] on the device (normalize: ImageNet-standardised)."""
    x = images.to(device, non_blocking=True).float() / 255
    return TF.normalize(x, datasets.IMAGENET_MEAN, datasets.IMAGENET_STD) if normalize else x


def score_image(dataset, index: int, det, shape, input_hw, protos=None, cat_ids=None) -> dict:
    """metrics.image_record of det (n, 6+nm) [xyxy input px, conf, cls, coefs], shape (orig_hw,
    ratio_pad), protos (nm, H/4, W/4) or None; "json": COCO results if cat_ids (an id per class)."""
    gt, (orig_hw, ratio_pad) = dataset.ground_truth(index), shape
    boxes = ops.scale_boxes(det[:, :4], ratio_pad, orig_hw)
    gt_boxes = gt["boxes"].to(det.device, torch.float64)
    ious = {"box": ops.box_iou(boxes.double(), gt_boxes).cpu().numpy()}
    found = []  # COCO's results format
    if cat_ids:
        stem = Path(dataset.im_files[index]).stem
        image_id = int(stem) if stem.isnumeric() else stem
        xywh = torch.cat((boxes[:, :2], boxes[:, 2:] - boxes[:, :2]), 1).cpu().tolist()
        for b, score, c in zip(xywh, det[:, 4].tolist(), det[:, 5].tolist()):
            res = {"image_id": image_id, "category_id": cat_ids[int(c)]}
            found.append(res | {"bbox": [round(v, 3) for v in b], "score": round(score, 5)})
    if protos is not None:
        gt_masks = ops.polygons_to_masks(gt["polygons"], orig_hw).to(det.device)
        pad = 1 + 4 / min(ratio_pad[0])  # masks reach a prototype pixel (4 input px) out of boxes
        near = ops.box_iou(boxes + boxes.new_tensor([-pad, -pad, pad, pad]), gt_boxes.to(boxes)) > 0
        same = det[:, 5:6].long() == gt["cls"].to(det.device)
        want = (near & same).any(1) | (cat_ids is not None)
        iou = torch.zeros(len(det), len(gt_masks), dtype=torch.float64, device=det.device)
        for idx in want.nonzero().squeeze(1).split(MASK_CHUNK):
            masks = ops.process_mask(protos, det[idx, 6:], det[idx, :4], input_hw)
            masks = ops.scale_masks(masks, ratio_pad, orig_hw)
            iou[idx] = ops.mask_iou(masks, gt_masks)
            for i, m in zip(idx.tolist(), masks) if cat_ids else ():
                found[i]["segmentation"] = ops.rle_encode(m)
        ious["mask"] = iou.cpu().numpy()
    rec = metrics.image_record(index, det[:, 4].cpu(), det[:, 5].cpu(), gt["cls"], ious)
    return rec | {"json": found}


@torch.no_grad()
def evaluate(model, loader, nms=VAL_NMS, plots_dir=None, save_json=None, coco_ids=False, amp=None):
    """metrics.summarize(_classes) of all ranks (call it on each) and "speed" (ms by STAGES); rank 0
    draws 3 batches in plots_dir, writes COCO results to save_json (ids cls + 1, or COCO-91)."""
    model = de_parallel(model)
    was_training, classify = model.training, model.task == "classify"
    model.eval()
    records, seen, times = [], 0, np.zeros(3)
    cat_ids = (COCO91_IDS if coco_ids else range(1, model.nc + 1)) if save_json else None
    for bi, batch in enumerate(loader):
        dets, protos, seconds = infer(model, batch["images"], nms, amp)
        times, seen = times + seconds, seen + len(dets)
        if classify:  # top-k and the loss of each image
            logits, labels = dets.cpu(), batch["targets"][:, 1]
            losses = F.cross_entropy(logits, labels, reduction="none")
            records += metrics.class_records(batch["indices"], logits, labels, losses)
            continue
        hw = batch["images"].shape[2:]
        for i, det, shape, proto in zip(batch["indices"].tolist(), dets, batch["shapes"], protos):
            records.append(score_image(loader.dataset, i, det, shape, hw, proto, cat_ids))
        if plots_dir is not None and bi < 3 and dist.is_main():
            plot_batch(batch, dets, protos, Path(plots_dir) / f"val_batch{bi}", model.names)
    # the pictures drawn in the background are written before evaluate returns
    plots.finish_drawing()
    records = metrics.merge_records(dist.all_gather_object(records))
    kinds = metrics.KINDS[model.task]
    res = metrics.summarize_classes(records) if classify else metrics.summarize(records, kinds)
    # the mean over every rank's images: the same dict on every rank
    timings = dist.all_gather_object((times, seen))
    times = sum(t for t, _ in timings)
    seen = sum(n for _, n in timings)
    res["speed"] = dict(zip(STAGES, (times * 1000 / max(seen, 1)).tolist()))
    if save_json and dist.is_main():
        Path(save_json).write_text(json.dumps([d for r in records for d in r["json"]]))
    model.train(was_training)
    return res


def infer(model, images: torch.Tensor, nms: dict, amp=None) -> tuple:
    """An eval-mode Model on uint8 images (bs, 3, H, W) -> (float logits (bs, nc) of a classifier,
    else NMS's detections per image; each image's prototypes (nm, H/4, W/4) or None; seconds)."""
    device, classify = next(model.parameters()).device, model.task == "classify"
    nm = model.head.nm if model.task == "segment" else 0
    t0 = now(device)
    x = preprocess(images, device, classify)
    t1 = now(device)
    with torch.autocast(device.type, amp, enabled=amp is not None):
        out = model(x)
    preds, protos = out if nm else (out, [None] * len(x))
    t2 = now(device)
    dets = preds.float() if classify else ops.non_max_suppression(preds.float(), nm=nm, **nms)
    return dets, protos, np.array([t1 - t0, t2 - t1, now(device) - t2])


def now(device: torch.device) -> float:
    """time.perf_counter() once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def round_imgsz(imgsz: int, stride: int) -> int:
    """imgsz rounded up to a multiple of the stride, with a warning (rank 0) if that changes it."""
    size = make_divisible(imgsz, stride)
    if size != imgsz:
        dist.print0(f"warning: --imgsz {imgsz} is not a multiple of {stride}, using {size}")
    return size


def speed_line(speed: dict, at: str) -> str:
    """yolov5's "Speed: ..." line of ms per image by STAGES."""
    stages = zip(STAGES, ("pre-process", "inference", "NMS"))
    return "Speed: " + ", ".join(f"{speed[k]:.1f}ms {s}" for k, s in stages) + f" per image at {at}"


def plot_batch(batch: dict, dets: list, protos, prefix: Path, names: list) -> None:
    """A batch's labels and predictions (conf >= 0.25): prefix_labels.jpg, prefix_pred.jpg."""
    images, kw = batch["images"], dict(names=names)
    plots.draw_later(images, batch["targets"], batch["masks"], fname=f"{prefix}_labels.jpg", **kw)
    preds = [d[d[:, 4] >= 0.25] for d in dets]
    if protos[0] is not None:
        hw = images.shape[2:]
        kw["masks"] = [ops.process_mask(q, p[:, 6:], p[:, :4], hw) for q, p in zip(protos, preds)]
    plots.draw_later(images, preds=preds, fname=f"{prefix}_pred.jpg", **kw)


def format_table(res: dict, names: list[str], verbose: bool = False) -> str:
    """yolov5-style results table: all classes (and each class with verbose)."""
    counts = [c for c in ("images", "instances") if c in res]  # classify: images
    cols = [c for c in res["metrics"] if c != "val_loss"]
    head = f"{'Class':>20}" + "".join(f"{c.capitalize():>11}" for c in counts)

    def row(name, values: dict) -> str:
        numbers = "".join(f"{values[c]:>13.3g}" for c in cols)
        return f"{name:>20}" + "".join(f"{values[c]:>11}" for c in counts) + numbers

    lines = [head + "".join(f"{c:>13}" for c in cols), row("all", res | res["metrics"])]
    lines += [row(names[pc["class"]], pc) for pc in res["per_class"]] if verbose else []
    return "\n".join(lines)


def check_options(options: dict) -> None:
    """ConfigError (TypeError for a value that is no number) naming the first option of LIMITS in
    options that is out of its range; NaN is out of every range, None (not given) is skipped."""
    for name, (kind, low, high) in LIMITS.items():
        value = options.get(name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        # a bool is an int to Python, not a number to the user
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (kind is int and not isinstance(value, int)):
            raise TypeError(f"{flag} {value!r:.60}: expected {kind.__name__}")
        # NaN compares false with everything: the range test written to fail for it
        in_range = low <= value and (high is None or value <= high)
        if not in_range:
            bounds = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
            raise ConfigError(f"{flag} {value}: must be {bounds}")


def base_parser(description: str, nms: dict, project: str) -> argparse.ArgumentParser:
    """The options of val.py and predict.py; nms: the defaults of conf_thres, iou_thres, max_det."""
    # No abbreviations: the Python API takes only whole names, and so does the command line.
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--weights", required=True, help="yolo_min checkpoint or yolov5 .pt")
    size = "long side, 32 to 8192 (rounded up to a multiple of the stride)"
    p.add_argument("--imgsz", type=int, default=640, help=size)
    p.add_argument("--conf-thres", type=float, default=nms["conf_thres"], help="0 to 1")
    p.add_argument("--iou-thres", type=float, default=nms["iou_thres"], help="NMS IoU, 0 to 1")
    p.add_argument("--max-det", type=int, default=nms["max_det"], help="per image, >= 1")
    p.add_argument("--device", default="", help="cpu, 0, cuda:1 (default: cuda if available)")
    p.add_argument("--amp", choices=["auto", "on", "off"], default="auto", help=AMP_HELP)
    p.add_argument("--project", default=project)
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true")
    return p


def get_args_parser() -> argparse.ArgumentParser:
    p = base_parser("Validate a checkpoint (COCO-exact mAP)", VAL_NMS, "runs/val")
    p.add_argument("--data", required=True, help="dataset yaml, or 'shapes'")
    p.add_argument("--batch-size", type=int, default=32, help="per rank, >= 1")
    p.add_argument("--workers", type=int, default=4, help=">= 0")
    p.add_argument("--save-json", action="store_true", help="write predictions.json")
    p.add_argument("--coco-ids", action="store_true", help="COCO-91 ids in predictions.json")
    p.add_argument("--plots", action="store_true", help="save label/prediction images")
    p.add_argument("--verbose", action="store_true", help="per-class table")
    return p


def main(args: argparse.Namespace, model=None) -> dict:
    """Validate the model (YOLO.val), else --weights; rank 0 prints the table and writes
    metrics.json. Returns evaluate's metrics."""
    # before the process group and the model: a bad number costs nothing
    check_options(vars(args))
    info = dist.setup(args.device)
    try:
        amp = amp_dtype(info.device, args.amp)
        layout = torch.channels_last if amp else torch.contiguous_format  # faster under autocast
        if model is None:
            model = load_model(args.weights, info.device)
        model = model.to(info.device, memory_format=layout)
        source = args.weights or "the model"
        imgsz = round_imgsz(args.imgsz, int(model.stride.max()))
        local = dict(local_world_size=info.local_world_size)
        with dist.main_first():  # local rank 0 verifies the labels and writes their cache first
            data = datasets.load_data_config(args.data)
            datasets.check_task(data, model.task)
            if model.nc != data["nc"]:
                raise ValueError(f"{source}: {model.nc} classes, {args.data}: {data['nc']}")
            if args.coco_ids and data["nc"] != 80:
                raise ValueError(f"--coco-ids: {args.data} does not have the 80 COCO classes")
            if model.task == "classify":
                dataset = datasets.ClassifyDataset(data["val"][0], imgsz, verbose=info.rank == 0)
            else:
                kw = dict(task=model.task, stride=int(model.stride.max()), nc=data["nc"])
                kw |= dict(rect=True, batch_size=args.batch_size, verbose=info.rank == 0)
                dataset = datasets.YOLODataset(data["val"], imgsz, **kw, **local)
            if model.task == "segment":
                dataset.check_polygons()
        model.names = data["names"]
        kw = dict(workers=args.workers, shuffle=False, rank=info.rank, world_size=info.world_size)
        loader, _ = datasets.build_dataloader(dataset, args.batch_size, **kw, **local)
        save_dir = dist.run_on_main(next_run_dir, args.project, args.name, args.exist_ok)
        save_dir.mkdir(parents=True, exist_ok=True)
        nms = dict(conf_thres=args.conf_thres, iou_thres=args.iou_thres, max_det=args.max_det)
        kw = dict(plots_dir=save_dir if args.plots else None, coco_ids=args.coco_ids)
        kw |= dict(save_json=save_dir / "predictions.json" if args.save_json else None)
        res = evaluate(model, loader, VAL_NMS | nms, amp=amp, **kw)
        if info.rank == 0:
            print(format_table(res, data["names"], args.verbose))
            print(speed_line(res["speed"], f"{imgsz}"))
            summary = {k: v for k, v in res.items() if k != "per_class"}
            (save_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
            print(f"Results saved to {save_dir}")
        return res
    finally:
        dist.cleanup()


def run(**kwargs) -> dict:
    """val.py from Python: `val.run(weights="best.pt", data="coco128.yaml")` returns main's."""
    return main(parse_kwargs(get_args_parser(), kwargs))
