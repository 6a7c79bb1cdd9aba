"""AutoAnchor, in pixels: the best possible recall (BPR) is the share of label boxes whose w and h
ratios to some anchor lie in [1/threshold, threshold]. Below 0.98, k-means and evolution propose
new anchors."""

import numpy as np

# The most label boxes AutoAnchor measures and fits, which bounds its time (yolov5 takes them all).
MAX_BOXES = 10_000


def label_wh(labels, imgsz, rng):
    """(n, 2) the dataset's label box sizes in pixels at training size, each image scaled by
    U(0.9, 1.1) like training's jitter; a random sample of at most MAX_BOXES (bounds the time)."""
    sizes = [np.zeros((0, 2))]
    for label in labels:
        if not len(label["bboxes"]):
            continue
        scale = imgsz / max(label["shape"]) * rng.uniform(0.9, 1.1)
        image_wh = np.array(label["shape"][::-1])
        sizes.append(label["bboxes"][:, 2:4] * image_wh * scale)
    wh = np.concatenate(sizes).astype(np.float32)
    if len(wh) > MAX_BOXES:
        wh = wh[rng.choice(len(wh), MAX_BOXES, replace=False)]
    return wh


def ratio_metric(anchors, wh):
    """(n, m): per anchor (n, 2) and label (m, 2), the worse of the w and h ratios, in (0, 1]."""
    # Widths and heights apart, labels last: numpy is fast along long contiguous rows.
    ratio = wh.T[:, None] / anchors.T[:, :, None]
    metric = np.minimum(ratio, 1 / ratio)
    # The worse of the two (a binary minimum: a reduction over an axis of 2 is slow in numpy).
    return np.minimum(metric[0], metric[1])


def bpr_and_aat(anchors, wh, threshold):
    """(best possible recall, mean number of anchors above threshold per label)."""
    above = ratio_metric(anchors, wh) > 1 / threshold
    return float(above.any(0).mean()), float(above.sum(0).mean())


def fitness(anchors, wh, threshold):
    """Evolution objective: mean over labels of the best anchor's ratio metric, counted as 0 where
    it is at most 1/threshold."""
    best = ratio_metric(anchors, wh).max(0)
    return float((best * (best > 1 / threshold)).mean())


def kmeans(points, k, rng):
    """k centres of the rows of points (m, d): k of its rows at random, then 30 Lloyd steps."""
    # scipy's kmeans, which yolov5 calls, starts from k random rows too.
    centres = points[rng.choice(len(points), k, replace=False)]
    for _ in range(30):
        distances = ((points[:, None] - centres) ** 2).sum(2)
        nearest = distances.argmin(1)
        # A centre that no point is nearest to stays where it is.
        for centre in np.unique(nearest):
            centres[centre] = points[nearest == centre].mean(0)
    return centres


def fit_anchors(wh, num_anchors, threshold, gens=1000, seed=0):
    """Anchors (num_anchors, 2) for the label sizes wh (m, 2), in pixels, sorted by area."""
    # k-means on the sizes scaled by their standard deviation, then `gens` generations of random
    # multiplicative mutations, each kept when it improves the fitness.
    rng = np.random.default_rng(seed)
    # Boxes under 2 pixels teach nothing.
    wh = wh[(wh >= 2.0).any(1)].astype(np.float64)
    if len(wh) < num_anchors:
        raise ValueError(
            f"AutoAnchor: {len(wh)} label boxes are too few to fit {num_anchors} anchors"
        )
    scale = wh.std(0) + 1e-9
    anchors = kmeans(wh / scale, num_anchors, rng) * scale
    best = fitness(anchors, wh, threshold)
    for _ in range(gens):
        # Mutate ~90% of the values by up to ~10%, times a random strength.
        mutated = rng.random(anchors.shape) < 0.9
        change = mutated * rng.random() * rng.standard_normal(anchors.shape)
        factor = (change * 0.1 + 1).clip(0.3, 3.0)
        candidate = (anchors * factor).clip(min=2.0)
        candidate_fitness = fitness(candidate, wh, threshold)
        if candidate_fitness > best:
            best = candidate_fitness
            anchors = candidate
    # sorted by area
    return anchors[np.argsort(anchors.prod(1))].astype(np.float32)


def check_anchors(labels, anchors, threshold, imgsz, seed):
    """Print the BPR of `anchors` (n, 2) on the labels; below 0.98 return better ones, else None."""
    wh = label_wh(labels, imgsz, np.random.default_rng(seed))
    if not len(wh):
        return None
    bpr, anchors_above = bpr_and_aat(anchors, wh, threshold)
    summary = (
        f"AutoAnchor: {anchors_above:.2f} anchors/target, {bpr:.3f} best possible recall (BPR)"
    )
    if bpr >= 0.98:
        print(f"{summary}: current anchors fit the dataset", flush=True)
        return None
    print(f"{summary}: re-fitting anchors with k-means and evolution ...", flush=True)
    try:
        new = fit_anchors(wh, num_anchors=len(anchors), threshold=threshold, seed=seed)
    except ValueError as error:
        print(f"{error}; keeping the original anchors", flush=True)
        return None
    new_bpr, _ = bpr_and_aat(new, wh, threshold)
    if new_bpr <= bpr:
        print("AutoAnchor: the re-fitted anchors are no better; keeping the originals", flush=True)
        return None
    sizes = ", ".join(f"{w:.0f},{h:.0f}" for w, h in new)
    print(f"AutoAnchor: new anchors, BPR {new_bpr:.3f}: {sizes}", flush=True)
    return new
