"""The dataset yaml, YOLODataset (mosaic or letterbox samples), collate, samplers and loaders.

File finding and label verification are in labels.py; image geometry and colour in augment.py.
"""
from __future__ import annotations

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
from .labels import DataError, list_images, load_labels, warn
from .losses import DEFAULT_HYP
from .ops import xywh2xyxy


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
            warn(prefix + m)
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
        need, free = self._offs[-1] * dist.local_world_size(), available_memory()
        if cache == "auto":  # small enough: decode each image once instead of in every epoch
            cache = "ram" if need < free / 10 else None
        if cache == "ram" and free and need > free:
            raise DataError(f"{prefix}caching the images in RAM needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
                            f"is available: use --cache off")
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
        w, h = map(int, self._dims[i])
        return torch.from_numpy(self._ram[self._offs[i]:self._offs[i + 1]].reshape(h, w, 3)), (w / w0, h / h0)

    def _cache(self, i: int) -> None:
        w, h = map(int, self._dims[i])
        im = self._decode(i, w / self.labels[i]["shape"][1]).resize((w, h), Image.Resampling.BILINEAR)
        self._ram[self._offs[i]:self._offs[i + 1]] = np.asarray(im).ravel()

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
        img, shifts = render(pieces, M, out, self.load_image)
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
                    boxes=xywh2xyxy(torch.from_numpy(b)),
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
    workers = min(workers, max(cpus // dist.local_world_size(), 1))
    kw = dict(num_workers=workers, collate_fn=collate, persistent_workers=workers > 0,
              pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
    if shuffle:
        sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kw), sampler
    if dataset.rect and batch_size != dataset.batch_size:
        raise ValueError(f"rect dataset built for batch {dataset.batch_size}, loader asked for {batch_size}")
    sampler = shard_batches(len(dataset), batch_size, rank, world_size)
    return DataLoader(dataset, batch_sampler=sampler, **kw), sampler
