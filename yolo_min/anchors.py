"""AutoAnchor: check that the anchors suit the training labels; re-fit them when they do not.

A label box is recallable by an anchor when both its width and height ratios to the anchor lie within
[1/thr, thr] (thr = hyp anchor_t, 4.0). Best possible recall (BPR) is the share of label boxes that some
anchor can recall. Below 0.98 new anchors come from k-means on the label sizes followed by a genetic
evolution of the fitness; they replace the old ones only if their BPR is higher. Rank 0 decides and
every rank receives its anchors (broadcast), so all ranks train the same model.
Holds no training code; label sizes come from `dataset.labels` (normalised xywh, original shape).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from . import dist
from .models import de_parallel


def label_wh(dataset, imgsz: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 2) float32 label widths and heights in pixels at training size (long side = imgsz),
    each image scaled by U(0.9, 1.1) like training's scale jitter."""
    wh = [lab["bboxes"][:, 2:4] * np.array(lab["shape"][::-1]) * (imgsz / max(lab["shape"]) * rng.uniform(0.9, 1.1))
          for lab in dataset.labels if len(lab["bboxes"])]
    return np.concatenate(wh).astype(np.float32) if wh else np.zeros((0, 2), np.float32)


def ratio_metric(anchors: np.ndarray, wh: np.ndarray) -> np.ndarray:
    """(m, n): for each label (m, 2) and anchor (n, 2), the worse of its w and h ratios, in (0, 1]."""
    r = wh[:, None] / anchors[None]
    return np.minimum(r, 1 / r).min(2)


def bpr_and_aat(anchors: np.ndarray, wh: np.ndarray, thr: float) -> tuple[float, float]:
    """(best possible recall, mean anchors above threshold per label) of anchors (n, 2) for label sizes wh (m, 2),
    both in pixels."""
    x = ratio_metric(anchors, wh)
    return float((x.max(1) > 1 / thr).mean()), float((x > 1 / thr).sum(1).mean())


def fitness(anchors: np.ndarray, wh: np.ndarray, thr: float) -> float:
    """Evolution objective: mean over labels wh (m, 2) of the best anchor ratio metric, 0 where <= 1/thr."""
    best = ratio_metric(anchors, wh).max(1)
    return float((best * (best > 1 / thr)).mean())


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> np.ndarray:
    """k centres of the rows of x (m, d): k-means++ seeding, then `iters` Lloyd steps."""
    centres = x[[rng.integers(len(x))]]
    while len(centres) < k:  # next seed with probability ~ squared distance to the nearest centre
        d2 = ((x[:, None] - centres[None]) ** 2).sum(2).min(1)
        p = d2 / d2.sum() if d2.sum() > 0 else None
        centres = np.concatenate([centres, x[[rng.choice(len(x), p=p)]]])
    for _ in range(iters):
        nearest = ((x[:, None] - centres[None]) ** 2).sum(2).argmin(1)
        for j in range(k):
            if (nearest == j).any():
                centres[j] = x[nearest == j].mean(0)
    return centres


def fit_anchors(wh: np.ndarray, n: int = 9, thr: float = 4.0, gens: int = 1000, seed: int = 0) -> np.ndarray:
    """n anchors (n, 2) in pixels, sorted by area: k-means on the sizes scaled by their standard
    deviation, then `gens` generations of random multiplicative mutations kept when fitness improves."""
    rng = np.random.default_rng(seed)
    wh = wh[(wh >= 2.0).any(1)].astype(np.float64)  # boxes under 2 pixels teach nothing
    if len(wh) < n:
        raise ValueError(f"AutoAnchor: {len(wh)} label boxes are too few to fit {n} anchors")
    s = wh.std(0) + 1e-9
    k = kmeans(wh / s, n, rng) * s
    f = fitness(k, wh, thr)
    for _ in range(gens):
        v = np.ones_like(k)
        while (v == 1).all():  # mutate ~90% of the values by up to ~10% (times a random strength)
            v = ((rng.random(k.shape) < 0.9) * rng.random() * rng.standard_normal(k.shape) * 0.1 + 1).clip(0.3, 3.0)
        kg = (k * v).clip(min=2.0)
        fg = fitness(kg, wh, thr)
        if fg > f:
            f, k = fg, kg
    return k[np.argsort(k.prod(1))].astype(np.float32)


def check_anchors(dataset, model: nn.Module, thr: float = 4.0, imgsz: int = 640, seed: int = 0) -> float:
    """Print the anchors' BPR on `dataset`; below 0.98 re-fit them in place (the head's `anchors`
    buffer, grid units). Call on every rank: rank 0 computes, all ranks get its anchors. Returns the BPR."""
    head = de_parallel(model).model[-1]
    stride = head.stride.to(head.anchors.device).view(-1, 1, 1)
    new, bpr = None, 1.0
    if dist.is_main():
        rng = np.random.default_rng(seed)
        wh = label_wh(dataset, imgsz, rng)
        old = (head.anchors * stride).view(-1, 2).cpu().numpy()
        if len(wh):
            bpr, aat = bpr_and_aat(old, wh, thr)
            msg = f"AutoAnchor: {aat:.2f} anchors/target, {bpr:.3f} best possible recall (BPR)"
            if bpr >= 0.98:
                print(f"{msg}: current anchors fit the dataset", flush=True)
            else:
                print(f"{msg}: re-fitting anchors with k-means and evolution ...", flush=True)
                try:
                    k = fit_anchors(wh, len(old), thr, seed=seed)
                except ValueError as e:
                    k = None
                    print(f"{e}; keeping the original anchors", flush=True)
                if k is not None and (new_bpr := bpr_and_aat(k, wh, thr)[0]) > bpr:
                    new, bpr = k, new_bpr
                    print(f"AutoAnchor: new anchors, BPR {new_bpr:.3f}: " +
                          ", ".join(f"{w:.0f},{h:.0f}" for w, h in k), flush=True)
                elif k is not None:
                    print("AutoAnchor: the re-fitted anchors are no better; keeping the original anchors", flush=True)
    new, bpr = dist.broadcast_object((new, bpr))
    if new is not None:
        head.anchors[:] = torch.from_numpy(new).to(head.anchors).view_as(head.anchors) / stride
    return bpr
