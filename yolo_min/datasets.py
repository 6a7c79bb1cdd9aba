"""The data config, YOLODataset (mosaic or letterbox), ClassifyDataset, samplers and loaders."""

import math
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets.folder import ImageFolder
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

# RGB, for pixels in [0, 1]
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_data_config(path):
    """Dataset yaml (folder: load_folder_data) -> {yaml_file, path, names: [str], nc, train: [str],
    val: [str]}. 'shapes', 'shapes-cls': embedded, made on first use (on local rank 0 first)."""
    config = Path(path)
    # a file or folder of that name comes first
    if str(path) in ("shapes", "shapes.yaml", "shapes-cls") and not config.exists():
        kind = str(path).removesuffix(".yaml")
        config = shapes.ensure(kind)
        if kind == "shapes":
            config = config / "shapes.yaml"
    if config.is_dir():
        return load_folder_data(config)
    if not config.exists():
        raise DataError(
            f"data yaml {path} not found; the embedded datasets are shapes (detect, segment) "
            "and shapes-cls (classify)"
        )
    try:
        cfg = read_yaml(config, "data yaml")
    except FileError as e:
        raise DataError(str(e)) from None
    if not isinstance(cfg, dict):
        cfg = {}
    missing = [key for key in ("train", "val", "names") if not cfg.get(key)]
    if missing:
        raise DataError(f"{config}: missing key(s) {', '.join(missing)}")
    names = cfg["names"]
    if isinstance(names, dict):
        names = [names.get(i, names.get(str(i))) for i in range(len(names))]
    if not isinstance(names, list) or None in names:
        raise DataError(f"{config}: names must be a list or a mapping {{0: name, 1: name, ...}}")
    if cfg.get("nc", len(names)) != len(names):
        raise DataError(f"{config}: nc is {cfg['nc']} but names has {len(names)} entries")
    names = list(map(str, names))
    # absolute: relative to the yaml's folder
    root = os.path.normpath(config.parent / str(cfg.get("path") or "."))
    data = {"yaml_file": str(config), "path": root, "names": names, "nc": len(names)}
    for split in ("train", "val"):
        sources = cfg[split]
        if not isinstance(sources, list):
            sources = [sources]
        data[split] = [os.path.normpath(os.path.join(root, str(s))) for s in sources]
        absent = [s for s in data[split] if not os.path.exists(s)]
        if absent:
            raise DataError(f"{config}: {split} source {absent[0]} not found")
    return data


def check_task(data, task):
    """DataError unless load_data_config's data suits the task: class folders for classify."""
    if (task == "classify") == ("yaml_file" in data):
        need = "a folder: root/train/<class>/" if task == "classify" else "a data yaml"
        raise DataError(f"{data['path']}: a {task} model needs {need}")


def load_folder_data(root):
    """Classification data root/{train,val or test}/<class>/* -> {path, names, nc, train, val}."""
    train = root / "train"
    val = root / ("val" if (root / "val").is_dir() else "test")
    if not (train.is_dir() and val.is_dir()):
        raise DataError(f"{root}: a classification dataset has train/ and val/ (or test/) folders")
    names, val_names = (sorted(e.name for e in os.scandir(d) if e.is_dir()) for d in (train, val))
    if not names:
        raise DataError(f"{train}: no class folders")
    if names != val_names:
        diff = ", ".join(sorted(set(names) ^ set(val_names))[:5])
        raise DataError(f"{val}: class folders differ from train/'s (not in both: {diff})")
    return {
        "path": str(root),
        "names": names,
        "nc": len(names),
        "train": [str(train)],
        "val": [str(val)],
    }


def available_memory():
    """Bytes of memory available for new allocations (Linux MemAvailable); 0 where unknown."""
    try:
        text = Path("/proc/meminfo").read_text()
        return int(text.split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return 0


def cache_in_ram(load, count, size, cache, local_world_size, prefix, verbose):
    """[load(i) for i in range(count)] decoded on threads when --cache says so, else None. size:
    their bytes; "ram": always (DataError if this node's processes would not fit), "auto": if
    they need under 10% of the available memory, any other value: never."""
    free = available_memory()
    need = size * local_world_size
    if cache == "ram" and free and need > free:
        raise DataError(
            f"{prefix}caching the images in RAM needs {need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB is available: use --cache off"
        )
    # auto: if small enough, decode each image once instead of in every epoch (forked workers
    # share these pages)
    if not (cache == "ram" or (cache == "auto" and need < free / 10)):
        return None
    images = thread_map(load, range(count))
    if verbose:
        print(f"{prefix}{count} images cached in RAM ({size / 1e6:.0f} MB)", flush=True)
    return images


class YOLODataset(Dataset):
    """YOLO images and labels as training (mosaic) or validation (letterbox) samples: `image` uint8
    (3,H,W) RGB; `targets` float32 (n,5) [cls, cx, cy, w, h] normalised; `masks` (H/4,W/4) overlap
    index map (k: the k-th target) or None; `path`; `shape` (orig_hw, ((rh, rw), (padw, padh))):
    input = original * r + pad; `index`. rect: sorted by h/w, batch b shaped batch_shapes[b].
    cache "ram": images in RAM at long side imgsz; "auto": if this node's processes need < 10%."""

    def __init__(
        self,
        sources,
        imgsz=640,
        augment=False,
        hyp=None,
        task="detect",
        rect=False,
        batch_size=16,
        stride=32,
        cache=None,
        prefix="",
        nc=None,
        verbose=True,
        local_world_size=1,
    ):
        if augment and hyp is None:
            raise ValueError("augment=True needs hyp (e.g. yolo_min/cfg/hyp.scratch-low.yaml)")
        self.imgsz = imgsz
        self.augment = augment
        self.hyp = hyp
        self.task = task
        self.rect = rect
        self.batch_size = batch_size
        self.prefix = prefix
        files = list_images(sources, prefix, verbose)
        self.im_files, self.labels, self.stats = load_labels(files, nc, prefix, verbose)
        hw = np.array([label["shape"] for label in self.labels], np.float64)
        if rect:
            aspect = hw[:, 0] / hw[:, 1]
            order = np.argsort(aspect, kind="stable")
            self.im_files = [self.im_files[i] for i in order]
            self.labels = [self.labels[i] for i in order]
            hw = hw[order]
            aspect = aspect[order]
            # each batch's input (H, W): the batch's most extreme image fits imgsz, each side a
            # multiple of stride
            first = np.arange(0, len(aspect), batch_size)
            last = np.minimum(first + batch_size, len(aspect)) - 1
            # H and W over imgsz: min(h/w, 1) of the batch's tallest image (its last), min(w/h, 1)
            # of its widest (its first)
            height = np.minimum(aspect[last], 1)
            width = np.minimum(1 / aspect[first], 1)
            relative = np.stack([height, width], 1)
            self.batch_shapes = np.ceil(relative * imgsz / stride + 0.5).astype(int) * stride
        # each image's (w, h) in the RAM cache: long side imgsz
        long_side = hw.max(1, keepdims=True)
        self._dims = np.round(hw[:, ::-1] * imgsz / long_side).astype(int)
        scales = self._dims[:, 0] / hw[:, 1]
        dims = self._dims.tolist()
        # load_image reads the cache: empty while it is being filled
        self._ram = None
        self._ram = cache_in_ram(
            lambda i: self.load_image(i, scales[i], dims[i])[0],
            count=len(self),
            size=int(self._dims.prod(1).sum()) * 3,
            cache=cache,
            local_world_size=local_world_size,
            prefix=prefix,
            verbose=verbose,
        )

    def check_polygons(self):
        """DataError unless some label is a polygon (from boxes alone masks would be rectangles)."""
        if not any(label["segments"] for label in self.labels):
            raise DataError(f"{self.prefix}a segmentation model needs polygon labels: boxes only")

    def __len__(self):
        return len(self.im_files)

    def load_image(self, i, scale=1.0, wh=None):
        """Image i, uint8 (h,w,3) RGB: cached, else at >= scale x its size (JPEG draft) and resized
        to wh (w, h) if given; and its (sx, sy) scale."""
        path = self.im_files[i]
        h0, w0 = self.labels[i]["shape"]
        if self._ram:
            image = self._ram[i]
        else:
            try:
                im = load_rgb(path, scale)
                if wh:
                    im = im.resize(wh, Image.Resampling.BILINEAR)
            except Exception as e:
                raise DataError(
                    f"{path}: unreadable now ({e}); it changed after verification"
                ) from e
            image = torch.from_numpy(np.array(im))
        return image, (image.shape[1] / w0, image.shape[0] / h0)

    def _letterbox(self, i):
        """-> ([Piece], canvas (w, h)): image i scaled to fit the input shape, centred."""
        size = self.imgsz
        h0, w0 = self.labels[i]["shape"]
        height = size
        width = size
        if self.rect:
            height, width = map(int, self.batch_shapes[i // self.batch_size])
        r = min(size / max(h0, w0), height / h0, width / w0)
        # the padding split as yolov5's letterbox splits it
        left = round((width - w0 * r) / 2 - 0.1)
        top = round((height - h0 * r) / 2 - 0.1)
        clip = (left, top, left + w0 * r, top + h0 * r)
        piece = Piece(index=i, r=r, ox=left, oy=top, clip=clip)
        return [piece], (width, height)

    def _mosaic(self, i):
        """-> (4 Pieces, canvas (w, h)): image i and 3 random ones around a random centre."""
        size = self.imgsz
        centre_x = random.uniform(0.5 * size, 1.5 * size)
        centre_y = random.uniform(0.5 * size, 1.5 * size)
        indices = [i] + random.choices(range(len(self)), k=3)
        pieces = []
        # top-left, top-right, bottom-left, bottom-right of the centre
        for j, k in enumerate(indices):
            h0, w0 = self.labels[k]["shape"]
            r = size / max(h0, w0)
            x0 = centre_x - w0 * r if j in (0, 2) else centre_x
            y0 = centre_y - h0 * r if j in (0, 1) else centre_y
            # the piece's extent on the canvas
            clip = tuple(np.clip([x0, y0, x0 + w0 * r, y0 + h0 * r], 0, 2 * size).tolist())
            pieces.append(Piece(index=k, r=r, ox=x0, oy=y0, clip=clip))
        return pieces, (2 * size, 2 * size)

    def __getitem__(self, key):
        """key: an index, or (seed, epoch, index) from EpochSampler: seeds the augmentation."""
        i = key
        if isinstance(key, tuple):
            random.seed("%d:%d:%d" % key)
            i = key[2]
        if self.augment and not self.rect and random.random() < self.hyp["mosaic"]:
            pieces, canvas = self._mosaic(i)
            out = (self.imgsz, self.imgsz)
        else:
            pieces, canvas = self._letterbox(i)
            out = canvas
        matrix = np.eye(3)
        scale = 1.0
        if self.augment:
            matrix, scale = affine_matrix(canvas, out, self.hyp)
        image, shifts = render(pieces, matrix, out_wh=out, load=self.load_image)
        first = pieces[0]
        label = self.labels[i]
        # where the original's (0, 0) is drawn, in input px
        pad = tuple(np.add((first.ox, first.oy), shifts[0]).tolist())
        if self.augment:
            labels = [self.labels[piece.index] for piece in pieces]
            cls, boxes, polys = place_labels(
                pieces, labels, matrix, scale, out_wh=out, shifts=shifts
            )
            image = hsv_jitter(image, self.hyp)
            # flipud mirrors y (axis 1 of the boxes, dim 1 of the image), fliplr x (axis 0, dim 2)
            for axis, flip in ((1, "flipud"), (0, "fliplr")):
                if random.random() < self.hyp[flip]:
                    image = image.flip(2 - axis)
                    boxes[:, [axis, axis + 2]] = out[axis] - boxes[:, [axis + 2, axis]]
                    for polygon in polys:
                        if polygon is not None:
                            polygon[:, axis] = out[axis] - polygon[:, axis]
        else:
            # the label file's boxes and polygons, exactly letterboxed: normalised -> input pixels
            to_pixels = np.array(label["shape"][::-1] * 2) * first.r
            cls = label["cls"]
            boxes = xywh2xyxy(label["bboxes"] * to_pixels + [*pad, 0, 0])
            polys = [s * to_pixels[:2] + pad for s in label["segments"]]
            polys = polys or [None] * len(cls)
        xywh = xyxy2xywh(boxes) / np.tile(out, 2)
        rows = np.column_stack([cls, xywh])
        masks = None
        if self.task == "segment":
            masks = overlap_mask(polys, boxes, out[::-1])
        return {
            "image": image,
            "targets": torch.from_numpy(rows).float(),
            "masks": masks,
            "path": self.im_files[i],
            "shape": (label["shape"], ((first.r, first.r), pad)),
            "index": i,
        }

    def ground_truth(self, i):
        """Labels of image i in ORIGINAL pixels: cls (n,) int64, boxes (n,4) xyxy float32, polygons
        [(k,2) float32] (rectangles of box rows for segment data; [] for detect data)."""
        label = self.labels[i]
        wh = np.array(label["shape"][::-1], np.float32)
        boxes = xywh2xyxy(torch.from_numpy(label["bboxes"] * np.tile(wh, 2)))
        polygons = label["segments"]
        if not polygons and self.task == "segment":
            polygons = box_corners(xywh2xyxy(label["bboxes"]))
        polygons = [s * wh for s in polygons]
        return {"cls": torch.from_numpy(label["cls"]), "boxes": boxes, "polygons": polygons}


def to_rgb8(image):
    """An image of any PIL mode as 8-bit RGB, its values scaled rather than clipped: 16-bit
    (I;16*) by >> 8; 32-bit integers (I) as 16-bit when all lie in 0..65535, else by >> 23 (the
    range 0..2^31-1), negative values as 0; floats (F) by 255 when all finite values lie in 0..1,
    else clipped to 0..255 (NaN as 0). Other modes (1, L, LA, P, PA, RGBA, CMYK, YCbCr, ...):
    PIL's convert("RGB")."""
    if image.mode == "RGB":
        return image
    if image.mode == "F":
        values = np.asarray(image, np.float64)
        finite = values[np.isfinite(values)]
        if ((finite >= 0) & (finite <= 1)).all():
            values = values * 255
        # NaN as 0; infinities as the largest floats, clipped below
        grey = np.nan_to_num(values).round()
    elif image.mode.startswith("I"):
        values = np.asarray(image, np.int64)
        shift = 8
        if values.size and values.max() > 65535:
            shift = 23
        # negative values stay negative through the shift, and are clipped to 0 below
        grey = values >> shift
    else:
        return image.convert("RGB")
    return Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8)).convert("RGB")


def load_rgb(path, scale=1.0):
    """An image file as 8-bit RGB (to_rgb8), turned as its EXIF orientation says; decoded at >=
    scale x its size where the format can (a JPEG draft)."""
    image = Image.open(path)
    if scale < 1:
        image.draft("RGB", (math.ceil(image.width * scale), math.ceil(image.height * scale)))
    # 0x0112: the EXIF orientation tag; 1: as stored (exif_transpose would copy the image)
    if image.getexif().get(0x0112, 1) != 1:
        image = ImageOps.exif_transpose(image)
    return to_rgb8(image)


class ClassifyDataset(ImageFolder):
    """ImageFolder split (root/<class>/*) as samples: `image` uint8 (3,imgsz,imgsz) RGB, `targets`
    int64 (1,1) [cls], `shape` the original (h, w), `path`, `index`. augment: the whole image
    stretched to the square, for cls_augment's crops; else the centre square resized.
    cache "ram": the images in RAM as samples; "auto": if this node's processes need < 10%."""

    task = "classify"
    rect = False

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
        self.imgsz = imgsz
        self.augment = augment
        checks = thread_map(lambda s: verify(s[0], ""), self.samples)  # no label file
        self.samples = [s for s, c in zip(self.samples, checks) if c.status != CORRUPT]
        self.imgs = self.samples
        self.targets = [k for _, k in self.samples]
        # a sample's (1, 1) [cls] is a view of these
        self.target_rows = torch.tensor(self.targets).view(-1, 1, 1)
        self.stats = {"images": len(checks), "corrupt": len(checks) - len(self.samples)}
        if verbose:
            self.walk.warn(prefix)
            for m in [m for c in checks for m in c.msgs][:MAX_WARNINGS]:
                print(f"WARNING {prefix}{m}", flush=True)
            print(f"{prefix}{len(checks)} images, {self.stats['corrupt']} corrupt", flush=True)
        if not self.samples:
            raise DataError(f"{prefix}no usable images in {root}: all are corrupt")
        self._ram = cache_in_ram(
            self.load,
            count=len(self.samples),
            size=len(self.samples) * 3 * imgsz**2,
            cache=cache,
            local_world_size=local_world_size,
            prefix=prefix,
            verbose=verbose,
        )

    @property
    def in_ram(self):
        return self._ram is not None

    def make_dataset(self, directory, class_to_idx, extensions, **kw):
        """(path, class) of the images under directory/<class>/: ImageFolder's, but each real file
        once and regular files only (see labels.Walk; ImageFolder follows links round a loop)."""
        # its counts are warned about once the split is verified
        self.walk = Walk()
        # in find_classes' order: by name, and so by class
        folders = {os.path.join(directory, name): k for name, k in class_to_idx.items()}
        self.walk.claim([directory, *folders])
        # ImageFolder's IMG_EXTENSIONS
        return [
            (f, k)
            for folder, k in folders.items()
            for f in self.walk.files(folder)
            if f.lower().endswith(extensions)
        ]

    def load(self, i):
        """(sample i's image uint8 (3, imgsz, imgsz), its original (h, w)): for augment the whole
        image, else its centre square, resized (bilinear, antialiased)."""
        image = load_rgb(self.samples[i][0])
        shape = (image.height, image.width)
        if not self.augment:
            image = v2.functional.center_crop(image, min(image.size))
        # The functional resize: v2.Compose's per-call overhead was twice the 64 px resize.
        image = v2.functional.resize(image, [self.imgsz, self.imgsz])
        # pil_to_tensor's (3, h, w) is a view of PIL's (h, w, 3) pixels: stacking 64 of them at
        # 64 px took 0.27 ms, 0.03 once they are laid out as they are indexed
        return v2.functional.pil_to_tensor(image).contiguous(), shape

    def __getitem__(self, key):
        """key: an index, or EpochSampler's (seed, epoch, index): the same sample for any (the
        trainer augments batches, cls_augment)."""
        i = key[2] if isinstance(key, tuple) else key
        image, shape = self._ram[i] if self._ram else self.load(i)
        return {
            "image": image,
            "targets": self.target_rows[i],
            "masks": None,
            "path": self.samples[i][0],
            "shape": shape,
            "index": i,
        }


def collate(samples):
    """Samples -> batch: images uint8 (bs,3,H,W); targets float32 (N,6) [image, cls, cx, cy, w, h]
    (classify: int64 (bs,2)); masks float32 (bs,H/4,W/4) or None; shapes; indices (bs,)."""
    # each target row led by its image's index in the batch
    counts = torch.tensor([len(s["targets"]) for s in samples])
    owners = torch.arange(len(samples)).repeat_interleave(counts)
    rows = torch.cat([s["targets"] for s in samples])
    rows = torch.cat([owners[:, None].to(rows.dtype), rows], dim=1)
    masks = None
    if samples[0]["masks"] is not None:
        masks = torch.stack([s["masks"] for s in samples]).float()
    return {
        "images": torch.stack([s["image"] for s in samples]),
        "targets": rows,
        "masks": masks,
        "indices": torch.tensor([s["index"] for s in samples]),
        "shapes": [s["shape"] for s in samples],
    }


def shard_batches(n, batch_size, rank, world_size):
    """This rank's validation batches: consecutive batches dealt round-robin, none padded."""
    starts = range(rank * batch_size, n, world_size * batch_size)
    return [list(range(start, min(start + batch_size, n))) for start in starts]


class EpochSampler(DistributedSampler):
    """DistributedSampler of (seed, epoch, index) keys: augmentation independent of workers."""

    def __iter__(self):
        return ((self.seed, self.epoch, i) for i in super().__iter__())


def quiet_lost_connection(kind, error, trace):
    """A data worker's sys.excepthook: a connection its stopped main process broke is no error."""
    if not isinstance(error, (EOFError, ConnectionError)):
        sys.__excepthook__(kind, error, trace)


def exit_outside_locks(signum, frame):
    """A data worker's SIGTERM handler: exit with code 0 at once, or, inside multiprocessing's
    locks (which it shares with the main process), as it returns from them."""
    # The main process ends the workers by setting their loader's done event, whose lock a worker
    # takes to read it: a worker gone while holding it left the main process waiting forever.
    if in_locks(frame):
        sys.setprofile(exit_on_return)
    else:
        os._exit(0)


def exit_on_return(frame, event, arg):
    """The profile hook of a worker stopped inside multiprocessing's locks (see above)."""
    if event == "return" and in_locks(frame) and not in_locks(frame.f_back):
        os._exit(0)


def in_locks(frame):
    """Whether a Python frame runs multiprocessing's locks, events or conditions."""
    return frame is not None and frame.f_globals.get("__name__") == "multiprocessing.synchronize"


def yield_cpu(worker_id):
    """Data workers at the lowest priority, quiet when the run is stopped (worker_init_fn)."""
    # Ctrl-C and `kill -TERM -pgid` (timeout, systemd, SLURM) reach the whole process group: the
    # main process says it once and ends the workers; a worker neither prints a traceback nor dies
    # by the signal (which the main process would report as a crashed worker)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_outside_locks)
    # A main process stopped mid-transfer breaks the connection through which a worker hands it a
    # batch's shared memory, and the worker's thread serving it would print that as a traceback.
    sys.excepthook = quiet_lost_connection
    # where the cores are few, a worker preempting one of the step's OpenMP threads stalls them
    # all; at nice 19 workers fill the step's idle moments; Windows has no nice
    if hasattr(os, "nice"):
        os.nice(19)


def build_dataloader(
    dataset,
    batch_size,
    workers,
    shuffle=True,
    rank=0,
    world_size=1,
    seed=0,
    local_world_size=1,
    drop_single=False,
):
    """-> (DataLoader, sampler): shuffle: a seeded EpochSampler (call set_epoch), else batches.
    drop_single: a shuffled epoch's last batch is dropped if it would hold a single image."""
    # the cores this process may run on, where the system says (Linux)
    cpus = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    workers = min(workers, max(cpus // local_world_size, 1))
    # A classification image cached in RAM is a lookup: the main process stacks a batch of them
    # in about 2 ms, where a worker's hand-over of it costs about 4 (a shared-memory file and a
    # socket handshake a tensor) besides the workers' start-up and CPU time.
    if isinstance(dataset, ClassifyDataset) and dataset.in_ram:
        workers = 0
    kw = {
        "collate_fn": collate,
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "worker_init_fn": yield_cpu,
        "pin_memory": torch.cuda.is_available(),
    }
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
    sampler = shard_batches(len(dataset), batch_size, rank=rank, world_size=world_size)
    return DataLoader(dataset, batch_sampler=sampler, **kw), sampler
