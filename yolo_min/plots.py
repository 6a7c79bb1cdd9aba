"""Batch pictures: a JPEG grid of images with boxes, class names and masks (torchvision.utils drawing).

Used by training (train_batch0.jpg: labels of a mosaic batch) and validation (labels and predictions
side by side as two files), and results.png from a run's results.csv when matplotlib is installed
(not a dependency). Holds no metrics (PR curves, confusion matrix).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks, make_grid

from .ops import xywh2xyxy

PALETTE = ["#FF3838", "#FF9D97", "#FF701F", "#FFB21D", "#CFD231", "#48F90A", "#92CC17", "#3DDB86", "#1A9334",
           "#00D4BB", "#2C99A8", "#00C2FF", "#344593", "#6473FF", "#0018EC", "#8438FF", "#520085", "#CB38FF",
           "#FF95C8", "#FF37C7"]


def draw_batch(images: torch.Tensor, targets: torch.Tensor | None = None, masks=None, paths=None,
               fname: str | Path = "train_batch0.jpg", names=None, preds=None, max_images: int = 16,
               max_size: int = 1920) -> Path:
    """Write a grid of up to `max_images` images to `fname` and return its path.

    images: uint8 (bs,3,H,W). Labels: targets (N,6) [img_idx, cls, cx, cy, w, h] normalised, with masks
    (bs,h,w) overlap index maps (value k = k-th target of that image). Predictions instead: preds =
    per-image (n,6+) [x1, y1, x2, y2, conf, cls] in input pixels, masks = per-image (n,h,w) bool.
    """
    bs, _, H, W = images.shape
    n = min(bs, max_images)
    cells = []
    for i in range(n):
        img = images[i].cpu()
        if preds is not None:
            p = preds[i].detach().float().cpu()
            boxes, cls, conf = p[:, :4], p[:, 5].long(), p[:, 4].tolist()
        else:
            t = targets[targets[:, 0] == i].float().cpu() if targets is not None else torch.zeros(0, 6)
            boxes, cls, conf = xywh2xyxy(t[:, 2:6] * torch.tensor([W, H, W, H])), t[:, 1].long(), None
        colors = [PALETTE[int(c) % len(PALETTE)] for c in cls]
        if masks is not None and len(cls):
            m = masks[i].cpu()
            inst = (m[None] == torch.arange(1, len(cls) + 1)[:, None, None]) if m.ndim == 2 else m.bool()
            inst = F.interpolate(inst[None].float(), size=(H, W), mode="nearest")[0].bool()
            img = draw_segmentation_masks(img, inst, alpha=0.45, colors=colors)
        if len(cls):
            text = [names[c] if names and c < len(names) else str(int(c)) for c in cls.tolist()]
            text = [f"{s} {c:.2f}" for s, c in zip(text, conf)] if conf is not None else text
            img = draw_bounding_boxes(img, boxes, labels=text, colors=colors, width=max(1, round(W / 320)))
        cells.append(img)
    nrow, pad = math.ceil(math.sqrt(n)), 4
    grid = Image.fromarray(make_grid(cells, nrow=nrow, padding=pad, pad_value=255).permute(1, 2, 0).numpy())
    if paths:
        draw = ImageDraw.Draw(grid)
        for k, path in enumerate(paths[:n]):
            x, y = pad + (k % nrow) * (W + pad), pad + (k // nrow) * (H + pad)
            draw.text((x + 3, y + 3), Path(path).name[:40], fill=(255, 255, 255))
    if max(grid.size) > max_size:
        r = max_size / max(grid.size)
        grid = grid.resize((round(grid.width * r), round(grid.height * r)), Image.Resampling.BILINEAR)
    Path(fname).parent.mkdir(parents=True, exist_ok=True)
    grid.save(fname, quality=90)
    return Path(fname)


def plot_results(path: Path) -> None:
    """results.png beside results.csv, one panel per column, when matplotlib is installed (not a dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("results.png skipped: matplotlib is not installed")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    n = math.ceil((len(rows[0]) - 1) / 5)
    fig, axes = plt.subplots(n, 5, figsize=(15, 3 * n), squeeze=False)
    for ax, k in zip(axes.flat, list(rows[0])[1:]):
        ax.plot([int(r["epoch"]) for r in rows], [float(r[k] or "nan") for r in rows], ".-")
        ax.set_title(k, fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)
