"""Embedded datasets, made on first use. "shapes": 128 px JPEGs of 1-4 circles, rectangles and
triangles (a band of hues per class) on noise, with polygon labels. "shapes-cls": shapes cut out."""

import colorsys
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

NAMES = ["circle", "rectangle", "triangle"]
# Bump when the generated content changes: the cache folders are <kind>-v{VERSION}.
VERSION = 4
N_TRAIN = 512
N_VAL = 64
SIZE = 128
N_CLS_TRAIN = 1200
N_CLS_VAL = 300
# Class k's hues are k/3 +- this (a fraction of the colour wheel).
HUE_SPREAD = 0.2


def make_image(rng, size=SIZE):
    """One RGB image (size x size) and its labels [(cls, polygon (k,2) float [x, y] in pixels)]."""
    # A muted, low-frequency colour field as the background.
    grid = rng.integers(70, 170, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    placed = []
    labels = []
    for _ in range(rng.integers(1, 5)):
        spot = _free_spot(rng, size, placed)
        if spot is None:
            continue
        placed.append(spot)
        kind = int(rng.integers(3))
        polygon = _shape_polygon(rng, kind, spot)
        # A random hue of the class's band, at full saturation and value.
        hue = (kind / 3 + rng.uniform(-HUE_SPREAD, HUE_SPREAD)) % 1
        colour = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, 1, 1))
        # PIL's polygon vertices are pixel centres, ours pixel corners.
        vertices = (polygon - 0.5).ravel().tolist()
        draw.polygon(vertices, fill=colour)
        labels.append((kind, polygon))
    noise = rng.normal(0, 4, (size, size, 3))
    pixels = np.asarray(image, np.float32) + noise
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels), labels


def _free_spot(rng, size, placed):
    """A random circle (centre (2,), radius) in pixels inside the image and 4 px clear of the
    placed ones, in at most 30 tries; else None."""
    for _ in range(30):
        radius = rng.uniform(0.12, 0.25) * size
        centre = rng.uniform(radius + 2, size - radius - 2, 2)
        if all(np.hypot(*(centre - c)) > radius + r + 4 for c, r in placed):
            return centre, radius
    return None


def _shape_polygon(rng, kind, spot):
    """The polygon (k,2) [x, y] in pixels of a shape of class kind, randomly turned, within the
    circle spot (centre, radius)."""
    centre, radius = spot
    turn = rng.uniform(0, 2 * math.pi)
    # The vertices are on the circle, but for a triangle's.
    radii = radius
    if kind == 0:
        # A circle: a regular 48-gon.
        angles = np.linspace(0, 2 * math.pi, 48, endpoint=False)
    elif kind == 1:
        # A rectangle: its corners on the circle, its aspect set by the angle of a diagonal.
        half = math.atan(rng.uniform(0.4, 1.0))
        angles = np.array([half, math.pi - half, math.pi + half, -half])
    else:
        # A triangle: 3 vertices at jittered angles and radii.
        jitter = rng.uniform(-0.3, 0.3, 3)
        angles = np.array([0, 2.1, 4.2]) + jitter
        radii = radius * rng.uniform(0.85, 1.0, 3)
    x = radii * np.cos(angles + turn)
    y = radii * np.sin(angles + turn)
    return centre + np.stack([x, y], 1)


def generate(root, n_train=N_TRAIN, n_val=N_VAL, size=SIZE, seed=0):
    """Write images/{train,val}/*.jpg, labels/{train,val}/*.txt and shapes.yaml under root."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", n_train), ("val", n_val)):
        image_dir = root / "images" / split
        label_dir = root / "labels" / split
        for folder in (image_dir, label_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, labels = make_image(rng, size)
            image.save(image_dir / f"{i:06d}.jpg", quality=92)
            # A YOLO polygon label a line: the class, then each point's normalised x y.
            lines = []
            for kind, polygon in labels:
                values = " ".join(f"{v:.6f}" for v in polygon.ravel() / size)
                lines.append(f"{kind} {values}\n")
            (label_dir / f"{i:06d}.txt").write_text("".join(lines))
    config = (
        f"# yolo_min synthetic shapes v{VERSION}\n"
        "path: .\n"
        "train: images/train\n"
        "val: images/val\n"
        f"names: [{', '.join(NAMES)}]\n"
    )
    (root / "shapes.yaml").write_text(config)


def generate_cls(root, n_train=N_CLS_TRAIN, n_val=N_CLS_VAL, seed=1):
    """Write {train,val}/<class>/*.jpg under root: a scene's first shape with 20% margins."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", n_train), ("val", n_val)):
        for name in NAMES:
            (root / split / name).mkdir(parents=True)
        for i in range(count):
            image, labels = make_image(rng)
            kind, polygon = labels[0]
            # A square about the shape's centre, its side 1.2 times the shape's longer side.
            centre = (polygon.min(0) + polygon.max(0)) / 2
            half = 0.6 * np.ptp(polygon, 0).max()
            box = np.clip(np.concatenate([centre - half, centre + half]), 0, SIZE)
            crop = image.crop(box.tolist())
            crop.save(root / split / NAMES[kind] / f"{i:06d}.jpg", quality=92)


def ensure(kind):
    """The folder of kind in $YOLO_MIN_CACHE (~/.cache/yolo_min), generated first if absent."""
    cache = os.environ.get("YOLO_MIN_CACHE") or Path.home() / ".cache" / "yolo_min"
    root = Path(cache) / f"{kind}-v{VERSION}"
    if root.is_dir():
        return root
    # Made in a folder of this process and renamed into place, so that none is seen half made.
    partial = root.with_name(f".{root.name}.{os.getpid()}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    if kind == "shapes-cls":
        generate_cls(partial)
    else:
        generate(partial)
    try:
        os.rename(partial, root)
    except OSError:
        # Another process finished first.
        shutil.rmtree(partial, ignore_errors=True)
    return root
