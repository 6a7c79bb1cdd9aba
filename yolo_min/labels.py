"""Finding images and verifying their YOLO label files (last /images/ -> /labels/, .txt), cached.
Bad input never crashes and is never silent: one warning per problem (file and line), counts."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .files import FileError, read_text
from .ops import box_corners, xywh2xyxy, xyxy2xywh

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")
CACHE_VERSION = "yolo_min-labels-3"
MAX_WARNINGS = 100  # printed per dataset; all are counted
MAX_LABEL_BYTES = 10_000_000  # a label file (a COCO image's: under 10 KB; 1000 polygons: ~5 MB)
MAX_LIST_BYTES = 200_000_000  # a .txt image list (COCO train2017's: 5 MB)
SLACK, TOL = 1e-3, 0.05  # coordinates this far outside [0,1]: clipped silently / with a warning
FOUND, MISSING, EMPTY, CORRUPT = range(4)
OPEN_ERRORS = {
    FileNotFoundError: "image not found",
    PermissionError: "image unreadable (permission denied)",
    Image.UnidentifiedImageError: "not an image (PIL cannot identify it)",
}
# PIL's formats for an extension; others: the extension, upper case
PIL_FORMATS = {"jpg": "JPEG MPO", "jpeg": "JPEG MPO", "tif": "TIFF"}
SUMMARY = "{images} images: {found} labelled, {missing} missing labels, {empty} empty, "
SUMMARY += "{corrupt} corrupt; {instances} instances; label rows: {dropped} dropped, {fixed} fixed"


class DataError(ValueError):
    """A dataset problem that stops the run: the message is one actionable line."""


def thread_map(fn, *iterables) -> list:
    """list(map(fn, *iterables)) on up to 8 threads: PIL decodes without holding the GIL."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, *iterables))


def img2label_path(f: str) -> str:
    """Last /images/ -> /labels/, extension -> .txt."""
    head, sep, tail = f.rpartition(f"{os.sep}images{os.sep}")
    return os.path.splitext(f"{head}{os.sep}labels{os.sep}{tail}" if sep else f)[0] + ".txt"


def list_images(sources, prefix: str = "", verbose: bool = True) -> list[str]:
    """Image files in sources: folders (recursive), .txt lists (relative to their folder), files."""
    files, skipped, walk = [], [], Walk()
    sources = [sources] if isinstance(sources, (str, Path)) else sources
    for src in map(Path, sources):
        if not src.exists():
            raise DataError(f"{prefix}{src} not found")
        if src.is_dir():
            found = [Path(f) for f in walk.files(src)]
        elif src.suffix == ".txt":
            try:
                text = read_text(src, MAX_LIST_BYTES, "image list")
            except FileError as e:
                raise DataError(f"{prefix}{e}") from None
            found = [src.parent / s.strip() for s in text.splitlines() if s.strip()]
        else:
            found = [src]
        for f in found:
            (files if f.suffix[1:].lower() in IMG_FORMATS else skipped).append(os.path.normpath(f))
    if not files:
        raise DataError(f"{prefix}no images found in {', '.join(map(str, sources))}")
    if skipped and verbose:
        why = f"file(s) without an image extension ({', '.join(IMG_FORMATS)}) skipped"
        print(f"WARNING {prefix}{len(skipped)} {why}, e.g. {skipped[0]}", flush=True)
    if verbose:
        walk.warn(prefix)
    return list(dict.fromkeys(files))


class Walk:
    """Folder walks that read each real file once: links are followed, but a folder or file already
    met (by device and inode) is skipped, so a link to a folder above is no loop; only regular files
    are listed (a FIFO would block a reader, a device never ends)."""

    def __init__(self):
        self.seen: set[tuple[int, int]] = set()
        self.claimed: set[tuple[int, int]] = set()  # folders walked only as a root of their own
        self.repeats = 0  # links to a folder or file met before
        self.others: list[str] = []  # FIFOs, devices, sockets, broken links

    def claim(self, folders) -> None:
        """Count folders as met (a link to one is not followed), but walk each given as a root:
        ImageFolder's split and class folders, so that no link moves a file to another class."""
        for folder in folders:
            st = os.stat(folder)
            self.seen.add((st.st_dev, st.st_ino))
            self.claimed.add((st.st_dev, st.st_ino))

    def files(self, root: str | Path) -> list[str]:
        """The regular files under root not met before, sorted as paths."""
        st = os.stat(root)
        if (key := (st.st_dev, st.st_ino)) in self.claimed:
            self.claimed.discard(key)
            self.seen.discard(key)
        found, todo = [], [str(root)]
        while todo:
            folder = todo.pop()
            if not self._first(os.stat(folder)):
                continue
            try:
                with os.scandir(folder) as it:
                    # by name: which of two paths to a file is kept does not depend on the disk
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:  # an unreadable folder
                self.others.append(folder)
                continue
            folders = []
            for entry in entries:
                kind = self._kind(entry)
                if kind == "folder":
                    folders.append(entry.path)
                elif kind == "file":
                    found.append(entry.path)
            todo += reversed(folders)  # the first by name is walked next
        return [str(f) for f in sorted(map(Path, found))]

    def _first(self, st: os.stat_result) -> bool:
        """Whether the folder or file of st is met for the first time (then remembered)."""
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            self.repeats += 1
            return False
        self.seen.add(key)
        return True

    def _kind(self, entry: os.DirEntry) -> str | None:
        """The entry's kind: "folder", "file" (regular, met for the first time) or None."""
        try:
            st = entry.stat()  # through links
        except OSError:
            self.others.append(entry.path)
            return None
        if stat.S_ISDIR(st.st_mode):
            return "folder"
        if not stat.S_ISREG(st.st_mode):
            self.others.append(entry.path)
            return None
        return "file" if self._first(st) else None

    def warn(self, prefix: str = "") -> None:
        """One warning line per kind of skipped entry."""
        if self.repeats:
            why = "link(s) to a folder or file met before skipped (each file is read once)"
            print(f"WARNING {prefix}{self.repeats} {why}", flush=True)
        if self.others:
            why = "entries that are not regular files (FIFOs, devices, broken links, ...) skipped"
            print(f"WARNING {prefix}{len(self.others)} {why}, e.g. {self.others[0]}", flush=True)


def parse_labels(text: str, where: str, nc: int | None = None) -> tuple[list, list, int, int]:
    """Label file text -> (rows [(cls, [cx, cy, w, h], polygon (k,2))], msgs, dropped, fixed). Row:
    `cls cx cy w h` or `cls x1 y1 x2 y2 x3 y3 ...` (a polygon, its box its extent) in [0, 1]. A file
    with both has its box rows made rectangles: all rows or none have a polygon (else k = 0)."""
    rows, seen, msgs, dropped, fixed = [], {}, [], 0, 0
    for ln, line in enumerate(text.splitlines(), 1):
        if not (parts := line.split()):
            continue
        n, why, v = len(parts), None, None
        with contextlib.suppress(ValueError):  # v stays None
            v = np.array([float(x) for x in parts])
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
            box = xyxy2xywh(np.concatenate([pts.min(0), pts.max(0)]))  # cx, cy, w, h
            if not why and (box[2] <= 0 or box[3] <= 0):
                why = "zero width or height after clipping to [0, 1]"
        if why:
            dropped += 1
            msgs.append(f"{where}:{ln}: {why}; row dropped")
            continue
        seen[tuple(v)] = ln
        rows.append((int(v[0]), box, pts if n > 5 else np.zeros((0, 2))))
    if len({len(p) > 0 for _, _, p in rows}) == 2:
        msgs.append(f"{where}: mixes box rows and polygon rows; boxes are used as rectangles")
        rows = [(c, b, p if len(p) else box_corners(xywh2xyxy(np.array(b)))) for c, b, p in rows]
    return rows, msgs, dropped, fixed


def verify(im_file: str, lb_file: str, nc: int | None = None) -> tuple:
    """One image/label pair -> (status, (h, w), rows, msgs, dropped, fixed). Never raises."""

    def bad(why):
        return CORRUPT, (0, 0), [], [f"{im_file}: {why}; image skipped"], 0, 0

    try:
        st = os.stat(im_file)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device never end
            return bad("not a regular file (a FIFO, device or socket)")
        if st.st_size == 0:
            return bad("empty (0-byte) file")
        with Image.open(im_file) as im:
            (w, h), fmt = im.size, im.format
            if w * h > Image.MAX_IMAGE_PIXELS:  # PIL only warns below twice as many: GBs to decode
                return bad(f"{w}x{h} pixels, more than PIL's limit of {Image.MAX_IMAGE_PIXELS:,}")
            if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF rotation by 90 degrees
                w, h = h, w
            im.draft("RGB", (1, 1))  # JPEG: the whole stream is still decoded, at 1/8 scale
            im.load() if im.mode == "RGB" else im.convert("RGB")
    except Exception as e:  # missing, unreadable, not an image, truncated, decompression bomb, ...
        return bad(OPEN_ERRORS.get(type(e), f"corrupt image ({type(e).__name__}: {e})"))
    if min(w, h) < 10:
        return bad(f"image too small ({w}x{h} px, need at least 10)")
    ext = os.path.splitext(im_file)[1][1:].lower()
    ok = fmt in PIL_FORMATS.get(ext, ext.upper()).split()
    msgs = [] if ok else [f"{im_file}: {fmt} data with a .{ext} extension; used as is"]
    if not os.path.exists(lb_file):
        return MISSING, (h, w), [], msgs, 0, 0
    try:
        text = read_text(lb_file, MAX_LABEL_BYTES)
    except FileError as e:
        return bad(f"label file {lb_file} unreadable ({str(e).removeprefix(f'{lb_file}: ')})")
    rows, m, dropped, fixed = parse_labels(text, lb_file, nc)
    if dropped and not rows:
        m.append(f"{im_file}: no valid label rows in {lb_file}; image skipped")
        return CORRUPT, (h, w), [], msgs + m, dropped, fixed
    return (FOUND if rows else EMPTY), (h, w), rows, msgs + m, dropped, fixed


def _verify_all(files: list, lb_files: list, nc) -> dict:
    """Verify every pair -> lists per file, flat tensors per row (weights_only-loadable)."""
    res = thread_map(verify, files, lb_files, [nc] * len(files))
    status, shapes, file_rows, file_msgs, dropped, fixed = zip(*res)
    cls, boxes, polys = list(zip(*[row for r in file_rows for row in r])) or [(), (), ()]
    no_dir = sorted({os.path.dirname(lb) for s, lb in zip(status, lb_files) if s == MISSING})
    bg = "does not exist: its images are used as background"
    msgs = [m for ms in file_msgs for m in ms]
    msgs += [f"labels folder {d} {bg}" for d in no_dir if not os.path.isdir(d)]
    boxes = torch.from_numpy(np.array(boxes, np.float32).reshape(-1, 4))
    pts = torch.from_numpy(np.concatenate([*polys, np.zeros((0, 2))]).astype(np.float32))
    npts = [len(p) for p in polys]
    per_file = dict(status=list(status), shapes=list(shapes), nrows=[len(r) for r in file_rows])
    per_row = dict(cls=torch.tensor(cls, dtype=torch.int64), boxes=boxes, npts=npts, pts=pts)
    return per_file | per_row | dict(msgs=msgs, dropped=sum(dropped), fixed=sum(fixed))


def _load_or_build(files: list, nc, prefix: str, verbose: bool) -> dict:
    """The labels/<split>.cache if its key (version, nc, file stats) matches; else verify, save."""
    lb_files = [img2label_path(f) for f in files]
    h = hashlib.sha256(f"{CACHE_VERSION}|{nc}".encode())
    for f in files + lb_files:
        s = os.stat(f) if os.path.exists(f) else None
        h.update(f"{f}|{s and (s.st_size, s.st_mtime_ns, s.st_mode)}\n".encode())
    key, path = h.hexdigest(), Path(os.path.dirname(lb_files[0]) + ".cache")
    with contextlib.suppress(Exception):  # absent, another format or damaged: verify again
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block torch.load
            raise FileError(f"{path}: not a regular file")
        data = torch.load(path, weights_only=True)  # tensors, lists, numbers, strings: no code
        if data["key"] == key:
            return data
    data = dict(_verify_all(files, lb_files, nc), key=key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed
    try:
        # root ignores permission bits; a folder marked read-only is respected
        if not (os.access(path.parent, os.W_OK) and path.parent.stat().st_mode & 0o222):
            raise PermissionError(f"{path.parent} is not writable")
        torch.save(data, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's zip writer, e.g. disk full
        tmp.unlink(missing_ok=True)
        if verbose:
            print(f"WARNING {prefix}label cache not saved to {path} ({e}): labels are re-verified")
    return data


def load_labels(files: list, nc: int | None = None, prefix: str = "", verbose: bool = True):
    """Verified (cached) labels -> (usable files, label dicts, counts); label dict: cls (n,) int64,
    bboxes (n,4) float32 normalised xywh, segments [(k,2) float32 normalised], shape (h, w)."""
    d = _load_or_build(files, nc, prefix, verbose)
    starts = np.cumsum([0, *d["nrows"]])  # file i's rows: starts[i] to starts[i + 1]
    polys = np.split(d["pts"].numpy(), np.cumsum(d["npts"])[:-1])  # per row; (0, 2) for a box
    cls, boxes = d["cls"].numpy(), d["boxes"].numpy()
    keep, labels = [], []
    for i in np.flatnonzero(np.array(d["status"]) != CORRUPT):
        a, b = starts[i], starts[i + 1]
        segs = [p for p in polys[a:b] if len(p)]
        keep.append(files[i])
        labels.append(dict(cls=cls[a:b], bboxes=boxes[a:b], segments=segs, shape=d["shapes"][i]))
    msgs, counts = d["msgs"], np.bincount(d["status"], minlength=4).tolist()
    stats = dict(images=len(files), **dict(zip(("found", "missing", "empty", "corrupt"), counts)))
    # instances: every row, as corrupt files have none
    stats.update(instances=len(cls), dropped=d["dropped"], fixed=d["fixed"], warnings=len(msgs))
    if verbose:
        more = [f"... and {len(msgs) - MAX_WARNINGS} more"] if len(msgs) > MAX_WARNINGS else []
        for m in msgs[:MAX_WARNINGS] + more:
            print(f"WARNING {prefix}{m}", flush=True)
        print(prefix + SUMMARY.format(**stats), flush=True)
    if not keep:
        raise DataError(f"{prefix}no usable images: all {len(files)} are corrupt")  # warned above
    return keep, labels, stats
