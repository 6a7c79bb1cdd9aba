"""Pictures: JPEG grids of batches with boxes, class names and masks (torchvision drawing)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks, make_grid

from .ops import xywh2xyxy

PALETTE = (
    "#FF3838 #FF9D97 #FF701F #FFB21D #CFD231 #48F90A #92CC17 #3DDB86 #1A9334 #00D4BB "
    "#2C99A8 #00C2FF #344593 #6473FF #0018EC #8438FF #520085 #CB38FF #FF95C8 #FF37C7"
).split()
MAX_IMAGES, MAX_SIZE, PAD = 16, 1920, 4  # images in a grid, its longest side, the gap (pixels)


def draw_batch(images, targets=None, masks=None, *, fname, names=None, preds=None):
    """Write a grid of up to MAX_IMAGES images, uint8 (bs,3,H,W), to fname -> its path. Labels:
    targets (N,6) [image, cls, cx, cy, w, h] normalised, masks (bs,h,w) overlap index maps; or
    preds per image (n,6+) [x1, y1, x2, y2, conf, cls] input px, masks per image (n,h,w) bool."""
    bs, _, H, W = images.shape
    n, cells = min(bs, MAX_IMAGES), []
    for i in range(n):
        if preds is not None:
            p = preds[i].detach().float().cpu()
            boxes, cls, conf = p[:, :4], p[:, 5].long().tolist(), p[:, 4].tolist()
        else:
            t = targets[targets[:, 0] == i].float().cpu()
            boxes = xywh2xyxy(t[:, 2:6] * torch.tensor([W, H, W, H]))
            cls, conf = t[:, 1].long().tolist(), None
        inst = masks[i].cpu() if masks is not None and cls else None
        if inst is not None:  # labels: an overlap index map (k: the k-th target); preds: (n,h,w)
            inst = inst == torch.arange(1, len(cls) + 1)[:, None, None] if inst.ndim == 2 else inst
            inst = F.interpolate(inst[None].float(), size=(H, W), mode="nearest")[0].bool()
        width = max(1, round(W / 320))
        cells.append(draw_detections(images[i].cpu(), boxes, cls, conf, names, inst, width))
    grid = make_grid(cells, math.ceil(math.sqrt(n)), PAD, pad_value=255)
    grid = Image.fromarray(grid.permute(1, 2, 0).numpy())
    grid.thumbnail((MAX_SIZE, MAX_SIZE), Image.Resampling.BILINEAR)  # only ever shrinks
    Path(fname).parent.mkdir(parents=True, exist_ok=True)
    grid.save(fname, quality=90)
    return Path(fname)


def draw_detections(image, boxes, cls, conf=None, names=None, masks=None, width=1, labels=True):
    """uint8 (3,H,W) image with bool masks (n,H,W) blended in and boxes (n,4) xyxy px drawn in the
    colours of classes cls, labelled "name conf" ("name" if conf is None, nothing unless labels)."""
    if not cls:
        return image
    colors = [PALETTE[c % len(PALETTE)] for c in cls]
    text = [names[c] if names and c < len(names) else str(c) for c in cls]
    if conf is not None:
        text = [f"{s} {c:.2f}" for s, c in zip(text, conf)]
    if masks is not None:
        image = draw_segmentation_masks(image, masks, alpha=0.5, colors=colors)
    image = draw_bounding_boxes(image, boxes, colors=colors, width=width)
    if labels:
        image = draw_labels(image, boxes, text, colors)
    return image


def draw_labels(image: torch.Tensor, boxes, text: list[str], colors: list[str]) -> torch.Tensor:
    """Each box's text, white on a tab of its colour above the box's top-left corner (inside the
    box where the image ends), in a font that scales with the image: uint8 (3,H,W) -> the same."""
    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    draw = ImageDraw.Draw(picture)
    font = label_font(sum(picture.size) / 2)
    for box, label, color in zip(boxes.tolist(), text, colors):
        left, top, right, bottom = draw.textbbox((0, 0), label, font=font)
        x, y = box[0], box[1] - (bottom - top) - 2
        if y < 0:
            y = box[1]
        draw.rectangle((x, y, x + right - left + 2, y + bottom - top + 2), fill=color)
        draw.text((x + 1 - left, y + 1 - top), label, fill="white", font=font)
    return torch.from_numpy(np.array(picture)).permute(2, 0, 1)


def label_font(image_size: float) -> ImageFont.ImageFont:
    """The labels' font: 3.5% of the image's mean side (yolov5's), at least 8 px."""
    size = max(round(image_size * 0.035), 8)
    try:
        return ImageFont.load_default(size)
    except TypeError:
        # Pillow before 10.1 has one bitmap font of one size
        return ImageFont.load_default()
