"""The data config, YOLODataset (mosaic or letterbox), ClassifyDataset, samplers and loaders."""

from __future__ import annotations

import math
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder
from torchvision.transforms import v2

from . import shapes
from .augment import Piece, affine_matrix, hsv_jitter, overlap_mask, place_labels, render
from .files import FileError, read_yaml
from .labels import (
    CORRUPT,
    MAX_WARNINGS,
    DataError,
    Walk,
    list_images,
    load_labels,
    thread_map,
    verify,
)
from .ops import box_corners, xywh2xyxy, xyxy2xywh

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # RGB, pixels in [0, 1]


def load_data_config(path: str) -> dict:
    """Dataset yaml (folder: load_folder_data) -> {yaml_file, path, names: [str], nc, train: [str],
    val: [str]}. 'shapes', 'shapes-cls': embedded, made on first use (on local rank 0 first)."""
    p, kind = Path(path), str(path).removesuffix(".yaml")
    if str(path) in ("shapes", "shapes.yaml", "shapes-cls") and not p.exists():  # embedded
        p = shapes.ensure(kind) / "shapes.yaml" if kind == "shapes" else shapes.ensure(kind)
    if p.is_dir():
        return load_folder_data(p)
    if not p.exists():
        embedded = "the embedded datasets are shapes (detect, segment) and shapes-cls (classify)"
        raise DataError(f"data yaml {path} not found; {embedded}")
    try:
        cfg = read_yaml(p, "data yaml")
    except FileError as e:
        raise DataError(str(e)) from None
    missing = [k for k in ("train", "val", "names") if not isinstance(cfg, dict) or not cfg.get(k)]
    if missing:
        raise DataError(f"{p}: missing key(s) {', '.join(missing)}")
    if isinstance(names := cfg["names"], dict):
        names = [names.get(i, names.get(str(i))) for i in range(len(names))]
    if not isinstance(names, list) or None in names:
        raise DataError(f"{p}: names must be a list or a mapping {{0: name, 1: name, ...}}")
    if cfg.get("nc", len(names)) != len(names):
        raise DataError(f"{p}: nc is {cfg['nc']} but names has {len(names)} entries")
    root = os.path.normpath(p.parent / str(cfg.get("path") or "."))  # absolute: the yaml's folder
    out = dict(yaml_file=str(p), path=root, names=[str(n) for n in names], nc=len(names))
    for k in ("train", "val"):
        srcs = cfg[k] if isinstance(cfg[k], list) else [cfg[k]]
        out[k] = [os.path.normpath(os.path.join(root, str(s))) for s in srcs]
        if absent := [s for s in out[k] if not os.path.exists(s)]:
            raise DataError(f"{p}: {k} source {absent[0]} not found")
    return out


def check_task(data: dict, task: str) -> None:
    """DataError unless load_data_config's data suits the task: class folders for classify."""
    if (task == "classify") == ("yaml_file" in data):
        need = "a folder: root/train/<class>/" if task == "classify" else "a data yaml"
        raise DataError(f"{data['path']}: a {task} model needs {need}")


def load_folder_data(root: Path) -> dict:
    """Classification data root/{train,val or test}/<class>/* -> {path, names, nc, train, val}."""
    train, val = root / "train", root / ("val" if (root / "val").is_dir() else "test")
    if not (train.is_dir() and val.is_dir()):
        raise DataError(f"{root}: a classification dataset has train/ and val/ (or test/) folders")
    names, other = (sorted(d.name for d in os.scandir(f) if d.is_dir()) for f in (train, val))
    if not names:
        raise DataError(f"{train}: no class folders")
    if names != other:
        diff = ", ".join(sorted(set(names) ^ set(other))[:5])
        raise DataError(f"{val}: class folders differ from train/'s (not in both: {diff})")
    return dict(path=str(root), names=names, nc=len(names), train=[str(train)], val=[str(val)])


def available_memory() -> int:
    """Bytes of memory available for new allocations (Linux MemAvailable); 0 where unknown."""
    try:
        return int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return 0


class YOLODataset(Dataset):
    """YOLO images and labels as training (mosaic) or validation (letterbox) samples: `image` uint8
    (3,H,W) RGB; `targets` float32 (n,5) [cls, cx, cy, w, h] normalised; `masks` (H/4,W/4) overlap
    index map (k: the k-th target) or None; `path`; `shape` (orig_hw, ((rh, rw), (padw, padh))):
    input = original * r + pad; `index`. rect: sorted by h/w, batch b shaped batch_shapes[b].
    cache "ram": images in RAM at long side imgsz; "auto": if this node's processes need < 10%."""

    def __init__(
        self,
        sources,
        imgsz: int = 640,
        augment: bool = False,
        hyp: dict | None = None,
        task: str = "detect",
        rect: bool = False,
        batch_size: int = 16,
        stride: int = 32,
        cache: str | None = None,
        prefix: str = "",
        nc: int | None = None,
        verbose: bool = True,
        local_world_size: int = 1,
    ):
        if augment and hyp is None:
            raise ValueError("augment=True needs hyp (e.g. yolo_min/cfg/hyp.scratch-low.yaml)")
        self.imgsz, self.augment, self.hyp, self.task = imgsz, augment, hyp, task
        self.rect, self.batch_size, self.prefix = rect, batch_size, prefix
        files = list_images(sources, prefix, verbose)
        self.im_files, self.labels, self.stats = load_labels(files, nc, prefix, verbose)
        hw = np.array([lb["shape"] for lb in self.labels], np.float64)
        if rect:
            order = np.argsort(hw[:, 0] / hw[:, 1], kind="stable")
            self.im_files = [self.im_files[i] for i in order]
            self.labels = [self.labels[i] for i in order]
            hw = hw[order]
            ar, first = hw[:, 0] / hw[:, 1], np.arange(0, len(hw), batch_size)
            lo, hi = ar[first], ar[np.minimum(first + batch_size, len(ar)) - 1]  # h/w of each batch
            rel = np.stack([np.where(hi < 1, hi, 1), np.where(lo > 1, 1 / lo, 1)], 1)  # H, W / size
            self.batch_shapes = np.ceil(rel * imgsz / stride + 0.5).astype(int) * stride
        # each image's (w, h) in the RAM cache: long side imgsz
        self._dims = np.round(hw[:, ::-1] * imgsz / hw.max(1, keepdims=True)).astype(int)
        size, free, self._ram = int(self._dims.prod(1).sum()) * 3, available_memory(), None
        need = size * local_world_size
        if cache == "ram" and free and need > free:
            gb = f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB is available"
            raise DataError(f"{prefix}caching the images in RAM {gb}: use --cache off")
        # auto: if small enough, decode each image once instead of in every epoch (forked workers
        # share these pages)
        if cache == "ram" or (cache == "auto" and need < free / 10):
            scales, wh = self._dims[:, 0] / hw[:, 1], self._dims.tolist()
            self._ram = [im for im, _ in thread_map(self.load_image, range(len(self)), scales, wh)]
            if verbose:
                print(f"{prefix}{len(self)} images cached in RAM ({size / 1e6:.0f} MB)", flush=True)

    def check_polygons(self) -> None:
        """DataError unless some label is a polygon (from boxes alone masks would be rectangles)."""
        if not any(len(lb["segments"]) for lb in self.labels):
            raise DataError(f"{self.prefix}a segmentation model needs polygon labels: boxes only")

    def __len__(self) -> int:
        return len(self.im_files)

    def load_image(self, i: int, scale: float = 1.0, wh=None) -> tuple[torch.Tensor, tuple]:
        """Image i, uint8 (h,w,3) RGB: cached, else at >= scale x its size (JPEG draft) and resized
        to wh (w, h) if given; and its (sx, sy) scale."""
        f, (h0, w0) = self.im_files[i], self.labels[i]["shape"]
        if self._ram:
            return self._ram[i], (self._ram[i].shape[1] / w0, self._ram[i].shape[0] / h0)
        try:
            im = Image.open(f)
            if scale < 1:
                im.draft("RGB", (math.ceil(im.width * scale), math.ceil(im.height * scale)))
            im = ImageOps.exif_transpose(im) if im.getexif().get(0x0112, 1) != 1 else im
            im = to_rgb8(im)
            im = im.resize(wh, Image.Resampling.BILINEAR) if wh else im
        except Exception as e:
            raise DataError(f"{f}: unreadable now ({e}); it changed after verification") from e
        return torch.from_numpy(np.array(im)), (im.width / w0, im.height / h0)

    def _pieces(self, i: int, mosaic: bool) -> tuple[list, tuple]:
        """-> (pieces, canvas (w, h)): a mosaic of 4 around a random centre, or i letterboxed."""
        s = self.imgsz
        if not mosaic:
            h0, w0 = self.labels[i]["shape"]
            H, W = map(int, self.batch_shapes[i // self.batch_size]) if self.rect else (s, s)
            r = min(s / max(h0, w0), H / h0, W / w0)
            ox, oy = round((W - w0 * r) / 2 - 0.1), round((H - h0 * r) / 2 - 0.1)
            return [Piece(i, r, ox, oy, (ox, oy, ox + w0 * r, oy + h0 * r))], (W, H)
        xc, yc = random.uniform(0.5 * s, 1.5 * s), random.uniform(0.5 * s, 1.5 * s)
        pieces = []
        # top-left, top-right, bottom-left, bottom-right of the centre
        for j, k in enumerate([i] + random.choices(range(len(self)), k=3)):
            h0, w0 = self.labels[k]["shape"]
            r = s / max(h0, w0)
            x0, y0 = (xc - w0 * r if j in (0, 2) else xc), (yc - h0 * r if j in (0, 1) else yc)
            clip = (max(x0, 0), max(y0, 0), min(x0 + w0 * r, 2 * s), min(y0 + h0 * r, 2 * s))
            pieces.append(Piece(k, r, x0, y0, clip))
        return pieces, (2 * s, 2 * s)

    def __getitem__(self, key: int | tuple) -> dict:
        """key: an index, or (seed, epoch, index) from EpochSampler: seeds the augmentation."""
        if isinstance(key, tuple):
            random.seed("%d:%d:%d" % key)
        i = key[2] if isinstance(key, tuple) else key
        mosaic = self.augment and not self.rect and random.random() < self.hyp["mosaic"]
        pieces, canvas = self._pieces(i, mosaic)
        W, H = out = (self.imgsz, self.imgsz) if mosaic else canvas
        M, sc = affine_matrix(canvas, out, self.hyp) if self.augment else (np.eye(3), 1.0)
        image, shifts = render(pieces, M, out, self.load_image)
        p0, lb = pieces[0], self.labels[i]
        pad = (float(p0.ox + shifts[0][0]), float(p0.oy + shifts[0][1]))
        if self.augment:
            labels = [self.labels[p.index] for p in pieces]
            cls, boxes, polys = place_labels(pieces, labels, M, sc, out, shifts)
            image = hsv_jitter(image, self.hyp)
            for ax, flip in ((1, "flipud"), (0, "fliplr")):  # ax 1: y, image dim 1; ax 0: x, dim 2
                if random.random() < self.hyp[flip]:
                    image = image.flip(2 - ax)
                    boxes[:, [ax, ax + 2]] = out[ax] - boxes[:, [ax + 2, ax]]
                    for q in (q for q in polys if q is not None):
                        q[:, ax] = out[ax] - q[:, ax]
        else:  # the label file's boxes and polygons, exactly letterboxed
            k = np.array(lb["shape"][::-1] * 2) * p0.r  # normalised -> input pixels
            cls, boxes = lb["cls"], xywh2xyxy(lb["bboxes"] * k + [*pad, 0, 0])
            polys = [s * k[:2] + pad for s in lb["segments"]] or [None] * len(cls)
        xywh = xyxy2xywh(boxes) / [W, H, W, H]
        targets = torch.from_numpy(np.concatenate([np.reshape(cls, (-1, 1)), xywh], 1)).float()
        masks = overlap_mask(polys, boxes, (H, W)) if self.task == "segment" else None
        shape, path = (lb["shape"], ((float(p0.r),) * 2, pad)), self.im_files[i]
        return dict(image=image, targets=targets, masks=masks, path=path, shape=shape, index=i)

    def ground_truth(self, i: int) -> dict:
        """Labels of image i in ORIGINAL pixels: cls (n,) int64, boxes (n,4) xyxy float32, polygons
        [(k,2) float32] (rectangles of box rows for segment data; [] for detect data)."""
        lb = self.labels[i]
        wh = np.array(lb["shape"][::-1], np.float32)
        rects = list(box_corners(xywh2xyxy(lb["bboxes"]))) if self.task == "segment" else []
        boxes = xywh2xyxy(torch.from_numpy(lb["bboxes"] * np.tile(wh, 2)))
        cls, polygons = torch.from_numpy(lb["cls"]), [s * wh for s in lb["segments"] or rects]
        return dict(cls=cls, boxes=boxes, polygons=polygons)


def to_rgb8(image: Image.Image) -> Image.Image:
    """An image of any PIL mode as 8-bit RGB, its values scaled rather than clipped: 16-bit
    (I;16*) by >> 8; 32-bit integers (I) as 16-bit when all lie in 0..65535, else by >> 23 (the
    range 0..2^31-1), negative values as 0; floats (F) by 255 when all finite values lie in 0..1,
    else clipped to 0..255 (NaN as 0). Other modes (1, L, LA, P, PA, RGBA, CMYK, YCbCr, ...):
    PIL's convert("RGB")."""
    if image.mode == "RGB":
        return image
    if image.mode == "F":
        grey = float_to_uint8(np.asarray(image))
    elif image.mode == "I" or image.mode.startswith("I;"):
        grey = int_to_uint8(np.asarray(image))
    else:
        return image.convert("RGB")
    return Image.fromarray(grey, "L").convert("RGB")


def float_to_uint8(values: np.ndarray) -> np.ndarray:
    """Float pixels -> uint8: x 255 if the finite ones all lie in [0, 1], else clipped to 0..255."""
    finite = values[np.isfinite(values)]
    scale = 1.0
    if finite.size == 0 or (finite.min() >= 0 and finite.max() <= 1):
        scale = 255.0
    scaled = np.nan_to_num(values.astype(np.float64) * scale, nan=0.0, posinf=255.0, neginf=0.0)
    return np.clip(scaled, 0, 255).round().astype(np.uint8)


def int_to_uint8(values: np.ndarray) -> np.ndarray:
    """Integer pixels -> uint8: 16-bit (all in 0..65535) >> 8, else 31-bit >> 23; negative: 0."""
    wide = np.clip(values.astype(np.int64), 0, None)
    shift = 8
    if wide.size and wide.max() > 65535:
        shift = 23
    return np.clip(wide >> shift, 0, 255).astype(np.uint8)


def load_rgb(path: str) -> Image.Image:
    """An image file as 8-bit RGB (to_rgb8), turned as its EXIF orientation says."""
    return to_rgb8(ImageOps.exif_transpose(Image.open(path)))


def center_square(im: Image.Image) -> Image.Image:
    return v2.functional.center_crop(im, min(im.size))


class ClassifyDataset(ImageFolder):
    """ImageFolder split (root/<class>/*) as samples: `image` uint8 (3,imgsz,imgsz) RGB, `targets`
    int64 (1,1) [cls], `shape` the original (h, w), `path`, `index`. augment: the whole image
    stretched to the square, for cls_augment's crops; else the centre square resized.
    cache "ram": the images in RAM as samples; "auto": if this node's processes need < 10%."""

    task, rect = "classify", False

    def __init__(
        self,
        root,
        imgsz=224,
        augment=False,
        prefix="",
        verbose=True,
        cache=None,
        local_world_size=1,
    ):
        super().__init__(root, allow_empty=True)  # classes: load_folder_data's
        steps = [] if augment else [center_square]
        self.transform = v2.Compose([*steps, v2.Resize((imgsz, imgsz)), v2.PILToTensor()])
        checks = thread_map(lambda s: verify(s[0], ""), self.samples)  # no label file
        self.samples = [s for s, c in zip(self.samples, checks) if c[0] != CORRUPT]
        self.imgs, self.targets = self.samples, [k for _, k in self.samples]
        self.stats = dict(images=len(checks), corrupt=len(checks) - len(self.samples))
        if verbose:
            self.walk.warn(prefix)
            for m in [m for c in checks for m in c[3]][:MAX_WARNINGS]:
                print(f"WARNING {prefix}{m}", flush=True)
            print(f"{prefix}{len(checks)} images, {self.stats['corrupt']} corrupt", flush=True)
        if not self.samples:
            raise DataError(f"{prefix}no usable images in {root}: all are corrupt")
        size, free, self._ram = len(self.samples) * 3 * imgsz**2, available_memory(), None
        need = size * local_world_size
        if cache == "ram" and free and need > free:
            gb = f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB is available"
            raise DataError(f"{prefix}caching the images in RAM {gb}: use --cache off")
        if cache == "ram" or (cache == "auto" and need < free / 10):
            self._ram = thread_map(self.load, range(len(self.samples)))
            if verbose:
                print(f"{prefix}{len(self)} images cached in RAM ({size / 1e6:.0f} MB)", flush=True)

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, **kw):
        """(path, class) of the images under directory/<class>/: ImageFolder's, but each real file
        once and regular files only (see labels.Walk; ImageFolder follows links round a loop)."""
        walk, samples = Walk(), []
        classes = sorted(class_to_idx.items(), key=lambda item: item[1])
        walk.claim([directory, *(os.path.join(directory, name) for name, _ in classes)])
        for name, k in classes:
            for f in walk.files(os.path.join(directory, name)):
                if f.lower().endswith(extensions or IMG_EXTENSIONS):
                    samples.append((f, k))
        self.walk = walk  # its counts are warned about once the split is verified
        return samples

    def load(self, i: int) -> tuple[torch.Tensor, tuple]:
        """(sample i's image as self.transform makes it, the original (h, w))."""
        image = load_rgb(self.samples[i][0])
        return self.transform(image), (image.height, image.width)

    def __getitem__(self, key: int | tuple) -> dict:
        """key: an index, or EpochSampler's (seed, epoch, index): the same sample for any (the
        trainer augments batches, cls_augment)."""
        i = key[2] if isinstance(key, tuple) else key
        image, shape = self._ram[i] if self._ram else self.load(i)
        sample = dict(image=image, targets=torch.tensor([[self.targets[i]]]), masks=None, index=i)
        return sample | dict(shape=shape, path=self.samples[i][0])


def collate(samples: list[dict]) -> dict:
    """Samples -> batch: images uint8 (bs,3,H,W); targets float32 (N,6) [image, cls, cx, cy, w, h]
    (classify: int64 (bs,2)); masks float32 (bs,H/4,W/4) or None; shapes; indices (bs,)."""
    images = torch.stack([s["image"] for s in samples])
    targets = torch.cat([F.pad(s["targets"], (1, 0), value=k) for k, s in enumerate(samples)])
    masks = [s["masks"] for s in samples]
    masks = None if masks[0] is None else torch.stack(masks).float()
    indices = torch.tensor([s["index"] for s in samples], dtype=torch.int64)
    shapes = [s["shape"] for s in samples]
    return dict(images=images, targets=targets, masks=masks, indices=indices, shapes=shapes)


def shard_batches(n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """This rank's validation batches: consecutive batches dealt round-robin, none padded."""
    starts = range(rank * batch_size, n, world_size * batch_size)
    return [list(range(s, min(s + batch_size, n))) for s in starts]


class EpochSampler(DistributedSampler):
    """DistributedSampler of (seed, epoch, index) keys: augmentation independent of workers."""

    def __iter__(self):
        return ((self.seed, self.epoch, i) for i in super().__iter__())


def yield_cpu(worker_id: int) -> None:
    """Data workers at the lowest priority, quiet when the run is stopped (worker_init_fn)."""
    # Ctrl-C and `kill -TERM -pgid` (timeout, systemd, SLURM) reach the whole process group: the
    # main process says it once and ends the workers; a worker neither prints a traceback nor dies
    # by the signal (which the main process would report as a crashed worker)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)
    # where the cores are few, a worker preempting one of the step's OpenMP threads stalls them
    # all; at nice 19 workers fill the step's idle moments
    if hasattr(os, "nice"):  # not on Windows
        os.nice(19)


def _exit_quietly(signum, frame) -> None:
    """A data worker's SIGTERM handler: end at once with exit code 0."""
    os._exit(0)


def build_dataloader(
    dataset,
    batch_size,
    workers=8,
    shuffle=True,
    rank=0,
    world_size=1,
    seed=0,
    local_world_size=1,
    drop_single=False,
) -> tuple:
    """-> (DataLoader, sampler): shuffle: a seeded EpochSampler (call set_epoch), else batches.
    drop_single: a shuffled epoch's last batch is dropped if it would hold a single image."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(workers, max(cpus // local_world_size, 1))
    kw = dict(collate_fn=collate, num_workers=workers, persistent_workers=workers > 0)
    kw |= dict(worker_init_fn=yield_cpu, pin_memory=torch.cuda.is_available())
    if shuffle:
        sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        # only a last batch of one image, and never the only batch: the rest of the recipe stays
        single = len(sampler) % batch_size == 1 and len(sampler) > batch_size
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_single and single,
            **kw,
        )
        return loader, sampler
    if dataset.rect and batch_size != dataset.batch_size:
        raise ValueError(f"rect dataset built for batch {dataset.batch_size}, not {batch_size}")
    sampler = shard_batches(len(dataset), batch_size, rank, world_size)
    return DataLoader(dataset, batch_sampler=sampler, **kw), sampler
