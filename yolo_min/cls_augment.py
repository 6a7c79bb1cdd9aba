"""yolov5's classification training augmentation, a batch at a time on the training device.

Each image draws its own parameters from its (seed, epoch, index) alone, so they are the same in
any batch, worker or rank: a RandomResizedCrop box (8-100% of the area, width / height 3/4-4/3, as
torchvision defines it), a horizontal flip (p 0.5) and, for half the images, colour jitter
(brightness, contrast and saturation factors each from U(0.6, 1.4), no hue). One grid_sample
call then crops, resizes and flips the whole batch."""

import math
import random

import torch
from torch.nn.functional import grid_sample
from torchvision.transforms.v2.functional import rgb_to_grayscale

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
# the aspect ratio is drawn uniformly on a log scale
LOG_RATIO = tuple(map(math.log, RATIO))
FLIP = 0.5
JITTER = 0.4
JITTER_P = 0.5


def crop_box(rng, height, width):
    """RandomResizedCrop's (top, left, h, w) in pixels of an image (height, width): up to 10 tries
    at a random area and aspect ratio, else the centre crop at the aspect ratio nearest its own."""
    for _ in range(10):
        area = height * width * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*LOG_RATIO))
        w = round(math.sqrt(area * aspect))
        h = round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w
    aspect = min(max(width / height, RATIO[0]), RATIO[1])
    w = min(width, round(height * aspect))
    h = min(height, round(width / aspect))
    top = (height - h) // 2
    left = (width - w) // 2
    return top, left, h, w


def draw(key, height, width):
    """(box (x0, y0, x1, y1) as fractions of the width and height, flip, (brightness, contrast,
    saturation) factors; 1.0: unchanged) of the image (height, width) px whose (seed, epoch,
    index) is key."""
    rng = random.Random("%d:%d:%d" % key)
    top, left, h, w = crop_box(rng, height, width)
    right = (left + w) / width
    bottom = (top + h) / height
    box = (left / width, top / height, right, bottom)
    flip = rng.random() < FLIP
    colour = (1.0, 1.0, 1.0)
    if rng.random() < JITTER_P:
        colour = tuple(rng.uniform(1 - JITTER, 1 + JITTER) for _ in range(3))
    return box, flip, colour


def augment(images, sizes, keys):
    """uint8 (bs,3,S,S), image k stretched from its original sizes[k] (h, w) px, augmented by its
    draw(keys[k], h, w) -> float32 (bs,3,S,S) of whole numbers 0-255 (the values a uint8 image
    would hold, without the conversions to it and back) on the same device: S is the training
    size."""
    draws = [draw(key, *size) for key, size in zip(keys, sizes)]
    boxes, flips, colours = zip(*draws)
    jittered = [k for k, colour in enumerate(colours) if colour != (1.0, 1.0, 1.0)]

    # Copies to the device that do not wait for it, and a select and index lists made on the host
    # rather than masks (on a GPU, a mask would wait for the previous step to end).
    def upload(values, dtype=None):
        return torch.tensor(values, dtype=dtype).to(images.device, non_blocking=True)

    grid = crop_grid(upload(boxes), upload(flips), side=images.shape[-1])
    # Bilinear samples at the crop's pixel centres, edges clamped, as roi_align(aligned=True)
    # takes them with one sample a pixel (a crop is never larger than the image).
    x = grid_sample(images.float(), grid, padding_mode="border", align_corners=False)
    factors = upload([colours[k] for k in jittered]).view(-1, 3)
    jittered = upload(jittered, dtype=torch.long)
    # Only the jittered half pays for the colour arithmetic and the clamp (a crop of a uint8
    # image stays within 0-255).
    x[jittered] = jitter(x.index_select(0, jittered), factors).clamp_(0, 255)
    return x.round_()


def crop_grid(boxes, flips, side):
    """grid_sample's grid (bs,side,side,2) of (x, y) in -1..1 (-1 and 1: the image's outer edges)
    at the pixel centres of each image's crop: boxes (bs,4) x0, y0, x1, y1 as fractions, flips
    (bs,) bool mirrors the crop left to right."""
    steps = (torch.arange(side, device=boxes.device) + 0.5) / side
    x0, y0, x1, y1 = (boxes * 2 - 1).T[..., None]
    xs = torch.lerp(x0, x1, steps)
    ys = torch.lerp(y0, y1, steps)
    xs = torch.where(flips[:, None], xs.flip(-1), xs)
    grid_x, grid_y = torch.broadcast_tensors(xs[:, None], ys[:, :, None])
    return torch.stack([grid_x, grid_y], dim=-1)


def jitter(x, factors):
    """float (n,3,S,S) 0-255 with each image's (brightness, contrast, saturation) factors (n,3)
    applied in place -> x, not clamped."""
    brightness, contrast, saturation = factors.T[..., None, None, None]
    # torchvision's saturation, contrast and brightness are linear maps that commute, so they
    # are one map, clamped once (torchvision clamps after each: it differs where a pixel
    # saturates between). Saturation blends each pixel with its gray, contrast the image with
    # its mean gray (which saturation leaves as it is).
    gray = rgb_to_grayscale(x)
    mean = gray.mean((1, 2, 3), keepdim=True)
    torch.lerp(gray, x, saturation, out=x)
    torch.lerp(mean, x, contrast, out=x)
    return x.mul_(brightness)


def augment_batch(batch, seed, epoch, device):
    """Replace batch["images"] (uint8, on the CPU) by their augmented copies on device (float32
    0-255), each image k by the draw of its key (seed, epoch, batch["indices"][k])."""
    keys = [(seed, epoch, index) for index in batch["indices"].tolist()]
    images = batch["images"].to(device, non_blocking=True)
    batch["images"] = augment(images, batch["shapes"], keys)
