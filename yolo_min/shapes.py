"""The embedded default dataset: deterministic synthetic shapes, generated on first use (no download).

Three classes of filled shapes (circle, rectangle, triangle) on smooth, mildly noisy backgrounds:
512 train / 64 val JPEGs of 128 x 128 px in YOLO layout, 1 to 4 non-overlapping shapes each (radius
12-25% of the image). Each class has its own band of hues (circles red-yellow, rectangles green-cyan,
triangles blue-magenta; the bands overlap at their edges), so colour and outline both tell the class
and a YOLOv5n learns it on a CPU in minutes (README: mAP50 > 0.9 in 30 epochs at imgsz 128).
Labels are the exact polygons the shapes were drawn from (circles as 48-gons), normalised: every
label matches its pixels, for detection (the polygons' extents) and segmentation alike.
Holds only generation; reading is datasets.py's job (`load_data_config("shapes")`).
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

NAMES = ["circle", "rectangle", "triangle"]
VERSION = 4  # bump when the generated content changes: the cache folder is shapes-v{VERSION}
N_TRAIN, N_VAL, SIZE = 512, 64, 128
HUE_SPREAD = 0.2  # class k's hues: k/3 +- this (fraction of the colour wheel)


def cache_root() -> Path:
    """$YOLO_MIN_CACHE, else ~/.cache/yolo_min."""
    return Path(os.environ.get("YOLO_MIN_CACHE") or Path.home() / ".cache" / "yolo_min")


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
            rr = np.full(48, rad)
        elif k == 1:
            half = math.atan(rng.uniform(0.4, 1.0))  # aspect of the rectangle
            ang = np.array([half, math.pi - half, math.pi + half, -half])
            rr = np.full(4, rad)
        else:
            ang = np.array([0, 2.1, 4.2]) + rng.uniform(-0.3, 0.3, 3)
            rr = rad * rng.uniform(0.85, 1.0, 3)
        poly = c + np.stack([rr * np.cos(ang + a), rr * np.sin(ang + a)], 1)
        hue = (k / 3 + rng.uniform(-HUE_SPREAD, HUE_SPREAD)) % 1
        rgb = [int(255 * min(1, max(0, abs(6 * ((hue + o) % 1) - 3) - 1))) for o in (0, 2 / 3, 1 / 3)]
        draw.polygon([tuple(p) for p in (poly - 0.5)], fill=tuple(rgb))  # PIL vertices are pixel centres
        labels.append((k, poly))
    noise = rng.normal(0, 4, (size, size, 3))
    return Image.fromarray(np.clip(np.asarray(im, np.float32) + noise, 0, 255).astype(np.uint8)), labels


def generate(root: Path, n_train: int = N_TRAIN, n_val: int = N_VAL, size: int = SIZE, seed: int = 0) -> Path:
    """Write images/{train,val}/*.jpg, labels/{train,val}/*.txt and shapes.yaml under root; returns the yaml."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            im, labels = make_image(rng, size)
            im.save(root / "images" / split / f"{i:06d}.jpg", quality=92)
            rows = [" ".join([str(k)] + [f"{v:.6f}" for v in (p / size).ravel()]) for k, p in labels]
            (root / "labels" / split / f"{i:06d}.txt").write_text("".join(r + "\n" for r in rows))
    names = "".join(f"  {i}: {n}\n" for i, n in enumerate(NAMES))
    (root / "shapes.yaml").write_text(f"# yolo_min synthetic shapes v{VERSION}\npath: .\ntrain: images/train\n"
                                      f"val: images/val\nnc: {len(NAMES)}\nnames:\n{names}")
    return root / "shapes.yaml"


def ensure() -> Path:
    """Path of shapes.yaml, generating the dataset first if absent (atomic: built aside, then renamed)."""
    root = cache_root() / f"shapes-v{VERSION}"
    if not (root / "shapes.yaml").is_file():
        tmp = root.with_name(f".{root.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        generate(tmp)
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return root / "shapes.yaml"
