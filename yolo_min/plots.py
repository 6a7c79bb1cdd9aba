"""Pictures: JPEG grids of batches with boxes, class names and masks (torchvision drawing)."""

import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms.functional import pil_to_tensor, to_pil_image
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks, make_grid

from .ops import xywh2xyxy

PALETTE = (
    "#FF3838 #FF9D97 #FF701F #FFB21D #CFD231 #48F90A #92CC17 #3DDB86 #1A9334 #00D4BB "
    "#2C99A8 #00C2FF #344593 #6473FF #0018EC #8438FF #520085 #CB38FF #FF95C8 #FF37C7"
).split()
# At most this many images in a grid.
MAX_IMAGES = 16
# The grid's longest side (pixels).
MAX_SIZE = 1920
# The gap between its images (pixels).
PAD = 4
# The threads of draw_later that finish_drawing has not yet waited for (yolov5 draws in threads
# too). None is left when a loader forks its workers: fork copies no thread.
DRAWING = []


def draw_batch(images, targets=None, masks=None, *, fname, names=None, preds=None):
    """Write a grid of up to MAX_IMAGES images, uint8 (bs,3,H,W), to fname -> its path. Labels:
    targets (N,6) [image, cls, cx, cy, w, h] normalised, masks (bs,h,w) overlap index maps; or
    preds per image (n,6+) [x1, y1, x2, y2, conf, cls] input px, masks per image (n,h,w) bool."""
    images = images[:MAX_IMAGES].cpu()
    height, width = images.shape[2:]
    line_width = max(1, round(width / 320))
    cells = []
    for i, image in enumerate(images):
        conf = None
        if preds is not None:
            pred = preds[i].detach().float().cpu()
            boxes = pred[:, :4]
            cls = pred[:, 5].long().tolist()
            conf = pred[:, 4].tolist()
        else:
            mine = targets[targets[:, 0] == i].float().cpu()
            # (W, H, W, H): the boxes' centres and sizes to pixels
            scale = torch.tensor([width, height] * 2)
            boxes = xywh2xyxy(mine[:, 2:6] * scale)
            cls = mine[:, 1].long().tolist()
        instance_masks = None
        if masks is not None and cls:
            instance_masks = masks[i].cpu()
            # an overlap index map (h, w), k where the k-th target is, to bool (n, h, w)
            if instance_masks.ndim == 2:
                numbers = torch.arange(1, len(cls) + 1)[:, None, None]
                instance_masks = instance_masks == numbers
            resized = F.interpolate(
                instance_masks[None].float(), size=(height, width), mode="nearest"
            )
            instance_masks = resized[0].bool()
        cells.append(
            draw_detections(
                image, boxes, cls, conf=conf, names=names, masks=instance_masks, width=line_width
            )
        )
    per_row = math.ceil(math.sqrt(len(images)))
    grid = make_grid(cells, nrow=per_row, padding=PAD, pad_value=255)
    picture = to_pil_image(grid)
    # thumbnail only ever shrinks.
    picture.thumbnail((MAX_SIZE, MAX_SIZE), Image.Resampling.BILINEAR)
    path = Path(fname)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path, quality=90)
    return path


def draw_later(*args, **kwargs):
    """draw_batch(*args, **kwargs) in a background thread, so that the run goes on meanwhile (an
    error is a one-line warning, not raised); finish_drawing waits for it."""
    DRAWING.append(threading.Thread(target=_draw_or_warn, args=args, kwargs=kwargs))
    DRAWING[-1].start()


def _draw_or_warn(*args, **kwargs):
    try:
        draw_batch(*args, **kwargs)
    except Exception as e:
        print(f"warning: {kwargs.get('fname')} not drawn: {e}", flush=True)


def finish_drawing():
    """Wait until the pictures of draw_later are written."""
    while DRAWING:
        DRAWING.pop().join()


def draw_detections(image, boxes, cls, conf, names, masks=None, width=1, labels=True):
    """uint8 (3,H,W) image with bool masks (n,H,W) blended in and boxes (n,4) xyxy px drawn in the
    colours of classes cls, labelled "name conf" ("name" if conf is None, nothing unless labels)."""
    if not cls:
        return image
    colors = [PALETTE[c % len(PALETTE)] for c in cls]
    # a class that names has no name for is shown by its number
    text = [names[c] if names and c < len(names) else str(c) for c in cls]
    if conf is not None:
        text = [f"{name} {score:.2f}" for name, score in zip(text, conf)]
    if masks is not None:
        image = draw_segmentation_masks(image, masks, alpha=0.5, colors=colors)
    image = draw_bounding_boxes(image, boxes, colors=colors, width=width)
    if labels:
        image = draw_labels(image, boxes, text, colors)
    return image


def draw_labels(image, boxes, text, colors):
    """Each box's text, white on a tab of its colour above the box's top-left corner (inside the
    box where the image ends), in a font that scales with the image: uint8 (3,H,W) -> the same."""
    picture = to_pil_image(image)
    draw = ImageDraw.Draw(picture)
    # 3.5% of the image's mean side (yolov5's), at least 8 px
    size = max(round(sum(picture.size) / 2 * 0.035), 8)
    try:
        font = ImageFont.load_default(size)
    except TypeError:
        # Pillow before 10.1 has one bitmap font of one size.
        font = ImageFont.load_default()
    for box, label, color in zip(boxes.tolist(), text, colors):
        left, top, right, bottom = draw.textbbox((0, 0), label, font=font)
        # The tab holds the text and a 1 px margin.
        x, y = box[:2]
        tab_height = bottom - top + 2
        if y >= tab_height:
            y -= tab_height
        draw.rectangle((x, y, x + right - left + 2, y + tab_height), fill=color)
        origin = (x + 1 - left, y + 1 - top)
        draw.text(origin, label, fill="white", font=font)
    return pil_to_tensor(picture)
