"""Prediction as yolov5's detect.py: boxes (and masks), or a classifier's top 5. `stream` is the
loop (`YOLO.predict`); `main` runs it on a source and writes yolov5's outputs (predict.py), each
rank on its share of the files under torchrun.

Hostile input: only regular files are read (a FIFO named x.jpg is skipped, never waited on), each
real file once; an image that cannot be decoded, resized, post-processed or saved is named,
skipped and counted while the rest goes on; 16-bit and float images are scaled to 8 bits
(datasets.to_rgb8). Everything is written inside the run folder: crops under crops/<the class
name as one safe folder name>/ (crop_folders), repeated image names kept apart (output_stems);
a run folder that holds a source file is refused (check_run_folder), and each output replaces
the file at its path rather than writing through it (replace_file)."""

import glob
import json
import os
import re
import stat
import time
import warnings
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, ImageDraw, ImageOps
from torch.utils.data import DataLoader

from . import dist, ops, plots
from .checkpoint import next_run_dir
from .cli import ConfigError, parse_kwargs
from .datasets import to_rgb8
from .files import READ_NONBLOCKING, first_line, replace_file
from .labels import IMG_FORMATS, DataError, file_id
from .models import amp_dtype, make_divisible
from .safe_load import load_model
from .validator import (
    STAGES,
    add_switches,
    base_parser,
    check_options,
    infer,
    round_imgsz,
    speed_line,
)

# yolov5's detect.py
PREDICT_NMS = {"conf_thres": 0.25, "iou_thres": 0.45, "max_det": 1000}
# characters that are no part of a safe file name on Linux, macOS or Windows
UNSAFE_CHARACTERS = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')
# a crop folder's name, in UTF-8 (file systems allow 255)
MAX_FOLDER_BYTES = 200


class ImageWarning(UserWarning):
    """A warning PIL gave while decoding an image, re-issued with the image named."""


class Seen(NamedTuple):
    """An image predicted and saved (the others were skipped): its place in the whole source, its
    detections, speed (ms by STAGES) and --save-json entry ({} without)."""

    place: int
    detections: int
    speed: np.ndarray
    entry: dict


def find_images(source):
    """The images of a file, folder (sorted, not recursive), glob or .txt list of paths (relative
    ones: to the list's folder, as training's lists), each real file once (its first mention); a
    `**` walks each real folder once, symlinks followed (a folder linked into itself ends)."""
    path = Path(source)
    if path.suffix == ".txt" and path.is_file():
        files = read_list(path)
    elif path.is_file():
        files = [source]
    else:
        # a folder: its own files, not its subfolders'
        pattern = str(Path(glob.escape(source)) / "*") if path.is_dir() else source
        files = sorted(expand_glob(pattern))
    images = [f for f in files if f.rpartition(".")[2].lower() in IMG_FORMATS]
    if not images:
        why = f"no images ({', '.join(IMG_FORMATS)})" if path.exists() else "not found"
        raise DataError(f"--source {source}: {why}")
    # each real file (file_key) keeps its first path, in the order first met
    unique = {}
    for image in images:
        unique.setdefault(file_key(image), image)
    return list(unique.values())


def read_list(path):
    """A .txt list's paths, one a line (UTF-8), relative ones joined to the list's folder."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--source {path}: cannot read the list ({one_line(e)})") from None
    lines = [line.strip() for line in text.splitlines()]
    return [str(path.parent / line) for line in lines if line]


def expand_glob(pattern):
    """glob.glob(pattern, recursive=True), but each `**` visits each real folder once."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return glob.glob(pattern)
    cut = parts.index("**")
    below = parts[cut + 1 :]
    # a trailing `**`: everything in each folder
    rest = os.path.join(*below) if below else "*"
    # a leading `**`: the folders of the working directory
    roots = glob.glob(str(Path(*parts[:cut]))) if cut else [""]
    found = []
    for root in roots:
        for folder in walk_once(root):
            found += expand_glob(os.path.join(glob.escape(folder), rest))
    return found


def walk_once(root):
    """root ("": the working directory) and the folders below it, but hidden ones (as glob's
    `**`): symlinks followed, each real folder (device, inode) once, the first way it is met."""
    seen = set()
    folders = []
    for top, subfolders, _ in os.walk(root or ".", followlinks=True):
        key = file_key(top)
        if key in seen:
            # a link back to a folder already walked: do not walk it again
            subfolders.clear()
            continue
        seen.add(key)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        # os.walk(".") gives ".", "./sub", ...: as glob's "", "sub", ...
        folders.append(top if root else top[2:])
    return folders


def file_key(path):
    """What makes path one real file: its (device, inode), else (missing) its absolute path."""
    try:
        return file_id(path)
    except (OSError, ValueError):
        # missing, or (ValueError) a NUL byte in the path
        return os.path.abspath(path)


def source_images(source):
    """YOLO.predict's and predict's source as stream's list of images: a path (an image, folder,
    glob or .txt list: find_images), a PIL image or an array (one image), or a list of these
    (each path in it one image)."""
    if isinstance(source, (str, os.PathLike)):
        return find_images(str(source))
    if isinstance(source, (Image.Image, np.ndarray)):
        return [source]
    if isinstance(source, (list, tuple)):
        return list(source)
    why = "an image path, folder, glob, .txt list, PIL image, array or a list of these"
    raise TypeError(f"predict(source): {type(source).__name__} is not {why}")


def letterbox(image, imgsz, stride):
    """uint8 (h, w, 3) -> (uint8 (3, H, W), ratio_pad): long side to imgsz, centred on 114 grey."""
    h0, w0 = image.shape[:2]
    r = imgsz / max(h0, w0)
    # a side of at least one pixel: a 5000 x 1 image is 640 x 1, not 640 x 0
    h = max(round(h0 * r), 1)
    w = max(round(w0 * r), 1)
    # the canvas, as yolov5's: each side rounded up to a multiple of the stride
    H = make_divisible(h, stride)
    W = make_divisible(w, stride)
    # as OpenCV's INTER_LINEAR: bilinear (resize's default), no antialiasing; at its own size the
    # image itself
    x = TF.resize(image.permute(2, 0, 1), [h, w], antialias=False)
    top = round((H - h) / 2 - 0.1)
    left = round((W - w) / 2 - 0.1)
    right = W - w - left
    bottom = H - h - top
    canvas = TF.pad(x, [left, top, right, bottom], fill=114)
    # the padding as yolov5's scale_boxes takes it
    pad = ((W - w0 * r) / 2, (H - h0 * r) / 2)
    return canvas, ((r, r), pad)


def decode(src):
    """A path (a regular file within PIL's pixel limit), PIL image or array -> uint8 (h, w, 3):
    EXIF-rotated, 8-bit RGB (to_rgb8: 16-bit and float images scaled, not clipped)."""
    if isinstance(src, Image.Image):
        src = to_rgb8(ImageOps.exif_transpose(src))
    elif not isinstance(src, np.ndarray):
        # without O_NONBLOCK, opening a FIFO waits for a writer, perhaps forever
        descriptor = os.open(src, READ_NONBLOCKING)
        with os.fdopen(descriptor, "rb") as file:
            # a FIFO, socket or device could block forever or never end
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise ValueError("not a regular file")
            opened = Image.open(file)
            width, height = opened.size
            limit = Image.MAX_IMAGE_PIXELS
            # PIL only warns below twice its limit: gigabytes to decode
            if limit and width * height > limit:
                raise ValueError(f"{width}x{height} pixels, more than PIL's limit of {limit:,}")
            # decoded while the file is open
            return decode(opened)
    image = torch.from_numpy(np.array(src))
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an array of {image.dtype} {tuple(image.shape)}, not uint8 RGB")
    return image


def one_line(e):
    """An exception as `Type: the first line of its message`."""
    return f"{type(e).__name__}: {first_line(e)}"


def read(item, imgsz, stride, classify):
    """(index, a path, PIL image or uint8 (h, w, 3) RGB array) -> {"index", "path", "image"
    (decode's), "input" (letterboxed; classify: centre square), "ratio_pad", "warnings" (PIL's
    while decoding, each naming the image)} or {"index", "path", "error"}; it never raises."""
    index, src = item
    path = str(src) if isinstance(src, (str, Path)) else None
    sample = {"index": index, "path": path}
    # missing, unreadable, not an image, truncated, too large, ...
    failure = "unreadable"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            image = decode(src)
        # an image of a shape the resizing cannot take
        failure = "resizing failed"
        if classify:
            # as ClassifyDataset's validation input, with no boxes to map back
            square = TF.center_crop(image.permute(2, 0, 1), min(image.shape[:2]))
            canvas = TF.resize(square, [imgsz, imgsz])
            ratio_pad = None
        else:
            canvas, ratio_pad = letterbox(image, imgsz, stride)
    except Exception as e:
        return sample | {"error": f"{failure} ({one_line(e)})"}
    where = path or f"image {index} of the source"
    notes = [f"{where}: {first_line(warning.message)}" for warning in caught]
    return sample | {"image": image, "input": canvas, "ratio_pad": ratio_pad, "warnings": notes}


def by_shape(samples, batch_size):
    """Lists of up to batch_size samples of one input shape, each once full; errors alone."""
    pending = {}
    for sample in samples:
        if "error" in sample:
            yield [sample]
            continue
        shape = tuple(sample["input"].shape)
        pending.setdefault(shape, []).append(sample)
        if len(pending[shape]) == batch_size:
            yield pending.pop(shape)
    yield from pending.values()


@torch.no_grad()
def stream(model, images, imgsz=640, batch_size=1, workers=0, polygons=False, amp=None, **nms):
    """Yield a Model's results on images (see read), batched by shape, out of order: {"index",
    "path", "image", "names", "speed" (ms by STAGES), "warnings"} and "probs" (nc,), or "boxes"
    (n, 6) xyxy original px, conf, cls by descending conf, "masks" (n, h, w) or None, "polygons"
    (k, 2); or, for an image that failed (decoding, letterbox, post-processing), {"index", "path",
    "error"}. The model runs in eval mode; its own mode is back once the generator ends. Each
    warning is also issued as an ImageWarning."""
    was_training = model.training
    model.eval()
    try:
        stride = model.max_stride
        classify = model.task == "classify"
        load = partial(read, imgsz=make_divisible(imgsz, stride), stride=stride, classify=classify)
        # collate_fn: each item is decoded in the workers
        items = list(enumerate(images))
        # no more processes than there are CPUs or images (as training's loaders)
        workers = min(workers, os.cpu_count() or 1, len(items))
        loader = DataLoader(items, batch_size=None, num_workers=workers, collate_fn=load)
        for group in by_shape(loader, batch_size):
            if "error" in group[0]:
                yield group[0]
                continue
            inputs = torch.stack([sample["input"] for sample in group])
            dets, protos, seconds = infer(model, inputs, PREDICT_NMS | nms, amp)
            if classify:
                # each image's class probabilities
                dets = dets.softmax(1).cpu()
            input_hw = inputs.shape[2:]
            speed = seconds * 1000 / len(group)
            for sample, det, proto in zip(group, dets, protos):
                for note in sample["warnings"]:
                    warnings.warn(note, ImageWarning, stacklevel=2)
                result = {"index": sample["index"], "path": sample["path"]}
                try:
                    if classify:
                        found = {"probs": det}
                    else:
                        found = to_original(
                            det=det,
                            protos=proto,
                            sample=sample,
                            input_hw=input_hw,
                            polygons=polygons,
                        )
                except Exception as e:
                    # e.g. a mask or polygon of a degenerate image
                    result["error"] = f"post-processing failed ({one_line(e)})"
                else:
                    result |= {
                        "image": sample["image"],
                        "names": model.names,
                        "speed": speed,
                        "warnings": sample["warnings"],
                        **found,
                    }
                yield result
    finally:
        model.train(was_training)


def stream_args(model, images, args, amp):
    """stream with predict.py's options (get_args_parser's; imgsz a multiple of the stride) and
    amp, the autocast dtype (predict_amp's)."""
    return stream(
        model,
        images,
        imgsz=args.imgsz,
        batch_size=args.batch_size,
        workers=args.workers,
        polygons=args.save_txt,
        amp=amp,
        conf_thres=args.conf_thres,
        iou_thres=args.iou_thres,
        max_det=args.max_det,
        classes=args.classes,
        agnostic=args.agnostic_nms,
    )


def to_original(det, protos, sample, input_hw, polygons):
    """Detections (n, 6+nm) on the input, prototypes or None -> stream's boxes, masks, polygons."""
    h, w = sample["image"].shape[:2]
    ratio_pad = sample["ratio_pad"]
    # whole pixels, as yolov5
    boxes = ops.scale_boxes(det[:, :4], ratio_pad, (h, w)).round()
    rows = torch.cat((boxes, det[:, 4:6]), 1).cpu()
    out = {"boxes": rows, "masks": None}
    if protos is None:
        return out
    masks = ops.process_mask(protos, det, input_hw)
    out["masks"] = ops.scale_masks(masks, ratio_pad, (h, w)).cpu()
    if polygons:
        # traced at input resolution, as yolov5 does
        (r, _), pad = ratio_pad
        traced = [ops.mask_to_polygon(mask) for mask in masks]
        out["polygons"] = [((polygon - pad) / r).clip(0, (w, h)) for polygon in traced]
    return out


def predict(model, images, **options):
    """`stream`'s results in the order of the images; model: a Model (its train or eval mode
    kept) or a weights file; images: as source_images takes them (a path is one source, as
    predict.py's --source). The numeric options are checked first (ValueError naming one)."""
    check_options(options)
    if isinstance(model, (str, Path)):
        model = load_model(model)
    return sorted(stream(model, source_images(images), **options), key=lambda r: r["index"])


def top5(result):
    """A classifier's 5 likeliest (class, probability), likeliest first."""
    probs, classes = result["probs"].sort(descending=True)
    return list(zip(classes[:5].tolist(), probs[:5].tolist()))


def draw(result, line_width=None, labels=True, conf=True):
    """A result pictured as yolov5 does: masks, boxes labelled "name conf", or the top 5 classes."""
    if "probs" in result:
        picture = Image.fromarray(result["image"].numpy())
        text = "\n".join(f"{result['names'][c]} {p:.2f}" for c, p in top5(result))
        ImageDraw.Draw(picture).multiline_text((8, 8), text, fill=(255, 255, 255))
        return picture
    image = result["image"].permute(2, 0, 1)
    boxes = result["boxes"]
    # by default 0.3% of the mean side, at least 2 pixels (yolov5's)
    mean_side = sum(image.shape[1:]) / 2
    width = line_width or max(round(mean_side * 0.003), 2)
    scores = boxes[:, 4].tolist() if conf else None
    drawn = plots.draw_detections(
        image,
        boxes[:, :4],
        cls=boxes[:, 5].long().tolist(),
        conf=scores,
        names=result["names"],
        masks=result["masks"],
        width=width,
        labels=labels,
    )
    return TF.to_pil_image(drawn)


def label_lines(result, conf):
    """yolov5's --save-txt lines, lowest conf first, normalised: `cls xc yc w h [conf]`, segment
    `cls x1 y1 x2 y2 ... [conf]` (the mask's outer polygon); classify `prob name` (the top 5)."""
    if "probs" in result:
        return "".join(f"{p:.2f} {result['names'][c]}\n" for c, p in top5(result))
    h, w = result["image"].shape[:2]
    boxes = result["boxes"].numpy()
    shapes = ops.xyxy2xywh(boxes[:, :4]) / [w, h, w, h]
    if result["masks"] is not None:
        # an empty mask's polygon: its box's corners
        pairs = zip(result["polygons"], ops.box_corners(boxes[:, :4]))
        shapes = [(polygon if len(polygon) else corners) / [w, h] for polygon, corners in pairs]
    lines = []
    for box, shape in zip(boxes, shapes):
        row = [box[5], *shape.ravel()]
        if conf:
            row.append(box[4])
        lines.append(" ".join(f"{v:g}" for v in row) + "\n")
    return "".join(reversed(lines))


def json_entry(result):
    """--save-json's entry: file, size, detections (box xyxy, mask as COCO RLE) or top 5 classes."""
    height, width = result["image"].shape[:2]
    entry = {"file": result["path"], "width": width, "height": height}
    names = result["names"]
    if "probs" in result:
        top = [{"class_id": c, "name": names[c], "confidence": p} for c, p in top5(result)]
        return entry | {"classes": top}
    masks = result["masks"]
    detections = []
    for k, (*box, conf, cls) in enumerate(result["boxes"].tolist()):
        cls = int(cls)
        detection = {"class_id": cls, "name": names[cls], "confidence": round(conf, 5), "box": box}
        if masks is not None:
            detection["mask"] = ops.rle_encode(masks[k])
        detections.append(detection)
    return entry | {"detections": detections}


def crop_folders(names):
    """--save-crop's folder under crops/ for each class: its name made one safe path component
    (/ \\ : * ? " < > | and control characters as _, leading and trailing dots and spaces dropped,
    so no `.` or `..`, at most MAX_FOLDER_BYTES in UTF-8; an empty one: class<k>), with _<k> (its
    class index k) added while another class has that folder already (names that differ only in
    case share one on some file systems)."""
    folders = []
    taken = set()
    for k, name in enumerate(names):
        clean = UNSAFE_CHARACTERS.sub("_", str(name)).strip(" .")
        folder = clean.encode()[:MAX_FOLDER_BYTES].decode(errors="ignore") or f"class{k}"
        while folder.casefold() in taken:
            folder = f"{folder}_{k}"
        taken.add(folder.casefold())
        folders.append(folder)
    return folders


def output_stems(files):
    """The name each source file's outputs take (<stem>.<ext>, labels/<stem>.txt, crops
    <stem>_<k>.jpg): its stem, with _2, _3, ... added to a stem met before in the source's order
    (also one met in another case), so that no output replaces another."""
    stems = []
    taken = set()
    for f in files:
        stem = Path(f).stem
        unique = stem
        n = 2
        while unique.casefold() in taken:
            unique = f"{stem}_{n}"
            n += 1
        taken.add(unique.casefold())
        stems.append(unique)
    return stems


def check_run_folder(save_dir, files, source):
    """ConfigError if the run folder holds a source image (or the .txt list), by the path given
    or the file it links to: predicting into it would replace the user's images."""
    run = Path(os.path.realpath(save_dir))
    inputs = [*files, source] if Path(source).is_file() else files
    for file in inputs:
        # the entry itself (its folder resolved), and the file it may link to
        folder = os.path.realpath(os.path.dirname(os.path.abspath(file)))
        entry = Path(folder) / os.path.basename(file)
        target = Path(os.path.realpath(file))
        if entry.is_relative_to(run) or target.is_relative_to(run):
            why = f"the run folder {save_dir} holds the source file {file}"
            raise ConfigError(f"--project/--name: {why}; predict into another folder")


def save(result, save_dir, args, stem, folders):
    """An image's outputs under stem (output_stems): its drawing <stem>.<ext>, labels/<stem>.txt
    (if it has detections) and crops/<folders[class]>/<stem>_<k>.jpg."""
    # find_images' extension: what follows the last dot
    ext = result["path"].rpartition(".")[2]
    boxes = result.get("boxes", torch.zeros(0, 6))
    if not args.nosave:
        picture = draw(
            result, line_width=args.line_width, labels=not args.hide_labels, conf=not args.hide_conf
        )
        # in the source's format: PIL takes it from the extension, which the temporary file keeps
        replace_file(save_dir / f"{stem}.{ext}", picture.save)
    if args.save_txt and (len(boxes) or "probs" in result):
        text = label_lines(result, args.save_conf)
        replace_file(save_dir / "labels" / f"{stem}.txt", lambda tmp: tmp.write_text(text))
    if not args.save_crop:
        return
    image = Image.fromarray(result["image"].numpy())
    limit = np.array(image.size)
    for k, (*box, _, cls) in enumerate(boxes.tolist()):
        # the box in whole pixels inside the image, at least 1 x 1 (PIL writes no empty image)
        start = np.clip(box[:2], 0, limit - 1)
        end = np.clip(box[2:], start + 1, limit)
        crop = image.crop([int(v) for v in (*start, *end)])
        folder = save_dir / "crops" / folders[int(cls)]
        folder.mkdir(parents=True, exist_ok=True)
        replace_file(folder / f"{stem}_{k}.jpg", crop.save)


def get_args_parser():
    parser = base_parser("Predict boxes (and masks) on images", PREDICT_NMS, "runs/predict")
    add = parser.add_argument
    add(
        "--source",
        required=True,
        help="image, folder, glob or .txt list of paths (relative ones: to the list's folder)",
    )
    add("--classes", nargs="+", type=int, help="keep only these classes")
    add_switches(parser, {"--agnostic-nms": "NMS across classes"})
    add("--batch-size", type=int, default=1, help="per rank, >= 1")
    add(
        "--workers",
        type=int,
        default=0,
        help="image decoding processes per rank, >= 0 (at most the CPUs)",
    )
    outputs = {
        "--save-txt": "labels/<image>.txt, yolov5's format"
        " (a repeated image name: <image>_2, _3, ...)",
        "--save-conf": "confidences in --save-txt labels",
        "--save-crop": "crops/<class>/<image>_<k>.jpg;"
        " <class>: the class name as one safe folder name"
        ' (/ \\ : * ? " < > | and control characters as _, no leading or trailing dots'
        " or spaces; empty: class<index>; _<index> added if two classes would share one)",
        "--save-json": "predictions.json for the source",
        "--nosave": "no annotated images",
    }
    add_switches(parser, outputs)
    add("--line-width", type=int, help="box width in pixels, >= 1 (default: by size)")
    add_switches(parser, {"--hide-labels": None, "--hide-conf": None})
    return parser


def predict_amp(device, amp):
    """The autocast dtype of prediction (None: fp32): amp_dtype's, but fp32 for `auto` on a CPU."""
    # bf16 moved ~5% of detections across the thresholds (README)
    if device.type == "cpu" and amp == "auto":
        return None
    return amp_dtype(device, amp)


def main(args):
    """Predict --source, sharded -> {"save_dir", "images", "skipped", "detections", "speed"}. The
    options, the source and the run folder are checked before the model is loaded."""
    # before the process group and the model: a bad number costs nothing
    check_options(vars(args))
    info = dist.setup(args.device)
    try:
        files = find_images(args.source)
        # named before sharding: the same names in one process and under torchrun
        stems = output_stems(files)
        save_dir = dist.run_on_main(next_run_dir, args.project, args.name, args.exist_ok)
        check_run_folder(save_dir, files, args.source)
        amp = predict_amp(info.device, args.amp)
        # faster, in fp32 too
        layout = torch.channels_last if args.amp != "off" else None
        model = load_model(args.weights, info.device).fuse().to(memory_format=layout)
        if args.classes and not all(0 <= c < model.nc for c in args.classes):
            listed = " ".join(map(str, args.classes))
            raise ValueError(f"--classes {listed}: {args.weights} has classes 0 to {model.nc - 1}")
        args.imgsz = round_imgsz(args.imgsz, model.max_stride)
        save_dir.mkdir(parents=True, exist_ok=True)
        if args.save_txt:
            (save_dir / "labels").mkdir(exist_ok=True)
        # this rank's files
        mine = slice(info.rank, None, info.world_size)
        share = predict_share(
            model, args, info, files=files[mine], stems=stems[mine], save_dir=save_dir, amp=amp
        )
        seen = [image for part in dist.all_gather_object(share) for image in part]
        # every image is either seen or skipped (named)
        skipped = len(files) - len(seen)
        summed = sum((image.speed for image in seen), np.zeros(3))
        speed = dict(zip(STAGES, (summed / max(len(seen), 1)).tolist()))
        if info.rank == 0:
            if args.save_json:
                # each entry in its file's place in the source
                placed = sorted(seen, key=lambda image: image.place)
                text = json.dumps([image.entry for image in placed])
                replace_file(save_dir / "predictions.json", lambda tmp: tmp.write_text(text))
            shape = (args.batch_size, 3, args.imgsz, args.imgsz)
            print(speed_line(speed, f"shape {shape}"))
            counted = f"{len(seen)} images"
            if skipped:
                counted += f", {skipped} skipped (named above)"
            print(counted)
            print(f"Results saved to {save_dir}", flush=True)
        return {
            "save_dir": str(save_dir),
            "images": len(seen),
            "skipped": skipped,
            "detections": sum(image.detections for image in seen),
            "speed": speed,
        }
    finally:
        dist.cleanup()


def predict_share(model, args, info, files, stems, save_dir, amp):
    """This rank's files predicted and saved, each one's warnings printed -> those seen; an image
    that failed (its result's error, or saving) is named and skipped."""
    folders = crop_folders(model.names)
    seen = []
    start = time.time()
    last = start
    with warnings.catch_warnings():
        # each is printed below, one line naming its image
        warnings.simplefilter("ignore", ImageWarning)
        for done, result in enumerate(stream_args(model, files, args, amp), 1):
            # progress, every 10 s
            if info.rank == 0 and time.time() - last > 10 and done < len(files):
                last = time.time()
                rate = done / (last - start)
                eta = f"eta {(len(files) - done) / rate:.0f}s"
                print(f"{done}/{len(files)} images  {rate:.1f} images/s  {eta}", flush=True)
            for note in result.get("warnings", []):
                print(f"WARNING {note}", flush=True)
            if "error" not in result:
                try:
                    entry = json_entry(result) if args.save_json else {}
                    save(result, save_dir, args, stem=stems[result["index"]], folders=folders)
                except Exception as e:
                    # e.g. a full disk, an image PIL cannot write
                    result["error"] = f"saving failed ({one_line(e)})"
            if "error" in result:
                # named and skipped: the run goes on
                print(f"WARNING {result['path']}: {result['error']}; skipped", flush=True)
                continue
            seen.append(
                Seen(
                    place=info.rank + result["index"] * info.world_size,
                    detections=len(result.get("boxes", ())),
                    speed=result["speed"],
                    entry=entry,
                )
            )
    return seen


def run(**kwargs):
    """predict.py from Python: `run(weights="best.pt", source="images/")` returns main's dict."""
    return main(parse_kwargs(get_args_parser(), kwargs))
