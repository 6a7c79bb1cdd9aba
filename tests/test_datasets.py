"""Data layer: yaml config, label parsing, hostile datasets, cache, geometry consistency, masks,
rect shapes, real COCO samples, loaders/samplers/determinism, the synthetic shapes dataset, batch
pictures."""

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import deny_image_open
from PIL import Image, ImageDraw

import yolo_min
from yolo_min import datasets as D
from yolo_min import labels as L
from yolo_min import ops, shapes
from yolo_min.augment import overlap_mask
from yolo_min.datasets import (
    DataError,
    YOLODataset,
    build_dataloader,
    collate,
    load_data_config,
    shard_batches,
)
from yolo_min.labels import parse_labels
from yolo_min.plots import draw_batch, draw_detections

CFG_DIR = Path(yolo_min.__file__).parent / "cfg"
HYP = yaml.safe_load((CFG_DIR / "hyp.scratch-low.yaml").read_text())  # the recipe train.py uses
NO_HSV = dict(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)


def write_img(path: Path, size=(64, 48), color=(90, 120, 150), fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, format=fmt)


def write_label(root: Path, split: str, stem: str, text):
    p = root / "labels" / split / f"{stem}.txt"
    p.parent.mkdir(parents=True, exist_ok=True)
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def xyxy(t: torch.Tensor, w: int, h: int) -> torch.Tensor:
    """(n,4) normalised xywh -> pixel xyxy."""
    xy, wh = t[:, :2] * torch.tensor([w, h]), t[:, 2:4] * torch.tensor([w, h])
    return torch.cat([xy - wh / 2, xy + wh / 2], 1)


# ---------------------------------------------------------------- config
def test_data_config(tmp_path):
    write_img(tmp_path / "d" / "images" / "a" / "x.jpg")
    write_img(tmp_path / "d" / "images" / "b" / "y.jpg")
    (tmp_path / "d" / "list.txt").write_text("images/b/y.jpg\n\n")
    (tmp_path / "cfg").mkdir()
    y = tmp_path / "cfg" / "data.yaml"
    y.write_text(
        "path: ../d\ntrain: [images/a, list.txt]\nval: images/b\nnames: {0: cat, 1: dog}\nnc: 2\n"
    )
    cfg = load_data_config(str(y))
    assert cfg["names"] == ["cat", "dog"] and cfg["nc"] == 2
    assert cfg["train"] == [str(tmp_path / "d" / "images" / "a"), str(tmp_path / "d" / "list.txt")]
    files = L.list_images(cfg["train"])
    assert [Path(f).name for f in files] == ["x.jpg", "y.jpg"]
    assert L.img2label_path("/r/images/images/t/x.jpg") == "/r/images/labels/t/x.txt"
    for text, err in [
        ("train: a\nval: a\n", r"missing key\(s\) names"),
        ("path: ../d\ntrain: images/a\nval: images/a\nnames: [a, b]\nnc: 3\n", "nc is 3"),
        ("path: ../d\ntrain: nope\nval: images/a\nnames: [a]\n", "train source"),
        (
            "path: ../d\ntrain: images/a\nval: images/a\nnames: {0: a, 2: b}\n",
            "names must be a list",
        ),
        (": : :\n", "not valid YAML"),
    ]:
        y.write_text(text)
        with pytest.raises(DataError, match=err):
            load_data_config(str(y))
    with pytest.raises(DataError, match="not found"):
        load_data_config(str(tmp_path / "absent.yaml"))


# ---------------------------------------------------------------- label parsing
def test_parse_labels_rows():
    text = "\n".join(
        [
            "0 0.5 0.5 0.2 0.2",  # 1 good box
            "0 0.5 0.5",  # 2 wrong column count
            "1 0.5 nan 0.2 0.2",  # 3 NaN
            "1 0.5 abc 0.2 0.2",  # 4 non-numeric
            "-1 0.5 0.5 0.2 0.2",  # 5 negative class
            "3 0.5 0.5 0.2 0.2",  # 6 class >= nc
            "0 50 50 20 20",  # 7 absurd coordinates
            "0 0.5 0.5 0.2 0.2",  # 8 duplicate of 1
            "0 0.99 0.5 0.04 0.2",  # 9 slightly outside -> clipped
            "1 0.1 0.1 0.2 0.1 0.3",  # 10 odd polygon
            "2 0.1 0.1 0.1 0.1 0.1 0.1",  # 11 < 3 distinct points
            "1 0.5 0.5 0 0.2",  # 12 zero width
            "1.5 0.5 0.5 0.2 0.2",  # 13 non-integer class
            "",
            "2 1.0000001 0.5 0.6 0.5 0.5 0.4",  # 15: rounding noise clipped silently
        ]
    )
    rows, msgs, dropped, fixed = parse_labels(text, "f.txt", nc=3)
    cls, boxes, segs = [r[0] for r in rows], np.array([r[1] for r in rows]), [r[2] for r in rows]
    assert cls == [0, 0, 2] and dropped == 11 and fixed == 1
    # x 0.97..1.01 clipped to 1
    np.testing.assert_allclose(boxes[1], [0.985, 0.5, 0.03, 0.2], atol=1e-6)
    np.testing.assert_allclose(boxes[2], [0.75, 0.45, 0.5, 0.1], atol=1e-6)  # polygon extent
    # mixed: boxes -> rectangles
    assert len(segs) == 3 and segs[0].shape == (4, 2) and segs[2].shape == (3, 2)
    lines = {int(m.split(":")[1]) for m in msgs if m.count(":") >= 2 and m.split(":")[1].isdigit()}
    assert lines == {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}
    expect = [
        "2: 3 values",
        "3: NaN",
        "4: non-numeric",
        "5: class -1",
        "6: class 3",
        "7: coordinates outside",
        "8: duplicate of line 1",
        "9: coordinates slightly outside",
        "10: polygon with an odd",
        "11: polygon with fewer",
        "12: box with zero",
        "13: class 1.5",
        "mixes box rows and polygon rows",
    ]
    for e in expect:
        assert any(e in m for m in msgs), e


# ---------------------------------------------------------------- hostile dataset
def make_hostile(root: Path) -> dict:
    """Every bad-input case; returns the expected train counts. nc = 3."""
    tr = root / "images" / "train"
    for stem in ("good1", "bg", "empty", "rows", "allbad", "binlabel", "dirlabel", "noperm"):
        write_img(tr / f"{stem}.jpg", color=(30, 30, 30))
    write_img(tr / "good2.png")
    write_label(root, "train", "good1", "0 0.5 0.5 0.4 0.4\n1 0.2 0.2 0.1 0.1\n")
    write_label(root, "train", "good2", "2 0.1 0.1 0.5 0.1 0.3 0.6\n")
    write_label(root, "train", "empty", "  \n")
    (tr / "zero.jpg").write_bytes(b"")
    (tr / "text.jpg").write_text("not an image")
    data = (tr / "good1.jpg").read_bytes()
    (tr / "trunc.jpg").write_bytes(data[: len(data) // 2])
    write_img(tr / "tiny.png", size=(8, 8))
    write_img(tr / "pngdata.jpg", fmt="PNG")  # PNG bytes with a .jpg name: used, with a warning
    write_label(root, "train", "pngdata", "0 0.5 0.5 0.5 0.5\n")
    (tr / "notes.gif").write_text("gif")  # no image extension: skipped
    write_label(
        root,
        "train",
        "rows",
        "0 0.5 0.5 0.2 0.2\n0 0.5 0.5\n1 0.5 nan 0.2 0.2\n-1 0.5 0.5 0.2 0.2\n"
        "3 0.5 0.5 0.2 0.2\n0 50 50 20 20\n0 0.5 0.5 0.2 0.2\n1 0.1 0.1 0.2 0.1 0.3\n"
        "0 0.99 0.5 0.04 0.2\n",
    )
    write_label(root, "train", "allbad", "7 0.5 0.5 0.2 0.2\n")
    write_label(root, "train", "binlabel", b"\xff\xfe\x00\x80garbage")
    (root / "labels" / "train" / "dirlabel.txt").mkdir()
    write_label(root, "train", "noperm", "0 0.5 0.5 0.2 0.2\n")
    root_user = os.geteuid() == 0
    if root_user:  # permission bits do not stop root: simulate with an image unreadable by anyone
        (tr / "noperm.jpg").unlink()
    else:
        os.chmod(tr / "noperm.jpg", 0)
    write_img(root / "images" / "val" / "v1.jpg")
    write_img(root / "images" / "val" / "v2.jpg")  # no labels/val folder at all
    (root / "images" / "none").mkdir()
    (root / "data.yaml").write_text(
        "path: .\ntrain: images/train\nval: images/val\nnames: [a, b, c]\n"
    )
    corrupt = ["zero", "text", "trunc", "tiny", "allbad", "binlabel", "dirlabel"] + (
        [] if root_user else ["noperm"]
    )
    return dict(
        images=len(corrupt) + 6,
        found=4,
        missing=1,
        empty=1,
        corrupt=len(corrupt),
        instances=6,
        dropped=8,
        fixed=1,
        corrupt_files=corrupt,
    )


def test_hostile_dataset(tmp_path, capsys, monkeypatch):
    exp = make_hostile(tmp_path)
    cfg = load_data_config(str(tmp_path / "data.yaml"))
    ds = YOLODataset(
        cfg["train"],
        imgsz=64,
        augment=True,
        hyp=HYP,
        task="segment",
        nc=cfg["nc"],
        prefix="train: ",
    )
    out = capsys.readouterr().out
    counts = {k: v for k, v in exp.items() if k != "corrupt_files"}
    assert {k: ds.stats[k] for k in counts} == counts
    for stem in exp["corrupt_files"]:
        assert any(f"{stem}." in line and "image skipped" in line for line in out.splitlines()), (
            stem
        )
    for frag in [
        "zero.jpg: empty (0-byte) file",
        "text.jpg: not an image",
        "trunc.jpg: corrupt image",
        "tiny.png: image too small (8x8",
        "pngdata.jpg: PNG data with a .jpg extension",
        "1 file(s) without an image extension",
        "rows.txt:2: 3 values",
        "rows.txt:3: NaN",
        "rows.txt:7: duplicate of line 1",
        "rows.txt:9: coordinates slightly outside",
        "binlabel.txt unreadable",
        "allbad.txt:1: class 7",
    ]:
        assert frag in out, frag
    summary = [
        line for line in out.splitlines() if line.startswith("train: ") and "images:" in line
    ]
    assert summary == [
        f"train: {exp['images']} images: 4 labelled, 1 missing labels, 1 empty, "
        f"{exp['corrupt']} corrupt; 6 instances; label rows: 8 dropped, 1 fixed"
    ]
    rows = ds.labels[ds.im_files.index(str(tmp_path / "images" / "train" / "rows.jpg"))]
    assert len(ds) == 6 and rows["cls"].tolist() == [0, 0]
    random.seed(0)
    b = collate([ds[i] for i in range(len(ds))])  # trains on the good files
    assert b["images"].shape == (6, 3, 64, 64) and b["masks"].shape == (6, 16, 16)
    # the cache is used on the next run (nothing re-verified), warnings are shown again
    monkeypatch.setattr(
        L, "verify", lambda *a: (_ for _ in ()).throw(AssertionError("re-verified"))
    )
    YOLODataset(cfg["train"], imgsz=64, nc=3, prefix="train: ")
    assert "rows.txt:3: NaN" in capsys.readouterr().out
    YOLODataset(cfg["train"], imgsz=64, nc=3, prefix="train: ", verbose=False)  # ranks other than 0
    assert capsys.readouterr().out == ""
    # a changed label file invalidates it
    monkeypatch.undo()
    write_label(tmp_path, "train", "allbad", "2 0.5 0.5 0.2 0.2\n")
    assert YOLODataset(cfg["train"], imgsz=64, nc=3).stats["found"] == 5
    # a split whose labels folder is missing: background images, one warning
    vs = YOLODataset(cfg["val"], imgsz=64, nc=3, prefix="val: ")
    assert vs.stats["missing"] == 2 and "labels folder" in capsys.readouterr().out
    with pytest.raises(DataError, match="no images found"):
        YOLODataset(str(tmp_path / "images" / "none"), nc=3)
    write_label(tmp_path, "solo", "s", "9 0.5 0.5 0.2 0.2\n")
    write_img(tmp_path / "images" / "solo" / "s.jpg")
    with pytest.raises(DataError, match="no usable images"):
        YOLODataset(str(tmp_path / "images" / "solo"), nc=3)


def test_permission_denied(tmp_path, monkeypatch):
    """Root ignores permission bits: the unreadable-image case is simulated at the open() call."""
    write_img(tmp_path / "images" / "t" / "a.jpg")
    write_label(tmp_path, "t", "a", "0 0.5 0.5 0.2 0.2\n")
    deny_image_open(monkeypatch, "a.jpg")
    im = str(tmp_path / "images" / "t" / "a.jpg")
    status, _, _, msgs, _, _ = L.verify(im, str(tmp_path / "labels" / "t" / "a.txt"))
    assert status == L.CORRUPT and msgs == [
        f"{im}: image unreadable (permission denied); image skipped"
    ]


def test_readonly_label_folder(tmp_path, capsys):
    write_img(tmp_path / "images" / "t" / "a.jpg")
    write_label(tmp_path, "t", "a", "0 0.5 0.5 0.2 0.2\n")
    lab = tmp_path / "labels" / "t"
    os.chmod(tmp_path / "labels", 0o555)
    try:
        YOLODataset(str(tmp_path / "images" / "t"), nc=1)
        assert "label cache not saved" in capsys.readouterr().out
        assert not Path(str(lab) + ".cache").exists()
    finally:
        os.chmod(tmp_path / "labels", 0o755)
    YOLODataset(str(tmp_path / "images" / "t"), nc=1)
    assert Path(str(lab) + ".cache").exists() and "not saved" not in capsys.readouterr().out


# ---------------------------------------------------------------- geometry consistency
def make_squares(root: Path, polygons: bool) -> str:
    """Dark images with bright objects (squares; a triangle when polygons) and exact labels."""
    specs = [
        ((160, 120), [(40, 30, 100, 90)]),
        ((100, 140), [(20, 50, 60, 110), (70, 10, 90, 40)]),
        ((200, 200), [(120, 120, 190, 190)]),
        ((90, 90), [(10, 10, 40, 60)]),
    ]
    for k, ((w, h), boxes) in enumerate(specs):
        a = np.full((h, w, 3), 20, np.uint8)
        rows = []
        for j, (x0, y0, x1, y1) in enumerate(boxes):
            if polygons and j == 1:  # a right triangle
                tri = Image.new("L", (w, h))
                ImageDraw.Draw(tri).polygon(
                    [(x0 - 0.5, y0 - 0.5), (x1 - 0.5, y1 - 0.5), (x0 - 0.5, y1 - 0.5)], fill=1
                )
                a[np.asarray(tri) > 0] = 240
                pts = [(x0, y0), (x1, y1), (x0, y1)]
            else:
                a[y0:y1, x0:x1] = 240
                pts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
            if polygons:
                rows.append("0 " + " ".join(f"{x / w:.6f} {y / h:.6f}" for x, y in pts))
            else:
                xywh = ((x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h)
                rows.append("0 " + " ".join(f"{v:.6f}" for v in xywh))
        write_img(root / "images" / "t" / f"{k}.png")
        Image.fromarray(a).save(root / "images" / "t" / f"{k}.png")
        write_label(root, "t", str(k), "\n".join(rows) + "\n")
    return str(root / "images" / "t")


@pytest.mark.parametrize(
    "polygons, hyp",
    [(False, {}), (True, {}), (True, dict(degrees=20, shear=5)), (False, dict(mosaic=0.0))],
)
def test_augment_keeps_labels_on_pixels(tmp_path, polygons, hyp):
    ds = YOLODataset(
        make_squares(tmp_path, polygons),
        imgsz=128,
        augment=True,
        task="segment",
        hyp={**HYP, **NO_HSV, "flipud": 0.5, **hyp},
        nc=1,
    )
    tol = 2.5 if polygons else 1.5  # acute corners of rasterised polygons lose their tips
    random.seed(1)
    covered = total = 0
    for n in range(24):
        s = ds[n % len(ds)]
        _, H, W = s["image"].shape
        bright = s["image"].float().mean(0) > 128
        boxes = xyxy(s["targets"][:, 1:], W, H)
        inbox = torch.zeros_like(bright)
        for k, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
            assert x1 - x0 > 2 and y1 - y0 > 2 and 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H
            inner = bright[round(y0) + 1 : round(y1) - 1, round(x0) + 1 : round(x1) - 1]
            if not polygons:  # a square's box is filled by it
                assert inner.float().mean() > 0.95
            # the box is tight: bright pixels touch every side (1.5 px tolerance)
            ox, oy = max(int(x0) - 1, 0), max(int(y0) - 1, 0)
            ys, xs = torch.nonzero(bright[oy : int(y1) + 2, ox : int(x1) + 2], as_tuple=True)
            assert len(xs), "box on no object"
            assert abs(xs.min() + ox - x0) <= tol and abs(xs.max() + 1 + ox - x1) <= tol
            assert abs(ys.min() + oy - y0) <= tol and abs(ys.max() + 1 + oy - y1) <= tol
            inbox[oy : int(y1) + 2, ox : int(x1) + 2] = True
            own = torch.zeros_like(bright)
            own[max(int(y0) - 4, 0) : int(y1) + 5, max(int(x0) - 4, 0) : int(x1) + 5] = True
            m = (s["masks"] == k + 1).repeat_interleave(4, 0).repeat_interleave(4, 1)
            assert m.any() and not (m & ~own).any()  # instance k's mask lies in box k
        covered += (bright & inbox).sum().item()
        total += bright.sum().item()
        # the overlap mask = kept objects' pixels sampled at the 1/4-resolution pixel centres (+-2)
        obj = (bright & inbox)[None, None].float()
        grown = torch.nn.functional.max_pool2d(obj, 5, 1, 2)[0, 0, 2::4, 2::4] > 0
        shrunk = -torch.nn.functional.max_pool2d(-obj, 5, 1, 2)[0, 0, 2::4, 2::4] > 0
        m4 = s["masks"] > 0
        assert not (m4 & ~grown).any() and not (shrunk & ~m4).any()
    # bright pixels outside every box: only slivers the candidate filter dropped
    assert covered / total > 0.95


def test_overlap_mask_order():
    big = np.array([[0, 0], [64, 0], [64, 64], [0, 64]], np.float32)
    small = np.array([[16, 16], [32, 16], [32, 32], [16, 32]], np.float32)
    boxes = np.array([[16, 16, 32, 32], [0, 0, 64, 64]], np.float32)
    m = overlap_mask([small, big], boxes, (64, 64))
    assert m.shape == (16, 16) and m[5, 5] == 1 and m[1, 1] == 2 and m[14, 14] == 2
    assert (m == 1).sum() == 16 and (m > 0).sum() == 256
    m = overlap_mask([None, None], boxes[::-1].copy(), (64, 64))  # box-only instances: rectangles
    assert m[5, 5] == 2 and m[1, 1] == 1
    many = [
        np.array(
            [
                [i % 16 * 4, i // 16 * 4],
                [i % 16 * 4 + 4, i // 16 * 4],
                [i % 16 * 4 + 4, i // 16 * 4 + 4],
            ],
            np.float32,
        )
        for i in range(300)
    ]
    m = overlap_mask(many, np.zeros((300, 4), np.float32), (128, 128))
    assert m.dtype == torch.int16 and m.max() == 300


# ------------------------------------------------------------ validation: rect shapes and letterbox
def test_rect_letterbox(tmp_path):
    src = make_squares(tmp_path, polygons=True)
    ds = YOLODataset(src, imgsz=96, rect=True, batch_size=2, task="segment", nc=1)
    ar = [lb["shape"][0] / lb["shape"][1] for lb in ds.labels]
    assert ar == sorted(ar)
    for i in range(len(ds)):
        s = ds[i]
        H, W = ds.batch_shapes[i // 2]
        assert s["image"].shape == (3, H, W) and H % 32 == 0 and W % 32 == 0
        assert s["masks"].shape == (H // 4, W // 4)
        (h0, w0), ((rh, rw), (pw, ph)) = s["shape"]
        assert max(h0 * rh, w0 * rw) == pytest.approx(96)
        # targets -> input pixels -> original pixels == ground truth
        back = (xyxy(s["targets"][:, 1:], W, H) - torch.tensor([pw, ph, pw, ph])) / rw
        torch.testing.assert_close(back, ds.ground_truth(i)["boxes"], atol=1e-3, rtol=0)
        bright = s["image"].float().mean(0) > 128
        for x0, y0, x1, y1 in xyxy(s["targets"][:, 1:], W, H).tolist():
            assert bright[int(y0) + 1 : int(y1) - 1, int(x0) + 1].any()
        assert (s["image"][:, :, : max(int(pw) - 1, 0)] == 114).all()  # padding
    b = collate([ds[0], ds[1]])
    assert (
        b["images"].dtype == torch.uint8
        and b["targets"].shape[1] == 6
        and b["masks"].dtype == torch.float32
    )
    assert b["indices"].tolist() == [0, 1] and b["targets"][:, 0].unique().tolist() == [0.0, 1.0]
    gt = ds.ground_truth(0)
    assert gt["cls"].dtype == torch.int64 and len(gt["polygons"]) == len(gt["cls"])


def test_collate_leads_each_target_row_by_its_image():
    """Targets of 2, 0 and 1 rows -> 3 rows [image, ...] in order, values and dtype kept (float
    detection rows; int64 classify rows)."""
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    rows = [torch.tensor([[1.0, 0.5, 0.5, 0.2, 0.2], [2.0, 0.1, 0.2, 0.3, 0.4]]), torch.zeros(0, 5)]
    rows.append(torch.tensor([[3.0, 0.9, 0.8, 0.1, 0.1]]))
    samples = [
        {"image": image, "targets": t, "masks": None, "shape": (4, 4), "index": 7 + k}
        for k, t in enumerate(rows)
    ]
    b = collate(samples)
    assert b["targets"].dtype == torch.float32 and b["indices"].tolist() == [7, 8, 9]
    assert b["targets"][:, 0].tolist() == [0.0, 0.0, 2.0]
    assert torch.equal(b["targets"][:, 1:], torch.cat(rows))
    for k, s in enumerate(samples):
        s["targets"] = torch.tensor([[k + 5]])
    assert collate(samples)["targets"].tolist() == [[0, 5], [1, 6], [2, 7]]
    assert collate(samples)["targets"].dtype == torch.int64


def test_val_letterbox_splits_odd_padding_as_yolov5(tmp_path):
    """Rect validation samples (yolov5's batch shapes: 41x64 -> 64x96) with odd padding d:
    round(d / 2 - 0.1) grey lines before the image, round(d / 2 + 0.1) after (41 rows on 64: 11
    and 12); `shape`'s pad is that offset, the targets the labels' pixels moved by it; at a
    fractional size (43.38 rows) the pad is where the image starts, as scale_masks takes it."""
    rng = np.random.default_rng(0)
    pixels = {"wide": rng.integers(0, 256, (41, 64, 3), np.uint8)}  # r 1: the pixels themselves
    pixels["tall"] = pixels["wide"].transpose(1, 0, 2).copy()
    pixels["half"] = np.full((82, 128, 3), 30, np.uint8)  # r 0.5: 41 rows, flat
    pixels["frac"] = np.full((61, 90, 3), 30, np.uint8)  # r 64 / 90: 43.38 rows
    boxes = {"wide": (10, 5, 30, 25), "tall": (5, 10, 25, 30), "half": (20, 10, 60, 50)}
    boxes["frac"] = (0, 0, 90, 61)
    (tmp_path / "images" / "t").mkdir(parents=True)
    for name, a in pixels.items():
        Image.fromarray(a).save(tmp_path / "images" / "t" / f"{name}.png")
        (h, w), (x0, y0, x1, y1) = a.shape[:2], boxes[name]
        xywh = ((x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h)
        write_label(tmp_path, "t", name, "0 " + " ".join(f"{v:.6f}" for v in xywh) + "\n")
    ds = YOLODataset(str(tmp_path / "images" / "t"), imgsz=64, rect=True, batch_size=1, nc=1)
    for i in range(len(ds)):
        s, name = ds[i], Path(ds.im_files[i]).stem
        (h0, w0), (_, pad) = s["shape"]
        tall = name == "tall"
        image, (pw, ph) = (s["image"].transpose(1, 2), pad[::-1]) if tall else (s["image"], pad)
        grey = [(image == 114).all(k).all(0).nonzero().flatten().tolist() for k in (2, 1)]
        assert image.shape == (3, 64, 96) and grey[1] == [*range(16), *range(80, 96)], name
        if name == "frac":  # 43.38 rows from round((64 - 43.38) / 2 - 0.1) = 10
            assert (pw, ph) == (16.0, 10.0) and grey[0] == [*range(10), *range(53, 64)]
            rows = torch.zeros(1, 64, 96, dtype=torch.bool)
            rows[0, 10:53, 16:80] = True
            assert ops.scale_masks(rows, s["shape"][1], (h0, w0)).all()
            continue
        assert (pw, ph) == (16.0, 11.0) and grey[0] == [*range(11), *range(52, 64)], name
        want = torch.from_numpy(pixels["wide"] if name != "half" else pixels[name][::2, ::2])
        assert torch.equal(image[:, 11:52, 16:80], want.permute(2, 0, 1)), name
        box = torch.tensor(boxes[name], dtype=torch.float32) * 64 / max(h0, w0)
        box += torch.tensor(pad * 2)
        H, W = s["image"].shape[1:]
        torch.testing.assert_close(xyxy(s["targets"][:, 1:], W, H)[0], box, atol=1e-3, rtol=0)


# ---------------------------------------------------------------- loaders, samplers, determinism
def test_samplers_and_determinism(tmp_path):
    src = make_squares(tmp_path, False)
    with pytest.raises(ValueError, match="augment=True needs hyp"):
        YOLODataset(src, imgsz=64, augment=True, nc=1)
    ds = YOLODataset(src, imgsz=64, augment=True, hyp=HYP, nc=1)
    for world in (1, 2, 3, 7):
        got = [i for r in range(world) for b in shard_batches(10, 3, r, world) for i in b]
        assert sorted(got) == list(range(10))  # each index exactly once, no padding
    assert shard_batches(10, 3, 5, 7) == []  # a rank may get nothing

    def batches(seed, rank=0, world=1, workers=2):
        loader, sampler = build_dataloader(
            ds, batch_size=2, workers=workers, shuffle=True, rank=rank, world_size=world, seed=seed
        )
        sampler.set_epoch(1)
        return [(b["indices"].tolist(), b["images"].clone(), b["targets"].clone()) for b in loader]

    def same(a, b):
        return len(a) == len(b) and all(
            x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
            for x, y in zip(a, b)
        )

    a, c = batches(3), batches(4)
    # any worker count: the same batches
    assert same(a, batches(3)) and same(a, batches(3, workers=0))
    assert any(not torch.equal(x[1], y[1]) for x, y in zip(a, c))
    r0, r1 = batches(3, 0, 2, 0), batches(3, 1, 2, 0)
    assert sorted(i for x in r0 + r1 for i in x[0]) == list(range(4))

    def per_image(batches):  # index -> (image, its targets)
        return {
            i: (x[1][k], x[2][x[2][:, 0] == k, 1:]) for x in batches for k, i in enumerate(x[0])
        }

    one, two = per_image(a), per_image(r0 + r1)  # 2 ranks augment each image as 1 rank does
    assert all(
        torch.equal(one[i][0], two[i][0]) and torch.equal(one[i][1], two[i][1]) for i in range(4)
    )
    vds = YOLODataset(make_squares(tmp_path, False), imgsz=64, rect=True, batch_size=3, nc=1)
    loader, _ = build_dataloader(vds, 3, workers=0, shuffle=False, rank=1, world_size=2)
    assert [b["indices"].tolist() for b in loader] == [[3]]
    with pytest.raises(ValueError, match="rect dataset"):
        build_dataloader(vds, 2, workers=0, shuffle=False)


def _ddp_rank(rank: int, src: str, out: str, port: int):
    os.environ.update(OMP_NUM_THREADS="1")
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls, real = [], L.verify
    L.verify = lambda *a: calls.append(a[0]) or real(*a)
    if (
        rank != 0
    ):  # as an entry script does: local rank 0 builds (and caches) first, then the others
        dist.barrier()
    ds = YOLODataset(src, imgsz=64, rect=True, batch_size=1, nc=1, verbose=rank == 0)
    if rank == 0:
        dist.barrier()
    idx = [
        i
        for b in build_dataloader(ds, 1, workers=0, shuffle=False, rank=rank, world_size=2)[0]
        for i in b["indices"].tolist()
    ]
    Path(out, f"{rank}.json").write_text(json.dumps(dict(calls=len(calls), idx=idx)))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_share_cache_and_shard_validation(tmp_path):
    """Local rank 0 verifies and caches first, then rank 1 reads the cache; disjoint val shards."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    src = make_squares(tmp_path / "d", False)
    torch.multiprocessing.spawn(_ddp_rank, args=(src, str(tmp_path), port), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert (r0["calls"], r1["calls"]) == (4, 0)
    assert sorted(r0["idx"] + r1["idx"]) == [0, 1, 2, 3] and not set(r0["idx"]) & set(r1["idx"])


def test_cache_ram(tmp_path, monkeypatch):
    src = make_squares(tmp_path, False)
    plain = YOLODataset(src, imgsz=64, rect=True, batch_size=2, nc=1)
    ref = [collate([plain[i], plain[i + 1]]) for i in (0, 2)]
    nbytes = sum(w * h * 3 for w, h in plain._dims)  # each image at long side imgsz
    # 10% is just too little
    monkeypatch.setattr(D, "available_memory", lambda: 10 * nbytes)
    assert YOLODataset(src, imgsz=64, rect=True, batch_size=2, nc=1, cache="auto")._ram is None
    monkeypatch.setattr(D, "available_memory", lambda: nbytes - 1)
    with pytest.raises(
        DataError, match="caching the images in RAM needs .* GB is available: use --cache off"
    ):
        YOLODataset(src, imgsz=64, rect=True, batch_size=2, nc=1, cache="ram")
    monkeypatch.setattr(D, "available_memory", lambda: 10 * nbytes + 1)
    ds = YOLODataset(src, imgsz=64, rect=True, batch_size=2, nc=1, cache="auto")
    assert [a.shape for a in ds._ram] == [(h, w, 3) for w, h in ds._dims]
    for f in ds.im_files:
        os.remove(f)  # decoded at construction: now served from RAM only, also by worker processes
    loader, _ = build_dataloader(ds, 2, workers=2, shuffle=False)
    for b, p in zip(loader, ref):
        assert (
            b["images"].shape == p["images"].shape
            and (b["images"].float() - p["images"].float()).abs().mean() < 2
        )


# ---------------------------------------------------------------- real data
def test_real_coco(data_dir, capsys):
    det = load_data_config(str(data_dir / "coco8.yaml"))
    seg = load_data_config(str(data_dir / "coco8-seg.yaml"))
    for cfg, task in ((det, "detect"), (seg, "segment")):
        tr = YOLODataset(cfg["train"], imgsz=128, augment=True, hyp=HYP, task=task, nc=cfg["nc"])
        va = YOLODataset(cfg["val"], imgsz=128, rect=True, batch_size=4, task=task, nc=cfg["nc"])
        assert (len(tr), tr.stats["instances"], len(va), va.stats["instances"]) == (4, 13, 4, 17)
        b = next(iter(build_dataloader(tr, 4, workers=0, seed=0)[0]))
        assert b["images"].shape == (4, 3, 128, 128) and (b["masks"] is None) == (task == "detect")
        if task == "segment":
            assert b["masks"].shape == (4, 32, 32) and b["masks"].max() >= 1
    # ground truth equals the COCO annotations (pixels)
    ann = json.loads((data_dir / "coco8" / "annotations" / "instances_val.json").read_text())
    va = YOLODataset(det["val"], imgsz=128, rect=True, batch_size=4, nc=80)
    for i, f in enumerate(va.im_files):
        ref = torch.tensor(
            [a["bbox"] for a in ann["annotations"] if a["image_id"] == int(Path(f).stem)]
        )
        ref[:, 2:] += ref[:, :2]
        gt = va.ground_truth(i)["boxes"]
        assert len(gt) == len(ref)
        d = torch.cdist(gt, ref.float())
        assert d.min(1).values.max() < 1.0
    cfg = load_data_config(str(data_dir / "coco128-seg.yaml"))
    ds = YOLODataset(cfg["train"], imgsz=128, task="segment", nc=80)
    assert (len(ds), ds.stats["found"], ds.stats["missing"], ds.stats["instances"]) == (
        128,
        126,
        2,
        929,
    )
    assert ds.stats["corrupt"] == ds.stats["dropped"] == ds.stats["fixed"] == 0
    assert (data_dir / "coco128-seg" / "labels" / "train2017.cache").is_file()


def test_read_only_labels_are_left_untouched(data_dir, tmp_path, capsys):
    """Labels in a folder marked read-only get no cache (even as root, who ignores the bits): one
    warning, and the labels are verified again next time."""
    root = tmp_path / "coco8"
    shutil.copytree(data_dir / "coco8", root, ignore=shutil.ignore_patterns("*.cache"))
    labels = root / "labels"
    for folder in (labels, labels / "train"):
        folder.chmod(0o555)
    try:
        ds = YOLODataset([str(root / "images" / "train")], imgsz=128, nc=80)
        assert len(ds) == 4 and ds.stats["instances"] == 13
        assert "not writable" in capsys.readouterr().out
        assert sorted(p.name for p in labels.iterdir()) == ["train", "val"]
    finally:
        for folder in (labels, labels / "train"):
            folder.chmod(0o755)


# ---------------------------------------------------------------- synthetic shapes
def test_shapes_dataset(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        shapes.generate(root, n_train=3, n_val=1, size=128, seed=5)
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert fa == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and len(fa) == 9
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in fa)  # deterministic
    rng = np.random.default_rng(0)
    for _ in range(
        5
    ):  # labels are the exact drawn polygons: uniform colour inside, different outside
        im, labels = shapes.make_image(rng, 256)
        px = np.asarray(im, np.float32)
        for k, poly in labels:
            c = poly.mean(0)
            inner = [tuple(c + (p - c) * 0.8) for p in poly]
            m = Image.new("L", im.size)
            ImageDraw.Draw(m).polygon(inner, fill=1)
            sel = px[np.asarray(m) > 0]
            assert sel.std(0).max() < 12 and 0 <= k < 3
    monkeypatch.setenv("YOLO_MIN_CACHE", str(tmp_path / "cache"))
    cfg = load_data_config("shapes")
    assert cfg["names"] == ["circle", "rectangle", "triangle"] and cfg["nc"] == 3
    ds = YOLODataset(cfg["val"], imgsz=128, task="segment", nc=3)
    assert len(ds) == 64 and ds.stats["corrupt"] == 0 and ds.stats["instances"] > 64
    assert load_data_config("shapes")["yaml_file"] == cfg["yaml_file"]  # generated once


# ---------------------------------------------------------------- pictures
def test_draw_batch(tmp_path):
    ds = YOLODataset(
        make_squares(tmp_path, True), imgsz=64, augment=True, hyp=HYP, task="segment", nc=1
    )
    random.seed(0)
    b = collate([ds[i] for i in range(4)])
    f = draw_batch(
        b["images"],
        b["targets"],
        b["masks"],
        fname=tmp_path / "p" / "train_batch0.jpg",
        names=["sq"],
    )
    assert Image.open(f).size == (2 * 64 + 3 * 4, 2 * 64 + 3 * 4)
    preds = [torch.tensor([[2.0, 2, 30, 30, 0.9, 0]]) for _ in range(4)]
    pm = [torch.ones(1, 16, 16, dtype=torch.bool) for _ in range(4)]
    assert draw_batch(b["images"], masks=pm, preds=preds, fname=tmp_path / "pred.jpg").exists()


def test_label_text_scales_with_the_image():
    """A box's label tab (its colour, above the box) is 3.5% of the image's mean side, at least
    8 px: small on a 128 px tile, larger on a 640 px photo; the text inside is white."""
    heights = {}
    for size in (128, 640):
        image = torch.full((3, size, size), 40, dtype=torch.uint8)
        box = torch.tensor([[0.2, 0.4, 0.6, 0.8]]) * size
        out = draw_detections(image, box, [0], [0.91], ["person"], width=2)
        # PALETTE[0] is #FF3838: the tab's rows are the rows above the box holding that colour
        red = (out[0] == 255) & (out[1] == 0x38) & (out[2] == 0x38)
        rows = red[: round(0.4 * size)].any(1).nonzero().flatten()
        heights[size] = round(0.4 * size) - rows.min().item()
        tab = out[:, rows.min() : round(0.4 * size), round(0.2 * size) :]
        assert (tab >= 200).all(0).any()  # white text (antialiased)
    assert 8 <= heights[128] <= 12
    assert 20 <= heights[640] <= 27
