"""Detection and segmentation metrics computed exactly as pycocotools' COCOeval does.

Per image: `match_predictions` matches detections to ground truth greedily in score order at every
threshold of the single constant `IOU_THRESHOLDS` (box IoU and mask IoU alike), giving a per-image
record keyed by dataset index. Records from every rank are gathered with `dist.all_gather_object`
and de-duplicated (`gather_records`), then `ap_per_class` / `summarize` turn them into AP
(101-point interpolated precision envelope, averaged over classes present in the ground truth),
P and R at the confidence that maximises the mean F1, and `fitness`.

COCOeval correspondence: areaRng "all", maxDets[-1] >= the detections per image (NMS caps them at
max_det, so run COCOeval with maxDets=[1, 10, max_det] to compare; no per-class cap here), no crowd
annotations. Ties in score are broken by dataset index, then by the order within the image, as
COCOeval does with image ids in ascending order. Does not hold NMS or mask assembly (ops.py).
"""
from __future__ import annotations

import numpy as np

from . import dist

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # float64, bit-equal to COCOeval's iouThrs
RECALL_POINTS = np.linspace(0.0, 1.0, 101)  # COCOeval's recThrs
CONF_GRID = np.linspace(0.0, 1.0, 1000)  # confidences scanned for the max-mean-F1 point
EPS = np.spacing(1)


def match_predictions(iou: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, gt_cls: np.ndarray) -> np.ndarray:
    """COCO greedy matching of one image's detections to its ground truth at every IoU threshold.

    iou (n, m) detection x ground-truth IoU (boxes or masks); conf (n,); pred_cls (n,); gt_cls (m,).
    In descending score order (stable), each detection takes the still-unmatched ground truth of its
    class with the highest IoU >= t (ties: the later ground truth, as COCOeval).
    Returns tp (n, T) bool, in the input order of the detections, T = len(IOU_THRESHOLDS).
    """
    n, m = iou.shape
    tp = np.zeros((n, len(IOU_THRESHOLDS)), dtype=bool)
    if n == 0 or m == 0:
        return tp
    iou = np.where(np.asarray(pred_cls)[:, None] == np.asarray(gt_cls)[None], np.asarray(iou, np.float64), -1.0)
    order = np.argsort(-np.asarray(conf), kind="stable")
    thr = IOU_THRESHOLDS[:, None]
    free = np.ones((len(IOU_THRESHOLDS), m), dtype=bool)
    rows = np.arange(len(IOU_THRESHOLDS))
    for d in order[iou[order].max(1) >= IOU_THRESHOLDS[0]]:  # only these can match anything
        cand = np.where(free & (iou[d] >= thr), iou[d], -1.0)[:, ::-1]  # reversed: argmax finds the last best
        best = cand.argmax(1)
        hit, j = cand[rows, best] >= 0, m - 1 - best
        tp[d, hit] = True
        free[rows[hit], j[hit]] = False
    return tp


def image_record(index: int, conf, pred_cls, gt_cls, ious: dict) -> dict:
    """Everything AP needs from one image, keyed by its dataset index (small; gathered across ranks).

    conf (n,), pred_cls (n,), gt_cls (m,); ious {"box": (n, m), "mask": (n, m)} any subset.
    Returns {"index", "conf" (n,) float64, "cls" (n,) int64, "gt_cls" (m,) int64, "tp": {kind: (n, T) bool}}.
    """
    conf = np.asarray(conf, dtype=np.float64).reshape(-1)
    pred_cls = np.asarray(pred_cls, dtype=np.int64).reshape(-1)
    gt_cls = np.asarray(gt_cls, dtype=np.int64).reshape(-1)
    tp = {k: match_predictions(np.asarray(v, np.float64).reshape(len(conf), len(gt_cls)), conf, pred_cls, gt_cls)
          for k, v in ious.items()}
    return {"index": int(index), "conf": conf, "cls": pred_cls, "gt_cls": gt_cls, "tp": tp}


def gather_records(records: list[dict]) -> list[dict]:
    """Every rank's records, de-duplicated by dataset index and sorted by it (same list on every rank)."""
    merged: dict[int, dict] = {}
    for part in dist.all_gather_object(records):
        for r in part:
            merged.setdefault(r["index"], r)
    return [merged[i] for i in sorted(merged)]


def ap_per_class(tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, gt_cls: np.ndarray) -> dict:
    """COCO AP per class from the detections of all images.

    tp (N, T) bool, conf (N,), pred_cls (N,): detections concatenated in dataset-index order, each image's
    in descending score order; gt_cls (M,) every ground-truth class.
    Returns {"classes" (K,) classes present in the ground truth, "n_gt" (K,), "ap" (K, T),
    "p" (K,), "r" (K,) at the confidence that maximises the mean F1 over classes, "conf": that confidence}.
    """
    classes, n_gt = np.unique(np.asarray(gt_cls, np.int64), return_counts=True)
    k, t = len(classes), tp.shape[1]
    ap = np.zeros((k, t))
    p_curve, r_curve = np.zeros((k, len(CONF_GRID))), np.zeros((k, len(CONF_GRID)))
    for ci, (c, npos) in enumerate(zip(classes, n_gt)):
        sel = np.flatnonzero(pred_cls == c)
        if len(sel) == 0:
            continue  # AP 0, P 0, R 0
        order = sel[np.argsort(-conf[sel], kind="mergesort")]  # stable, as COCOeval
        tpc = np.cumsum(tp[order], 0).astype(np.float64)
        fpc = np.cumsum(~tp[order], 0).astype(np.float64)
        recall, precision = tpc / npos, tpc / (tpc + fpc + EPS)
        envelope = np.maximum.accumulate(precision[::-1], 0)[::-1]
        for ti in range(t):
            idx = np.searchsorted(recall[:, ti], RECALL_POINTS, side="left")
            q = np.where(idx < len(order), envelope[np.minimum(idx, len(order) - 1), ti], 0.0)
            ap[ci, ti] = q.mean()
        # P/R at IoU 0.5 as step functions of the confidence threshold (detections with conf >= x)
        n_above = np.searchsorted(-conf[order], -CONF_GRID, side="right")
        last = np.maximum(n_above - 1, 0)
        r_curve[ci] = np.where(n_above > 0, tpc[last, 0] / npos, 0.0)
        p_curve[ci] = np.where(n_above > 0, tpc[last, 0] / np.maximum(n_above, 1), 1.0)
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    best = int(f1.mean(0).argmax()) if k else 0
    return {"classes": classes, "n_gt": n_gt, "ap": ap, "p": p_curve[:, best], "r": r_curve[:, best],
            "conf": float(CONF_GRID[best])}


def _kind_summary(res: dict) -> dict:
    if len(res["classes"]) == 0:
        return {"P": 0.0, "R": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
    return {"P": float(res["p"].mean()), "R": float(res["r"].mean()),
            "mAP50": float(res["ap"][:, 0].mean()), "mAP50-95": float(res["ap"].mean())}


def summarize(records: list[dict], kinds: tuple[str, ...] = ("box",)) -> dict:
    """Metrics from gathered per-image records.

    Returns {kind: {"P", "R", "mAP50", "mAP50-95"} for kind in kinds, "images": n, "instances": n,
    "fitness": float, "per_class": [{"class", "images", "instances", kind: {...}}, ...]} (classes in GT).
    """
    cat = (lambda key: np.concatenate([r[key] for r in records])) if records else (lambda key: np.zeros(0))
    conf, pred_cls, gt_cls = cat("conf"), cat("cls").astype(np.int64), cat("gt_cls").astype(np.int64)
    out, per_kind = {}, {}
    for kind in kinds:
        tp = (np.concatenate([r["tp"][kind] for r in records]) if records
              else np.zeros((0, len(IOU_THRESHOLDS)), dtype=bool))
        per_kind[kind] = ap_per_class(tp, conf, pred_cls, gt_cls)
        out[kind] = _kind_summary(per_kind[kind])
    classes, n_gt = np.unique(gt_cls, return_counts=True)
    images_with = np.bincount(np.concatenate([np.unique(r["gt_cls"]) for r in records] or [np.zeros(0, np.int64)]),
                              minlength=int(classes.max(initial=-1)) + 1)
    out["per_class"] = [
        {"class": int(c), "images": int(images_with[c]), "instances": int(n),
         **{kind: {"P": float(res["p"][i]), "R": float(res["r"][i]), "mAP50": float(res["ap"][i, 0]),
                   "mAP50-95": float(res["ap"][i].mean())} for kind, res in per_kind.items()}}
        for i, (c, n) in enumerate(zip(classes, n_gt))]
    out["images"], out["instances"] = len(records), int(len(gt_cls))
    out["fitness"] = fitness(out)
    return out


def fitness(metrics: dict) -> float:
    """0.1 * mAP50 + 0.9 * mAP50-95, summed over box and (when present) mask."""
    return float(sum(0.1 * metrics[k]["mAP50"] + 0.9 * metrics[k]["mAP50-95"] for k in ("box", "mask") if k in metrics))
