"""Image geometry and colour (no OpenCV): yolov5's random affine, render, place_labels, HSV jitter,
overlap masks. Pixel j covers [j, j+1); boxes xyxy; randomness: `random`, seeded per sample."""

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


def _uniform(spread, centre=0):
    """U(centre - spread, centre + spread)."""
    return random.uniform(centre - spread, centre + spread)


def affine_matrix(in_wh, out_wh, hyp):
    """yolov5's random T @ S @ R @ P @ C -> (3x3: canvas (in_wh) to output (out_wh) px, scale)."""
    # C moves the canvas centre to the origin.
    C = np.eye(3)
    C[:2, 2] = -np.array(in_wh) / 2
    P = np.eye(3)
    P[2, :2] = [_uniform(hyp["perspective"]) for _ in range(2)]
    # R rotates and scales.
    angle = math.radians(_uniform(hyp["degrees"]))
    scale = _uniform(hyp["scale"], centre=1)
    cos = scale * math.cos(angle)
    sin = scale * math.sin(angle)
    R = np.eye(3)
    R[:2, :2] = [[cos, sin], [-sin, cos]]
    # S shears x by y, then y by x.
    S = np.eye(3)
    S[[0, 1], [1, 0]] = [math.tan(math.radians(_uniform(hyp["shear"]))) for _ in range(2)]
    # T moves the centre to a random point near the output's centre.
    T = np.eye(3)
    T[:2, 2] = [_uniform(hyp["translate"], centre=0.5) * side for side in out_wh]
    return T @ S @ R @ P @ C, scale


def _paste(out, src, scale, offset, rect):
    """Resample src (h,w,3) by [x', y'] = scale * [x, y] + offset ([x, y] arrays) into the part of
    out (3,H,W) in rect (int rows [x0, y0], [x1, y1]), only the needed crop -> [dx, dy]: the drawn
    pixels are the exact mapping shifted by |d| <= 0.5 px."""
    low, high = rect
    # The source columns and rows that land in rect, and one more on each side for the filter.
    first = np.maximum(np.floor((low - offset) / scale) - 1, 0).astype(int)
    last = np.ceil((high - offset) / scale) + 1
    last = np.minimum(last, src.shape[1::-1]).astype(int)
    if (last <= first).any():
        return np.zeros(2)
    (col0, row0), (col1, row1) = first, last
    # A (3,h,w) view of the channels-last crop.
    crop = src[row0:row1, col0:col1].permute(2, 0, 1)
    if (scale != 1).any():
        crop = F.interpolate(
            crop[None],
            scale_factor=tuple(scale[::-1]),
            mode="bilinear",
            antialias=True,
            recompute_scale_factor=False,
        )[0]
    # The exact output position of the crop's corner, and the pixel it is drawn at.
    exact = scale * first + offset
    corner = exact.round().astype(int)
    # The part of the drawn crop inside rect: [x0, y0] to [x1, y1] in output px.
    start = np.maximum(low, corner)
    end = np.minimum(high, corner + (crop.shape[2], crop.shape[1]))
    if (end > start).all():
        (x0, y0), (x1, y1) = start, end
        # The same part in crop px.
        (crop_x0, crop_y0), (crop_x1, crop_y1) = start - corner, end - corner
        out[:, y0:y1, x0:x1] = crop[:, crop_y0:crop_y1, crop_x0:crop_x1]
    return corner - exact


def render(pieces, M, out_wh, load):
    """Pieces through canvas->output matrix M on grey uint8 (3,H,W) of size out_wh -> (image, per
    piece its pixels' (dx, dy) canvas shift). Scale+shift M: sources load()ed; else PIL warps."""
    # Off the diagonal: M rotates, shears or projects.
    if M[0, 1] or M[1, 0] or M[2, :2].any():
        return _render_warped(pieces, M, out_wh, load)
    width, height = out_wh
    out = torch.full((3, height, width), FILL[0], dtype=torch.uint8)
    shifts = []
    # M maps canvas px to output px: [x', y'] = scale * [x, y] + shift.
    scale = M.diagonal()[:2]
    shift = M[:2, 2]
    for piece in pieces:
        # The piece's clip, rows [x0, y0] and [x1, y1], in whole output px.
        rect = np.reshape(piece.clip, (2, 2)) * scale + shift
        rect = rect.clip(0, out_wh).round().astype(int)
        if (rect[1] <= rect[0]).any():
            shifts.append((0.0, 0.0))
            continue
        # The piece's original px to output px.
        zoom = scale * piece.r
        # load() may decode the image smaller (a JPEG draft): at the larger zoom, at most at the
        # canvas's scale; it returns the scale it decoded at.
        image, loaded = load(piece.index, min(zoom.max(), piece.r))
        offset = scale * (piece.ox, piece.oy) + shift
        drawn_shift = _paste(out, image, scale=zoom / loaded, offset=offset, rect=rect)
        shifts.append(tuple(drawn_shift / scale))
    return out, shifts


def _render_warped(pieces, M, out_wh, load):
    """render for an M that rotates, shears or projects: the pieces on the canvas, warped by PIL."""
    # The canvas as far as the pieces reach.
    far_corner = np.max([piece.clip[2:] for piece in pieces], 0)
    canvas_wh = np.ceil(far_corner).astype(int).tolist()
    canvas, shifts = render(pieces, np.eye(3), canvas_wh, load)
    # PIL maps output px back to canvas px. An affine M gives PIL's AFFINE result too.
    inverse = np.linalg.inv(M)
    inverse = inverse / inverse[2, 2]
    image = Image.fromarray(canvas.permute(1, 2, 0).numpy())
    image = image.transform(
        out_wh,
        method=Image.PERSPECTIVE,
        data=tuple(inverse.ravel()[:8]),
        resample=Image.BILINEAR,
        fillcolor=FILL,
    )
    # Stacking the bands is faster than permuting the interleaved pixels.
    return torch.from_numpy(np.stack(image.split())), shifts


def resample(polys):
    """Closed polygons [(k,2)] -> (m,NPTS,2): points spread evenly over each one's vertex index."""
    sizes = np.array([len(poly) for poly in polys])
    points = np.concatenate(polys)
    # Per polygon (a column): its first row in points, and its number of vertices.
    first = (np.cumsum(sizes) - sizes)[:, None]
    count = sizes[:, None]
    # NPTS positions from vertex 0 to vertex count (vertex 0 again), and the vertices around each.
    steps = np.linspace(0, 1, NPTS, dtype=np.float32)
    position = steps * count
    vertex = np.minimum(position.astype(np.int64), count - 1)
    following = (vertex + 1) % count
    weight = (position - vertex)[..., None]
    start = points[vertex + first]
    end = points[following + first]
    return start * (1 - weight) + end * weight


def place_labels(
    pieces,
    labels,
    M,
    scale,
    out_wh,
    shifts,
):
    """Label dicts of the pieces through the geometry -> cls (n,), boxes (n,4) xyxy output px,
    polygons ((NPTS,2) output px; None: a box). scale: the affine's; shifts: render's."""
    # Per label: its box before (canvas px) and after (output px), its polygon or None.
    before = []
    after = []
    polygons = []
    for piece, label, shift in zip(pieces, labels, shifts):
        has_polygons = bool(label["segments"])
        points = _canvas_points(piece, label, shift)
        before.append(np.concatenate([points.min(1), points.max(1)], 1))
        projected = _project(M, points)
        after.append(_output_boxes(projected, out_wh, has_polygons))
        polygons += [polygon if has_polygons else None for polygon in projected]
    classes = np.concatenate([label["cls"] for label in labels])
    # float64 boxes before, as the canvas points are.
    before = np.concatenate(before).astype(np.float64) * scale
    boxes = np.concatenate(after).astype(np.float32)
    is_polygon = np.array([polygon is not None for polygon in polygons], bool)
    keep = _box_candidates(before, boxes, is_polygon)
    kept_polygons = [polygon for polygon, kept in zip(polygons, keep) if kept]
    return classes[keep], boxes[keep], kept_polygons


def _canvas_points(piece, label, shift):
    """A label's polygons (NPTS points each) or boxes (their 4 corners) in canvas px, clamped to
    the piece's visible part -> (n, points, 2) [x, y]."""
    height, width = label["shape"]
    if label["segments"]:
        points = resample(label["segments"])
    else:
        points = box_corners(xywh2xyxy(label["bboxes"]))
    dx, dy = shift
    x = points[..., 0] * (width * piece.r) + piece.ox + dx
    y = points[..., 1] * (height * piece.r) + piece.oy + dy
    left, top, right, bottom = piece.clip
    return np.stack([np.clip(x, left, right), np.clip(y, top, bottom)], 2)


def _project(M, points):
    """Points (n, k, 2) [x, y] canvas px through the 3x3 matrix M -> (n, k, 2) output px."""
    # M times each [x, y, 1] -> (n, k, 3): the last is the projective divisor, 1 for an affine M.
    x = points[..., :1]
    y = points[..., 1:]
    homogeneous = x * M[:, 0] + y * M[:, 1] + M[:, 2]
    return homogeneous[..., :2] / homogeneous[..., 2:]


def _output_boxes(points, out_wh, is_polygon):
    """Boxes (n,4) xyxy output px of points (n, k, 2) output px, within the output."""
    # A polygon's box: the extent of its points inside the output; a box's: of its corners, clipped.
    inside = ((points >= 0) & (points <= out_wh)).all(2) | (not is_polygon)
    low = np.where(inside[..., None], points, np.inf).min(1)
    high = np.where(inside[..., None], points, -np.inf).max(1)
    boxes = np.concatenate([low, high], 1).clip(0, [*out_wh, *out_wh])
    # No point inside: an empty box, which the size rule drops.
    boxes[~inside.any(1)] = 0
    return boxes


def _box_candidates(before, after, is_polygon):
    """yolov5's rule for the labels to keep, from boxes (n,4) xyxy before and after the geometry
    (both in output px): wider and taller than 2 px, keeping over 1% of their area (polygons) or
    10% (boxes), aspect ratio under 100 -> (n,) bool."""
    size_before = before[:, 2:] - before[:, :2]
    size = after[:, 2:] - after[:, :2]
    width, height = size.T
    aspect = np.maximum(width / (height + 1e-16), height / (width + 1e-16))
    area_kept = size.prod(1) / (size_before.prod(1) + 1e-16)
    area_ok = area_kept > np.where(is_polygon, 0.01, 0.1)
    return (width > 2.0) & (height > 2.0) & area_ok & (aspect < 100.0)


def hsv_jitter(img, hyp):
    """yolov5's HSV gains U(-1,1) * hsv_h/s/v + 1 on uint8 (3,H,W) RGB, applied in RGB."""
    keys = ("hsv_h", "hsv_s", "hsv_v")
    hue_gain, saturation_gain, value_gain = [random.uniform(-1, 1) * hyp[key] + 1 for key in keys]
    red, green, blue = map(Image.fromarray, img.numpy())
    # Saturation: a blend with the grey of V = max(R, G, B).
    value = ImageChops.lighter(ImageChops.lighter(red, green), blue)
    grey = Image.merge("RGB", (value,) * 3)
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
    # A circulant matrix: each row is the one above shifted right by one.
    rotation = np.stack([np.roll([diagonal, minus, plus], k) for k in range(3)])
    # PIL's convert takes a 3x4 matrix: a 4th column of offsets, here 0.
    matrix = np.pad(rotation * value_gain, [(0, 0), (0, 1)])
    image = image.convert("RGB", tuple(matrix.ravel().tolist()))
    # Stacking the bands is faster than permuting the interleaved pixels.
    return torch.from_numpy(np.stack(image.split()))


def polygon_area(polygon):
    """Area of a closed polygon (k, 2) [x, y] (shoelace formula)."""
    x, y = polygon.T
    twice_area = x[:-1] @ y[1:] - x[1:] @ y[:-1]
    # The closing edge, from the last vertex to the first.
    twice_area = twice_area + x[-1] * y[0] - x[0] * y[-1]
    return 0.5 * abs(float(twice_area))


def overlap_mask(polys, boxes, out_hw):
    """Overlap index map (H//4, W//4) uint8 (int16 from 256 instances): k where a pixel's
    centre is in polys[k-1] (m,2) output px, or boxes[k-1] xyxy if None; smaller on top (yolov5)."""
    # The masks' resolution, a quarter of the input's.
    height = out_hw[0] // 4
    width = out_hw[1] // 4
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
        vertices = shapes[k] / 2 + 0.5
        draw.polygon(vertices.ravel().tolist(), fill=int(k) + 1)
    sampled = np.asarray(mask)[1::2, 1::2]
    dtype = np.uint8 if few else np.int16
    return torch.from_numpy(sampled.astype(dtype))
