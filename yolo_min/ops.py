"""Box and mask helpers (yolov5's NMS, COCO-exact rasterisation and RLE), coordinates in pixels;
`ratio_pad` is a letterbox's ((ratio_h, ratio_w), (pad_w, pad_h)), `*_hw` are (height, width)."""

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor


def xywh2xyxy(x):
    """(..., 4) [cx, cy, w, h] -> [x1, y1, x2, y2], a tensor or a numpy array like x."""
    centre = x[..., :2]
    half_size = x[..., 2:4] / 2
    concat = torch.cat if isinstance(x, Tensor) else np.concatenate
    return concat((centre - half_size, centre + half_size), -1)


def xyxy2xywh(x):
    """(..., 4) [x1, y1, x2, y2] -> [cx, cy, w, h], a tensor or a numpy array like x."""
    top_left = x[..., :2]
    bottom_right = x[..., 2:4]
    concat = torch.cat if isinstance(x, Tensor) else np.concatenate
    centre = (top_left + bottom_right) / 2
    size = bottom_right - top_left
    return concat((centre, size), -1)


def box_corners(xyxy):
    """(..., 4) xyxy boxes -> (..., 4, 2) corners [x, y] clockwise from the top-left, dtype kept."""
    # [x1, y1], [x2, y1], [x2, y2], [x1, y2]
    corners = xyxy[..., [0, 1, 2, 1, 2, 3, 0, 3]]
    return corners.reshape(*xyxy.shape[:-1], 4, 2)


# xyxy (n, 4), (m, 4) -> (n, m) IoU, by COCO's formula (no +1)
box_iou = torchvision.ops.box_iou


def non_max_suppression(
    pred, conf_thres, iou_thres, multi_label=False, max_det=300, nm=0, classes=None, agnostic=False
):
    """yolov5's NMS: pred (bs, N, 5+nc+nm) [cx, cy, w, h, obj, class probs, coefs] -> per image
    (n, 6+nm) [x1, y1, x2, y2, conf = obj * prob, cls, coefs] by descending conf. multi_label: all
    (box, class) pairs over conf_thres; classes: only these; agnostic: one NMS for all classes."""
    coefs_start = pred.shape[2] - nm
    out = []
    for x in pred:
        x = x[x[:, 4] > conf_thres].float()
        scores = x[:, 5:coefs_start] * x[:, 4:5]
        pairs = scores > conf_thres
        if not multi_label:
            # each box's best class only
            pairs &= F.one_hot(scores.argmax(1), scores.shape[1]).bool()
        i, j = pairs.nonzero().T
        if classes is not None:
            wanted = torch.isin(j, torch.tensor(classes, device=j.device))
            i = i[wanted]
            j = j[wanted]
        conf = scores[i, j]
        # yolov5's max_nms: the 30000 most confident pairs (only theirs are turned into rows)
        top = conf.argsort(descending=True)[:30000]
        i = i[top]
        j = j[top]
        det = torch.cat(
            (xywh2xyxy(x[i, :4]), conf[top, None], j[:, None].float(), x[i, coefs_start:]), 1
        )
        groups = torch.zeros_like(j) if agnostic else j
        keep = torchvision.ops.batched_nms(det[:, :4], det[:, 4], groups, iou_thres)
        out.append(det[keep[:max_det]])
    return out


def scale_boxes(boxes, ratio_pad, orig_hw):
    """xyxy (n, 4) in letterboxed input pixels -> xyxy original pixels, clipped to the image."""
    (ratio_h, ratio_w), (pad_w, pad_h) = ratio_pad
    orig_h, orig_w = orig_hw
    # x1, x2 and y1, y2
    x = ((boxes[:, ::2] - pad_w) / ratio_w).clamp(0, orig_w)
    y = ((boxes[:, 1::2] - pad_h) / ratio_h).clamp(0, orig_h)
    return torch.stack((x, y), 2).flatten(1)


def process_mask(protos, det, input_hw):
    """protos (nm, h, w), det (n, 6+nm) non_max_suppression's [x1, y1, x2, y2 input pixels, conf,
    cls, coefs] -> (n, H, W) bool masks."""
    # yolov5's process_mask(upsample=True): sigmoid(coefs @ protos), cropped, upsampled, > 0.5
    h, w = protos.shape[1:]
    masks = (det[:, 6:].float() @ protos.float().flatten(1)).sigmoid().view(-1, 1, h, w)
    boxes = det[:, :4]
    input_h, input_w = input_hw
    scale = boxes.new_tensor([w / input_w, h / input_h] * 2)
    # the boxes in prototype pixels, each coordinate (n, 1, 1, 1)
    x1, y1, x2, y2 = (boxes * scale).T[..., None, None, None]
    rows = torch.arange(h, device=boxes.device)[:, None]
    cols = torch.arange(w, device=boxes.device)
    in_rows = (rows >= y1) & (rows < y2)
    in_cols = (cols >= x1) & (cols < x2)
    masks = masks * in_rows * in_cols
    upsampled = F.interpolate(masks, size=input_hw, mode="bilinear", align_corners=False)
    return upsampled[:, 0] > 0.5


def scale_masks(masks, ratio_pad, orig_hw):
    """(n, H, W) bool masks on the input -> (n, h, w) on the original: padding cut, nearest."""
    (ratio_h, ratio_w), (pad_w, pad_h) = ratio_pad
    orig_h, orig_w = orig_hw
    # the image on the input: rows x cols pixels, at least one each (a 5000 x 1 image: 640 x 1)
    rows = max(round(orig_h * ratio_h), 1)
    cols = max(round(orig_w * ratio_w), 1)
    # where letterbox put it: round((H - rows) / 2 - 0.1); pad_h is (H - h * r) / 2 or that row
    top = round(pad_h + (orig_h * ratio_h - rows) / 2 - 0.1)
    left = round(pad_w + (orig_w * ratio_w - cols) / 2 - 0.1)
    masks = masks[:, top : top + rows, left : left + cols]
    if masks.shape[1:] == tuple(orig_hw):
        return masks
    return F.interpolate(masks[:, None].byte(), size=orig_hw, mode="nearest-exact")[:, 0].bool()


def polygons_to_masks(polygons, hw):
    """Polygons (each (k, 2) [x, y] pixels) -> (m, h, w) bool masks, exactly as pycocotools."""
    # pycocotools' way: edges walked in 1/5-pixel steps toggle the pixels below them per column
    # (PIL's polygon fill differs on ~1% of the pixels)
    h, w = hw
    out = np.zeros((len(polygons), h, w), dtype=bool)
    for i, polygon in enumerate(polygons):
        points = np.asarray(polygon, dtype=np.float64).reshape(-1, 2)
        points = np.trunc(points * 5 + 0.5).astype(np.int64)
        # (under 3 points, each edge is walked there and back: no pixel filled)
        u, v = walk_edges(points)
        # the walk crosses a column boundary between points j and j + 1, one step apart
        j = np.flatnonzero(np.diff(u))
        # the 1/5-pixel column left of the boundary: it counts where it holds a pixel's centre,
        # 5 * col + 2
        left = np.minimum(u[j], u[j + 1])
        col, off_centre = np.divmod(left - 2, 5)
        # the row below the crossing, in pixels
        top = np.minimum(v[j], v[j + 1])
        row = np.ceil(np.clip((top + 0.5) / 5 - 0.5, 0, h)).astype(np.int64)
        keep = (off_centre == 0) & (col >= 0) & (col < w)
        if not keep.any():
            continue
        # toggles in column-major order, parity fills; columns lo..hi only
        col = col[keep]
        row = row[keep]
        lo = col.min()
        hi = col.max() + 1
        # row h: below the image; its toggles are dropped
        index = (col - lo) * h + row
        toggles = np.bincount(index, minlength=(hi - lo) * h + 1)[:-1]
        filled = np.cumsum(toggles) % 2 == 1
        out[i, :, lo:hi] = filled.reshape(hi - lo, h).T
    return torch.from_numpy(out)


def walk_edges(points):
    """A closed polygon's (k, 2) int64 vertices [x, y] in 1/5 pixels -> the x and y of the points
    pycocotools walks along its edges: one step along each edge's longer axis, the other rounded."""
    ends = np.roll(points, -1, axis=0)
    lengths = np.abs(ends - points)
    # each edge's axes, its longer one (x on a tie) first
    axes = np.where(lengths[:, :1] >= lengths[:, 1:], [0, 1], [1, 0])
    start_major, start_minor = np.take_along_axis(points, axes, 1).T
    end_major, end_minor = np.take_along_axis(ends, axes, 1).T
    # one step along the longer axis, -1 or 1; rounded from the end lower on that axis
    direction = np.where(start_major > end_major, -1, 1)
    low_major = np.minimum(start_major, end_major)
    low_minor = np.where(direction < 0, end_minor, start_minor)
    steps = lengths.max(1)
    slope = direction * (end_minor - start_minor) / np.maximum(steps, 1)
    # each walked point's edge, and its step from the edge's start
    edge = np.repeat(np.arange(len(points)), steps + 1)
    first = np.cumsum(steps + 1) - steps - 1
    step = np.arange(len(edge)) - first[edge]
    major = start_major[edge] + direction[edge] * step
    t = major - low_major[edge]
    minor = np.trunc(low_minor[edge] + slope[edge] * t + 0.5).astype(np.int64)
    # back to [x, y]: swapping the axes again undoes the swap
    walked = np.stack([major, minor], 1)
    return np.take_along_axis(walked, axes[edge], 1).T


def trace_border(m, start):
    """Moore-neighbour trace of the outer border of the 8-connected component at flat index `start`
    of a zero-framed bool mask -> its pixels (k, 2) [x, y] clockwise, each one's step (0-7)."""
    flat = m.ravel()
    w = m.shape[1]
    # the 8 neighbours' flat offsets, clockwise from the east: E, SE, S, SW, then their opposites
    # W, NW, N, NE
    steps = [1, w + 1, w, w - 1]
    steps += [-offset for offset in steps]
    # (pixel, its step) along the border; the search starts at the west, background
    path = []
    pixel = start
    direction = 4
    while True:
        turns = [(direction + k) % 8 for k in range(8)]
        step = next((turn for turn in turns if flat[pixel + steps[turn]]), None)
        # an isolated pixel, or leaving the start again
        if step is None or (path and path[0] == (pixel, step)):
            break
        path.append((pixel, step))
        pixel += steps[step]
        # the next search starts from the last background neighbour seen
        direction = (step + 6 - step % 2) % 8
    points, dirs = np.array(path or [(start, 0)]).T
    return np.stack([points % w, points // w], 1), dirs


def as_bool_array(mask):
    """A mask, a tensor on any device or an array, as a numpy bool array."""
    if isinstance(mask, Tensor):
        mask = mask.cpu()
    return np.asarray(mask, dtype=bool)


def mask_to_polygon(mask):
    """A bool (h, w) mask's outer border with the most corners -> those (k, 2) float32 [x, y], as
    yolov5 uses OpenCV's findContours (RETR_EXTERNAL, CHAIN_APPROX_SIMPLE); (0, 2) if empty."""
    m = np.pad(as_bool_array(mask), 1)
    best = np.zeros((0, 2), np.float32)
    while m.any():
        # the first pixel left, row by row: on a component's outer border
        start = int(m.argmax())
        border, dirs = trace_border(m, start)
        # the pixels whose centres lie inside the border, and the border's own
        inside = polygons_to_masks([border + 0.5], m.shape)[0].numpy()
        inside[border[:, 1], border[:, 0]] = True
        # where the border turns; a lone pixel is a corner of its own
        turns = (dirs != np.roll(dirs, 1)) | (len(dirs) == 1)
        corners = border[turns]
        # ties: the lower one, as OpenCV lists them bottom up
        if len(corners) >= len(best):
            best = (corners - 1).astype(np.float32)
        # the component, its holes and all inside them
        m &= ~inside
    return best


def mask_iou(a, b):
    """IoU of bool masks a (n, h, w) and b (m, h, w) -> (n, m) float64."""
    a = a.flatten(1).float()
    b = b.flatten(1).float()
    # exact pixel counts up to 2**24 pixels per mask
    inter = (a @ b.T).double()
    area_a = a.sum(1).double()
    area_b = b.sum(1).double()
    union = area_a[:, None] + area_b - inter
    # 0 where both are empty
    return inter / union.clamp(min=1)


def rle_encode(mask):
    """COCO's compressed RLE of one (h, w) bool mask: {"size": [h, w], "counts": str}."""
    flat = as_bool_array(mask).T.ravel()
    # run lengths from the runs' starts; the first run is one of zeros (maybe empty)
    starts = np.flatnonzero(np.diff(flat, prepend=False))
    counts = np.diff(np.r_[0, starts, flat.size]).tolist()
    chars = []
    for i, x in enumerate(counts):
        # a delta against the last run of the same value
        if i > 2:
            x -= counts[i - 2]
        # 5 bits per char, bit 0x20: more follow, offset 48
        more = True
        while more:
            bits = x & 0x1F
            x >>= 5
            more = x != -1 if bits & 0x10 else x != 0
            chars.append(chr(bits + 0x20 * more + 48))
    return {"size": list(mask.shape), "counts": "".join(chars)}
