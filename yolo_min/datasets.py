"""YOLO-format data: dataset yaml, label verification with a cache, the Dataset, collate and loaders.

Labels live at the image path with the last /images/ -> /labels/ and a .txt extension; rows are
`cls cx cy w h` or `cls x1 y1 x2 y2 ...` (polygon; box = its extent), normalised to [0, 1]. Every pair
is verified once (full decode) and cached next to the labels (`labels/<split>.cache`, atomic, keyed by
file list, sizes, mtimes, modes and nc). Bad input never crashes and is never silent: one warning per
problem naming file and line, then a summary of counts. Geometry is in augment.py.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import dist, shapes
from .augment import Piece, affine_matrix, hsv_jitter, overlap_mask, place_labels, render
from .losses import DEFAULT_HYP

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")
CACHE_VERSION = "yolo_min-labels-1"
MAX_WARNINGS = 100  # printed per dataset; all are counted
SLACK, TOL = 1e-3, 0.05  # coordinates this far outside [0,1]: clipped silently / clipped with a warning
FOUND, MISSING, EMPTY, CORRUPT = range(4)


class DataError(ValueError):
    """A dataset problem that stops the run: the message is one actionable line."""


def _warn(msg: str) -> None:
    if dist.is_main():
        print(f"WARNING {msg}", flush=True)


def load_data_config(path: str) -> dict:
    """Dataset yaml -> {yaml_file, path, train: [str], val: [str], names: [str], nc}; 'shapes' = embedded."""
    p = Path(path)
    if str(path) in ("shapes", "shapes.yaml") and not p.exists():
        with dist.main_first():
            p = shapes.ensure()
    if not p.is_file():
        raise DataError(f"data yaml {path} not found")
    try:
        cfg = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DataError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    missing = [k for k in ("train", "val", "names") if not isinstance(cfg, dict) or not cfg.get(k)]
    if missing:
        raise DataError(f"{p}: missing key(s) {', '.join(missing)}")
    names = cfg["names"]
    if isinstance(names, dict):
        names = [names.get(i, names.get(str(i))) for i in range(len(names))]
    if not isinstance(names, list) or None in names:
        raise DataError(f"{p}: names must be a list or a mapping {{0: name, 1: name, ...}}")
    if cfg.get("nc", len(names)) != len(names):
        raise DataError(f"{p}: nc is {cfg['nc']} but names has {len(names)} entries")
    root = p.parent / str(cfg.get("path") or ".")  # an absolute path replaces the yaml's folder
    out = dict(yaml_file=str(p), path=os.path.normpath(root), names=[str(n) for n in names], nc=len(names))
    for k in ("train", "val"):
        out[k] = [os.path.normpath(root / str(s)) for s in (cfg[k] if isinstance(cfg[k], list) else [cfg[k]])]
        for s in out[k]:
            if not os.path.exists(s):
                raise DataError(f"{p}: {k} source {s} not found")
    return out


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
        s = os.stat(f) if os.path.exists(f) else None
        h.update(f"{f}|{s and (s.st_size, s.st_mtime_ns, s.st_mode)}\n".encode())
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
        _warn(f"{prefix}label cache not saved: {d} is not writable (labels are re-verified each run)")
        return data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **data)
        os.replace(tmp, path)
    except OSError as e:
        _warn(f"{prefix}label cache not saved to {path} ({e})")
        tmp.unlink(missing_ok=True)
    return data


def load_labels(files: list, nc: int | None = None, prefix: str = "") -> tuple[list, list, dict]:
    """Verified (cached) labels of image files -> (usable files, label dicts, counts); prints warnings + summary."""
    with dist.main_first():  # under torchrun local rank 0 builds the cache; nothing inside may raise
        d = _load_or_build(files, prefix, nc)
    msgs = [prefix + str(m) for m in d["msgs"]]
    for m in msgs[:MAX_WARNINGS] + [f"{prefix}... and {len(msgs) - MAX_WARNINGS} more"] * (len(msgs) > MAX_WARNINGS):
        _warn(m)
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


def available_memory() -> int:
    """Bytes of memory available for new allocations (Linux MemAvailable); 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


class YOLODataset(Dataset):
    """Images and labels of YOLO-format sources as training (mosaic) or validation (letterbox) samples.

    Sample (dict): `image` uint8 (3,H,W) RGB; `targets` float32 (n,5) [cls, cx, cy, w, h] normalised to
    the input; `masks` (H/4,W/4) uint8/int16 overlap index map (value k = k-th target, 1-based) or None
    (detect); `path`; `shape` (orig_hw (h,w), ratio_pad ((rh,rw),(padw,padh))) with input pixel =
    original pixel * r + pad; `index`. `labels[i]`: cls (n,) int64, bboxes (n,4) normalised xywh,
    segments [(k,2) normalised] or [], shape (h,w). With rect=True files are sorted by aspect ratio and
    the batch of `batch_size` consecutive indices shares `batch_shapes[i // batch_size]` (H, W).
    cache="ram": every image is decoded once here (threads), resized to long side imgsz and kept in RAM
    (forked workers share it); "auto": the same when that needs < 10% of the available memory.
    """

    def __init__(self, sources, imgsz: int = 640, augment: bool = False, hyp: dict | None = None,
                 task: str = "detect", rect: bool = False, batch_size: int = 16, stride: int = 32,
                 pad: float = 0.5, cache: str | None = None, prefix: str = "", nc: int | None = None):
        self.imgsz, self.augment, self.task, self.rect, self.batch_size = imgsz, augment, task, rect, batch_size
        self.hyp = {**DEFAULT_HYP, **(hyp or {})}
        files, msgs = list_images([sources] if isinstance(sources, (str, Path)) else sources, prefix)
        for m in msgs:
            _warn(prefix + m)
        self.im_files, self.labels, self.stats = load_labels(files, nc, prefix)
        hw = np.array([lb["shape"] for lb in self.labels], np.float64)
        if rect:
            order = np.argsort(hw[:, 0] / hw[:, 1], kind="stable")
            self.im_files, self.labels = [self.im_files[i] for i in order], [self.labels[i] for i in order]
            hw = hw[order]
            ar = [hw[b:b + batch_size, 0] / hw[b:b + batch_size, 1] for b in range(0, len(hw), batch_size)]
            rel = np.array([[a[-1], 1] if a[-1] < 1 else [1, 1 / a[0]] if a[0] > 1 else [1, 1] for a in ar])
            self.batch_shapes = np.ceil(rel * imgsz / stride + pad).astype(int) * stride
        self._dims = np.round(hw[:, ::-1] * imgsz / hw.max(1, keepdims=True)).astype(int)  # (w, h) at imgsz
        self._offs, self._ram = np.cumsum([0, *(self._dims.prod(1) * 3)]), None
        if cache == "auto":  # small enough: decode each image once instead of in every epoch
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            cache = "ram" if self._offs[-1] * ranks < available_memory() / 10 else None
        if cache == "ram":
            self._ram = np.empty(self._offs[-1], np.uint8)  # forked workers share these pages (never written)
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # PIL decodes outside the GIL
                list(pool.map(self._cache, range(len(self))))
            dist.print0(f"{prefix}{len(self)} images cached in RAM ({self._offs[-1] / 1e6:.0f} MB)")

    def __len__(self) -> int:
        return len(self.im_files)

    def load_image(self, i: int, scale: float = 1.0) -> tuple[torch.Tensor, tuple]:
        """Image i as uint8 (h,w,3) RGB, decoded at >= `scale` x its original size where the format allows
        (JPEG DCT scaling), and its (sx, sy) size relative to the original. cache='ram': the cached copy."""
        h0, w0 = self.labels[i]["shape"]
        if self._ram is None:
            im = self._decode(i, scale)
            return torch.from_numpy(np.array(im)), (im.width / w0, im.height / h0)
        (w, h), start = map(int, self._dims[i]), self._offs[i]
        return torch.from_numpy(self._ram[start:start + w * h * 3].reshape(h, w, 3)), (w / w0, h / h0)

    def _cache(self, i: int) -> None:
        (w, h), start = map(int, self._dims[i]), self._offs[i]
        im = self._decode(i, w / self.labels[i]["shape"][1]).resize((w, h), Image.Resampling.BILINEAR)
        self._ram[start:start + w * h * 3] = np.asarray(im).ravel()

    def _decode(self, i: int, scale: float) -> Image.Image:
        try:
            im = Image.open(self.im_files[i])
            if scale < 1:
                im.draft("RGB", (math.ceil(im.width * scale), math.ceil(im.height * scale)))
            im = ImageOps.exif_transpose(im) if im.getexif().get(0x0112, 1) != 1 else im
            return im if im.mode == "RGB" else im.convert("RGB")
        except Exception as e:
            raise DataError(f"{self.im_files[i]}: unreadable now ({e}); it changed after verification") from e

    def _pieces(self, i: int, mosaic: bool) -> tuple[list, tuple]:
        """Where the source images go on the canvas: mosaic of 4 on 2s x 2s, or one letterboxed image."""
        s = self.imgsz
        if not mosaic:
            h0, w0 = self.labels[i]["shape"]
            H, W = map(int, self.batch_shapes[i // self.batch_size]) if self.rect else (s, s)
            r = min(s / max(h0, w0), H / h0, W / w0)
            ox, oy = round((W - w0 * r) / 2 - 0.1), round((H - h0 * r) / 2 - 0.1)
            return [Piece(i, r, ox, oy, (ox, oy, ox + w0 * r, oy + h0 * r))], (W, H)
        xc, yc = random.uniform(0.5 * s, 1.5 * s), random.uniform(0.5 * s, 1.5 * s)
        pieces = []
        for j, k in enumerate([i] + random.choices(range(len(self)), k=3)):  # top-left, top-right, bottom-l, -r
            h0, w0 = self.labels[k]["shape"]
            r = s / max(h0, w0)
            x0, y0 = (xc - w0 * r if j in (0, 2) else xc), (yc - h0 * r if j in (0, 1) else yc)
            clip = (max(x0, 0), max(y0, 0), min(x0 + w0 * r, 2 * s), min(y0 + h0 * r, 2 * s))
            pieces.append(Piece(k, r, x0, y0, clip))
        return pieces, (2 * s, 2 * s)

    def __getitem__(self, key: int | tuple) -> dict:
        """key: an index, or (seed, epoch, index) from EpochSampler, which seeds this sample's augmentation."""
        i = key
        if isinstance(key, tuple):
            random.seed("%d:%d:%d" % key)  # one stream per sample: the same images at any worker count or rank
            i = key[2]
        hyp = self.hyp
        mosaic = self.augment and not self.rect and random.random() < hyp["mosaic"]
        pieces, canvas = self._pieces(i, mosaic)
        W, H = out = (self.imgsz, self.imgsz) if mosaic else canvas
        M, sc = affine_matrix(canvas, out, *(hyp[k] for k in ("degrees", "translate", "scale", "shear", "perspective"))
                              ) if self.augment else (np.eye(3), 1.0)
        labels = [self.labels[p.index] for p in pieces]
        img, shifts = render(pieces, M, out, self.load_image, [lb["shape"] for lb in labels])
        p0, lb = pieces[0], labels[0]
        pad = (float(p0.ox + shifts[0][0]), float(p0.oy + shifts[0][1]))
        if self.augment:
            cls, boxes, polys = place_labels(pieces, labels, M, sc, out, shifts)
            im = hsv_jitter(img, hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"])
            for p, ax, flip in ((hyp["flipud"], 1, Image.Transpose.FLIP_TOP_BOTTOM),
                                (hyp["fliplr"], 0, Image.Transpose.FLIP_LEFT_RIGHT)):
                if random.random() < p:
                    im, boxes[:, [ax, ax + 2]] = im.transpose(flip), out[ax] - boxes[:, [ax + 2, ax]]
                    for q in (q for q in polys if q is not None):
                        q[:, ax] = out[ax] - q[:, ax]
            image = torch.from_numpy(np.stack([np.asarray(c) for c in im.split()]))  # (3,H,W); cheaper than permute
        else:  # the label file's boxes and polygons, exactly letterboxed
            k, image = np.array(lb["shape"][::-1]) * p0.r, img
            xy, wh = lb["bboxes"][:, :2] * k + pad, lb["bboxes"][:, 2:] * k
            cls, boxes = lb["cls"], np.concatenate([xy - wh / 2, xy + wh / 2], 1)
            polys = [s * k + pad for s in lb["segments"]] or [None] * len(cls)
        xywh = np.concatenate([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]], 1) / [W, H, W, H]
        return dict(image=image, targets=torch.from_numpy(np.concatenate([np.reshape(cls, (-1, 1)), xywh], 1)).float(),
                    masks=overlap_mask(polys, boxes, (H, W)) if self.task == "segment" else None,
                    path=self.im_files[i], shape=(lb["shape"], ((float(p0.r),) * 2, pad)), index=i)

    def ground_truth(self, i: int) -> dict:
        """Labels of image i in ORIGINAL pixels: cls (n,) int64, boxes (n,4) xyxy float32, polygons
        [(k,2) float32] (rectangles of box rows for segment data; [] for detect data), orig_hw (h, w)."""
        lb, rect = self.labels[i], np.array([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]], np.float32)
        b = lb["bboxes"] * np.array(lb["shape"][::-1] * 2, np.float32)
        segs = lb["segments"] or ([x[:2] + rect * x[2:] for x in lb["bboxes"]] if self.task == "segment" else [])
        return dict(cls=torch.as_tensor(lb["cls"], dtype=torch.int64),
                    boxes=torch.from_numpy(np.concatenate([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)),
                    polygons=[s * np.array(lb["shape"][::-1], np.float32) for s in segs], orig_hw=lb["shape"])


def collate(samples: list[dict]) -> dict:
    """Samples -> batch: images uint8 (bs,3,H,W); targets float32 (N,6) [img_idx, cls, cx, cy, w, h];
    masks float32 (bs,H/4,W/4) or None; paths; shapes; indices int64 (bs,)."""
    targets = [torch.cat([torch.full((len(s["targets"]), 1), float(k)), s["targets"]], 1)
               for k, s in enumerate(samples)]
    masks = None if samples[0]["masks"] is None else torch.stack([s["masks"] for s in samples]).float()
    return dict(images=torch.stack([s["image"] for s in samples]), targets=torch.cat(targets), masks=masks,
                paths=[s["path"] for s in samples], shapes=[s["shape"] for s in samples],
                indices=torch.tensor([s["index"] for s in samples], dtype=torch.int64))


def shard_batches(n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Validation batches of this rank: whole consecutive batches dealt round-robin, so every index is on
    exactly one rank, nothing is padded (a rank may get none) and rect batch shapes stay intact."""
    return [list(range(s, min(s + batch_size, n))) for s in range(rank * batch_size, n, world_size * batch_size)]


class EpochSampler(DistributedSampler):
    """DistributedSampler yielding (seed, epoch, index) keys, so each sample's augmentation depends only on
    them: batches are the same for any number of workers, and a resumed run sees the same images."""

    def __iter__(self):
        return ((self.seed, self.epoch, i) for i in super().__iter__())


def build_dataloader(dataset: YOLODataset, batch_size: int, workers: int = 8, shuffle: bool = True,
                     rank: int = 0, world_size: int = 1, seed: int = 0, pin_memory: bool | None = None):
    """-> (DataLoader, sampler). shuffle=True (training): a seeded EpochSampler, also at world size 1
    (call `sampler.set_epoch(e)`): the same seed gives the same batches. shuffle=False (validation): the
    `shard_batches` list.
    `workers` is capped at this rank's share of the CPUs (more would only compete with training)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(workers, max(cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))
    g = torch.Generator()
    g.manual_seed(seed * 1000 + rank)
    kw = dict(num_workers=workers, collate_fn=collate, generator=g, persistent_workers=workers > 0,
              pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
    if shuffle:
        sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kw), sampler
    if dataset.rect and batch_size != dataset.batch_size:
        raise ValueError(f"rect dataset built for batch {dataset.batch_size}, loader asked for {batch_size}")
    sampler = shard_batches(len(dataset), batch_size, rank, world_size)
    return DataLoader(dataset, batch_sampler=sampler, **kw), sampler
