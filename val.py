"""Validate a yolo_min or yolov5 checkpoint on a YOLO dataset: COCO-exact box (and mask) mAP.

    python val.py --weights best.pt --data coco128.yaml --imgsz 640
    torchrun --nproc_per_node 2 val.py --weights best.pt --data coco128-seg.yaml   # images sharded over ranks

Also holds `evaluate(...)`, the loop train.py calls on every rank with the EMA model, and
`format_table(...)`. Matching and AP live in yolo_min/metrics.py, NMS and mask helpers in yolo_min/ops.py.
Writes metrics.json (and predictions.json with --save-json, COCO results format) in the save dir.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from yolo_min import dist
from yolo_min.metrics import gather_records, image_record, summarize
from yolo_min.models import de_parallel, load_model, make_divisible
from yolo_min.ops import (box_iou, mask_iou, non_max_suppression, polygons_to_masks, process_mask, rle_encode,
                          scale_boxes, scale_masks)

# official COCO category ids of the 80 YOLO classes (COCO numbers 91 ids, 11 of them unused)
COCO91_IDS = [*range(1, 12), *range(13, 26), 27, 28, *range(31, 45), *range(46, 66), 67, 70, *range(72, 83),
              *range(84, 91)]
MASK_CHUNK = 32  # masks assembled at once per image (bounds memory at full resolution)


def _image_id(path: str) -> int | str:
    stem = Path(path).stem
    return int(stem) if stem.isnumeric() else stem


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def score_image(index: int, det: torch.Tensor, gt: dict, shape, input_hw: tuple[int, int],
                protos: torch.Tensor | None = None, json_meta: dict | None = None) -> dict:
    """Match one image's detections to its ground truth; returns a metrics.image_record.

    det (n, 6+nm) [x1, y1, x2, y2 (input pixels), conf, cls, coefs...] from NMS; gt from
    dataset.ground_truth (boxes xyxy original pixels, polygons original pixels); shape = (orig_hw, ratio_pad).
    protos (nm, H/4, W/4) for segmentation. Masks are scored at original resolution, and only for
    detections near a GT box of their class (others cannot overlap) unless json_meta asks for every RLE:
    json_meta {"image_id", "coco_ids"} adds record["json"], the image's COCO-format results.
    """
    orig_hw, ratio_pad = shape
    boxes = scale_boxes(det[:, :4], ratio_pad, orig_hw)
    gt_cls = gt["cls"].to(det.device).long()
    ious = {"box": box_iou(boxes.double(), gt["boxes"].to(det.device, torch.float64)).cpu().numpy()}
    rles = [None] * len(det)
    if protos is not None:
        gt_masks = polygons_to_masks(gt["polygons"], orig_hw).to(det.device)
        # masks lie inside their boxes (up to one input pixel): only detections touching a GT box of their
        # class can overlap a GT mask
        pad = 1 + 1 / min(ratio_pad[0])
        near = box_iou(boxes + boxes.new_tensor([-pad, -pad, pad, pad]), gt["boxes"].to(boxes)) > 0
        want = (near & (det[:, 5:6].long() == gt_cls)).any(1) | bool(json_meta)
        iou_m = torch.zeros(len(det), len(gt_cls), dtype=torch.float64, device=det.device)
        for idx in want.nonzero().squeeze(1).split(MASK_CHUNK) if want.any() else ():
            masks = scale_masks(process_mask(protos, det[idx, 6:], det[idx, :4], input_hw), ratio_pad, orig_hw)
            iou_m[idx] = mask_iou(masks, gt_masks)
            if json_meta:
                for i, m in zip(idx.tolist(), masks):
                    rles[i] = rle_encode(m)
        ious["mask"] = iou_m.cpu().numpy()
    rec = image_record(index, det[:, 4].cpu(), det[:, 5].cpu(), gt["cls"].cpu(), ious)
    if json_meta:
        xywh = torch.cat((boxes[:, :2], boxes[:, 2:] - boxes[:, :2]), 1).cpu().tolist()
        cat = COCO91_IDS.__getitem__ if json_meta["coco_ids"] else (lambda c: c + 1)
        rec["json"] = [{"image_id": json_meta["image_id"], "category_id": cat(int(c)),
                        "bbox": [round(v, 3) for v in b], "score": round(float(s), 5),
                        **({"segmentation": r} if r is not None else {})}
                       for b, s, c, r in zip(xywh, det[:, 4].tolist(), det[:, 5].tolist(), rles)]
    return rec


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, dataset, *, conf_thres: float = 0.001, iou_thres: float = 0.6,
             max_det: int = 300, device: str | torch.device | None = None, half: bool = False,
             plots_dir: str | Path | None = None, names: list[str] | None = None,
             save_json: str | Path | None = None, coco_ids: bool = False) -> dict:
    """Score `model` on every image of `loader` (this rank's shard) and return metrics equal on every rank.

    Call it on every rank (it gathers). loader batches: dicts with uint8 `images` (bs, 3, H, W), `shapes`,
    `indices` (and `targets`/`masks` for plots); dataset.ground_truth(index) gives the original-pixel labels.
    Returns {"box": {"P", "R", "mAP50", "mAP50-95"}, "mask": {...} (segment), "images", "instances",
    "fitness", "speed": {"preprocess", "inference", "nms"} ms per image (this rank), "per_class": [...]}.
    save_json: path that rank 0 writes COCO-format predictions to (category ids cls+1, or COCO-91 with coco_ids).
    """
    model = de_parallel(model)
    was_training = model.training
    model.eval()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    segment = model.task == "segment"
    nm = model.model[-1].nm if segment else 0
    records, seen, times = [], 0, np.zeros(3)
    for bi, batch in enumerate(loader):
        t0 = _sync(device)
        images = batch["images"].to(device, non_blocking=True).float() / 255
        t1 = _sync(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=half and device.type == "cuda"):
            out = model(images)
        preds, protos = out if segment else (out, None)
        t2 = _sync(device)
        dets = non_max_suppression(preds.float(), conf_thres, iou_thres, multi_label=True, max_det=max_det, nm=nm)
        times += (t1 - t0, t2 - t1, _sync(device) - t2)
        seen += len(images)
        for j, det in enumerate(dets):
            index = int(batch["indices"][j])
            meta = {"image_id": _image_id(dataset.im_files[index]), "coco_ids": coco_ids} if save_json else None
            records.append(score_image(index, det, dataset.ground_truth(index), batch["shapes"][j],
                                       images.shape[2:], protos[j].float() if segment else None, meta))
        if plots_dir is not None and bi < 3 and dist.is_main():
            _plot(batch, dets, protos, Path(plots_dir), bi, names)
    records = gather_records(records)
    res = summarize(records, ("box", "mask") if segment else ("box",))
    res["speed"] = dict(zip(("preprocess", "inference", "nms"), (times * 1000 / max(seen, 1)).tolist()))
    if save_json and dist.is_main():
        with open(save_json, "w") as f:
            json.dump([d for r in records for d in r["json"]], f)
    model.train(was_training)
    return res


def _plot(batch: dict, dets: list[torch.Tensor], protos, plots_dir: Path, bi: int, names) -> None:
    """Labels and predictions (conf >= 0.25) of one batch, side by side as two JPEG grids."""
    from yolo_min.plots import draw_batch

    preds = [d[d[:, 4] >= 0.25] for d in dets]
    masks = None if protos is None else [process_mask(pr, p[:, 6:], p[:, :4], batch["images"].shape[2:])
                                         for pr, p in zip(protos, preds)]
    kw = dict(paths=batch["paths"], names=names)
    draw_batch(batch["images"], batch["targets"], batch["masks"], fname=plots_dir / f"val_batch{bi}_labels.jpg", **kw)
    draw_batch(batch["images"], masks=masks, preds=[p[:, :6] for p in preds],
               fname=plots_dir / f"val_batch{bi}_pred.jpg", **kw)


def format_table(metrics: dict, names: list[str] | None = None, verbose: bool = False) -> str:
    """yolov5-style results table: all classes (and each class with verbose)."""
    kinds, stats = [k for k in ("box", "mask") if k in metrics], ("P", "R", "mAP50", "mAP50-95")
    cols = [c for k in kinds for c in (f"{k.capitalize()}(P)", *stats[1:])]
    head = f"{'Class':>20}{'Images':>11}{'Instances':>11}" + "".join(f"{c:>11}" for c in cols)

    def row(name, images, inst, m):
        return f"{name:>20}{images:>11}{inst:>11}" + "".join(f"{m[k][c]:>11.3g}" for k in kinds for c in stats)

    lines = [head, row("all", metrics["images"], metrics["instances"], metrics)]
    if verbose:
        for pc in metrics["per_class"]:
            name = names[pc["class"]] if names and pc["class"] < len(names) else str(pc["class"])
            lines.append(row(name, pc["images"], pc["instances"], pc))
    return "\n".join(lines)


def _save_dir(project: str, name: str, exist_ok: bool) -> Path:
    """project/name, or project/name2, name3, ... when it exists (unless exist_ok)."""
    path, n = Path(project) / name, 2
    while path.exists() and not exist_ok:
        path, n = Path(project) / f"{name}{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="yolo_min validation (COCO-exact mAP)")
    p.add_argument("--weights", required=True, help="yolo_min checkpoint or yolov5 .pt")
    p.add_argument("--data", required=True, help="dataset yaml")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--conf-thres", type=float, default=0.001)
    p.add_argument("--iou-thres", type=float, default=0.6, help="NMS IoU")
    p.add_argument("--max-det", type=int, default=300)
    p.add_argument("--device", default="", help="cpu, 0, cuda:1 (default: cuda if available)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--half", action="store_true", help="fp16 autocast inference (CUDA)")
    p.add_argument("--save-json", action="store_true", help="write predictions.json (COCO results)")
    p.add_argument("--coco-ids", action="store_true", help="official COCO-91 category ids in predictions.json")
    p.add_argument("--plots", action="store_true", help="save label/prediction images")
    p.add_argument("--verbose", action="store_true", help="per-class table")
    p.add_argument("--project", default="runs/val")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true")
    return p


def main(args: argparse.Namespace) -> dict:
    from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config

    info = dist.setup(args.device)
    try:
        model = load_model(args.weights, info.device)
        data = load_data_config(args.data)
        if model.nc != data["nc"]:
            raise SystemExit(f"{args.weights}: model has {model.nc} classes but {args.data} has {data['nc']}")
        if args.coco_ids and data["nc"] != 80:
            raise SystemExit(f"--coco-ids needs the 80 COCO classes; {args.data} has {data['nc']}")
        stride = int(model.stride.max())
        imgsz = make_divisible(args.imgsz, stride)
        dataset = YOLODataset(data["val"], imgsz=imgsz, augment=False, task=model.task, rect=True,
                              batch_size=args.batch_size, stride=stride, pad=0.5, prefix="val: ", nc=data["nc"])
        if model.task == "segment" and not any(len(lb["segments"]) for lb in dataset.labels):
            raise SystemExit(f"{args.data}: a segmentation model needs polygon labels, the val labels hold boxes only")
        loader, _ = build_dataloader(dataset, args.batch_size, args.workers, shuffle=False,
                                     rank=info.rank, world_size=info.world_size)
        save_dir = _save_dir(args.project, args.name, args.exist_ok) if info.is_main else None
        save_dir = Path(dist.broadcast_object(str(save_dir)))
        metrics = evaluate(model, loader, dataset, conf_thres=args.conf_thres, iou_thres=args.iou_thres,
                           max_det=args.max_det, device=info.device, half=args.half,
                           plots_dir=save_dir if args.plots else None, names=data["names"],
                           save_json=save_dir / "predictions.json" if args.save_json else None,
                           coco_ids=args.coco_ids)
        if info.is_main:
            print(format_table(metrics, data["names"], args.verbose))
            s = metrics["speed"]
            print(f"Speed: {s['preprocess']:.1f}ms pre-process, {s['inference']:.1f}ms inference, {s['nms']:.1f}ms NMS "
                  f"per image at {imgsz} (rank 0)")
            keep = {k: metrics[k] for k in ("box", "mask", "images", "instances", "fitness", "speed") if k in metrics}
            (save_dir / "metrics.json").write_text(json.dumps(keep, indent=2))
            print(f"Results saved to {save_dir}")
        return metrics
    finally:
        dist.cleanup()


if __name__ == "__main__":
    try:
        main(get_args_parser().parse_args())
    except (ValueError, OSError) as e:  # a bad or refused weights file, a bad data file: one line, no traceback
        sys.exit(f"val.py: error: {str(e).splitlines()[0]}")
