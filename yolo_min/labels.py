"""Finding images and verifying their YOLO label files (last /images/ -> /labels/, .txt), cached.
Bad input never crashes and is never silent: one warning per problem (file and line), counts."""

import contextlib
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from .files import FileError, read_text, replace_file
from .ops import box_corners, xywh2xyxy, xyxy2xywh

IMG_FORMATS = ("bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp")
CACHE_VERSION = "yolo_min-labels-3"
# printed per dataset; all are counted
MAX_WARNINGS = 100
# a label file (a COCO image's: under 10 KB; 1000 polygons: ~5 MB)
MAX_LABEL_BYTES = 10_000_000
# a .txt image list (COCO train2017's: 5 MB)
MAX_LIST_BYTES = 200_000_000
# coordinates this far outside [0, 1] are clipped silently; up to TOL, with a warning
SLACK = 1e-3
TOL = 0.05
FOUND, MISSING, EMPTY, CORRUPT = range(4)
OPEN_ERRORS = {
    FileNotFoundError: "image not found",
    PermissionError: "image unreadable (permission denied)",
    Image.UnidentifiedImageError: "not an image (PIL cannot identify it)",
}
# PIL's formats for an extension; others: the extension, upper case
PIL_FORMATS = {"jpg": "JPEG MPO", "jpeg": "JPEG MPO", "tif": "TIFF"}
SUMMARY = (
    "{images} images: {found} labelled, {missing} missing labels, {empty} empty, "
    "{corrupt} corrupt; {instances} instances; label rows: {dropped} dropped, {fixed} fixed"
)


class DataError(ValueError):
    """A dataset problem that stops the run: the message is one actionable line."""


class Parsed(NamedTuple):
    """A label file's valid rows [(cls, [cx, cy, w, h], polygon (k, 2))], its warnings, and how
    many rows were dropped and how many clipped into [0, 1]."""

    rows: list
    msgs: list
    dropped: int
    fixed: int


class Verified(NamedTuple):
    """One image/label pair: FOUND, MISSING, EMPTY or CORRUPT; the image's (h, w) as shown (0, 0 if
    corrupt); its label rows, warnings, rows dropped and rows clipped (as Parsed)."""

    status: int
    shape: tuple
    rows: list
    msgs: list
    dropped: int = 0
    fixed: int = 0


def thread_map(fn, items):
    """[fn(item) for item in items] on up to 8 threads (PIL decodes without holding the GIL), each
    a contiguous share: a task per item costs more than a small image's decode."""
    items = list(items)
    threads = min(8, os.cpu_count() or 1)
    size = len(items) // threads + 1
    with ThreadPoolExecutor(threads) as pool:
        shares = pool.map(
            lambda k: [fn(x) for x in items[k : k + size]], range(0, len(items), size)
        )
        return [result for share in shares for result in share]


def img2label_path(f):
    """Last /images/ -> /labels/, extension -> .txt."""
    head, images, tail = f.rpartition(f"{os.sep}images{os.sep}")
    if images:
        f = f"{head}{os.sep}labels{os.sep}{tail}"
    return os.path.splitext(f)[0] + ".txt"


def list_images(sources, prefix="", verbose=True):
    """Image files in sources: folders (recursive), .txt lists (relative to their folder), files."""
    files = []
    skipped = []
    walk = Walk()
    if isinstance(sources, (str, Path)):
        sources = [sources]
    for src in map(Path, sources):
        if not src.exists():
            raise DataError(f"{prefix}{src} not found")
        if src.is_dir():
            found = walk.files(src)
        elif src.suffix == ".txt":
            try:
                text = read_text(src, MAX_LIST_BYTES, "image list")
            except FileError as e:
                raise DataError(f"{prefix}{e}") from None
            found = [src.parent / line for line in map(str.strip, text.splitlines()) if line]
        else:
            found = [src]
        for f in map(Path, found):
            kept = files if f.suffix[1:].lower() in IMG_FORMATS else skipped
            kept.append(os.path.normpath(f))
    if not files:
        raise DataError(f"{prefix}no images found in {', '.join(map(str, sources))}")
    if verbose and skipped:
        print(
            f"WARNING {prefix}{len(skipped)} file(s) without an image extension"
            f" ({', '.join(IMG_FORMATS)}) skipped, e.g. {skipped[0]}",
            flush=True,
        )
    if verbose:
        walk.warn(prefix)
    return list(dict.fromkeys(files))


def file_id(path):
    """The (device, inode) of the file or folder at path, through links."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


class Walk:
    """Folder walks that read each real file once: links are followed, but a folder or file already
    met (by device and inode) is skipped, so a link to a folder above is no loop; only regular files
    are listed (a FIFO would block a reader, a device never ends)."""

    def __init__(self):
        # the file_id of each folder and file met
        self.seen = set()
        # those of folders counted as met until they are walked as a root
        self.claimed = set()
        # links to a folder or file met before
        self.repeats = 0
        # the paths of FIFOs, devices, sockets, broken links
        self.others = []

    def claim(self, folders):
        """Count folders as met (a link to one is not followed), but walk each given as a root:
        ImageFolder's split and class folders, so that no link moves a file to another class."""
        self.claimed |= {file_id(folder) for folder in folders}

    def files(self, root):
        """The regular files under root not met before, sorted as paths."""
        self.claimed.discard(file_id(root))
        found = []
        for folder, subfolders, names in os.walk(root, onerror=self._unreadable, followlinks=True):
            if not self._first(file_id(folder)):
                # met before: not walked again
                subfolders.clear()
                continue
            # by name: which of two paths to a file is kept does not depend on the disk
            subfolders.sort()
            for name in sorted(names):
                path = os.path.join(folder, name)
                # through links; False for a broken one
                if not os.path.isfile(path):
                    self.others.append(path)
                elif self._first(file_id(path)):
                    found.append(path)
        return [str(f) for f in sorted(map(Path, found))]

    def _first(self, key):
        """Whether the folder or file of key (file_id) is met for the first time (then
        remembered)."""
        if key in self.seen or key in self.claimed:
            self.repeats += 1
            return False
        self.seen.add(key)
        return True

    def _unreadable(self, error):
        """os.walk's onerror: a folder it cannot list, counted once among the others (a folder met
        before: a repeat)."""
        if self._first(file_id(error.filename)):
            self.others.append(error.filename)

    def warn(self, prefix):
        """One warning line per kind of skipped entry."""
        if self.repeats:
            print(
                f"WARNING {prefix}{self.repeats} link(s) to a folder or file met before skipped"
                " (each file is read once)",
                flush=True,
            )
        if self.others:
            print(
                f"WARNING {prefix}{len(self.others)} entries that are not regular files (FIFOs,"
                f" devices, broken links, ...) skipped, e.g. {self.others[0]}",
                flush=True,
            )


def row_problem(line, values, nc):
    """Why a label row (its text; its numbers, None if one is not a number) is neither a box
    `cls cx cy w h` nor a polygon `cls x1 y1 x2 y2 x3 y3 ...` of a class in [0, nc); None if ok."""
    parts = line.split()
    n = len(parts)
    if n < 5:
        return f"{n} values; a row is 'cls cx cy w h' or 'cls x1 y1 x2 y2 x3 y3 ...'"
    if n > 5 and n % 2 == 0:
        return f"polygon with an odd number of coordinates ({n - 1})"
    if values is None:
        return f"non-numeric value in '{line.strip()[:50]}'"
    if not np.isfinite(values).all():
        return "NaN or inf value"
    cls = values[0]
    if cls != int(cls) or cls < 0 or (nc is not None and cls >= nc):
        limit = nc if nc is not None else "nc"
        return f"class {parts[0]} is not an integer in [0, {limit})"
    if n == 5 and values[3:].min() <= 0:
        return "box with zero or negative width/height"
    if n > 5 and len(np.unique(values[1:].reshape(-1, 2), axis=0)) < 3:
        return "polygon with fewer than 3 distinct points"
    return None


def parse_labels(text, where, nc):
    """Label file text -> Parsed: rows [(cls, [cx, cy, w, h], polygon (k,2))], msgs, dropped,
    fixed. Row: `cls cx cy w h` or `cls x1 y1 x2 y2 x3 y3 ...` (a polygon, its box its extent) in
    [0, 1]. A file with both has its box rows made rectangles: all rows or none have a polygon (else
    k = 0)."""
    rows = []
    # the values of each row kept -> its line number
    seen = {}
    msgs = []
    dropped = 0
    fixed = 0
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        polygon = len(parts) > 5
        values = None
        # a value that is not a number leaves values None
        with contextlib.suppress(ValueError):
            values = np.array(parts, float)
        why = row_problem(line, values, nc)
        if why is None and tuple(values) in seen:
            why = f"duplicate of line {seen[tuple(values)]}"
        if why is None:
            # a polygon's points, or a box's top-left and bottom-right corners
            points = values[1:].reshape(-1, 2)
            if not polygon:
                points = values[1:3] + np.array([[-0.5], [0.5]]) * values[3:5]
            low = points.min()
            high = points.max()
            if low < -TOL or high > 1 + TOL:
                why = f"coordinates outside [0, 1] (min {low:.4g}, max {high:.4g})"
            elif low < -SLACK or high > 1 + SLACK:
                fixed += 1
                msgs.append(f"{where}:{number}: coordinates slightly outside [0, 1] clipped")
            points = np.clip(points, 0, 1)
            # cx, cy, w, h
            box = xyxy2xywh(np.concatenate([points.min(0), points.max(0)]))
            if not why and box[2:].min() <= 0:
                why = "zero width or height after clipping to [0, 1]"
        if why:
            dropped += 1
            msgs.append(f"{where}:{number}: {why}; row dropped")
            continue
        seen[tuple(values)] = number
        if not polygon:
            points = np.zeros((0, 2))
        rows.append((int(values[0]), box, points))
    if len({len(points) > 0 for _, _, points in rows}) == 2:
        msgs.append(f"{where}: mixes box rows and polygon rows; boxes are used as rectangles")
        rows = [
            (cls, box, points if len(points) else box_corners(xywh2xyxy(box)))
            for cls, box, points in rows
        ]
    return Parsed(rows=rows, msgs=msgs, dropped=dropped, fixed=fixed)


def verify(im_file, lb_file, nc=None):
    """One image/label pair -> Verified (status, (h, w), rows, msgs, dropped, fixed); never
    raises."""

    def bad(why):
        return Verified(CORRUPT, (0, 0), [], msgs=[f"{im_file}: {why}; image skipped"])

    try:
        st = os.stat(im_file)
        # a FIFO would block, a device never end
        if not stat.S_ISREG(st.st_mode):
            return bad("not a regular file (a FIFO, device or socket)")
        if st.st_size == 0:
            return bad("empty (0-byte) file")
        with Image.open(im_file) as im:
            w, h = im.size
            fmt = im.format
            # PIL only warns below twice as many: GBs to decode
            if w * h > Image.MAX_IMAGE_PIXELS:
                return bad(f"{w}x{h} pixels, more than PIL's limit of {Image.MAX_IMAGE_PIXELS:,}")
            # 0x0112: the EXIF orientation; 5 to 8 turn the image by 90 degrees
            if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                w, h = h, w
            # JPEG: the whole stream is still decoded, at 1/8 scale
            im.draft("RGB", (1, 1))
            # decoded (as training converts it)
            im.convert("RGB")
    except Exception as e:
        # missing, unreadable, not an image, truncated, decompression bomb, ...
        return bad(OPEN_ERRORS.get(type(e), f"corrupt image ({type(e).__name__}: {e})"))
    if min(w, h) < 10:
        return bad(f"image too small ({w}x{h} px, need at least 10)")
    ext = os.path.splitext(im_file)[1][1:].lower()
    msgs = []
    if fmt not in PIL_FORMATS.get(ext, ext.upper()).split():
        msgs.append(f"{im_file}: {fmt} data with a .{ext} extension; used as is")
    if not os.path.exists(lb_file):
        return Verified(MISSING, (h, w), [], msgs=msgs)
    try:
        text = read_text(lb_file, MAX_LABEL_BYTES)
    except FileError as e:
        why = str(e).removeprefix(f"{lb_file}: ")
        return bad(f"label file {lb_file} unreadable ({why})")
    rows, row_msgs, dropped, fixed = parse_labels(text, lb_file, nc)
    msgs += row_msgs
    status = FOUND if rows else EMPTY
    if dropped and not rows:
        msgs.append(f"{im_file}: no valid label rows in {lb_file}; image skipped")
        status = CORRUPT
    return Verified(status, (h, w), rows, msgs=msgs, dropped=dropped, fixed=fixed)


def _load_or_build(files, nc, prefix, verbose):
    """The labels/<split>.cache if its key (version, nc, file stats) matches; else every pair
    verified and saved: a value per file, flat tensors per row (weights_only-loadable)."""
    lb_files = [img2label_path(f) for f in files]
    digest = hashlib.sha256(f"{CACHE_VERSION}|{nc}".encode())
    for f in files + lb_files:
        # None for a file that is absent
        state = None
        if os.path.exists(f):
            st = os.stat(f)
            state = (st.st_size, st.st_mtime_ns, st.st_mode)
        digest.update(f"{f}|{state}\n".encode())
    key = digest.hexdigest()
    path = Path(os.path.dirname(lb_files[0]) + ".cache")
    # absent, another format or damaged: verify again
    with contextlib.suppress(Exception):
        # a FIFO would block torch.load; weights_only: tensors, lists, numbers, strings, no code
        if os.path.isfile(path):
            data = torch.load(path, weights_only=True)
            if data["key"] == key:
                return data
    results = thread_map(lambda pair: verify(*pair, nc), zip(files, lb_files))
    # per file: Verified's fields
    status, shapes, file_rows, file_msgs, dropped, fixed = zip(*results)
    rows = [row for per_file in file_rows for row in per_file]
    polygons = [points for _, _, points in rows]
    msgs = [msg for per_file in file_msgs for msg in per_file]
    missing = {os.path.dirname(lb) for s, lb in zip(status, lb_files) if s == MISSING}
    msgs += [
        f"labels folder {folder} does not exist: its images are used as background"
        for folder in sorted(missing)
        if not os.path.isdir(folder)
    ]
    boxes = np.array([box for _, box, _ in rows], np.float32).reshape(-1, 4)
    points = np.concatenate([*polygons, np.zeros((0, 2))]).astype(np.float32)
    data = {
        "status": status,
        "shapes": shapes,
        "nrows": [len(per_file) for per_file in file_rows],
        "cls": torch.tensor([cls for cls, _, _ in rows], dtype=torch.int64),
        "boxes": torch.from_numpy(boxes),
        "npts": [len(p) for p in polygons],
        "pts": torch.from_numpy(points),
        "msgs": msgs,
        "dropped": sum(dropped),
        "fixed": sum(fixed),
        "key": key,
    }
    try:
        # root ignores permission bits; a folder marked read-only is respected
        writable = os.access(path.parent, os.W_OK) and path.parent.stat().st_mode & 0o222
        if not writable:
            raise PermissionError(f"{path.parent} is not writable")
        # written whole, then renamed
        replace_file(path, partial(torch.save, data))
    except (OSError, RuntimeError) as e:
        # RuntimeError: torch's zip writer, e.g. disk full
        if verbose:
            print(f"WARNING {prefix}label cache not saved to {path} ({e}): labels are re-verified")
    return data


def load_labels(files, nc, prefix="", verbose=True):
    """Verified (cached) labels -> (usable files, label dicts, counts); label dict: cls (n,) int64,
    bboxes (n,4) float32 normalised xywh, segments [(k,2) float32 normalised], shape (h, w)."""
    data = _load_or_build(files, nc, prefix=prefix, verbose=verbose)
    # file i's rows: starts[i] to starts[i + 1]
    starts = np.cumsum([0, *data["nrows"]])
    # per row; (0, 2) for a box
    polygons = np.split(data["pts"].numpy(), np.cumsum(data["npts"])[:-1])
    cls = data["cls"].numpy()
    boxes = data["boxes"].numpy()
    keep = []
    labels = []
    for i in np.flatnonzero(np.array(data["status"]) != CORRUPT):
        rows = slice(starts[i], starts[i + 1])
        keep.append(files[i])
        labels.append(
            {
                "cls": cls[rows],
                "bboxes": boxes[rows],
                "segments": [p for p in polygons[rows] if len(p)],
                "shape": data["shapes"][i],
            }
        )
    msgs = data["msgs"]
    # how many files have each status, in the order of their values
    counts = np.bincount(data["status"], minlength=4).tolist()
    stats = {
        "images": len(files),
        **dict(zip(["found", "missing", "empty", "corrupt"], counts)),
        # every row, as corrupt files have none
        "instances": len(cls),
        "dropped": data["dropped"],
        "fixed": data["fixed"],
        "warnings": len(msgs),
    }
    if verbose:
        shown = msgs[:MAX_WARNINGS]
        if len(msgs) > MAX_WARNINGS:
            shown.append(f"... and {len(msgs) - MAX_WARNINGS} more")
        for msg in shown:
            print(f"WARNING {prefix}{msg}", flush=True)
        print(prefix + SUMMARY.format(**stats), flush=True)
    if not keep:
        # each corrupt file is warned about above
        raise DataError(f"{prefix}no usable images: all {len(files)} are corrupt")
    return keep, labels, stats
