"""Box and mask AP exactly as COCOeval (areaRng "all", maxDets >= detections, no crowds; score ties
by dataset index, then order), and top-k accuracy, from small per-image records keyed by index."""

import numpy as np

# float64, bit-equal to COCOeval's iouThrs.
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
# COCOeval's recThrs.
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
# The confidences scanned for the max-mean-F1 point.
CONF_GRID = np.linspace(0.0, 1.0, 1000)
# Metric names: "mAP50(B)", "mAP50-95(M)", ...
SUFFIX = {"box": "B", "mask": "M"}
# What each task scores.
KINDS = {
    "detect": ("box",),
    "segment": ("box", "mask"),
    "classify": ("class",),
}
# ap_per_class's metrics, in the order summarize names them.
AP_METRICS = ("P", "R", "mAP50", "mAP50-95")


def match_predictions(iou, conf, pred_cls, gt_cls):
    """COCO's greedy matching: iou (n, m), conf (n,), pred_cls (n,), gt_cls (m,) -> tp (n, T) bool;
    by descending conf, each takes its class's free ground truth of top IoU >= t (ties: last)."""
    thresholds = IOU_THRESHOLDS[:, None]
    levels = np.arange(len(IOU_THRESHOLDS))
    tp = np.zeros((len(iou), len(levels)), bool)
    # A prediction only matches ground truth of its class. The ground truths reversed, so that
    # argmax (the first best) finds the last best one.
    same_class = pred_cls[:, None] == gt_cls
    iou = np.where(same_class, iou, -1.0)[:, ::-1]
    # Per threshold, the (reversed) ground truths not matched yet.
    free = np.ones((len(levels), iou.shape[1]), bool)
    order = np.argsort(-conf, kind="stable")
    # Only the predictions with an IoU over the lowest threshold can match anything.
    best_iou = iou[order].max(1, initial=-1.0)
    for pred in order[best_iou >= thresholds[0]]:
        pred_iou = iou[pred]
        candidates = np.where(free & (pred_iou >= thresholds), pred_iou, -1.0)
        best = candidates.argmax(1)
        hit = candidates[levels, best] >= 0
        tp[pred, hit] = True
        free[levels[hit], best[hit]] = False
    return tp


def image_record(index, conf, pred_cls, gt_cls, ious):
    """What AP needs from one image: conf (n,), pred_cls (n,), gt_cls (m,), ious {"box" and/or
    "mask": (n, m) float64} -> {"index", "conf", "cls", "gt_cls", "tp": {kind: (n, T) bool}}."""
    conf = np.asarray(conf, np.float64)
    pred_cls = np.asarray(pred_cls, np.int64)
    gt_cls = np.asarray(gt_cls, np.int64)
    return {
        "index": int(index),
        "conf": conf,
        "cls": pred_cls,
        "gt_cls": gt_cls,
        "tp": {kind: match_predictions(iou, conf, pred_cls, gt_cls) for kind, iou in ious.items()},
    }


def merge_records(parts):
    """Every rank's records as one list, de-duplicated by dataset index and sorted by it."""
    # Read from the last rank's to the first's, so that the first rank's record wins.
    merged = {record["index"]: record for part in reversed(parts) for record in part}
    return [merged[index] for index in sorted(merged)]


def ap_per_class(tp, conf, pred_cls, classes, n_gt):
    """COCO AP of all detections tp (N, T), conf (N,), pred_cls (N,) (by dataset index) for classes
    (K,) of n_gt (K,) instances -> "P", "R" at the max-mean-F1 conf, "mAP50", "mAP50-95" (K, T)."""
    n_classes = len(classes)
    ap = np.zeros((n_classes, tp.shape[1]))
    p_curve = np.zeros((n_classes, len(CONF_GRID)))
    r_curve = np.zeros_like(p_curve)
    for row, (cls, n_positives) in enumerate(zip(classes, n_gt)):
        selected = np.flatnonzero(pred_cls == cls)
        # A class without detections: AP 0, P 0, R 0.
        if len(selected) == 0:
            continue
        # By descending confidence, stable as COCOeval's mergesort.
        order = selected[np.argsort(-conf[selected], kind="mergesort")]
        tp_cumsum = np.cumsum(tp[order], 0).astype(np.float64)
        ap[row] = _average_precision(tp_cumsum, n_positives)
        # P and R at IoU 0.5 as step functions of the confidence threshold x: the detections
        # with conf >= x, and the true positives among them (none above all detections).
        n_above = np.searchsorted(-conf[order], -CONF_GRID, side="right")
        tp_above = np.append(0.0, tp_cumsum[:, 0])[n_above]
        p_curve[row] = np.where(n_above > 0, tp_above / np.maximum(n_above, 1), 1.0)
        r_curve[row] = tp_above / n_positives
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    # The confidence of the best F1, averaged over the classes.
    best = int(f1.mean(0).argmax()) if n_classes else 0
    return {
        "P": p_curve[:, best],
        "R": r_curve[:, best],
        "mAP50": ap[:, 0],
        "mAP50-95": ap,
    }


def _average_precision(tp_cumsum, n_positives):
    """COCO AP at each IoU threshold of one class from its detections' cumulative true positives
    (N, T), by descending confidence -> T values."""
    recall = tp_cumsum / n_positives
    # True and false positives so far.
    n_seen = np.arange(1.0, len(tp_cumsum) + 1)[:, None]
    precision = tp_cumsum / (n_seen + np.spacing(1))
    # The precision envelope: the best precision at this recall or a higher one.
    envelope = np.maximum.accumulate(precision[::-1], 0)[::-1]
    # And 0 past the last recall.
    envelope = np.pad(envelope, ((0, 1), (0, 0)))
    # At each recall point: the envelope at the first detection reaching it.
    return [
        envelope[np.searchsorted(recall[:, t], RECALL_POINTS), t].mean()
        for t in range(tp_cumsum.shape[1])
    ]


def metric_names(kinds):
    """Names of the metrics summarize gives kinds ("box", "mask"), summarize_classes ("class")."""
    if kinds == ("class",):
        return ["top1_acc", "top5_acc", "val_loss"]
    return [f"{name}({SUFFIX[kind]})" for kind in kinds for name in AP_METRICS]


def summarize(records, kinds=("box",)):
    """{"metrics": {"P(B)", "R(B)", "mAP50(B)", "mAP50-95(B)" (and (M) for masks)}, "fitness",
    "images", "instances", "per_class": [{"class", "images", "instances", metrics...}]}."""
    conf = _joined(records, "conf", np.zeros(0))
    pred_cls = _joined(records, "cls", np.zeros(0, np.int64))
    gt_cls = _joined(records, "gt_cls", np.zeros(0, np.int64))
    classes, n_gt = np.unique(gt_cls, return_counts=True)
    # The number of images showing each class.
    present = [np.unique(record["gt_cls"]) for record in records]
    n_images = np.unique(np.concatenate([classes[:0], *present]), return_counts=True)[1]
    counts = zip(classes.tolist(), n_images.tolist(), n_gt.tolist())
    rows = [
        {"class": cls, "images": images, "instances": instances}
        for cls, images, instances in counts
    ]
    tp_records = [record["tp"] for record in records]
    no_tp = np.zeros((0, len(IOU_THRESHOLDS)), bool)
    metrics = {}
    for kind in kinds:
        tp = _joined(tp_records, kind, no_tp)
        results = ap_per_class(tp, conf, pred_cls, classes=classes, n_gt=n_gt)
        for name, values in results.items():
            key = f"{name}({SUFFIX[kind]})"
            metrics[key] = float(values.mean()) if len(classes) else 0.0
            for row, value in zip(rows, values):
                row[key] = float(value.mean())
    return {
        "metrics": metrics,
        "fitness": fitness(metrics),
        "images": len(records),
        "instances": len(gt_cls),
        "per_class": rows,
    }


def _joined(records, key, empty):
    """The records' (dicts') arrays under key, concatenated after the array empty (which sets the
    dtype)."""
    return np.concatenate([empty] + [record[key] for record in records])


def class_records(indices, scores, labels, losses):
    """A batch's indices, labels, losses (bs,) and scores (bs, nc) (CPU logits or probabilities)
    -> per image {"index", "label", "top5" (the min(5, nc) best classes, best first), "loss"}."""
    scores = np.asarray(scores, np.float64)
    # Ties in the order of the classes.
    top5 = np.argsort(-scores, 1, kind="stable")[:, :5]
    return [
        {
            "index": int(index),
            "label": int(label),
            "top5": best,
            "loss": float(loss),
        }
        for index, label, best, loss in zip(indices, labels, top5, losses)
    ]


def summarize_classes(records):
    """summarize's dict of class_records: "metrics" {"top1_acc", "top5_acc" (1 if nc < 5, as
    yolov5), "val_loss"}, "fitness" (top1_acc), "images", "per_class" (the accuracies by label)."""
    labels = np.array([record["label"] for record in records], np.int64)
    top1_hits = [record["top5"][0] == record["label"] for record in records]
    top5_hits = [record["label"] in record["top5"] for record in records]
    hits = np.stack([top1_hits, top5_hits], 1)
    losses = [record["loss"] for record in records]
    val_loss = float(np.mean(losses)) if losses else 0.0
    metrics = _accuracy(hits) | {"val_loss": val_loss}
    rows = []
    for cls in np.unique(labels):
        in_class = labels == cls
        row = {"class": int(cls), "images": int(in_class.sum())}
        rows.append(row | _accuracy(hits[in_class]))
    return {
        "metrics": metrics,
        "fitness": metrics["top1_acc"],
        "images": len(records),
        "per_class": rows,
    }


def _accuracy(hits):
    """Top-1 and top-5 accuracy of hits (n, 2) bool [top-1 hit, top-5 hit] (0 for none)."""
    top1, top5 = hits.mean(0) if len(hits) else (0.0, 0.0)
    return {"top1_acc": float(top1), "top5_acc": float(top5)}


def fitness(metrics):
    """0.1 * mAP50 + 0.9 * mAP50-95, summed over boxes and (segment) masks."""
    return sum(
        0.1 * metrics[f"mAP50({suffix})"] + 0.9 * metrics[f"mAP50-95({suffix})"]
        for suffix in SUFFIX.values()
        if f"mAP50({suffix})" in metrics
    )
