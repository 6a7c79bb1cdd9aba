"""AutoAnchor's fit: the same anchors, bit for bit, as the plain per-label formulation it replaced
(labels first: ratios (m, n, 2)), for fixed seeds."""

import numpy as np
import pytest

from yolo_min.anchors import bpr_and_aat, fit_anchors, kmeans


def reference_metric(anchors: np.ndarray, wh: np.ndarray) -> np.ndarray:
    """(m, n) the worse of the w and h ratios of label (m, 2) and anchor (n, 2)."""
    ratio = wh[:, None] / anchors[None]
    return np.minimum(ratio, 1 / ratio).min(2)


def reference_fitness(anchors: np.ndarray, wh: np.ndarray, threshold: float) -> float:
    best = reference_metric(anchors, wh).max(1)
    return float((best * (best > 1 / threshold)).mean())


def reference_fit(wh: np.ndarray, num_anchors: int, threshold: float, gens: int, seed: int):
    """fit_anchors as it was: k-means, then one mutation a generation, kept when it is better."""
    rng = np.random.default_rng(seed)
    wh = wh[(wh >= 2.0).any(1)].astype(np.float64)
    scale = wh.std(0) + 1e-9
    anchors = kmeans(wh / scale, num_anchors, rng) * scale
    best = reference_fitness(anchors, wh, threshold)
    for _ in range(gens):
        mutated = rng.random(anchors.shape) < 0.9
        change = mutated * rng.random() * rng.standard_normal(anchors.shape)
        candidate = (anchors * (change * 0.1 + 1).clip(0.3, 3.0)).clip(min=2.0)
        candidate_fitness = reference_fitness(candidate, wh, threshold)
        if candidate_fitness > best:
            best, anchors = candidate_fitness, candidate
    return anchors[np.argsort(anchors.prod(1))].astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threshold", [4.0, 2.0])
def test_fit_anchors_as_before(seed, threshold):
    rng = np.random.default_rng(seed + 10)
    boxes = 30 + 400 * seed
    wh = rng.lognormal(3, 1, (boxes, 2)).astype(np.float32)
    wh[:3] = 1.0  # under 2 pixels: left out
    new = fit_anchors(wh, 9, threshold, gens=300, seed=seed)
    old = reference_fit(wh, 9, threshold, gens=300, seed=seed)
    assert np.array_equal(new, old)
    ratios = reference_metric(new, wh) > 1 / threshold
    expected = (float(ratios.any(1).mean()), float(ratios.sum(1).mean()))
    assert bpr_and_aat(new, wh, threshold) == expected
