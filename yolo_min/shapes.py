"""The embedded default dataset: deterministic synthetic shapes, generated on first use (no download).

Three classes of filled shapes (circle, rectangle, triangle) in random bright colours on textured
backgrounds, 128 train / 32 val JPEGs of 256 x 256 px in YOLO layout. Labels are the exact polygons
the shapes were drawn from (circles as 48-gons), normalised; shapes never overlap, so every label
matches its pixels. Task-agnostic: detection uses the polygons' extents.
Holds only generation; reading is datasets.py's job (`load_data_config("shapes")`).
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

NAMES = ["circle", "rectangle", "triangle"]
VERSION = 3


def cache_root() -> Path:
    """$YOLO_MIN_CACHE, else ~/.cache/yolo_min."""
    return Path(os.environ.get("YOLO_MIN_CACHE") or Path.home() / ".cache" / "yolo_min")


def make_image(rng: np.random.Generator, size: int = 256) -> tuple[Image.Image, list]:
    """One image and its labels [(cls, polygon (k,2) in pixels)]."""
    grid = rng.integers(50, 200, (5, 5, 3), dtype=np.uint8)  # muted low-frequency colour field
    im = Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(rng.integers(1, 5)):  # distractor strokes
        draw.line([tuple(rng.uniform(0, size, 2)), tuple(rng.uniform(0, size, 2))],
                  fill=tuple(int(v) for v in rng.integers(40, 210, 3)), width=int(rng.integers(1, 3)))
    objects, labels = [], []
    for _ in range(rng.integers(2, 6)):
        for _try in range(30):
            rad = rng.uniform(0.1, 0.22) * size
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
        hue = rng.uniform(0, 1)
        rgb = [int(255 * min(1, max(0, abs(6 * ((hue + o) % 1) - 3) - 1))) for o in (0, 2 / 3, 1 / 3)]
        draw.polygon([tuple(p) for p in (poly - 0.5)], fill=tuple(rgb))  # PIL vertices are pixel centres
        labels.append((k, poly))
    noise = rng.normal(0, 6, (size, size, 3))
    im = Image.fromarray(np.clip(np.asarray(im, np.float32) + noise, 0, 255).astype(np.uint8))
    return im.filter(ImageFilter.SMOOTH) if rng.random() < 0.3 else im, labels


def generate(root: Path, n_train: int = 128, n_val: int = 32, size: int = 256, seed: int = 0) -> Path:
    """Write images/{train,val}/*.jpg, labels/{train,val}/*.txt and shapes.yaml under root."""
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
