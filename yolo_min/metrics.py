"""Box and mask AP exactly as COCOeval (areaRng "all", maxDets >= detections, no crowds; score ties
by dataset index, then order), and top-k accuracy, from small per-image records keyed by index."""

from __future__ import annotations

import numpy as np

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # float64, bit-equal to COCOeval's iouThrs
RECALL_POINTS = np.linspace(0.0, 1.0, 101)  # COCOeval's recThrs
CONF_GRID = np.linspace(0.0, 1.0, 1000)  # confidences scanned for the max-mean-F1 point
SUFFIX = {"box": "B", "mask": "M"}  # metric names: "mAP50(B)", "mAP50-95(M)", ...
KINDS = {"detect": ("box",), "segment": ("box", "mask"), "classify": ("class",)}  # what it scores


def match_predictions(iou: np.ndarray, conf, pred_cls, gt_cls) -> np.ndarray:
    """COCO's greedy matching: iou (n, m), conf (n,), pred_cls (n,), gt_cls (m,) -> tp (n, T) bool;
    by descending conf, each takes its class's free ground truth of top IoU >= t (ties: last)."""
    thr, m = IOU_THRESHOLDS[:, None], iou.shape[1]
    tp = np.zeros((len(iou), len(thr)), dtype=bool)
    free, rows = np.ones((len(thr), m), dtype=bool), np.arange(len(thr))
    iou = np.where(pred_cls[:, None] == gt_cls[None], iou, -1.0)
    order = np.argsort(-conf, kind="stable")
    for d in order[iou[order].max(1, initial=-1.0) >= thr[0]]:  # only these can match anything
        cand = np.where(free & (iou[d] >= thr), iou[d], -1.0)[:, ::-1]  # argmax: the last best
        best = cand.argmax(1)
        hit = cand[rows, best] >= 0
        tp[d, hit] = True
        free[rows[hit], m - 1 - best[hit]] = False
    return tp


def image_record(index: int, conf, pred_cls, gt_cls, ious: dict) -> dict:
    """What AP needs from one image: conf (n,), pred_cls (n,), gt_cls (m,), ious {"box" and/or
    "mask": (n, m) float64} -> {"index", "conf", "cls", "gt_cls", "tp": {kind: (n, T) bool}}."""
    conf = np.asarray(conf, dtype=np.float64).reshape(-1)
    pred_cls, gt_cls = (np.asarray(c, dtype=np.int64).reshape(-1) for c in (pred_cls, gt_cls))
    tp = {kind: match_predictions(iou, conf, pred_cls, gt_cls) for kind, iou in ious.items()}
    return {"index": int(index), "conf": conf, "cls": pred_cls, "gt_cls": gt_cls, "tp": tp}


def merge_records(parts: list[list[dict]]) -> list[dict]:
    """Every rank's records as one list, de-duplicated by dataset index and sorted by it."""
    merged = {r["index"]: r for part in reversed(parts) for r in part}  # the first rank's wins
    return [merged[i] for i in sorted(merged)]


def ap_per_class(tp: np.ndarray, conf, pred_cls, classes, n_gt) -> dict:
    """COCO AP of all detections tp (N, T), conf (N,), pred_cls (N,) (by dataset index) for classes
    (K,) of n_gt (K,) instances -> "P", "R" at the max-mean-F1 conf, "mAP50", "mAP50-95" (K, T)."""
    ap = np.zeros((len(classes), tp.shape[1]))
    p_curve, r_curve = np.zeros((2, len(classes), len(CONF_GRID)))
    for ci, (c, npos) in enumerate(zip(classes, n_gt)):
        sel = np.flatnonzero(pred_cls == c)
        if len(sel) == 0:
            continue  # AP 0, P 0, R 0
        order = sel[np.argsort(-conf[sel], kind="mergesort")]  # stable, as COCOeval
        tpc = np.cumsum(tp[order], 0).astype(np.float64)
        n_seen = np.arange(1.0, len(order) + 1)[:, None]  # true + false positives so far
        recall, precision = tpc / npos, tpc / (n_seen + np.spacing(1))
        # the precision envelope, and 0 past the last recall
        envelope = np.pad(np.maximum.accumulate(precision[::-1], 0)[::-1], ((0, 1), (0, 0)))
        for ti in range(tp.shape[1]):  # at a recall point: the first detection reaching it
            ap[ci, ti] = envelope[np.searchsorted(recall[:, ti], RECALL_POINTS), ti].mean()
        # P/R at IoU 0.5 as step functions of the confidence threshold (detections with conf >= x)
        n_above = np.searchsorted(-conf[order], -CONF_GRID, side="right")
        last = np.maximum(n_above - 1, 0)
        r_curve[ci] = np.where(n_above > 0, tpc[last, 0] / npos, 0.0)
        p_curve[ci] = np.where(n_above > 0, tpc[last, 0] / np.maximum(n_above, 1), 1.0)
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    best = int(f1.mean(0).argmax()) if len(classes) else 0
    return {"P": p_curve[:, best], "R": r_curve[:, best], "mAP50": ap[:, 0], "mAP50-95": ap}


def metric_names(kinds: tuple[str, ...]) -> list[str]:
    """Names of the metrics summarize gives kinds ("box", "mask"), summarize_classes ("class")."""
    if kinds == ("class",):
        return ["top1_acc", "top5_acc", "val_loss"]
    return [f"{m}({SUFFIX[k]})" for k in kinds for m in ("P", "R", "mAP50", "mAP50-95")]


def summarize(records: list[dict], kinds: tuple[str, ...] = ("box",)) -> dict:
    """{"metrics": {"P(B)", "R(B)", "mAP50(B)", "mAP50-95(B)" (and (M) for masks)}, "fitness",
    "images", "instances", "per_class": [{"class", "images", "instances", metrics...}]}."""
    conf = np.concatenate([np.zeros(0)] + [r["conf"] for r in records])
    pred_cls = np.concatenate([np.zeros(0, np.int64)] + [r["cls"] for r in records])
    gt_cls = np.concatenate([np.zeros(0, np.int64)] + [r["gt_cls"] for r in records])
    classes, n_gt = np.unique(gt_cls, return_counts=True)
    present = np.concatenate([np.unique(r["gt_cls"]) for r in records] + [classes[:0]])
    n_images = np.unique(present, return_counts=True)[1]  # images showing each class
    counts = zip(classes.tolist(), n_images.tolist(), n_gt.tolist())
    rows = [{"class": c, "images": i, "instances": n} for c, i, n in counts]
    metrics = {}
    for kind in kinds:
        tp = np.concatenate([r["tp"][kind] for r in records] + [np.zeros((0, 10), bool)])
        for name, values in ap_per_class(tp, conf, pred_cls, classes, n_gt).items():
            key = f"{name}({SUFFIX[kind]})"
            metrics[key] = float(values.mean()) if len(classes) else 0.0
            for row, v in zip(rows, values):
                row[key] = float(v.mean())
    out = {"metrics": metrics, "fitness": fitness(metrics), "images": len(records)}
    return out | {"instances": len(gt_cls), "per_class": rows}


def class_records(indices, scores, labels, losses) -> list[dict]:
    """A batch's indices, labels, losses (bs,) and scores (bs, nc) (CPU logits or probabilities)
    -> per image {"index", "label", "top5" (the min(5, nc) best classes, best first), "loss"}."""
    top5 = np.argsort(-np.asarray(scores, np.float64), 1, kind="stable")[:, :5]
    keys = zip(indices, labels, top5, losses)
    return [{"index": int(i), "label": int(c), "top5": t, "loss": float(x)} for i, c, t, x in keys]


def summarize_classes(records: list[dict]) -> dict:
    """summarize's dict of class_records: "metrics" {"top1_acc", "top5_acc" (1 if nc < 5, as
    yolov5), "val_loss"}, "fitness" (top1_acc), "images", "per_class" (the accuracies by label)."""
    labels = np.array([r["label"] for r in records], np.int64)
    hits = np.array([[r["top5"][0] == r["label"], r["label"] in r["top5"]] for r in records])

    def accuracy(h: np.ndarray) -> dict:
        top1, top5 = h.reshape(-1, 2).mean(0) if len(h) else (0.0, 0.0)
        return {"top1_acc": float(top1), "top5_acc": float(top5)}

    rows = [{"class": int(c), "images": int((labels == c).sum())} for c in np.unique(labels)]
    metrics = accuracy(hits) | {"val_loss": float(np.mean([r["loss"] for r in records] or [0]))}
    rows = [row | accuracy(hits[labels == row["class"]]) for row in rows]
    return dict(metrics=metrics, fitness=metrics["top1_acc"], images=len(records), per_class=rows)


def fitness(metrics: dict) -> float:
    """0.1 * mAP50 + 0.9 * mAP50-95, summed over boxes and (segment) masks."""
    kinds = [s for s in SUFFIX.values() if f"mAP50({s})" in metrics]
    return sum(0.1 * metrics[f"mAP50({s})"] + 0.9 * metrics[f"mAP50-95({s})"] for s in kinds)
