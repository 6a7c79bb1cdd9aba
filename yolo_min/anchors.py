"""AutoAnchor, in pixels: the best possible recall (BPR) is the share of label boxes whose w and h
ratios to some anchor lie in [1/thr, thr]. Below 0.98, k-means and evolution propose new anchors."""

from __future__ import annotations

import numpy as np

MAX_BOXES = 10_000  # label boxes AutoAnchor measures and fits (yolov5: all of them)


def label_wh(labels: list[dict], imgsz: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 2) the dataset's label box sizes in pixels at training size, each image scaled by
    U(0.9, 1.1) like training's jitter; a random sample of at most MAX_BOXES (bounds the time)."""
    wh = []
    for lab in labels:
        if len(lab["bboxes"]):
            scale = imgsz / max(lab["shape"]) * rng.uniform(0.9, 1.1)
            wh.append(lab["bboxes"][:, 2:4] * np.array(lab["shape"][::-1]) * scale)
    wh = np.concatenate([np.zeros((0, 2)), *wh]).astype(np.float32)
    return wh[rng.choice(len(wh), MAX_BOXES, replace=False)] if len(wh) > MAX_BOXES else wh


def ratio_metric(anchors: np.ndarray, wh: np.ndarray) -> np.ndarray:
    """(m, n): per label (m, 2) and anchor (n, 2), the worse of the w and h ratios, in (0, 1]."""
    r = wh[:, None] / anchors[None]
    return np.minimum(r, 1 / r).min(2)


def bpr_and_aat(anchors: np.ndarray, wh: np.ndarray, thr: float) -> tuple[float, float]:
    """(best possible recall, mean number of anchors above threshold per label)."""
    x = ratio_metric(anchors, wh)
    return float((x.max(1) > 1 / thr).mean()), float((x > 1 / thr).sum(1).mean())


def fitness(anchors: np.ndarray, wh: np.ndarray, thr: float) -> float:
    """Evolution objective: mean over labels of the best anchor's ratio metric, 0 where <= 1/thr."""
    best = ratio_metric(anchors, wh).max(1)
    return float((best * (best > 1 / thr)).mean())


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> np.ndarray:
    """k centres of the rows of x (m, d): k of its rows at random, then `iters` Lloyd steps."""
    centres = x[rng.choice(len(x), k, replace=False)]  # scipy's kmeans (yolov5's) seeds so too
    for _ in range(iters):
        nearest = ((x[:, None] - centres[None]) ** 2).sum(2).argmin(1)
        for j in np.unique(nearest):  # a centre no row is nearest to stays
            centres[j] = x[nearest == j].mean(0)
    return centres


def fit_anchors(wh: np.ndarray, n: int = 9, thr: float = 4.0, gens=1000, seed=0) -> np.ndarray:
    """n anchors (n, 2) for the label sizes wh (m, 2) in pixels, sorted by area."""
    # k-means on the sizes scaled by their standard deviation, then `gens` generations of random
    # multiplicative mutations, kept when the fitness improves
    rng = np.random.default_rng(seed)
    wh = wh[(wh >= 2.0).any(1)].astype(np.float64)  # boxes under 2 pixels teach nothing
    if len(wh) < n:
        raise ValueError(f"AutoAnchor: {len(wh)} label boxes are too few to fit {n} anchors")
    s = wh.std(0) + 1e-9
    k = kmeans(wh / s, n, rng) * s
    f = fitness(k, wh, thr)
    for _ in range(gens):  # mutate ~90% of the values by up to ~10% (times a random strength)
        change = (rng.random(k.shape) < 0.9) * rng.random() * rng.standard_normal(k.shape)
        kg = (k * (change * 0.1 + 1).clip(0.3, 3.0)).clip(min=2.0)
        fg = fitness(kg, wh, thr)
        if fg > f:
            f, k = fg, kg
    return k[np.argsort(k.prod(1))].astype(np.float32)


def check_anchors(labels, anchors: np.ndarray, thr=4.0, imgsz=640, seed=0) -> np.ndarray | None:
    """Print the BPR of `anchors` (n, 2) on the labels; below 0.98 return better ones, else None."""
    wh = label_wh(labels, imgsz, np.random.default_rng(seed))
    if not len(wh):
        return None
    bpr, aat = bpr_and_aat(anchors, wh, thr)
    msg = f"AutoAnchor: {aat:.2f} anchors/target, {bpr:.3f} best possible recall (BPR)"
    if bpr >= 0.98:
        print(f"{msg}: current anchors fit the dataset", flush=True)
        return None
    print(f"{msg}: re-fitting anchors with k-means and evolution ...", flush=True)
    try:
        new = fit_anchors(wh, len(anchors), thr, seed=seed)
    except ValueError as e:
        print(f"{e}; keeping the original anchors", flush=True)
        return None
    new_bpr = bpr_and_aat(new, wh, thr)[0]
    if new_bpr <= bpr:
        print("AutoAnchor: the re-fitted anchors are no better; keeping the originals", flush=True)
        return None
    sizes = ", ".join(f"{w:.0f},{h:.0f}" for w, h in new)
    print(f"AutoAnchor: new anchors, BPR {new_bpr:.3f}: {sizes}", flush=True)
    return new
