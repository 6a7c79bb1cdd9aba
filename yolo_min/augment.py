"""Image geometry and colour (no OpenCV): yolov5's random affine, render, place_labels, HSV jitter,
overlap masks. Pixel j covers [j, j+1); boxes xyxy; randomness: `random`, seeded per sample."""

from __future__ import annotations

import math
import random
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageChops, ImageDraw

from .ops import box_corners, xywh2xyxy

FILL = (114, 114, 114)
NPTS = 1000  # polygons are resampled to this many points before clipping (as yolov5 does)
# One source image on the canvas: canvas = r * original_pixel + (ox, oy), visible in clip (x0, y0,
# x1, y1) canvas pixels
Piece = namedtuple("Piece", "index r ox oy clip")


def affine_matrix(in_wh: tuple, out_wh: tuple, hyp: dict) -> tuple[np.ndarray, float]:
    """yolov5's random T @ S @ R @ P @ C -> (3x3: canvas (in_wh) to output (out_wh) px, scale)."""
    p, deg, sh, tr = hyp["perspective"], hyp["degrees"], hyp["shear"], hyp["translate"]
    C, P, S, T = np.eye(3), np.eye(3), np.eye(3), np.eye(3)
    C[0, 2], C[1, 2] = -in_wh[0] / 2, -in_wh[1] / 2  # canvas centre to the origin
    P[2, 0], P[2, 1] = random.uniform(-p, p), random.uniform(-p, p)
    a = math.radians(random.uniform(-deg, deg))
    s = random.uniform(1 - hyp["scale"], 1 + hyp["scale"])
    c, n = s * math.cos(a), s * math.sin(a)
    R = np.array([[c, n, 0], [-n, c, 0], [0, 0, 1]])
    S[0, 1], S[1, 0] = (math.tan(math.radians(random.uniform(-sh, sh))) for _ in range(2))
    T[0, 2], T[1, 2] = (random.uniform(0.5 - tr, 0.5 + tr) * size for size in out_wh)
    return T @ S @ R @ P @ C, s


def _paste(out: torch.Tensor, src: torch.Tensor, ax, bx, ay, by, rect: tuple) -> tuple:
    """Resample src (h,w,3) by x' = ax*x + bx, y' = ay*y + by into out[:, Y0:Y1, X0:X1] (only the
    needed crop) -> (dx, dy): the drawn pixels are the exact mapping shifted by |d| <= 0.5 px."""
    X0, Y0, X1, Y1 = rect
    hs, ws = src.shape[:2]
    c0, c1 = max(math.floor((X0 - bx) / ax) - 1, 0), min(math.ceil((X1 - bx) / ax) + 1, ws)
    r0, r1 = max(math.floor((Y0 - by) / ay) - 1, 0), min(math.ceil((Y1 - by) / ay) + 1, hs)
    if c1 <= c0 or r1 <= r0:
        return 0.0, 0.0
    y = src[r0:r1, c0:c1].permute(2, 0, 1)  # (3,h,w) channels-last view
    if ax != 1 or ay != 1:
        kw = dict(mode="bilinear", antialias=True, recompute_scale_factor=False)
        y = F.interpolate(y[None], scale_factor=(ay, ax), **kw)[0]
    px, py = ax * c0 + bx, ay * r0 + by  # exact output position of the crop's corner
    P, Q = round(px), round(py)
    xa, ya, xb, yb = max(X0, P), max(Y0, Q), min(X1, P + y.shape[2]), min(Y1, Q + y.shape[1])
    if xb > xa and yb > ya:
        out[:, ya:yb, xa:xb] = y[:, ya - Q : yb - Q, xa - P : xb - P]
    return P - px, Q - py


def render(pieces: list[Piece], M: np.ndarray, out_wh: tuple, load) -> tuple:
    """Pieces through canvas->output matrix M on grey uint8 (3,H,W) of size out_wh -> (image, per
    piece its pixels' (dx, dy) canvas shift). Scale+shift M: sources load()ed; else PIL warps."""
    if M[0, 1] or M[1, 0] or M[2, 0] or M[2, 1]:
        size = math.ceil(max(p.clip[2] for p in pieces)), math.ceil(max(p.clip[3] for p in pieces))
        canvas, shifts = render(pieces, np.eye(3), size, load)
        Mi = np.linalg.inv(M)
        coefs = tuple((Mi / Mi[2, 2]).ravel()[:8])  # an affine M gives PIL's AFFINE result too
        im = Image.fromarray(canvas.permute(1, 2, 0).numpy())
        im = im.transform(out_wh, Image.PERSPECTIVE, coefs, Image.BILINEAR, fillcolor=FILL)
        return torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous(), shifts
    out, shifts = torch.full((3, out_wh[1], out_wh[0]), FILL[0], dtype=torch.uint8), []
    # canvas -> output pixels: sx * x + bx, sy * y + by
    sx, bx, sy, by = M[0, 0], M[0, 2], M[1, 1], M[1, 2]
    for p in pieces:
        rect = np.array(p.clip) * (sx, sy, sx, sy) + (bx, by, bx, by)
        X0, Y0, X1, Y1 = (round(v) for v in rect.clip(0, out_wh * 2))  # out_wh * 2: W, H, W, H
        if X1 <= X0 or Y1 <= Y0:
            shifts.append((0.0, 0.0))
            continue
        ax, ay = sx * p.r, sy * p.r  # original pixels -> output pixels
        im, (kx, ky) = load(p.index, min(max(ax, ay), p.r))
        dx, dy = _paste(out, im, ax / kx, sx * p.ox + bx, ay / ky, sy * p.oy + by, (X0, Y0, X1, Y1))
        shifts.append((dx / sx, dy / sy))
    return out, shifts


def resample(polys: list, n: int = NPTS) -> np.ndarray:
    """Closed polygons [(k,2)] -> (m,n,2): n points spread evenly over each one's vertex index."""
    k = np.array([len(p) for p in polys])
    allp, start = np.concatenate(polys), np.cumsum(k) - k
    t = np.linspace(0, 1, n, dtype=np.float32)[None] * k[:, None]
    i = np.minimum(t.astype(np.int64), k[:, None] - 1)
    f = (t - i)[..., None]
    nxt = np.where(i + 1 == k[:, None], 0, i + 1) + start[:, None]
    return allp[i + start[:, None]] * (1 - f) + allp[nxt] * f


def place_labels(pieces: list, labels: list, M: np.ndarray, sc: float, out_wh: tuple, shifts: list):
    """Label dicts of the pieces through the geometry -> cls (n,), boxes (n,4) xyxy output px,
    polygons ((NPTS,2) output px; None: a box). sc: the affine's scale; shifts: render's."""
    W, H = out_wh
    # per piece: cls, box before (canvas), box after (output), has-polygon; first: float64, no rows
    empty = (np.zeros(0, np.int64), np.zeros((0, 4)), np.zeros((0, 4)), np.zeros(0, bool))
    out, polys = [empty], []
    for p, lb, (dx, dy) in zip(pieces, labels, shifts):
        (h0, w0), seg = lb["shape"], len(lb["segments"]) > 0
        # a polygon: NPTS points, a box: its 4 corners; clamped to the piece's visible part
        pts = resample(lb["segments"]) if seg else box_corners(xywh2xyxy(lb["bboxes"]))
        x = np.clip(pts[..., 0] * (w0 * p.r) + p.ox + dx, p.clip[0], p.clip[2])
        y = np.clip(pts[..., 1] * (h0 * p.r) + p.oy + dy, p.clip[1], p.clip[3])
        before = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], 1)
        d = M[2, 0] * x + M[2, 1] * y + M[2, 2]  # exactly 1 for an affine M
        qx, qy = ((M[row, 0] * x + M[row, 1] * y + M[row, 2]) / d for row in (0, 1))
        # a polygon's box: the extent of its points inside the output; a box's: its corners, clipped
        ins = (qx >= 0) & (qx <= W) & (qy >= 0) & (qy <= H) if seg else np.ones_like(qx, bool)
        lo = [np.where(ins, q, np.inf).min(1) for q in (qx, qy)]
        hi = [np.where(ins, q, -np.inf).max(1) for q in (qx, qy)]
        after = np.stack(lo + hi, 1).clip(0, (W, H, W, H))
        after[~ins.any(1)] = 0
        polys += list(np.stack([qx, qy], 2)) if seg else [None] * len(qx)
        out.append((lb["cls"], before, after, np.full(len(qx), seg)))
    cls, before, boxes, seg = map(np.concatenate, zip(*out))
    boxes, before = boxes.astype(np.float32), before * sc
    # yolov5's rule: wider and taller than 2 px, kept area > 1% (polygons) / 10%, aspect < 100
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    ar = np.maximum(w2 / (h2 + 1e-16), h2 / (w2 + 1e-16))
    area_ok = w2 * h2 / (w1 * h1 + 1e-16) > np.where(seg, 0.01, 0.1)
    keep = (w2 > 2.0) & (h2 > 2.0) & area_ok & (ar < 100.0)
    return cls[keep].astype(np.int64), boxes[keep], [q for q, k in zip(polys, keep) if k]


def hsv_jitter(img: torch.Tensor, hyp: dict) -> torch.Tensor:
    """yolov5's HSV gains U(-1,1) * hsv_h/s/v + 1 on uint8 (3,H,W) RGB, applied in RGB."""
    # saturation: a blend with V = max(R,G,B); value: a product; hue: a rotation about the grey
    # axis (<= 2.7 deg off yolov5's hue shift)
    gh, gs, gv = (random.uniform(-1, 1) * hyp[k] + 1 for k in ("hsv_h", "hsv_s", "hsv_v"))
    r, g, b = (Image.fromarray(c) for c in img.numpy())
    v = ImageChops.lighter(ImageChops.lighter(r, g), b)
    im = Image.blend(Image.merge("RGB", (v, v, v)), Image.merge("RGB", (r, g, b)), gs)
    t = math.radians((gh - 1) * 180)
    c, k, q = math.cos(t), (1 - math.cos(t)) / 3, math.sin(t) / math.sqrt(3)
    rot = np.array([[c + k, k - q, k + q], [k + q, c + k, k - q], [k - q, k + q, c + k]]) * gv
    im = im.convert("RGB", tuple(np.concatenate([rot, np.zeros((3, 1))], 1).ravel().tolist()))
    return torch.from_numpy(np.stack([np.asarray(ch) for ch in im.split()]))  # faster than permute


def polygon_area(p: np.ndarray) -> float:
    """Area of a closed polygon (k, 2) [x, y] (shoelace formula)."""
    x, y = p[:, 0], p[:, 1]
    return 0.5 * abs(float(x[:-1] @ y[1:] - x[1:] @ y[:-1] + x[-1] * y[0] - x[0] * y[-1]))


def overlap_mask(polys: list, boxes: np.ndarray, out_hw: tuple, ratio: int = 4) -> torch.Tensor:
    """Overlap index map (H//ratio, W//ratio) uint8 (int16 from 256 instances): k where a pixel's
    centre is in polys[k-1] (m,2) output px, or boxes[k-1] xyxy if None; smaller on top (yolov5)."""
    h, w = out_hw[0] // ratio, out_hw[1] // ratio
    m = Image.new("L" if len(boxes) < 256 else "I", (2 * w, 2 * h), 0)
    draw = ImageDraw.Draw(m)  # PIL truncates vertices and fills edges: drawn at 2x, sampled
    shapes = [c if p is None else p for p, c in zip(polys, box_corners(boxes))]
    for k in np.argsort(-np.array([polygon_area(s) for s in shapes]), kind="stable"):
        draw.polygon((shapes[k] * (2 / ratio) + 0.5).ravel().tolist(), fill=int(k) + 1)
    dtype = np.uint8 if m.mode == "L" else np.int16
    return torch.from_numpy(np.asarray(m)[1::2, 1::2].astype(dtype))
