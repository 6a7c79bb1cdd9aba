"""Image geometry and colour (no OpenCV): yolov5's random affine, render, place_labels, HSV jitter,
overlap masks. Pixel j covers [j, j+1); boxes xyxy; randomness: `random`, seeded per sample."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageChops, ImageDraw

from .ops import box_corners, xywh2xyxy

FILL = (114, 114, 114)
# Polygons are resampled to this many points before clipping, as yolov5 does.
NPTS = 1000


class Piece(NamedTuple):
    """One source image on the canvas: canvas px = r * original px + (ox, oy), visible in clip
    (x0, y0, x1, y1) canvas px."""

    index: int
    r: float
    ox: float
    oy: float
    clip: tuple


def affine_matrix(in_wh: tuple, out_wh: tuple, hyp: dict) -> tuple[np.ndarray, float]:
    """yolov5's random T @ S @ R @ P @ C -> (3x3: canvas (in_wh) to output (out_wh) px, scale)."""
    in_width, in_height = in_wh
    out_width, out_height = out_wh
    # C moves the canvas centre to the origin.
    C = np.eye(3)
    C[0, 2] = -in_width / 2
    C[1, 2] = -in_height / 2
    perspective = hyp["perspective"]
    P = np.eye(3)
    P[2, 0] = random.uniform(-perspective, perspective)
    P[2, 1] = random.uniform(-perspective, perspective)
    # R rotates and scales.
    degrees = hyp["degrees"]
    angle = math.radians(random.uniform(-degrees, degrees))
    scale = random.uniform(1 - hyp["scale"], 1 + hyp["scale"])
    cos = scale * math.cos(angle)
    sin = scale * math.sin(angle)
    R = np.eye(3)
    R[0, 0] = cos
    R[0, 1] = sin
    R[1, 0] = -sin
    R[1, 1] = cos
    shear = hyp["shear"]
    shear_x = random.uniform(-shear, shear)
    shear_y = random.uniform(-shear, shear)
    S = np.eye(3)
    S[0, 1] = math.tan(math.radians(shear_x))
    S[1, 0] = math.tan(math.radians(shear_y))
    # T moves the centre to a random point near the output's centre.
    low = 0.5 - hyp["translate"]
    high = 0.5 + hyp["translate"]
    T = np.eye(3)
    T[0, 2] = random.uniform(low, high) * out_width
    T[1, 2] = random.uniform(low, high) * out_height
    return T @ S @ R @ P @ C, scale


def _paste(
    out: torch.Tensor,
    src: torch.Tensor,
    scale: tuple,
    offset: tuple,
    rect: tuple,
) -> tuple:
    """Resample src (h,w,3) by x' = scale_x * x + offset_x (and so for y) into out[:, y0:y1, x0:x1]
    of rect (x0, y0, x1, y1), only the needed crop -> (dx, dy): the drawn pixels are the exact
    mapping shifted by |d| <= 0.5 px."""
    left, top, right, bottom = rect
    scale_x, scale_y = scale
    offset_x, offset_y = offset
    src_height, src_width = src.shape[:2]
    # rect in source px.
    src_left = (left - offset_x) / scale_x
    src_right = (right - offset_x) / scale_x
    src_top = (top - offset_y) / scale_y
    src_bottom = (bottom - offset_y) / scale_y
    # The source columns and rows that land in rect, and one more on each side for the filter.
    col0 = max(math.floor(src_left) - 1, 0)
    col1 = min(math.ceil(src_right) + 1, src_width)
    row0 = max(math.floor(src_top) - 1, 0)
    row1 = min(math.ceil(src_bottom) + 1, src_height)
    if col1 <= col0 or row1 <= row0:
        return 0.0, 0.0
    # A (3,h,w) view of the channels-last crop.
    crop = src[row0:row1, col0:col1].permute(2, 0, 1)
    if scale_x != 1 or scale_y != 1:
        crop = F.interpolate(
            crop[None],
            scale_factor=(scale_y, scale_x),
            mode="bilinear",
            antialias=True,
            recompute_scale_factor=False,
        )[0]
    # The exact output position of the crop's corner, and the pixel it is drawn at.
    exact_x = scale_x * col0 + offset_x
    exact_y = scale_y * row0 + offset_y
    corner_x = round(exact_x)
    corner_y = round(exact_y)
    # The part of the drawn crop inside rect.
    x0 = max(left, corner_x)
    y0 = max(top, corner_y)
    x1 = min(right, corner_x + crop.shape[2])
    y1 = min(bottom, corner_y + crop.shape[1])
    if x1 > x0 and y1 > y0:
        part = crop[:, y0 - corner_y : y1 - corner_y]
        part = part[:, :, x0 - corner_x : x1 - corner_x]
        out[:, y0:y1, x0:x1] = part
    return corner_x - exact_x, corner_y - exact_y


def render(pieces: list[Piece], M: np.ndarray, out_wh: tuple, load) -> tuple:
    """Pieces through canvas->output matrix M on grey uint8 (3,H,W) of size out_wh -> (image, per
    piece its pixels' (dx, dy) canvas shift). Scale+shift M: sources load()ed; else PIL warps."""
    rotates_or_shears = M[0, 1] or M[1, 0]
    projects = M[2, 0] or M[2, 1]
    if rotates_or_shears or projects:
        return _render_warped(pieces, M, out_wh, load)
    width, height = out_wh
    size = (3, height, width)
    out = torch.full(size, FILL[0], dtype=torch.uint8)
    shifts = []
    # M maps canvas px to output px: x' = scale_x * x + shift_x, y' = scale_y * y + shift_y.
    scale_x = M[0, 0]
    shift_x = M[0, 2]
    scale_y = M[1, 1]
    shift_y = M[1, 2]
    for piece in pieces:
        rect = np.array(piece.clip) * (scale_x, scale_y, scale_x, scale_y)
        rect = rect + (shift_x, shift_y, shift_x, shift_y)
        rect = rect.clip(0, (width, height, width, height))
        left, top, right, bottom = (round(v) for v in rect)
        if right <= left or bottom <= top:
            shifts.append((0.0, 0.0))
            continue
        # The piece's original px to output px.
        zoom_x = scale_x * piece.r
        zoom_y = scale_y * piece.r
        # load() may decode the image smaller (a JPEG draft): at the larger zoom, at most at the
        # canvas's scale; it returns the scale it decoded at.
        decode_scale = min(max(zoom_x, zoom_y), piece.r)
        image, (loaded_x, loaded_y) = load(piece.index, decode_scale)
        dx, dy = _paste(
            out,
            image,
            scale=(zoom_x / loaded_x, zoom_y / loaded_y),
            offset=(scale_x * piece.ox + shift_x, scale_y * piece.oy + shift_y),
            rect=(left, top, right, bottom),
        )
        shifts.append((dx / scale_x, dy / scale_y))
    return out, shifts


def _render_warped(pieces, M, out_wh, load):
    """render for an M that rotates, shears or projects: the pieces on the canvas, warped by PIL."""
    canvas_width = math.ceil(max(piece.clip[2] for piece in pieces))
    canvas_height = math.ceil(max(piece.clip[3] for piece in pieces))
    canvas_size = (canvas_width, canvas_height)
    canvas, shifts = render(pieces, np.eye(3), canvas_size, load)
    # PIL maps output px back to canvas px. An affine M gives PIL's AFFINE result too.
    inverse = np.linalg.inv(M)
    inverse = inverse / inverse[2, 2]
    coefficients = tuple(inverse.ravel()[:8])
    image = Image.fromarray(canvas.permute(1, 2, 0).numpy())
    image = image.transform(
        out_wh,
        method=Image.PERSPECTIVE,
        data=coefficients,
        resample=Image.BILINEAR,
        fillcolor=FILL,
    )
    warped = torch.from_numpy(np.array(image))
    return warped.permute(2, 0, 1).contiguous(), shifts


def resample(polys: list, n: int = NPTS) -> np.ndarray:
    """Closed polygons [(k,2)] -> (m,n,2): n points spread evenly over each one's vertex index."""
    sizes = np.array([len(poly) for poly in polys])
    points = np.concatenate(polys)
    # Per polygon (a column): its first row in points, and its number of vertices.
    first = (np.cumsum(sizes) - sizes)[:, None]
    count = sizes[:, None]
    # n positions from vertex 0 to vertex count (vertex 0 again), and the vertices around each.
    steps = np.linspace(0, 1, n, dtype=np.float32)
    position = steps[None] * count
    vertex = np.minimum(position.astype(np.int64), count - 1)
    following = np.where(vertex + 1 == count, 0, vertex + 1)
    weight = (position - vertex)[..., None]
    start = points[vertex + first]
    end = points[following + first]
    return start * (1 - weight) + end * weight


def place_labels(
    pieces: list,
    labels: list,
    M: np.ndarray,
    scale: float,
    out_wh: tuple,
    shifts: list,
):
    """Label dicts of the pieces through the geometry -> cls (n,), boxes (n,4) xyxy output px,
    polygons ((NPTS,2) output px; None: a box). scale: the affine's; shifts: render's."""
    # Per label: its class, its box before (canvas px) and after (output px), whether it is a
    # polygon. Each list starts with an empty part, which sets the dtypes (float64 boxes).
    classes = [np.zeros(0, np.int64)]
    before = [np.zeros((0, 4))]
    after = [np.zeros((0, 4))]
    is_polygon = [np.zeros(0, bool)]
    polygons = []
    for piece, label, shift in zip(pieces, labels, shifts):
        has_polygons = len(label["segments"]) > 0
        x, y = _canvas_points(piece, label, shift)
        top_left = [x.min(1), y.min(1)]
        bottom_right = [x.max(1), y.max(1)]
        before.append(np.stack(top_left + bottom_right, 1))
        out_x, out_y = _project(M, x, y)
        after.append(_output_boxes(out_x, out_y, out_wh, has_polygons))
        if has_polygons:
            polygons += list(np.stack([out_x, out_y], 2))
        else:
            polygons += [None] * len(out_x)
        classes.append(label["cls"])
        is_polygon.append(np.full(len(out_x), has_polygons))
    classes = np.concatenate(classes)
    before = np.concatenate(before) * scale
    boxes = np.concatenate(after).astype(np.float32)
    keep = _box_candidates(before, boxes, np.concatenate(is_polygon))
    kept_polygons = [poly for poly, kept in zip(polygons, keep) if kept]
    return classes[keep].astype(np.int64), boxes[keep], kept_polygons


def _canvas_points(piece, label, shift):
    """A label's polygons (NPTS points each) or boxes (their 4 corners) in canvas px, clamped to
    the piece's visible part -> x, y (n, points)."""
    height, width = label["shape"]
    if len(label["segments"]) > 0:
        points = resample(label["segments"])
    else:
        points = box_corners(xywh2xyxy(label["bboxes"]))
    canvas_width = width * piece.r
    canvas_height = height * piece.r
    dx, dy = shift
    x = points[..., 0] * canvas_width + piece.ox + dx
    y = points[..., 1] * canvas_height + piece.oy + dy
    left, top, right, bottom = piece.clip
    return np.clip(x, left, right), np.clip(y, top, bottom)


def _project(M, x, y):
    """Points x, y (canvas px) through the 3x3 matrix M -> x, y (output px)."""
    # The projective divisor: exactly 1 for an affine M.
    divisor = _row_times(M[2], x, y)
    out_x = _row_times(M[0], x, y) / divisor
    out_y = _row_times(M[1], x, y) / divisor
    return out_x, out_y


def _row_times(row, x, y):
    """A row (3,) of a 3x3 matrix times the points [x, y, 1]."""
    return row[0] * x + row[1] * y + row[2]


def _output_boxes(x, y, out_wh, is_polygon):
    """Boxes (n,4) xyxy output px of points x, y (n, points) output px, within the output."""
    width, height = out_wh
    if is_polygon:
        # A polygon's box: the extent of its points inside the output.
        inside_x = (x >= 0) & (x <= width)
        inside_y = (y >= 0) & (y <= height)
        inside = inside_x & inside_y
    else:
        # A box's: the extent of its corners, clipped.
        inside = np.ones_like(x, bool)
    left = np.where(inside, x, np.inf).min(1)
    top = np.where(inside, y, np.inf).min(1)
    right = np.where(inside, x, -np.inf).max(1)
    bottom = np.where(inside, y, -np.inf).max(1)
    boxes = np.stack([left, top, right, bottom], 1)
    boxes = boxes.clip(0, (width, height, width, height))
    # No point inside: an empty box, which the size rule drops.
    boxes[~inside.any(1)] = 0
    return boxes


def _box_candidates(before, after, is_polygon):
    """yolov5's rule for the labels to keep, from boxes (n,4) xyxy before and after the geometry
    (both in output px): wider and taller than 2 px, keeping over 1% of their area (polygons) or
    10% (boxes), aspect ratio under 100 -> (n,) bool."""
    width_before = before[:, 2] - before[:, 0]
    height_before = before[:, 3] - before[:, 1]
    width = after[:, 2] - after[:, 0]
    height = after[:, 3] - after[:, 1]
    wide = width / (height + 1e-16)
    tall = height / (width + 1e-16)
    aspect = np.maximum(wide, tall)
    area_kept = width * height / (width_before * height_before + 1e-16)
    area_ok = area_kept > np.where(is_polygon, 0.01, 0.1)
    return (width > 2.0) & (height > 2.0) & area_ok & (aspect < 100.0)


def hsv_jitter(img: torch.Tensor, hyp: dict) -> torch.Tensor:
    """yolov5's HSV gains U(-1,1) * hsv_h/s/v + 1 on uint8 (3,H,W) RGB, applied in RGB."""
    hue_gain = random.uniform(-1, 1) * hyp["hsv_h"] + 1
    saturation_gain = random.uniform(-1, 1) * hyp["hsv_s"] + 1
    value_gain = random.uniform(-1, 1) * hyp["hsv_v"] + 1
    red, green, blue = map(Image.fromarray, img.numpy())
    # Saturation: a blend with the grey of V = max(R, G, B).
    value = ImageChops.lighter(ImageChops.lighter(red, green), blue)
    grey = Image.merge("RGB", (value, value, value))
    colour = Image.merge("RGB", (red, green, blue))
    image = Image.blend(grey, colour, saturation_gain)
    # Hue: a rotation about the grey axis (1, 1, 1) (Rodrigues' formula), within 2.7 degrees of
    # yolov5's hue shift. Value: a product.
    angle = math.radians((hue_gain - 1) * 180)
    cos = math.cos(angle)
    along = (1 - cos) / 3
    across = math.sin(angle) / math.sqrt(3)
    diagonal = cos + along
    plus = along + across
    minus = along - across
    rotation = np.array(
        [
            [diagonal, minus, plus],
            [plus, diagonal, minus],
            [minus, plus, diagonal],
        ]
    )
    # PIL's convert takes a 3x4 matrix: a 4th column of offsets, here 0.
    matrix = np.zeros((3, 4))
    matrix[:, :3] = rotation * value_gain
    image = image.convert("RGB", tuple(matrix.ravel().tolist()))
    # Stacking the bands is faster than permuting the interleaved pixels.
    bands = [np.asarray(band) for band in image.split()]
    return torch.from_numpy(np.stack(bands))


def polygon_area(polygon: np.ndarray) -> float:
    """Area of a closed polygon (k, 2) [x, y] (shoelace formula)."""
    x = polygon[:, 0]
    y = polygon[:, 1]
    forward = x[:-1] @ y[1:]
    backward = x[1:] @ y[:-1]
    # The closing edge, from the last vertex to the first.
    closing_forward = x[-1] * y[0]
    closing_backward = x[0] * y[-1]
    twice_area = forward - backward + closing_forward - closing_backward
    return 0.5 * abs(float(twice_area))


def overlap_mask(polys: list, boxes: np.ndarray, out_hw: tuple, ratio: int = 4) -> torch.Tensor:
    """Overlap index map (H//ratio, W//ratio) uint8 (int16 from 256 instances): k where a pixel's
    centre is in polys[k-1] (m,2) output px, or boxes[k-1] xyxy if None; smaller on top (yolov5)."""
    height = out_hw[0] // ratio
    width = out_hw[1] // ratio
    few = len(boxes) < 256
    # PIL truncates vertices and fills a polygon's edges too: drawn at twice the size, then
    # sampled at the pixel centres.
    mode = "L" if few else "I"
    mask = Image.new(mode, (2 * width, 2 * height), 0)
    draw = ImageDraw.Draw(mask)
    corners = box_corners(boxes)
    shapes = [box if poly is None else poly for poly, box in zip(polys, corners)]
    areas = np.array([polygon_area(shape) for shape in shapes])
    # The largest first, so that smaller ones are drawn over it.
    for k in np.argsort(-areas, kind="stable"):
        vertices = shapes[k] * (2 / ratio) + 0.5
        number = int(k) + 1
        draw.polygon(vertices.ravel().tolist(), fill=number)
    sampled = np.asarray(mask)[1::2, 1::2]
    dtype = np.uint8 if few else np.int16
    return torch.from_numpy(sampled.astype(dtype))
