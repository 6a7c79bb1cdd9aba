"""Box and mask helpers (yolov5's NMS, COCO-exact rasterisation and RLE), coordinates in pixels;
`ratio_pad` is a letterbox's ((ratio_h, ratio_w), (pad_w, pad_h)), `*_hw` are (height, width)."""

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


box_iou = torchvision.ops.box_iou  # xyxy (n, 4), (m, 4) -> (n, m) IoU, COCO's formula (no +1)


def non_max_suppression(
    pred, conf_thres, iou_thres, multi_label=False, max_det=300, nm=0, classes=None, agnostic=False
) -> list[torch.Tensor]:
    """yolov5's NMS: pred (bs, N, 5+nc+nm) [cx, cy, w, h, obj, class probs, coefs] -> per image
    (n, 6+nm) [x1, y1, x2, y2, conf = obj * prob, cls, coefs] by descending conf. multi_label: all
    (box, class) pairs over conf_thres; classes: only these; agnostic: one NMS for all classes."""
    nc = pred.shape[2] - 5 - nm
    out = []
    for x in pred:
        x = x[x[:, 4] > conf_thres].float()
        scores = x[:, 5 : 5 + nc] * x[:, 4:5]
        if multi_label:
            i, j = (scores > conf_thres).nonzero().T
        else:
            i, j = torch.arange(len(x), device=x.device), scores.argmax(1)
        conf = scores[i, j]
        keep = conf > conf_thres
        if classes is not None:
            keep &= torch.isin(j, torch.tensor(classes, device=j.device))
        # yolov5's max_nms: the 30000 most confident pairs (only theirs are turned into rows)
        top = keep.nonzero().squeeze(1)[conf[keep].argsort(descending=True)[:30000]]
        i, j = i[top], j[top]
        det = torch.cat(
            (xywh2xyxy(x[i, :4]), scores[i, j, None], j[:, None].float(), x[i, 5 + nc :]), 1
        )
        groups = torch.zeros_like(det[:, 5]) if agnostic else det[:, 5]
        keep = torchvision.ops.batched_nms(det[:, :4], det[:, 4], groups, iou_thres)
        out.append(det[keep[:max_det]])
    return out


def scale_boxes(boxes: torch.Tensor, ratio_pad, orig_hw: tuple[int, int]) -> torch.Tensor:
    """xyxy (n, 4) in letterboxed input pixels -> xyxy original pixels, clipped to the image."""
    (rh, rw), (pw, ph) = ratio_pad
    x = ((boxes[:, 0:4:2] - pw) / rw).clamp(0, orig_hw[1])
    y = ((boxes[:, 1:4:2] - ph) / rh).clamp(0, orig_hw[0])
    return torch.stack((x, y), 2).flatten(1)


def process_mask(protos, coefs, boxes, input_hw: tuple[int, int]) -> torch.Tensor:
    """protos (nm, h, w), coefs (n, nm), boxes (n, 4) xyxy input pixels -> (n, H, W) bool masks."""
    # yolov5's process_mask(upsample=True): sigmoid(coefs @ protos), cropped, upsampled, > 0.5
    nm, h, w = protos.shape
    m = (coefs.float() @ protos.float().view(nm, -1)).sigmoid().view(-1, 1, h, w)
    scale = boxes.new_tensor([w / input_hw[1], h / input_hw[0]] * 2)
    x1, y1, x2, y2 = (boxes[:, :4] * scale)[:, :, None, None, None].unbind(1)  # prototype pixels
    rows = torch.arange(h, device=m.device, dtype=boxes.dtype)[:, None]
    cols = torch.arange(w, device=m.device, dtype=boxes.dtype)
    m = m * ((rows >= y1) & (rows < y2) & (cols >= x1) & (cols < x2))
    return F.interpolate(m, size=input_hw, mode="bilinear", align_corners=False)[:, 0] > 0.5


def scale_masks(masks: torch.Tensor, ratio_pad, orig_hw: tuple[int, int]) -> torch.Tensor:
    """(n, H, W) bool masks on the input -> (n, h, w) on the original: padding cut, nearest."""
    (rh, rw), (pw, ph) = ratio_pad
    # the image on the input: rows x cols pixels, at least one each (a 5000 x 1 image: 640 x 1)
    rows = max(round(orig_hw[0] * rh), 1)
    cols = max(round(orig_hw[1] * rw), 1)
    # where letterbox put it: round((H - rows) / 2 - 0.1); ph is (H - h * r) / 2 or that row
    top = round(ph + (orig_hw[0] * rh - rows) / 2 - 0.1)
    left = round(pw + (orig_hw[1] * rw - cols) / 2 - 0.1)
    m = masks[:, top : top + rows, left : left + cols]
    if m.shape[1:] != tuple(orig_hw):
        m = F.interpolate(m[:, None].byte(), size=orig_hw, mode="nearest-exact")[:, 0].bool()
    return m


def polygons_to_masks(polygons: list, hw: tuple[int, int]) -> torch.Tensor:
    """Polygons (each (k, 2) [x, y] pixels) -> (m, h, w) bool masks, exactly as pycocotools."""
    # pycocotools' way: edges walked in 1/5-pixel steps toggle the pixels below them per column
    # (PIL's polygon fill differs on ~1% of the pixels)
    h, w = hw
    out = np.zeros((len(polygons), h, w), dtype=bool)
    for i, poly in enumerate(polygons):
        p = np.trunc(np.asarray(poly, dtype=np.float64).reshape(-1, 2) * 5 + 0.5).astype(np.int64)
        if len(p) < 3:
            continue
        xs, ys, xe, ye = p[:, 0], p[:, 1], np.roll(p[:, 0], -1), np.roll(p[:, 1], -1)
        along_x = np.abs(xe - xs) >= np.abs(ye - ys)
        flip = np.where(along_x, xs > xe, ys > ye)  # round from the lower end, walk the edge's way
        x0, y0, x1, y1 = np.where(flip, (xe, ye, xs, ys), (xs, ys, xe, ye))
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
            # row h: below the image; its toggles are dropped
            toggles = np.bincount((col - lo) * h + row, minlength=(hi - lo) * h + 1)[:-1]
            out[i, :, lo:hi] = (np.cumsum(toggles) % 2 == 1).reshape(hi - lo, h).T
    return torch.from_numpy(out)


def trace_border(m: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Moore-neighbour trace of the outer border of the 8-connected component at flat index `start`
    of a zero-framed bool mask -> its pixels (k, 2) [x, y] clockwise, each one's step (0-7)."""
    flat, w = m.ravel(), m.shape[1]
    # the 8 neighbours' flat offsets, clockwise from the east: E, SE, S, SW, W, NW, N, NE
    steps = [1, w + 1, w, w - 1, -1, -w - 1, -w, -w + 1]
    p, d, path = start, 4, []  # (pixel, its step); the search starts at the west, background
    while True:
        nd = next(((d + k) % 8 for k in range(8) if flat[p + steps[(d + k) % 8]]), None)
        if nd is None or (path and path[0] == (p, nd)):  # leaving the start again
            break
        path.append((p, nd))
        p, d = p + steps[nd], (nd + 6 - nd % 2) % 8  # from the last background neighbour seen
    points, dirs = np.array(path or [(start, 0)]).T
    return np.stack([points % w, points // w], 1), dirs


def mask_to_polygon(mask: torch.Tensor | np.ndarray) -> np.ndarray:
    """A bool (h, w) mask's outer border with the most corners -> those (k, 2) float32 [x, y], as
    yolov5 uses OpenCV's findContours (RETR_EXTERNAL, CHAIN_APPROX_SIMPLE); (0, 2) if empty."""
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
    return inter / union.clamp(min=1)  # 0 where both are empty


def rle_encode(mask: torch.Tensor | np.ndarray) -> dict:
    """COCO's compressed RLE of one (h, w) bool mask: {"size": [h, w], "counts": str}."""
    flat = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool).T.ravel()
    # run lengths from the runs' starts; the first run is one of zeros (maybe empty)
    counts = np.diff(np.r_[0, np.flatnonzero(np.diff(flat, prepend=False)), flat.size]).tolist()
    chars = []
    for i, x in enumerate(counts):
        x = x - counts[i - 2] if i > 2 else x  # delta against the last run of the same value
        more = True
        while more:  # 5 bits per char, bit 0x20 = more follow, offset 48
            c, x = x & 0x1F, x >> 5
            more = x != -1 if c & 0x10 else x != 0
            chars.append(chr(c + 0x20 * more + 48))
    return {"size": [int(n) for n in mask.shape], "counts": "".join(chars)}
