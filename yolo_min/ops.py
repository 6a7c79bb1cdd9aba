"""Box and mask helpers shared by the data pipeline, validation, prediction and plotting.

Holds box format conversion, IoU, NMS (yolov5 semantics, torchvision batched NMS, no time limit),
mapping boxes and masks from the letterboxed network input back to the original image, mask
assembly from prototypes, polygon rasterisation and COCO RLE encoding (no pycocotools).
Does not hold matching or AP (metrics.py). Coordinates are pixels; `ratio_pad` is the dataset's
((ratio_h, ratio_w), (pad_w, pad_h)) letterbox record, `*_hw` are (height, width).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import torchvision


def xywh2xyxy(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """(..., 4) [cx, cy, w, h] -> [x1, y1, x2, y2], a tensor or a numpy array like x."""
    xy, wh = x[..., :2], x[..., 2:4] / 2
    return (torch.cat if isinstance(x, torch.Tensor) else np.concatenate)((xy - wh, xy + wh), -1)


def xyxy2xywh(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """(..., 4) [x1, y1, x2, y2] -> [cx, cy, w, h], a tensor or a numpy array like x."""
    xy, wh = (x[..., :2] + x[..., 2:4]) / 2, x[..., 2:4] - x[..., :2]
    return (torch.cat if isinstance(x, torch.Tensor) else np.concatenate)((xy, wh), -1)


def box_corners(xyxy: np.ndarray) -> np.ndarray:
    """(..., 4) xyxy boxes -> (..., 4, 2) corners [x, y] clockwise from the top-left, dtype kept."""
    return xyxy[..., [0, 1, 2, 1, 2, 3, 0, 3]].reshape(*xyxy.shape[:-1], 4, 2)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of xyxy boxes a (n, 4) and b (m, 4) -> (n, m) (COCO's formula, no +1)."""
    return torchvision.ops.box_iou(a, b)


def non_max_suppression(
    pred: torch.Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
    multi_label: bool = False,
    max_det: int = 300,
    nm: int = 0,
    max_nms: int = 30000,
    classes: list[int] | None = None,
    agnostic: bool = False,
) -> list[torch.Tensor]:
    """Per-class NMS of decoded head output.

    pred (bs, N, 5+nc+nm): [cx, cy, w, h (input pixels), obj, cls probs..., mask coefs...].
    Score = obj * cls; multi_label keeps every (box, class) pair above conf_thres, else the best.
    classes: keep only these; agnostic: boxes of different classes suppress each other too.
    The `max_nms` highest scores enter NMS; the `max_det` best survivors are kept.
    Returns per image (n, 6+nm) [x1, y1, x2, y2, conf, cls, coefs...] sorted by conf (descending).
    """
    nc = pred.shape[2] - 5 - nm
    out = []
    for x in pred:
        x = x[x[:, 4] > conf_thres].float()
        scores = x[:, 5 : 5 + nc] * x[:, 4:5]
        if multi_label:
            i, j = (scores > conf_thres).nonzero().T
            conf = scores[i, j]
        else:
            conf, j = scores.max(1)
            i = (conf > conf_thres).nonzero().squeeze(1)
            conf, j = conf[i], j[i]
        if classes is not None:
            keep = torch.isin(j, torch.tensor(classes, device=j.device))
            i, j, conf = i[keep], j[keep], conf[keep]
        det = torch.cat((xywh2xyxy(x[i, :4]), conf[:, None], j[:, None].float(), x[i, 5 + nc :]), 1)
        det = det[conf.argsort(descending=True)[:max_nms]]
        groups = torch.zeros_like(det[:, 5]) if agnostic else det[:, 5]
        keep = torchvision.ops.batched_nms(det[:, :4], det[:, 4], groups, iou_thres)
        out.append(det[keep[:max_det]])
    return out


def scale_boxes(boxes: torch.Tensor, ratio_pad, orig_hw: tuple[int, int]) -> torch.Tensor:
    """xyxy (n, 4) in letterboxed input pixels -> xyxy original pixels, clipped to the image."""
    (rh, rw), (pw, ph) = ratio_pad
    b = boxes[:, :4].clone()
    b[:, 0::2] = ((b[:, 0::2] - pw) / rw).clamp(0, orig_hw[1])
    b[:, 1::2] = ((b[:, 1::2] - ph) / rh).clamp(0, orig_hw[0])
    return b


def process_mask(
    protos: torch.Tensor, coefs: torch.Tensor, boxes: torch.Tensor, input_hw: tuple[int, int]
) -> torch.Tensor:
    """Instance masks at the network input size, as yolov5's process_mask(upsample=True).

    protos (nm, h, w), coefs (n, nm), boxes (n, 4) xyxy input pixels -> (n, H, W) bool:
    sigmoid(coefs @ protos), zero outside the box (at prototype resolution), bilinear upsampling
    to input_hw, > 0.5. A mask reaches at most one prototype pixel beyond its box.
    """
    nm, h, w = protos.shape
    if len(coefs) == 0:
        return torch.zeros((0, *input_hw), dtype=torch.bool, device=protos.device)
    m = (coefs.float() @ protos.float().view(nm, -1)).sigmoid().view(-1, h, w)
    scale = boxes.new_tensor([w / input_hw[1], h / input_hw[0]] * 2)
    x1, y1, x2, y2 = (boxes[:, :4] * scale)[:, :, None].unbind(1)  # (n, 1) each, prototype pixels
    rows = torch.arange(h, device=m.device, dtype=boxes.dtype)
    cols = torch.arange(w, device=m.device, dtype=boxes.dtype)
    in_rows, in_cols = (rows >= y1) & (rows < y2), (cols >= x1) & (cols < x2)  # (n, h), (n, w)
    m = m * (in_rows[:, :, None] & in_cols[:, None, :])
    return F.interpolate(m[None], size=input_hw, mode="bilinear", align_corners=False)[0] > 0.5


def scale_masks(masks: torch.Tensor, ratio_pad, orig_hw: tuple[int, int]) -> torch.Tensor:
    """(n, H, W) bool masks on the letterboxed input -> (n, h, w) bool on the original image.

    The padding is cut and the rest resized (nearest) to orig_hw.
    """
    (rh, rw), (pw, ph) = ratio_pad
    top, left = (
        round(ph - 0.1),
        round(pw - 0.1),
    )  # the image starts here (yolov5 splits odd padding this way)
    m = masks[:, top : top + round(orig_hw[0] * rh), left : left + round(orig_hw[1] * rw)]
    if m.shape[0] == 0:
        return masks.new_zeros((0, *orig_hw))
    if tuple(m.shape[1:]) != tuple(orig_hw):
        m = F.interpolate(m[None].to(torch.uint8), size=tuple(orig_hw), mode="nearest-exact")[
            0
        ].bool()
    return m


def polygons_to_masks(polygons: list, hw: tuple[int, int]) -> torch.Tensor:
    """Rasterise polygons (each (k, 2) [x, y] pixels) into (m, h, w) bool masks, exactly as COCO.

    pycocotools' polygon rasteriser, reimplemented: vertices snapped to 1/5 pixel, each edge walked
    in 1/5-pixel steps along its longer axis, and at every column centre the edge toggles the
    pixels from the first row whose centre lies below it. PIL's ImageDraw would differ on ~1% of
    the pixels (it rounds vertices to whole pixels and fills the outline).
    """
    h, w = hw
    out = np.zeros((len(polygons), h, w), dtype=bool)
    for i, poly in enumerate(polygons):
        p = np.trunc(np.asarray(poly, dtype=np.float64).reshape(-1, 2) * 5 + 0.5).astype(np.int64)
        if len(p) < 3:
            continue
        xs, ys, xe, ye = p[:, 0], p[:, 1], np.roll(p[:, 0], -1), np.roll(p[:, 1], -1)
        along_x = np.abs(xe - xs) >= np.abs(ye - ys)
        flip = np.where(
            along_x, xs > xe, ys > ye
        )  # round from the lower end, walk in the edge's direction
        x0, y0, x1, y1 = (
            np.where(flip, xe, xs),
            np.where(flip, ye, ys),
            np.where(flip, xs, xe),
            np.where(flip, ys, ye),
        )
        n = np.maximum(np.abs(xe - xs), np.abs(ye - ys))
        slope = np.where(along_x, y1 - y0, x1 - x0) / np.maximum(n, 1)
        e = np.repeat(np.arange(len(p)), n + 1)  # edge of each walked point
        step = np.arange(len(e)) - np.repeat(np.cumsum(n + 1) - n - 1, n + 1)
        t = np.where(flip[e], n[e] - step, step)
        minor = np.trunc(np.where(along_x, y0, x0)[e] + slope[e] * t + 0.5).astype(np.int64)
        u, v = np.where(along_x[e], x0[e] + t, minor), np.where(along_x[e], minor, y0[e] + t)
        j = np.flatnonzero(u[1:] != u[:-1]) + 1  # the walk crosses a column boundary
        col = (np.where(u[j] < u[j - 1], u[j], u[j] - 1) + 0.5) / 5 - 0.5
        row = np.ceil(np.clip((np.minimum(v[j], v[j - 1]) + 0.5) / 5 - 0.5, 0, h))
        keep = (np.floor(col) == col) & (col >= 0) & (col <= w - 1)
        if keep.any():  # toggles in column-major order, parity fills; columns lo..hi only
            col, row = col[keep].astype(np.int64), row[keep].astype(np.int64)
            lo, hi = col.min(), col.max() + 1
            toggles = np.bincount((col - lo) * h + row, minlength=(hi - lo) * h + 1)[
                : (hi - lo) * h
            ]
            out[i, :, lo:hi] = (np.cumsum(toggles) % 2 == 1).reshape(hi - lo, h).T
    return torch.from_numpy(out)


# the 8 neighbours (dy, dx) of a pixel, clockwise from the east (rows grow downwards)
NEIGHBOURS = ((0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1))


def trace_border(m: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Moore-neighbour tracing of the outer border of the 8-connected component whose first pixel
    in raster order is `start` (a flat index) in a bool (h, w) mask with a background frame ->
    (border pixels (k, 2) [x, y] clockwise, the direction index of the step leaving each)."""
    flat, w = m.ravel(), m.shape[1]
    steps = [dy * w + dx for dy, dx in NEIGHBOURS]
    p, d, points, dirs = start, 4, [], []  # the search starts at the west, known background
    while True:
        nd = next(((d + k) % 8 for k in range(8) if flat[p + steps[(d + k) % 8]]), None)
        if nd is None or (dirs and nd == dirs[0] and p == start):  # leaving the start again
            break
        points.append(p)
        dirs.append(nd)
        p, d = p + steps[nd], (nd + 6 - nd % 2) % 8  # from the last background neighbour seen
    points = np.array(points or [start])
    return np.stack([points % w, points // w], 1), np.array(dirs or [0])


def mask_to_polygon(mask: torch.Tensor | np.ndarray) -> np.ndarray:
    """The largest outer border of a bool (h, w) mask -> (k, 2) float32 [x, y] pixel indices of its
    corner pixels, (0, 2) for an empty mask. As yolov5 writes OpenCV's findContours (RETR_EXTERNAL,
    CHAIN_APPROX_SIMPLE): straight runs keep their ends, components in another's holes are not
    outer borders, and the largest is the one with the most corners."""
    m = np.pad(np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool), 1)
    best = np.zeros((0, 2), np.float32)
    while m.any():
        border, dirs = trace_border(m, int(m.argmax()))
        inside = polygons_to_masks([border + 0.5], m.shape)[0].numpy()  # pixel centres inside
        inside[border[:, 1], border[:, 0]] = True
        corners = border[(dirs != np.roll(dirs, 1)) | (len(dirs) == 1)]
        if len(corners) >= len(best):  # ties: the lower one, as OpenCV lists them bottom up
            best = (corners - 1).astype(np.float32)
        m &= ~inside  # the component, its holes and all inside them
    return best


def mask_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of bool masks a (n, h, w) and b (m, h, w) -> (n, m) float64."""
    a, b = a.flatten(1).float(), b.flatten(1).float()
    inter = (a @ b.T).double()  # exact pixel counts up to 2**24 pixels per mask
    union = a.sum(1).double()[:, None] + b.sum(1).double()[None] - inter
    return torch.where(union > 0, inter / union.clamp(min=1), torch.zeros_like(inter))


def rle_encode(mask: torch.Tensor | np.ndarray) -> dict:
    """COCO's compressed RLE of one (h, w) bool mask: {"size": [h, w], "counts": str}."""
    m = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool)
    flat = m.T.reshape(-1)
    edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate(([0], edges, [flat.size]))).tolist()
    if flat.size and flat[0]:
        counts = [0] + counts  # runs always start with zeros
    chars = []
    for i, x in enumerate(counts):
        x = x - counts[i - 2] if i > 2 else x  # delta against the run of the same value
        while True:  # 5 bits per char, bit 0x20 = more follow, offset 48
            c, x = x & 0x1F, x >> 5
            more = x != -1 if c & 0x10 else x != 0
            chars.append(chr(c + (0x20 if more else 0) + 48))
            if not more:
                break
    return {"size": [int(m.shape[0]), int(m.shape[1])], "counts": "".join(chars)}
