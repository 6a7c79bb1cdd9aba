"""Finding images and verifying their YOLO label files, with a cache of the verification.

Labels live at the image path with the last /images/ -> /labels/ and a .txt extension; rows are
`cls cx cy w h` or `cls x1 y1 x2 y2 ...` (polygon; box = its extent), normalised to [0, 1]. Every pair
is verified once (full decode) and cached next to the labels (`labels/<split>.cache`, atomic, keyed by
file list, sizes, mtimes, modes and nc). Bad input never crashes and is never silent: one warning per
problem naming file and line, then a summary of counts.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from . import dist

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")
CACHE_VERSION = "yolo_min-labels-1"
MAX_WARNINGS = 100  # printed per dataset; all are counted
SLACK, TOL = 1e-3, 0.05  # coordinates this far outside [0,1]: clipped silently / clipped with a warning
FOUND, MISSING, EMPTY, CORRUPT = range(4)


class DataError(ValueError):
    """A dataset problem that stops the run: the message is one actionable line."""


def warn(msg: str) -> None:
    """Print a one-line warning on the main process."""
    dist.print0(f"WARNING {msg}")


def img2label_path(f: str) -> str:
    """Last /images/ -> /labels/, extension -> .txt."""
    head, sep, tail = f.rpartition(f"{os.sep}images{os.sep}")
    return os.path.splitext(f"{head}{os.sep}labels{os.sep}{tail}" if sep else f)[0] + ".txt"


def list_images(sources: list, prefix: str = "") -> tuple[list[str], list[str]]:
    """Image files of folders (recursive), .txt lists (relative lines: against the list's folder) and files."""
    files, skipped = [], []
    for src in map(Path, sources):
        if not src.exists():
            raise DataError(f"{prefix}{src} not found")
        if src.is_dir():
            found = sorted(f for f in src.rglob("*") if f.is_file())
        elif src.suffix == ".txt":
            try:
                found = [src.parent / s.strip() for s in src.read_text().splitlines() if s.strip()]
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"{prefix}cannot read image list {src} ({e})") from None
        else:
            found = [src]
        for f in found:
            (files if f.suffix[1:].lower() in IMG_FORMATS else skipped).append(os.path.normpath(f))
    if not files:
        raise DataError(f"{prefix}no images found in {', '.join(map(str, sources))}")
    return list(dict.fromkeys(files)), [f"{len(skipped)} file(s) without an image extension "
                                        f"({', '.join(IMG_FORMATS)}) skipped, e.g. {skipped[0]}"] if skipped else []


def parse_labels(text: str, where: str, nc: int | None = None) -> tuple[list, list, int, int]:
    """Label file text -> (rows [(cls, [cx, cy, w, h], polygon (k,2) or None)], msgs, dropped, fixed).

    Box rows of a file that also has polygons become rectangles, so every row has a polygon or none does.
    """
    rows, seen, msgs, dropped, fixed = [], {}, [], 0, 0
    for ln, line in enumerate(text.splitlines(), 1):
        parts, why = line.split(), None
        if not parts:
            continue
        n = len(parts)
        try:
            v = np.array([float(x) for x in parts])
        except ValueError:
            v = None
        if n < 5:
            why = f"{n} values; a row is 'cls cx cy w h' or 'cls x1 y1 x2 y2 x3 y3 ...'"
        elif n > 5 and n % 2 == 0:
            why = f"polygon with an odd number of coordinates ({n - 1})"
        elif v is None:
            why = f"non-numeric value in '{line.strip()[:50]}'"
        elif not np.isfinite(v).all():
            why = "NaN or inf value"
        elif v[0] != int(v[0]) or v[0] < 0 or (nc is not None and v[0] >= nc):
            why = f"class {parts[0]} is not an integer in [0, {nc if nc is not None else 'nc'})"
        elif n == 5 and (v[3] <= 0 or v[4] <= 0):
            why = "box with zero or negative width/height"
        elif n > 5 and len(np.unique(v[1:].reshape(-1, 2), axis=0)) < 3:
            why = "polygon with fewer than 3 distinct points"
        elif tuple(v) in seen:
            why = f"duplicate of line {seen[tuple(v)]}"
        else:
            pts = v[1:].reshape(-1, 2) if n > 5 else v[1:3] + np.array([[-0.5], [0.5]]) * v[3:5]
            lo, hi = pts.min(), pts.max()
            if lo < -TOL or hi > 1 + TOL:
                why = f"coordinates outside [0, 1] (min {lo:.4g}, max {hi:.4g})"
            elif lo < -SLACK or hi > 1 + SLACK:
                fixed += 1
                msgs.append(f"{where}:{ln}: coordinates slightly outside [0, 1] clipped")
            pts = np.clip(pts, 0, 1)
            (x0, y0), (x1, y1) = pts.min(0), pts.max(0)
            if not why and (x1 - x0 <= 0 or y1 - y0 <= 0):
                why = "zero width or height after clipping to [0, 1]"
        if why:
            dropped += 1
            msgs.append(f"{where}:{ln}: {why}; row dropped")
            continue
        seen[tuple(v)] = ln
        rows.append((int(v[0]), [(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], pts if n > 5 else None))
    if len({r[2] is None for r in rows}) == 2:
        msgs.append(f"{where}: mixes box rows and polygon rows; boxes are used as rectangles")
        rect = [[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]]
        rows = [(c, b, np.array(b[:2]) + np.array(rect) * b[2:] if p is None else p) for c, b, p in rows]
    return rows, msgs, dropped, fixed


def verify(im_file: str, lb_file: str, nc: int | None = None) -> tuple:
    """One image/label pair -> (status, (h, w), rows, msgs, dropped, fixed). Never raises."""
    def bad(why):
        return CORRUPT, (0, 0), [], [f"{im_file}: {why}; image skipped"], 0, 0
    try:
        if os.path.getsize(im_file) == 0:
            return bad("empty (0-byte) file")
        with Image.open(im_file) as im:
            (w, h), fmt = im.size, im.format
            if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF rotation by 90 degrees
                w, h = h, w
            im.draft("RGB", (1, 1))  # JPEG: the whole stream is still decoded, at 1/8 scale
            im.load() if im.mode == "RGB" else im.convert("RGB")
    except Exception as e:  # missing, unreadable, not an image, truncated, decompression bomb, ...
        return bad({FileNotFoundError: "image not found", PermissionError: "image unreadable (permission denied)",
                    Image.UnidentifiedImageError: "not an image (PIL cannot identify it)"}.get(
                        type(e), f"corrupt image ({type(e).__name__}: {e})"))
    if min(w, h) < 10:
        return bad(f"image too small ({w}x{h} px, need at least 10)")
    ext = os.path.splitext(im_file)[1][1:].lower()
    msgs = [] if fmt in {"jpg": "JPEG MPO", "jpeg": "JPEG MPO", "tif": "TIFF"}.get(ext, ext.upper()).split() else [
        f"{im_file}: {fmt} data with a .{ext} extension; used as is"]
    if not os.path.exists(lb_file):
        return MISSING, (h, w), [], msgs, 0, 0
    try:
        with open(lb_file, encoding="utf-8") as f:
            rows, m, dropped, fixed = parse_labels(f.read(), lb_file, nc)
    except (OSError, UnicodeDecodeError) as e:
        return bad(f"label file {lb_file} unreadable ({type(e).__name__}: {e})")
    if dropped and not rows:
        m.append(f"{im_file}: no valid label rows in {lb_file}; image skipped")
        return CORRUPT, (h, w), [], msgs + m, dropped, fixed
    return (FOUND if rows else EMPTY), (h, w), rows, msgs + m, dropped, fixed


def _verify_all(files: list, lb_files: list, nc) -> dict:
    """Verify in threads and pack into flat arrays (one cache file, loadable without pickle)."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
        res = list(ex.map(lambda a: verify(*a, nc), zip(files, lb_files)))
    msgs = [m for r in res for m in r[3]] + [
        f"labels folder {d} does not exist: its images are used as background" for d in
        sorted({os.path.dirname(lb) for r, lb in zip(res, lb_files) if r[0] == MISSING}) if not os.path.isdir(d)]
    rows = [row for r in res for row in r[2]]
    return dict(files=np.array(files), status=np.array([r[0] for r in res], np.int8),
                shapes=np.array([r[1] for r in res], np.int64), nlab=np.array([len(r[2]) for r in res]),
                cls=np.array([c for c, _, _ in rows], np.int64),
                boxes=np.array([b for _, b, _ in rows], np.float32).reshape(-1, 4),
                npts=np.array([0 if p is None else len(p) for _, _, p in rows], np.int64),
                pts=np.concatenate([p for _, _, p in rows if p is not None] + [np.zeros((0, 2))]).astype(np.float32),
                msgs=np.array(msgs, dtype=str), rows=np.array([sum(r[4] for r in res), sum(r[5] for r in res)]))


def _load_or_build(files: list, prefix: str, nc) -> dict:
    """Verification results from the cache when its key matches, else verified now (and saved)."""
    lb_files = [img2label_path(f) for f in files]
    h = hashlib.sha256(f"{CACHE_VERSION}|{nc}".encode())
    for f in files + lb_files:
        try:
            s = os.stat(f)
            s = (s.st_size, s.st_mtime_ns, s.st_mode)
        except (OSError, ValueError):  # absent (what os.path.exists would say False to)
            s = None
        h.update(f"{f}|{s}\n".encode())
    key, path = h.hexdigest(), Path(os.path.dirname(lb_files[0]) + ".cache")
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) == key:
                return {k: z[k] for k in z.files}
    except Exception:  # absent, stale format or damaged: rebuild
        pass
    data = dict(_verify_all(files, lb_files, nc), key=np.array(key))
    d = path.parent  # root ignores permission bits; a folder marked read-only is respected anyway
    if not (d.is_dir() and os.access(d, os.W_OK) and d.stat().st_mode & 0o222):
        warn(f"{prefix}label cache not saved: {d} is not writable (labels are re-verified each run)")
        return data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **data)
        os.replace(tmp, path)
    except OSError as e:
        warn(f"{prefix}label cache not saved to {path} ({e})")
        tmp.unlink(missing_ok=True)
    return data


def load_labels(files: list, nc: int | None = None, prefix: str = "") -> tuple[list, list, dict]:
    """Verified (cached) labels of image files -> (usable files, label dicts, counts); prints warnings + summary."""
    with dist.main_first():  # under torchrun local rank 0 builds the cache; nothing inside may raise
        d = _load_or_build(files, prefix, nc)
    msgs = [prefix + str(m) for m in d["msgs"]]
    for m in msgs[:MAX_WARNINGS] + [f"{prefix}... and {len(msgs) - MAX_WARNINGS} more"] * (len(msgs) > MAX_WARNINGS):
        warn(m)
    st, nlab, npts = d["status"], d["nlab"], d["npts"]
    ends, pends = np.cumsum(nlab), np.cumsum(npts)
    keep, labels = [], []
    for i in np.flatnonzero(st != CORRUPT):
        a, b = ends[i] - nlab[i], ends[i]
        segs = [d["pts"][pends[j] - npts[j]:pends[j]] for j in range(a, b)] if npts[a:b].any() else []
        keep.append(str(d["files"][i]))
        labels.append(dict(cls=d["cls"][a:b], bboxes=d["boxes"][a:b], segments=segs,
                           shape=tuple(map(int, d["shapes"][i]))))
    c = np.bincount(st, minlength=4)
    stats = dict(images=len(st), found=int(c[FOUND]), missing=int(c[MISSING]), empty=int(c[EMPTY]),
                 corrupt=int(c[CORRUPT]), instances=int(sum(len(lb["cls"]) for lb in labels)),
                 dropped=int(d["rows"][0]), fixed=int(d["rows"][1]), warnings=len(msgs))
    dist.print0(f"{prefix}{stats['images']} images: {stats['found']} labelled, {stats['missing']} missing labels, "
                f"{stats['empty']} empty, {stats['corrupt']} corrupt; {stats['instances']} instances; "
                f"label rows: {stats['dropped']} dropped, {stats['fixed']} fixed")
    if not keep:
        raise DataError(f"{prefix}no usable images: all {len(st)} are corrupt (see the warnings above)")
    return keep, labels, stats
