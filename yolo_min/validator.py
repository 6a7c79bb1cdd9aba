"""Validation: COCO-exact box (and mask) mAP, or top-1/5 accuracy. `evaluate` is the loop that
training runs every epoch on every rank; `main` validates a checkpoint (val.py, `YOLO.val`),
sharded over the ranks under torchrun."""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torchvision.ops import box_convert

from . import datasets, dist, metrics, ops, plots
from .checkpoint import next_run_dir
from .cli import ConfigError, is_kind, parse_kwargs
from .models import amp_dtype, de_parallel, make_divisible
from .safe_load import load_model

# the official COCO category ids of the 80 YOLO classes (COCO numbers 91, 11 of them unused)
COCO91_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
# masks assembled at once at full resolution (bounds memory)
MASK_CHUNK = 32
AMP_HELP = "auto: fp16 on CUDA, bf16 on a CPU with it (predict.py: fp32); on; off: exact fp32"
# yolov5's val.py
VAL_NMS = {"conf_thres": 0.001, "iou_thres": 0.6, "multi_label": True, "max_det": 300}
# the "speed" of evaluate and predict, ms per image
STAGES = ("preprocess", "inference", "nms")
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


def preprocess(images, device, normalize=False):
    """uint8 (or float 0-255) (bs, 3, H, W) -> float in [0, 1] on the device (normalize:
    ImageNet-standardised)."""
    x = images.to(device, non_blocking=True).float() / 255
    if normalize:
        return TF.normalize(x, datasets.IMAGENET_MEAN, datasets.IMAGENET_STD)
    return x


def score_image(dataset, index, det, shape, input_hw, protos, cat_ids):
    """metrics.image_record of det (n, 6+nm) [xyxy input px, conf, cls, coefs], shape (orig_hw,
    ratio_pad), protos (nm, H/4, W/4) or None; "json": COCO results if cat_ids (an id per class)."""
    gt = dataset.ground_truth(index)
    orig_hw, ratio_pad = shape
    boxes = ops.scale_boxes(det[:, :4], ratio_pad, orig_hw)
    gt_boxes = gt["boxes"].to(det.device, torch.float64)
    ious = {"box": ops.box_iou(boxes.double(), gt_boxes).cpu().numpy()}
    # COCO's results format
    found = []
    if cat_ids:
        stem = Path(dataset.im_files[index]).stem
        image_id = int(stem) if stem.isnumeric() else stem
        # [x, y, w, h] from the top left corner
        xywh = box_convert(boxes, "xyxy", "xywh").tolist()
        found = [
            {
                "image_id": image_id,
                "category_id": cat_ids[int(cls)],
                "bbox": [round(v, 3) for v in box],
                "score": round(score, 5),
            }
            for box, (score, cls) in zip(xywh, det[:, 4:6].tolist())
        ]
    if protos is not None:
        gt_masks = ops.polygons_to_masks(gt["polygons"], orig_hw).to(det.device)
        # masks reach a prototype pixel (4 input px) out of their boxes
        pad = 1 + 4 / min(ratio_pad[0])
        grown = boxes + boxes.new_tensor([-pad, -pad, pad, pad])
        near = ops.box_iou(grown, gt_boxes.to(boxes)) > 0
        same = det[:, 5:6].long() == gt["cls"].to(det.device)
        # a mask overlaps only what its grown box does: the others' IoU stays 0 (the json needs
        # every mask, though)
        wanted = (near & same).any(1) | (cat_ids is not None)
        iou = gt_boxes.new_zeros(len(det), len(gt_masks))
        for idx in wanted.nonzero().squeeze(1).split(MASK_CHUNK):
            masks = ops.process_mask(protos, det[idx], input_hw)
            masks = ops.scale_masks(masks, ratio_pad, orig_hw)
            iou[idx] = ops.mask_iou(masks, gt_masks)
            if cat_ids:
                for i, mask in zip(idx.tolist(), masks):
                    found[i]["segmentation"] = ops.rle_encode(mask)
        ious["mask"] = iou.cpu().numpy()
    record = metrics.image_record(
        index, det[:, 4].cpu(), det[:, 5].cpu(), gt_cls=gt["cls"], ious=ious
    )
    return record | {"json": found}


@torch.no_grad()
def evaluate(model, loader, nms=VAL_NMS, plots_dir=None, save_json=None, coco_ids=False, amp=None):
    """metrics.summarize(_classes) of all ranks (call it on each) and "speed" (ms by STAGES); rank 0
    draws 3 batches in plots_dir, writes COCO results to save_json (ids cls + 1, or COCO-91)."""
    model = de_parallel(model)
    was_training = model.training
    classify = model.task == "classify"
    model.eval()
    records = []
    times = np.zeros(3)
    # the COCO category id of each class, for the json
    cat_ids = None
    if save_json:
        cat_ids = COCO91_IDS if coco_ids else range(1, model.nc + 1)
    for batch_index, batch in enumerate(loader):
        dets, protos, seconds = infer(model, batch["images"], nms, amp)
        times += seconds
        if classify:
            # top-k and the loss of each image
            logits = dets.cpu()
            labels = batch["targets"][:, 1]
            losses = F.cross_entropy(logits, labels, reduction="none")
            records += metrics.class_records(batch["indices"], logits, labels, losses)
            continue
        input_hw = batch["images"].shape[2:]
        per_image = zip(batch["indices"].tolist(), dets, batch["shapes"], protos)
        for index, det, shape, proto in per_image:
            records.append(
                score_image(
                    loader.dataset,
                    index,
                    det,
                    shape=shape,
                    input_hw=input_hw,
                    protos=proto,
                    cat_ids=cat_ids,
                )
            )
        if plots_dir is not None and batch_index < 3 and dist.is_main():
            prefix = Path(plots_dir) / f"val_batch{batch_index}"
            plot_batch(batch, dets, protos, prefix=prefix, names=model.names)
    # The pictures drawn in the background are written before evaluate returns.
    plots.finish_drawing()
    records = metrics.merge_records(dist.all_gather_object(records))
    if classify:
        results = metrics.summarize_classes(records)
    else:
        results = metrics.summarize(records, metrics.KINDS[model.task])
    # the mean over every rank's images (one record each): the same dict on every rank
    times = sum(dist.all_gather_object(times))
    per_image_ms = times * 1000 / max(len(records), 1)
    results["speed"] = dict(zip(STAGES, per_image_ms.tolist()))
    if save_json and dist.is_main():
        found = [result for record in records for result in record["json"]]
        Path(save_json).write_text(json.dumps(found))
    model.train(was_training)
    return results


def infer(model, images, nms, amp):
    """An eval-mode Model on uint8 images (bs, 3, H, W) -> (float logits (bs, nc) of a classifier,
    else NMS's detections per image; each image's prototypes (nm, H/4, W/4) or None; seconds)."""
    device = next(model.parameters()).device
    classify = model.task == "classify"
    # a Detect head has no mask coefficients (nm 0), a Classify head none at all
    nm = 0 if classify else model.head.nm
    start = now(device)
    x = preprocess(images, device, classify)
    preprocessed = now(device)
    with torch.autocast(device.type, amp, enabled=amp is not None):
        out = model(x)
    # a segmentation model also gives each image's mask prototypes
    preds, protos = out if nm else (out, [None] * len(x))
    inferred = now(device)
    # a classifier's logits, else NMS's detections
    dets = preds.float() if classify else ops.non_max_suppression(preds.float(), nm=nm, **nms)
    seconds = np.array([preprocessed - start, inferred - preprocessed, now(device) - inferred])
    return dets, protos, seconds


def now(device):
    """time.perf_counter() once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def round_imgsz(imgsz, stride):
    """imgsz rounded up to a multiple of the stride, with a warning (rank 0) if that changes it."""
    size = make_divisible(imgsz, stride)
    if size != imgsz:
        dist.print0(f"warning: --imgsz {imgsz} is not a multiple of {stride}, using {size}")
    return size


def speed_line(speed, at):
    """yolov5's "Speed: ..." line of ms per image by STAGES."""
    stages = zip(STAGES, ("pre-process", "inference", "NMS"))
    times = ", ".join(f"{speed[key]:.1f}ms {stage}" for key, stage in stages)
    return f"Speed: {times} per image at {at}"


def plot_batch(batch, dets, protos, prefix, names):
    """A batch's labels and predictions (conf >= 0.25): prefix_labels.jpg, prefix_pred.jpg."""
    images = batch["images"]
    plots.draw_later(
        images, batch["targets"], batch["masks"], fname=f"{prefix}_labels.jpg", names=names
    )
    preds = [det[det[:, 4] >= 0.25] for det in dets]
    masks = None
    if protos[0] is not None:
        input_hw = images.shape[2:]
        pairs = zip(protos, preds)
        masks = [ops.process_mask(proto, det, input_hw) for proto, det in pairs]
    plots.draw_later(images, preds=preds, masks=masks, fname=f"{prefix}_pred.jpg", names=names)


def format_table(res, names, verbose=False):
    """yolov5-style results table: all classes (and each class with verbose)."""
    # classify: images only
    counts = [c for c in ("images", "instances") if c in res]
    columns = [c for c in res["metrics"] if c != "val_loss"]
    head = f"{'Class':>20}" + "".join(f"{c.capitalize():>11}" for c in counts)
    lines = [head + "".join(f"{c:>13}" for c in columns)]
    rows = [("all", res | res["metrics"])]
    if verbose:
        rows += [(names[values["class"]], values) for values in res["per_class"]]
    for name, values in rows:
        counted = "".join(f"{values[c]:>11}" for c in counts)
        numbers = "".join(f"{values[c]:>13.3g}" for c in columns)
        lines.append(f"{name:>20}{counted}{numbers}")
    return "\n".join(lines)


def check_options(options):
    """ConfigError (TypeError for a value that is no number) naming the first option of LIMITS in
    options that is out of its range; NaN is out of every range, None (not given) is skipped."""
    for name, (kind, low, high) in LIMITS.items():
        value = options.get(name)
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        # a bool is an int to Python, not a number to the user
        if not is_kind(value, kind):
            raise TypeError(f"{flag} {value!r:.60}: expected {kind.__name__}")
        # NaN compares false with everything: the range test written to fail for it
        if not (low <= value and (high is None or value <= high)):
            bounds = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
            raise ConfigError(f"{flag} {value}: must be {bounds}")


def base_parser(description, nms, project):
    """The options of val.py and predict.py; nms: the defaults of conf_thres, iou_thres, max_det."""
    # No abbreviations: the Python API takes only whole names, and so does the command line.
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add = parser.add_argument
    add("--weights", required=True, help="yolo_min checkpoint or yolov5 .pt")
    add(
        "--imgsz",
        type=int,
        default=640,
        help="long side, 32 to 8192 (rounded up to a multiple of the stride)",
    )
    add("--conf-thres", type=float, default=nms["conf_thres"], help="0 to 1")
    add("--iou-thres", type=float, default=nms["iou_thres"], help="NMS IoU, 0 to 1")
    add("--max-det", type=int, default=nms["max_det"], help="per image, >= 1")
    add("--device", default="", help="cpu, 0, cuda:1 (default: cuda if available)")
    add("--amp", choices=["auto", "on", "off"], default="auto", help=AMP_HELP)
    add("--project", default=project)
    add("--name", default="exp")
    add("--exist-ok", action="store_true")
    return parser


def get_args_parser():
    parser = base_parser("Validate a checkpoint (COCO-exact mAP)", VAL_NMS, "runs/val")
    add = parser.add_argument
    add("--data", required=True, help="dataset yaml, or 'shapes'")
    add("--batch-size", type=int, default=32, help="per rank, >= 1")
    add("--workers", type=int, default=4, help=">= 0")
    switches = {
        "--save-json": "write predictions.json",
        "--coco-ids": "COCO-91 ids in predictions.json",
        "--plots": "save label/prediction images",
        "--verbose": "per-class table",
    }
    add_switches(parser, switches)
    return parser


def add_switches(parser, switches):
    """A store_true option for each flag of switches, with its help text (None: none)."""
    for flag, text in switches.items():
        parser.add_argument(flag, action="store_true", help=text)


def main(args, model=None):
    """Validate the model (YOLO.val), else --weights; rank 0 prints the table and writes
    metrics.json. Returns evaluate's metrics."""
    # before the process group and the model: a bad number costs nothing
    check_options(vars(args))
    info = dist.setup(args.device)
    try:
        amp = amp_dtype(info.device, args.amp)
        # faster under autocast
        layout = torch.channels_last if amp else torch.contiguous_format
        if model is None:
            model = load_model(args.weights, info.device)
        model = model.to(info.device, memory_format=layout)
        imgsz = round_imgsz(args.imgsz, model.max_stride)
        loader = build_loader(args, model, imgsz=imgsz, info=info)
        save_dir = dist.run_on_main(next_run_dir, args.project, args.name, args.exist_ok)
        save_dir.mkdir(parents=True, exist_ok=True)
        nms = {"conf_thres": args.conf_thres, "iou_thres": args.iou_thres, "max_det": args.max_det}
        results = evaluate(
            model,
            loader,
            VAL_NMS | nms,
            plots_dir=save_dir if args.plots else None,
            save_json=save_dir / "predictions.json" if args.save_json else None,
            coco_ids=args.coco_ids,
            amp=amp,
        )
        if info.rank == 0:
            print(format_table(results, model.names, args.verbose))
            print(speed_line(results["speed"], f"{imgsz}"))
            summary = {k: v for k, v in results.items() if k != "per_class"}
            (save_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
            print(f"Results saved to {save_dir}")
        return results
    finally:
        dist.cleanup()


def build_loader(args, model, imgsz, info):
    """A loader of this rank's shard of --data's val split, the data checked against the model
    (task, classes) first; the model takes the data's class names."""
    verbose = info.rank == 0
    # local rank 0 verifies the labels and writes their cache first
    with dist.main_first():
        data = datasets.load_data_config(args.data)
        datasets.check_task(data, model.task)
        if model.nc != data["nc"]:
            source = args.weights or "the model"
            raise ValueError(f"{source}: {model.nc} classes, {args.data}: {data['nc']}")
        if args.coco_ids and data["nc"] != 80:
            raise ValueError(f"--coco-ids: {args.data} does not have the 80 COCO classes")
        if model.task == "classify":
            dataset = datasets.ClassifyDataset(data["val"][0], imgsz, verbose=verbose)
        else:
            dataset = datasets.YOLODataset(
                data["val"],
                imgsz,
                task=model.task,
                rect=True,
                batch_size=args.batch_size,
                stride=model.max_stride,
                nc=data["nc"],
                verbose=verbose,
                local_world_size=info.local_world_size,
            )
        if model.task == "segment":
            dataset.check_polygons()
    model.names = data["names"]
    loader, _ = datasets.build_dataloader(
        dataset,
        args.batch_size,
        workers=args.workers,
        shuffle=False,
        rank=info.rank,
        world_size=info.world_size,
        local_world_size=info.local_world_size,
    )
    return loader


def run(**kwargs):
    """val.py from Python: `val.run(weights="best.pt", data="coco128.yaml")` returns main's."""
    return main(parse_kwargs(get_args_parser(), kwargs))
