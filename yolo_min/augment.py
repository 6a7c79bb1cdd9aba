"""Image geometry and colour for the data pipeline (torch, PIL, numpy; no OpenCV).

Holds yolov5's random affine as a 3x3 matrix, `render` (mosaic pieces or a letterboxed image drawn
through it in ONE resampling per source), `place_labels` (boxes and polygons through the same geometry,
box candidates), HSV jitter and polygon -> overlap-mask rasterisation. Coordinates are continuous
pixels (pixel j covers [j, j+1)); boxes xyxy. Randomness: `random` (seeded per worker by torch).
File reading and batching live in datasets.py, label verification in labels.py.
"""
from __future__ import annotations

import math
import random
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageChops, ImageDraw

FILL = (114, 114, 114)
NPTS = 1000  # polygons are resampled to this many points before clipping (as yolov5 does)


class Piece(NamedTuple):
    """One source image on the canvas: canvas = r * original_pixel + (ox, oy), visible in `clip`."""
    index: int
    r: float
    ox: float
    oy: float
    clip: tuple  # (x0, y0, x1, y1) canvas pixels


def affine_matrix(in_wh: tuple, out_wh: tuple, degrees=0.0, translate=0.1, scale=0.5, shear=0.0,
                  perspective=0.0) -> tuple[np.ndarray, float]:
    """Random 3x3 matrix mapping canvas pixels (x, y, 1) to output pixels (yolov5 order T @ S @ R @ P @ C), and
    its scale factor. in_wh, out_wh: (width, height) of the canvas and the output."""
    C = np.eye(3)
    C[0, 2], C[1, 2] = -in_wh[0] / 2, -in_wh[1] / 2  # canvas centre to origin
    P = np.eye(3)
    P[2, 0], P[2, 1] = random.uniform(-perspective, perspective), random.uniform(-perspective, perspective)
    a, s = math.radians(random.uniform(-degrees, degrees)), random.uniform(1 - scale, 1 + scale)
    R = np.array([[s * math.cos(a), s * math.sin(a), 0], [-s * math.sin(a), s * math.cos(a), 0], [0, 0, 1]])
    S = np.eye(3)
    S[0, 1] = math.tan(math.radians(random.uniform(-shear, shear)))
    S[1, 0] = math.tan(math.radians(random.uniform(-shear, shear)))
    T = np.eye(3)
    T[0, 2] = random.uniform(0.5 - translate, 0.5 + translate) * out_wh[0]
    T[1, 2] = random.uniform(0.5 - translate, 0.5 + translate) * out_wh[1]
    return T @ S @ R @ P @ C, s


Loader = Callable[[int, float], tuple]  # (index, wanted scale) -> (uint8 (h,w,3) tensor, (sx, sy) vs original)


def _paste(out: torch.Tensor, src: torch.Tensor, ax: float, bx: float, ay: float, by: float, rect: tuple) -> tuple:
    """Resample src (h,w,3) by x_out = ax*x_src + bx, y_out = ay*y_src + by into out[:, Y0:Y1, X0:X1].

    Only the source crop that is needed is resized (torch's uint8 antialiased bilinear, exact scale).
    Returns (dx, dy): drawn pixels = exact mapping shifted by (dx, dy), |d| <= 0.5 px (integer placement).
    """
    X0, Y0, X1, Y1 = rect
    hs, ws = src.shape[:2]
    c0, c1 = max(math.floor((X0 - bx) / ax) - 1, 0), min(math.ceil((X1 - bx) / ax) + 1, ws)
    r0, r1 = max(math.floor((Y0 - by) / ay) - 1, 0), min(math.ceil((Y1 - by) / ay) + 1, hs)
    if c1 <= c0 or r1 <= r0:
        return 0.0, 0.0
    y = src[r0:r1, c0:c1].permute(2, 0, 1)  # (3,h,w) channels-last view
    if ax != 1 or ay != 1:
        y = F.interpolate(y[None], scale_factor=(ay, ax), mode="bilinear", antialias=True,
                          recompute_scale_factor=False)[0]
    px, py = ax * c0 + bx, ay * r0 + by  # exact output position of the crop's corner
    P, Q = round(px), round(py)
    xa, ya, xb, yb = max(X0, P), max(Y0, Q), min(X1, P + y.shape[2]), min(Y1, Q + y.shape[1])
    if xb > xa and yb > ya:
        out[:, ya:yb, xa:xb] = y[:, ya - Q:yb - Q, xa - P:xb - P]
    return P - px, Q - py


def render(pieces: list[Piece], M: np.ndarray, out_wh: tuple, load: Loader) -> tuple[torch.Tensor, list]:
    """Draw the pieces through canvas->output matrix M onto a 114-grey uint8 (3,H,W) image of size out_wh.

    Scale/translate-only M (the default): each source is decoded at reduced scale when possible, but
    never finer than its letterbox size r (yolov5 resizes to r first, and so does cache='ram'), and
    resampled straight into its output rectangle (one resampling). Rotation/shear/perspective: the
    canvas is drawn first, then warped once with PIL's AFFINE/PERSPECTIVE transform.
    Also returns per piece the (dx, dy) canvas-pixel shift of its drawn pixels (sub-pixel placement),
    for `place_labels`.
    """
    if M[0, 1] or M[1, 0] or M[2, 0] or M[2, 1]:
        size = math.ceil(max(p.clip[2] for p in pieces)), math.ceil(max(p.clip[3] for p in pieces))
        canvas, shifts = render(pieces, np.eye(3), size, load)
        Mi = np.linalg.inv(M)
        Mi /= Mi[2, 2]
        persp = bool(M[2, 0] or M[2, 1])
        im = Image.fromarray(canvas.permute(1, 2, 0).numpy()).transform(
            tuple(out_wh), Image.Transform.PERSPECTIVE if persp else Image.Transform.AFFINE,
            tuple(Mi.ravel()[:8 if persp else 6]), Image.Resampling.BILINEAR, fillcolor=FILL)
        return torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous(), shifts
    out = torch.full((3, out_wh[1], out_wh[0]), FILL[0], dtype=torch.uint8)
    shifts = []
    for p in pieces:
        X0, Y0 = round(max(M[0, 0] * p.clip[0] + M[0, 2], 0)), round(max(M[1, 1] * p.clip[1] + M[1, 2], 0))
        X1 = round(min(M[0, 0] * p.clip[2] + M[0, 2], out_wh[0]))
        Y1 = round(min(M[1, 1] * p.clip[3] + M[1, 2], out_wh[1]))
        if X1 <= X0 or Y1 <= Y0:
            shifts.append((0.0, 0.0))
            continue
        ax, ay = M[0, 0] * p.r, M[1, 1] * p.r  # original pixels -> output pixels
        im, (sx, sy) = load(p.index, min(max(ax, ay), p.r))
        dx, dy = _paste(out, im, ax / sx, M[0, 0] * p.ox + M[0, 2], ay / sy, M[1, 1] * p.oy + M[1, 2], (X0, Y0, X1, Y1))
        shifts.append((dx / M[0, 0], dy / M[1, 1]))
    return out, shifts


def resample(polys: list, n: int = NPTS) -> np.ndarray:
    """Closed polygons [(k,2)] -> (m,n,2) points spread evenly over each one's vertex index (yolov5's way)."""
    k = np.array([len(p) for p in polys])
    allp, start = np.concatenate(polys), np.cumsum(k) - k
    t = np.linspace(0, 1, n, dtype=np.float32)[None] * k[:, None]
    i = np.minimum(t.astype(np.int64), k[:, None] - 1)
    f = (t - i)[..., None]
    nxt = np.where(i + 1 == k[:, None], 0, i + 1) + start[:, None]
    return allp[i + start[:, None]] * (1 - f) + allp[nxt] * f


def box_candidates(b1: np.ndarray, b2: np.ndarray, wh_thr=2.0, ar_thr=100.0, area_thr=0.1) -> np.ndarray:
    """Keep mask (n,) for boxes b1 (before augment, scaled) -> b2 (after), both (n,4) xyxy pixels."""
    w1, h1 = b1[:, 2] - b1[:, 0], b1[:, 3] - b1[:, 1]
    w2, h2 = b2[:, 2] - b2[:, 0], b2[:, 3] - b2[:, 1]
    ar = np.maximum(w2 / (h2 + 1e-16), h2 / (w2 + 1e-16))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + 1e-16) > area_thr) & (ar < ar_thr)


def place_labels(pieces: list[Piece], labels: list[dict], M: np.ndarray, sc: float, out_wh: tuple,
                 shifts: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Labels of each piece through the geometry: -> cls (n,), boxes (n,4) xyxy output px, polygons.

    labels[k] is the dataset label dict of pieces[k] (normalised `bboxes` xywh, `segments`).
    Instances with a polygon use it: resampled to NPTS points, clamped to the piece's visible canvas
    area, transformed; the box is the extent of the points inside the output. Box-only instances
    transform their corners and clip. polygons[j] is an (NPTS,2) array in output pixels, or None for a
    box-only instance. sc: the affine's scale, for the box-candidate area ratio (yolov5's rule).
    shifts: render's per-piece sub-pixel shifts, so labels follow the drawn pixels exactly.
    """
    W, H = out_wh
    out = []  # per piece: cls, box before (canvas), box after (output), points or None, has-polygon
    for p, lb, (dx, dy) in zip(pieces, labels, shifts):
        if not len(lb["cls"]):
            continue
        (h0, w0), seg = lb["shape"], len(lb["segments"]) > 0
        if seg:
            pts = resample(lb["segments"])
            x, y = pts[..., 0], pts[..., 1]  # (n, NPTS) each
        else:
            b = lb["bboxes"]
            x0, y0, x1, y1 = b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2
            x, y = np.stack([x0, x1, x1, x0], 1), np.stack([y0, y0, y1, y1], 1)
        x = np.clip(x * (w0 * p.r) + p.ox + dx, p.clip[0], p.clip[2])
        y = np.clip(y * (h0 * p.r) + p.oy + dy, p.clip[1], p.clip[3])
        before = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], 1)
        qx, qy = M[0, 0] * x + M[0, 1] * y + M[0, 2], M[1, 0] * x + M[1, 1] * y + M[1, 2]
        if M[2, 0] or M[2, 1]:
            d = M[2, 0] * x + M[2, 1] * y + M[2, 2]
            qx, qy = qx / d, qy / d
        if seg:
            ins = (qx >= 0) & (qx <= W) & (qy >= 0) & (qy <= H)
            after = np.stack([np.where(ins, qx, np.inf).min(1), np.where(ins, qy, np.inf).min(1),
                              np.where(ins, qx, -np.inf).max(1), np.where(ins, qy, -np.inf).max(1)], 1)
            after[~ins.any(1)] = 0
            polys = list(np.stack([qx, qy], 2))
        else:
            after = np.stack([qx.min(1), qy.min(1), qx.max(1), qy.max(1)], 1).clip(0, (W, H, W, H))
            polys = [None] * len(qx)
        out.append((lb["cls"], before, after, polys, np.full(len(qx), seg)))
    if not out:
        return np.zeros(0, np.int64), np.zeros((0, 4), np.float32), []
    cls, before, boxes, polys, seg = (np.concatenate(x) if k != 3 else sum(x, []) for k, x in enumerate(zip(*out)))
    boxes, before = boxes.astype(np.float32), before * sc
    keep = box_candidates(before, boxes, area_thr=0.1) | (seg & box_candidates(before, boxes, area_thr=0.01))
    return cls[keep].astype(np.int64), boxes[keep], [q for q, k in zip(polys, keep) if k]


def hsv_jitter(img: torch.Tensor, hgain=0.015, sgain=0.7, vgain=0.4) -> Image.Image:
    """HSV augmentation with gains U(-1,1)*gain+1 (yolov5's distribution), done in RGB for speed.

    Saturation: blend with the per-pixel value image V = max(R,G,B) (c' = V + gs*(c - V): HSV S times gs,
    H and V kept). Value: every channel times gv (HSV V times gv). Both exact except where a channel
    clips. Hue: a rotation about the grey axis by (gh-1)*180 degrees, the mean shift of yolov5's
    multiplicative hue gain (an approximation; at most +-2.7 degrees).
    """
    gh, gs, gv = (random.uniform(-1, 1) * k + 1 for k in (hgain, sgain, vgain))
    r, g, b = (Image.fromarray(c) for c in img.numpy())  # img: uint8 (3,H,W); returns a PIL RGB image
    v = ImageChops.lighter(ImageChops.lighter(r, g), b)
    im = Image.blend(Image.merge("RGB", (v, v, v)), Image.merge("RGB", (r, g, b)), gs)
    t = math.radians((gh - 1) * 180)
    c, k, q = math.cos(t), (1 - math.cos(t)) / 3, math.sin(t) / math.sqrt(3)
    rot = np.array([[c + k, k - q, k + q], [k + q, c + k, k - q], [k - q, k + q, c + k]]) * gv
    return im.convert("RGB", tuple(np.concatenate([rot, np.zeros((3, 1))], 1).ravel().tolist()))


def polygon_area(p: np.ndarray) -> float:
    """Area of a closed polygon (k, 2) [x, y] (shoelace formula), in squared units of its coordinates."""
    x, y = p[:, 0], p[:, 1]
    return 0.5 * abs(float(x[:-1] @ y[1:] - x[1:] @ y[:-1] + x[-1] * y[0] - x[0] * y[-1]))


def overlap_mask(polys: list, boxes: np.ndarray, out_hw: tuple, ratio: int = 4) -> torch.Tensor:
    """Overlap index map (H//ratio, W//ratio) uint8/int16: value k = the k-th instance (1-based, input order).

    polys[j]: (m,2) output-pixel polygon of instance j, or None to use its box (n,4 xyxy). Instances
    are painted largest area first, so smaller ones stay on top where they overlap (yolov5's order).
    A pixel is set when its centre lies inside the polygon, to within 1 input pixel: PIL truncates
    vertices and fills boundaries inclusively, so we draw at 2x and sample (offsets make it symmetric).
    """
    h, w = out_hw[0] // ratio, out_hw[1] // ratio
    m = Image.new("L" if len(boxes) < 256 else "I", (2 * w, 2 * h), 0)
    draw = ImageDraw.Draw(m)
    shapes = [p if p is not None else b[[0, 1, 2, 1, 2, 3, 0, 3]].reshape(4, 2) for p, b in zip(polys, boxes)]
    areas = np.array([polygon_area(s) for s in shapes])
    for k in np.argsort(-areas, kind="stable"):
        draw.polygon((shapes[k] * (2 / ratio) + 0.5).ravel().tolist(), fill=int(k) + 1)
    return torch.from_numpy(np.asarray(m)[1::2, 1::2].astype(np.uint8 if m.mode == "L" else np.int16))
