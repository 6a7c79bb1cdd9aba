"""Embedded datasets, made on first use. "shapes": 128 px JPEGs of 1-4 circles, rectangles and
triangles (a band of hues per class) on noise, with polygon labels. "shapes-cls": shapes cut out."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

NAMES = ["circle", "rectangle", "triangle"]
VERSION = 4  # bump when the generated content changes: the cache folders are <kind>-v{VERSION}
N_TRAIN, N_VAL, SIZE = 512, 64, 128
N_CLS_TRAIN, N_CLS_VAL = 1200, 300
HUE_SPREAD = 0.2  # class k's hues: k/3 +- this (fraction of the colour wheel)


def make_image(rng: np.random.Generator, size: int = SIZE) -> tuple[Image.Image, list]:
    """One RGB image (size x size) and its labels [(cls, polygon (k,2) float [x, y] in pixels)]."""
    grid = rng.integers(70, 170, (4, 4, 3), dtype=np.uint8)  # muted low-frequency colour field
    im = Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(im)
    objects, labels = [], []
    for _ in range(rng.integers(1, 5)):
        for _try in range(30):  # a free spot: no overlap with the shapes already drawn
            rad = rng.uniform(0.12, 0.25) * size
            c = rng.uniform(rad + 2, size - rad - 2, 2)
            if all(np.hypot(*(c - c2)) > rad + r2 + 4 for c2, r2 in objects):
                break
        else:
            continue
        objects.append((c, rad))
        k, a = int(rng.integers(3)), rng.uniform(0, 2 * math.pi)
        if k == 0:
            ang = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        elif k == 1:
            half = math.atan(rng.uniform(0.4, 1.0))  # aspect of the rectangle
            ang = np.array([half, math.pi - half, math.pi + half, -half])
        else:
            ang = np.array([0, 2.1, 4.2]) + rng.uniform(-0.3, 0.3, 3)
        rr = rad * rng.uniform(0.85, 1.0, 3) if k == 2 else np.full(len(ang), rad)  # vertex radii
        poly = c + np.stack([rr * np.cos(ang + a), rr * np.sin(ang + a)], 1)
        hue = (k / 3 + rng.uniform(-HUE_SPREAD, HUE_SPREAD)) % 1
        ramp = [abs(6 * ((hue + o) % 1) - 3) - 1 for o in (0, 2 / 3, 1 / 3)]  # hue -> r, g, b
        rgb = tuple(int(255 * min(1, max(0, x))) for x in ramp)
        # PIL's polygon vertices are pixel centres, ours pixel corners
        draw.polygon([tuple(p) for p in (poly - 0.5)], fill=rgb)
        labels.append((k, poly))
    px = np.asarray(im, np.float32) + rng.normal(0, 4, (size, size, 3))
    return Image.fromarray(np.clip(px, 0, 255).astype(np.uint8)), labels


def generate(root: Path, n_train=N_TRAIN, n_val=N_VAL, size=SIZE, seed=0) -> None:
    """Write images/{train,val}/*.jpg, labels/{train,val}/*.txt and shapes.yaml under root."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for d in ("images", "labels"):
            (root / d / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            im, labels = make_image(rng, size)
            im.save(root / "images" / split / f"{i:06d}.jpg", quality=92)
            rows = [" ".join([str(k), *(f"{v:.6f}" for v in p.ravel() / size)]) for k, p in labels]
            (root / "labels" / split / f"{i:06d}.txt").write_text("".join(f"{r}\n" for r in rows))
    head = f"# yolo_min synthetic shapes v{VERSION}\npath: .\ntrain: images/train\n"
    (root / "shapes.yaml").write_text(f"{head}val: images/val\nnames: [{', '.join(NAMES)}]\n")


def generate_cls(root: Path, n_train=N_CLS_TRAIN, n_val=N_CLS_VAL, seed=1) -> None:
    """Write {train,val}/<class>/*.jpg under root: a scene's first shape with 20% margins."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for name in NAMES:
            (root / split / name).mkdir(parents=True)
        for i in range(n):
            im, ((k, poly), *_) = make_image(rng)
            c, half = (poly.min(0) + poly.max(0)) / 2, 0.6 * np.ptp(poly, 0).max()
            box = tuple(np.clip([*(c - half), *(c + half)], 0, SIZE).tolist())
            im.crop(box).save(root / split / NAMES[k] / f"{i:06d}.jpg", quality=92)


def ensure(kind: str = "shapes") -> Path:
    """The folder of kind in $YOLO_MIN_CACHE (~/.cache/yolo_min), generated first if absent."""
    cache = os.environ.get("YOLO_MIN_CACHE") or Path.home() / ".cache" / "yolo_min"
    root = Path(cache) / f"{kind}-v{VERSION}"
    if not root.is_dir():
        tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (generate_cls if kind == "shapes-cls" else generate)(tmp)
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return root
