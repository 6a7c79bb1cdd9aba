"""cls_augment: yolov5's classification augmentation drawn per image, made per batch. The draws'
distribution against torchvision's RandomResizedCrop and the flip and jitter definitions, the
batch against the same steps done image by image, and the seeding."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from yolo_min.cls_augment import RATIO, SCALE, augment, crop_box, draw
from yolo_min.datasets import ClassifyDataset

N = 20000


@pytest.mark.parametrize("hw", [(480, 640), (100, 30)])
def test_draws_follow_the_definitions(hw):
    height, width = hw
    draws = [draw((0, 0, i), height, width) for i in range(N)]
    boxes, flips, colour = map(np.array, zip(*draws))
    boxes = boxes * [width, height, width, height]
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
    assert np.allclose(boxes, boxes.round()) and (w >= 1).all() and (h >= 1).all()
    torch.manual_seed(0)
    image = torch.empty(3, height, width)
    ref = np.array([RandomResizedCrop.get_params(image, SCALE, RATIO)[2:] for _ in range(N)])
    # area fraction and aspect ratio: torchvision's distribution (quantiles within 0.02)
    q = np.linspace(0.05, 0.95, 19)
    area, ref_area = w * h / (width * height), ref.prod(1) / (width * height)
    assert np.abs(np.quantile(area, q) - np.quantile(ref_area, q)).max() < 0.02
    assert area.max() <= 1
    ratio, ref_ratio = w / h, ref[:, 1] / ref[:, 0]
    assert np.abs(np.quantile(ratio, q) - np.quantile(ref_ratio, q)).max() < 0.03
    assert abs(flips.mean() - 0.5) < 0.015
    jittered = (colour != 1).any(1)
    assert abs(jittered.mean() - 0.5) < 0.015
    factors = colour[jittered]
    assert factors.min() >= 0.6 and factors.max() <= 1.4
    # uniform on [0.6, 1.4]: its quantiles, each factor on its own, independent of the flip
    expected = 0.6 + 0.8 * q
    assert all(np.abs(np.quantile(f, q) - expected).max() < 0.02 for f in factors.T)
    assert abs(flips[jittered].mean() - 0.5) < 0.02


def test_centre_crop_when_no_try_fits():
    class Never:
        """A generator whose tries never fit: area 100x the image's."""

        def uniform(self, lo, hi):
            return 100.0 if hi == 1.0 else 0.0

    assert crop_box(Never(), 100, 30) == (30, 0, 40, 30)  # 3/4 at most: h = 30 / (3/4)
    assert crop_box(Never(), 30, 100) == (0, 30, 30, 40)
    assert crop_box(Never(), 50, 60) == (0, 0, 50, 60)


def test_batch_is_the_per_image_recipe():
    """Each image of the batch: its crop of the original resized, flipped, jittered (torchvision's
    functions one image at a time), to within resampling twice (original -> square -> crop)."""
    height, width, side = 48, 80, 32
    yy, xx = np.mgrid[0:height, 0:width]
    originals, squares, sizes, keys = [], [], [], []
    for k in range(8):
        rgb = [128 + 100 * np.sin(xx / 9 + k), 128 + 80 * np.cos(yy / 7), 60 + xx + yy / 3]
        im = torch.from_numpy(np.stack(rgb).clip(0, 255).astype(np.uint8))
        originals.append(im)
        squares.append(TF.resize(im, [side, side], antialias=True))
        sizes.append((height, width))
        keys.append((3, 1, k))
    out = augment(torch.stack(squares), sizes, keys)
    assert (
        out.shape == (8, 3, side, side)
        and out.dtype == torch.float32
        and torch.equal(out, out.round().clamp(0, 255))
    )
    errors = []
    for im, key, got in zip(originals, keys, out):
        box, flip, colour = draw(key, height, width)
        x0, y0, x1, y1 = (round(v * s) for v, s in zip(box, (width, height) * 2))
        ref = TF.resized_crop(im, y0, x0, y1 - y0, x1 - x0, [side, side], antialias=True)
        if flip:
            ref = TF.horizontal_flip(ref)
        brightness, contrast, saturation = colour
        ref = TF.adjust_brightness(ref, brightness)
        ref = TF.adjust_contrast(ref, contrast)
        ref = TF.adjust_saturation(ref, saturation)
        errors.append(float((got.float() - ref.float()).abs().mean()))
    assert max(errors) < 3


def test_seeded_by_key_alone():
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    sizes = [(16, 16)] * 6
    keys = [(0, 2, k) for k in range(6)]
    state = torch.get_rng_state()
    a = augment(images, sizes, keys)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random numbers untouched
    assert torch.equal(a, augment(images, sizes, keys))
    # an image's result does not depend on the others in its batch, nor on its place in it
    assert torch.equal(a[[4, 1]], augment(images[[4, 1]], sizes[:2], [keys[4], keys[1]]))
    assert not torch.equal(a, augment(images, sizes, [(0, 3, k) for k in range(6)]))


def test_cache_holds_the_samples(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    for k in range(3):
        Image.fromarray(np.full((20, 30 + k, 3), 40 * k, np.uint8)).save(
            tmp_path / "a" / f"{k}.png"
        )
    ds = ClassifyDataset(tmp_path, imgsz=16, augment=True, cache="ram", prefix="train: ")
    assert "train: 3 images cached in RAM (0 MB)" in capsys.readouterr().out
    plain = ClassifyDataset(tmp_path, imgsz=16, augment=True, verbose=False)
    for k in range(3):
        assert torch.equal(ds[k]["image"], plain[k]["image"]) and ds[k]["shape"] == (20, 30 + k)
    assert math.prod(ds[0]["image"].shape) == 3 * 16 * 16


def test_a_batch_without_jitter_or_of_one_image():
    """Batches where no image is jittered (one image, or all its draws unjittered) work too."""
    image = torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8)
    unjittered = [k for k in range(200) if draw((0, 0, k), 32, 32)[2] == (1.0, 1.0, 1.0)][:3]
    out = augment(image.expand(3, -1, -1, -1), [(32, 32)] * 3, [(0, 0, k) for k in unjittered])
    assert (
        out.shape == (3, 3, 32, 32)
        and out.dtype == torch.float32
        and torch.equal(out, out.round().clamp(0, 255))
    )
    one = augment(image, [(32, 32)], [(0, 0, unjittered[0])])
    assert torch.equal(one[0], out[0])
