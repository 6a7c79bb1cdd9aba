"""predict.py: agreement with yolov5's detect.py and segment/predict.py on the fixtures, the sources
it reads, the files it writes, the Python API, bad input, and 2 ranks under torchrun."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from yolo_min import cli, ops, predictor, trainer, validator
from yolo_min.models import Model, amp_dtype
from yolo_min.safe_load import load_model

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def read_labels(path: Path, hw) -> list:
    """A --save-txt --save-conf file -> [(cls, conf, box xyxy pixels or None, polygon or None)]
    (segment: the box is the polygon's extent; an empty polygon has neither)."""
    (h, w), rows = hw, []
    for line in path.read_text().splitlines() if path.exists() else []:
        v = np.array(line.split(), float)
        cls, conf, xy = int(v[0]), v[-1], v[1:-1]
        if len(xy) == 4:
            rows.append((cls, conf, ops.xywh2xyxy(xy * [w, h, w, h]), None))
        else:
            poly = xy.reshape(-1, 2) * [w, h]
            box = np.concatenate([poly.min(0), poly.max(0)]) if len(poly) else None
            rows.append((cls, conf, box, poly))
    return rows


def agreement(ours: Path, ref: Path, images: Path) -> dict:
    """Match each reference detection (by descending confidence; those without a polygon last) to
    an unused one of ours of its class with confidence within 0.03 and box IoU >= 0.9 (detect) or
    polygon mask IoU >= 0.8 (segment; an empty reference polygon: class and confidence only).
    Returns {"ref", "ours", "matched", "mask_ious"}."""
    n_ref = n_ours = matched = 0
    mask_ious = []
    for im in sorted(images.iterdir()):
        w, h = Image.open(im).size
        a, b = (read_labels(d / f"{im.stem}.txt", (h, w)) for d in (ref, ours))
        n_ref, n_ours, free = n_ref + len(a), n_ours + len(b), set(range(len(b)))
        for c, conf, box, poly in sorted(a, key=lambda r: (r[2] is None, -r[1])):
            scores = {}
            for k in free:
                c2, conf2, box2, poly2 = b[k]
                if c2 != c or abs(conf2 - conf) > 0.03:
                    continue
                if poly is None:
                    scores[k] = ops.box_iou(*torch.tensor(np.stack([box, box2]))[:, None]).item()
                elif box is None or poly2 is None or box2 is None:  # ours empty or 2 points
                    scores[k] = float(box is None)  # an empty reference: class and conf only
                else:
                    m = ops.polygons_to_masks([poly + 0.5, poly2 + 0.5], (h, w))
                    scores[k] = ops.mask_iou(m[:1], m[1:]).item()
            best = max(scores, key=scores.get, default=None)
            if best is not None and scores[best] >= (0.9 if poly is None else 0.8):
                free.remove(best)
                matched += 1
                mask_ious += [scores[best]] if box is not None and poly is not None else []
    return dict(ref=n_ref, ours=n_ours, matched=matched, mask_ious=mask_ious)


def run_predict(tmp_path, name, **kw) -> Path:
    kw = dict(device="cpu", project=str(tmp_path), name=name, exist_ok=True) | kw
    return Path(predictor.run(**kw)["save_dir"])


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_agrees_with_yolov5(fixtures_dir, tmp_path, task):
    """commands.txt's options; >= 95% of yolov5's detections matched, <= 5% extra. Another folder
    laid out as fixtures/yolov5/predict (its own images and labels) can be named in the
    environment variable YOLO_MIN_PREDICT_FIXTURES."""
    fx = Path(os.environ.get("YOLO_MIN_PREDICT_FIXTURES", fixtures_dir / "predict"))
    weights, ref = ("det.pt", "detect_labels") if task == "detect" else ("seg.pt", "segment_labels")
    opts = dict(imgsz=160, conf_thres=0.25, iou_thres=0.45, save_txt=True, save_conf=True)
    out = run_predict(tmp_path, task, weights=str(fx / weights), source=str(fx / "images"), **opts)
    res = agreement(out / "labels", fx / ref, fx / "images")
    assert res["ref"] > 0 and res["matched"] >= 0.95 * res["ref"], res
    assert res["ours"] - res["matched"] <= 0.05 * res["ref"], res
    assert (task == "segment") == (len(res["mask_ious"]) > 0.9 * res["ref"])


def test_letterbox_as_yolov5():
    """The smallest stride-multiple canvas; the image resized to whole pixels (Python rounding,
    106.5 -> 106), centred as yolov5 splits odd padding, by bilinear interpolation without
    antialiasing (OpenCV's INTER_LINEAR); ratio_pad as yolov5's scale_boxes maps back."""
    canvas, ratio_pad = predictor.letterbox(torch.zeros(426, 640, 3, dtype=torch.uint8), 160, 32)
    assert canvas.shape == (3, 128, 160) and ratio_pad == ((0.25, 0.25), (0.0, 10.75))
    assert (canvas[:, 11:117] == 0).all() and (canvas[:, :11] == 114).all()
    assert (canvas[:, 117:] == 114).all()
    row = torch.tensor([0, 100, 200, 100], dtype=torch.uint8)[None, :, None].expand(2, 4, 3)
    up, _ = predictor.letterbox(row, 8, 4)  # 2x: source x = (x + 0.5) / 2 - 0.5
    assert up.shape == (3, 4, 8) and up[0, 0].tolist() == [0, 25, 75, 125, 175, 175, 125, 100]
    stripes = torch.tensor([0, 255, 255, 255] * 8, dtype=torch.uint8)[None, :, None]
    down, _ = predictor.letterbox(stripes.expand(32, 32, 3), 8, 4)  # source x = 4 x + 1.5
    assert (down == 255).all()  # only pixels 4x + 1 and 4x + 2: no antialiasing
    for hw, want in [((80, 128), (128, 160)), ((128, 256), (96, 160)), ((256, 128), (160, 96))]:
        canvas, _ = predictor.letterbox(torch.zeros(*hw, 3, dtype=torch.uint8), 160, 32)
        assert canvas.shape[1:] == want, hw


def grey_lines(canvas: torch.Tensor) -> list[int]:
    """The rows of a letterboxed (3, H, W) that are all 114 grey."""
    return (canvas == 114).all(2).all(0).nonzero().flatten().tolist()


@pytest.mark.parametrize("portrait", [False, True], ids=["rows", "columns"])
def test_letterbox_splits_odd_padding_as_yolov5(portrait):
    """Odd padding d: round(d / 2 - 0.1) lines before the image, round(d / 2 + 0.1) after (yolov5's
    letterbox); ratio_pad's pad is yolov5's (canvas - original * r) / 2, unrounded."""
    turn = (lambda t: t.transpose(-1, -2)) if portrait else (lambda t: t)  # (..., h, w): landscape
    # 427x640 at 128: r 0.2, 85.4 -> 85 rows on a 96-row canvas, d = 11: 5 grey rows, 85, 6
    image = torch.zeros(640, 427, 3) if portrait else torch.zeros(427, 640, 3)
    canvas, ((rh, rw), pad) = predictor.letterbox(image.byte(), 128, 32)
    canvas = turn(canvas)
    assert canvas.shape == (3, 96, 128) and (canvas[:, 5:90] == 0).all()
    assert grey_lines(canvas) == [*range(5), *range(90, 96)]
    assert rh == rw == 0.2 and pytest.approx(pad[::-1] if portrait else pad) == (0.0, 5.3)
    # 85x128 at 128, not resized: its pixels, from row 5
    image = torch.randint(0, 256, (3, 85, 128), generator=torch.Generator().manual_seed(0))
    canvas, ratio_pad = predictor.letterbox(turn(image.byte()).permute(1, 2, 0), 128, 32)
    canvas = turn(canvas)
    assert canvas.shape == (3, 96, 128) and torch.equal(canvas[:, 5:90], image.byte())
    assert (canvas[:, :5] == 114).all() and (canvas[:, 90:] == 114).all()
    assert ratio_pad == ((1.0, 1.0), (5.5, 0.0) if portrait else (0.0, 5.5))


@pytest.mark.parametrize("portrait", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("h0", [423, 425, 427])  # r 0.2: 84.6, 85, 85.4 -> 85 rows from row 5 of 96
def test_scale_masks_and_boxes_invert_odd_letterbox(h0, portrait):
    """The image's rows of the input map back onto the whole original; at 425x640 (5x5 original
    pixels per input pixel) a mask letterboxed with the image comes back exactly, and a box drawn
    on it lies within 0.5 input px of ratio_pad's affine, which scale_boxes undoes."""
    turn = (lambda t: t.transpose(-1, -2)) if portrait else (lambda t: t)  # (..., h, w): landscape
    hw = (640, h0) if portrait else (h0, 640)
    blocks = torch.rand(86, 128, generator=torch.Generator().manual_seed(1)) < 0.5
    mask = blocks.repeat_interleave(5, 0).repeat_interleave(5, 1)[:h0]  # (h0, 640)
    mask[50:150], mask[:, 100:200] = False, False  # a black cross, a white box at its centre:
    mask[50:150, 100:200] = True  # original rows 50-149, columns 100-199
    image = turn(mask.byte() * 255)[..., None].expand(*hw, 3).contiguous()
    canvas, ratio_pad = predictor.letterbox(image, 128, 32)
    assert grey_lines(turn(canvas)) == [*range(5), *range(90, 96)]
    rows = torch.zeros(96, 128, dtype=torch.bool)
    rows[5:90] = True
    assert ops.scale_masks(turn(rows)[None], ratio_pad, hw).all()
    (r, _), (pw, ph) = ratio_pad
    box = torch.tensor([[50.0, 100, 150, 200] if portrait else [100.0, 50, 200, 150]])
    on_input = box * r + torch.tensor([pw, ph, pw, ph])
    torch.testing.assert_close(ops.scale_boxes(on_input, ratio_pad, hw), box, rtol=0, atol=1e-4)
    if h0 == 425:  # each input pixel samples a block's centre: exact
        assert torch.equal(turn(canvas[0])[5:90], mask[2::5, 2::5].byte() * 255)
        back = ops.scale_masks(canvas[:1] > 127, ratio_pad, hw)[0]
        assert torch.equal(turn(back), mask)
        white = turn(canvas[0]) == 255  # the box: input rows 15-34, columns 20-39
        assert white[15:35, 20:40].all() and not white[[14, 35], 20:40].any()
        assert not white[15:35, [19, 40]].any()
        drawn = torch.tensor([[20.0, 15, 40, 35]])  # x1 y1 x2 y2, the pixels' edges
        drawn = drawn[:, [1, 0, 3, 2]] if portrait else drawn
        assert (drawn - on_input).abs().max() <= 0.5


def test_sources(tmp_path, monkeypatch):
    """An image, a folder (sorted, not recursive, images only), a glob, a .txt list (relative
    lines: to the list's folder, as training's lists); nothing found: one line."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "no [images]").mkdir()
    for name in ("b.jpg", "a.PNG", "c.txt", "sub/d.jpg", "no [images]/e.txt"):
        Image.new("RGB", (8, 8)).save(tmp_path / name, "PNG") if "txt" not in name else None
    (tmp_path / "c.txt").write_text("a.PNG\n\nsub/d.jpg\n")
    (tmp_path / "sub" / "e.txt").write_text("d.jpg\n../b.jpg\n")
    (tmp_path / "no [images]" / "e.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    assert predictor.find_images("b.jpg") == ["b.jpg"]
    assert predictor.find_images(".") == ["a.PNG", "b.jpg"]
    assert predictor.find_images("**/*.jpg") == ["b.jpg", "sub/d.jpg"]
    assert predictor.find_images("c.txt") == ["a.PNG", "sub/d.jpg"]
    assert predictor.find_images("sub/e.txt") == ["sub/d.jpg", "sub/../b.jpg"]
    bad = {"nope": "nope: not found", "sub/*.png": "not found", "no [images]": "no images"}
    for source, why in bad.items():
        with pytest.raises(ValueError, match=why):
            predictor.find_images(source)


def test_api_on_paths_pil_and_arrays(fixtures_dir, tmp_path):
    """The same pixels as a path, a PIL image, an array and an EXIF-rotated file give the same
    detections; batching by shape changes only float rounding; draw() pictures the original."""
    model = load_model(fixtures_dir / "predict" / "seg.pt")
    path = fixtures_dir / "predict" / "images" / "tall00.png"
    pil = Image.open(path).convert("RGB")
    rotated = tmp_path / "rotated.png"  # stored turned by 90 degrees; EXIF orientation 6 undoes it
    exif = Image.Exif()
    exif[0x0112] = 6
    pil.transpose(Image.Transpose.ROTATE_90).save(rotated, exif=exif)
    images = [str(path), pil, np.asarray(pil), pil.crop((0, 0, 128, 80)), rotated]
    res = predictor.predict(model, images, imgsz=160, batch_size=3)
    assert [r["path"] for r in res] == [str(path), None, None, None, str(rotated)]
    a = res[0]
    assert a["names"] == ["circle", "rectangle", "triangle"] and len(a["boxes"]) >= 3
    assert a["masks"].shape == (len(a["boxes"]), 256, 128) and a["masks"].dtype == torch.bool
    for r in res[1:3]:
        assert torch.equal(r["boxes"], a["boxes"]) and torch.equal(r["masks"], a["masks"])
    assert torch.equal(res[4]["image"], a["image"])
    assert torch.allclose(res[4]["boxes"], a["boxes"], atol=1e-4)  # batch 1, not 3: float rounding
    one = predictor.predict(model, images[:4], imgsz=160)[3]  # alone in its batch
    assert torch.allclose(one["boxes"], res[3]["boxes"], atol=1e-4)
    assert predictor.draw(a).size == (128, 256)
    assert predictor.draw(res[3], labels=False, line_width=1).size == (128, 80)
    bad = predictor.predict(model, [np.zeros((8, 8), np.uint8)])[0]
    assert "not uint8 RGB" in bad["error"]


def test_output_files(fixtures_dir, tmp_path):
    """--save-txt (parsed back), --save-json, --save-crop and the drawings, for segment; --classes
    keeps only those; an image without detections has no label file."""
    fx = fixtures_dir / "predict"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("sq00.png", "sq01.jpg", "wide00.png"):
        shutil.copy(fx / "images" / name, src / name)
    Image.new("RGB", (64, 64), (40, 40, 40)).save(src / "blank.png")
    opts = dict(imgsz=160, save_txt=True, save_json=True, save_crop=True, workers=2)
    out = run_predict(
        tmp_path, "seg", weights=str(fx / "seg.pt"), source=str(src), **opts | {"classes": [0, 2]}
    )
    entries = json.loads((out / "predictions.json").read_text())
    files = [str(src / n) for n in ("blank.png", "sq00.png", "sq01.jpg", "wide00.png")]
    assert [e["file"] for e in entries] == files
    assert entries[0]["detections"] == [] and not (out / "labels" / "blank.txt").exists()
    crops = 0
    for e in entries[1:]:
        stem, (w, h) = Path(e["file"]).stem, (e["width"], e["height"])
        assert Image.open(out / Path(e["file"]).name).size == (w, h)
        lines = (out / "labels" / f"{stem}.txt").read_text().splitlines()[::-1]  # lowest conf first
        assert len(lines) == len(e["detections"]) > 0
        for k, (line, d) in enumerate(zip(lines, e["detections"])):
            v = np.array(line.split(), float)
            assert v[0] == d["class_id"] in (0, 2) and d["name"] in ("circle", "triangle")
            poly = v[1:].reshape(-1, 2) * [w, h]  # no confidence without --save-conf
            assert len(poly) >= 3 and (poly >= 0).all() and (poly <= [w, h]).all()
            x1, y1, x2, y2 = d["box"]  # masks reach a prototype pixel (4 / 1.25 px) beyond boxes
            assert x1 - 4 <= poly[:, 0].min() and poly[:, 0].max() <= x2 + 4
            assert y1 - 4 <= poly[:, 1].min() and poly[:, 1].max() <= y2 + 4
            assert d["mask"]["size"] == [h, w] and 0.25 <= d["confidence"] <= 1
            crop = Image.open(out / "crops" / d["name"] / f"{stem}_{k}.jpg")
            assert crop.size == (round(x2 - x1), round(y2 - y1))
        crops += len(lines)
    assert len(list((out / "crops").rglob("*.jpg"))) == crops


def test_detect_txt_and_json_agree(fixtures_dir, tmp_path):
    fx = fixtures_dir / "predict"
    source = str(fx / "images" / "wide01.png")
    opts = dict(imgsz=160, save_txt=True, save_conf=True, save_json=True, save_crop=True)
    out = run_predict(
        tmp_path, "det", weights=str(fx / "det.pt"), source=source, **opts, nosave=True
    )
    (entry,) = json.loads((out / "predictions.json").read_text())
    lines = (out / "labels" / "wide01.txt").read_text().splitlines()[::-1]
    assert len(lines) == len(entry["detections"]) > 0 and not (out / "wide01.png").exists()
    for k, (line, d) in enumerate(zip(lines, entry["detections"])):
        c, xc, yc, w, h, conf = map(float, line.split())
        box = np.array([xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2]) * [128, 80, 128, 80]
        assert c == d["class_id"] and abs(conf - d["confidence"]) < 1e-5 and "mask" not in d
        assert np.allclose(box, d["box"], atol=1e-3) and np.allclose(box, box.round(), atol=1e-3)
        crop = Image.open(out / "crops" / d["name"] / f"wide01_{k}.jpg")
        assert crop.size == (round(box[2] - box[0]), round(box[3] - box[1]))


def test_amp_auto_runs_fp32_on_a_cpu(tmp_path, monkeypatch):
    """On a CPU with native bfloat16, where val.py's --amp auto is bf16, predict.py's --amp auto
    runs every convolution in float32 (bf16 moved detections across the thresholds); --amp on,
    bf16 but Detect's (kept in float32)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    assert amp_dtype(torch.device("cpu"), "auto") == torch.bfloat16  # val.py's auto here
    model = Model("yolov5n.yaml", nc=2)
    state = {"model_cfg": model.yaml, "model": model.state_dict(), "names": ["a", "b"]}
    torch.save(state, tmp_path / "det.pt")
    n_convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())  # all of them run
    image = np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8)
    Image.fromarray(image).save(tmp_path / "im.png")
    seen, real_fuse = {}, Model.fuse

    def fuse(self):  # hooks on the convolutions predict.py runs (fuse replaces most)
        for name, m in real_fuse(self).named_modules():
            if isinstance(m, torch.nn.Conv2d):
                m.register_forward_hook(lambda m, args, y, name=name: seen.update({name: y.dtype}))
        return self

    monkeypatch.setattr(Model, "fuse", fuse)
    opts = dict(source=str(tmp_path / "im.png"), imgsz=64, device="cpu", nosave=True)
    for amp in ("auto", "on"):
        seen.clear()
        predictor.run(weights=str(tmp_path / "det.pt"), amp=amp, project=str(tmp_path), **opts)
        head = {k: v for k, v in seen.items() if k.startswith("model.24.")}  # Detect's
        assert len(seen) == n_convs and len(head) == 3 and set(head.values()) == {torch.float32}
        body = {v for k, v in seen.items() if k not in head}
        assert body == {torch.bfloat16 if amp == "on" else torch.float32}, amp


def run_cli(*args):
    cmd = [sys.executable, str(ROOT / "predict.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["no source", "empty folder", "not a checkpoint", "bad class"])
def test_bad_input_is_one_line_and_exit_2(fixtures_dir, tmp_path, monkeypatch, capsys, case):
    """What `python predict.py ...` runs (cli.run_command), in this process."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    fx, extra = fixtures_dir / "predict", []
    weights, source = fx / "det.pt", fx / "images"
    if case == "no source":
        source, why = tmp_path / "missing", "not found"
    elif case == "empty folder":
        source, why = tmp_path / "empty", "no images"
    elif case == "not a checkpoint":
        weights, why = tmp_path / "notes.pt", "notes.pt: "
    else:
        extra, why = ["--classes", "1", "3"], "--classes 1 3: "
    args = ["--weights", str(weights), "--source", str(source), "--project", str(tmp_path), *extra]
    monkeypatch.setattr(sys, "argv", ["predict.py", *args])
    with pytest.raises(SystemExit) as stop:
        cli.run_command(predictor.main, predictor.get_args_parser())
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("predict.py: error: ") and why in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "exp").exists()


def test_unreadable_images_are_named_skipped_and_counted(fixtures_dir, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(fixtures_dir / "predict" / "images" / "sq00.png", src / "good.png")
    (src / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a JPEG")
    (src / "list.txt").write_text(f"{src / 'good.png'}\n{src / 'broken.jpg'}\n{src / 'gone.png'}\n")
    weights, source = str(fixtures_dir / "predict" / "det.pt"), str(src / "list.txt")
    out = run_predict(tmp_path, "exp", weights=weights, source=source, imgsz=160, save_txt=True)
    text = capsys.readouterr().out
    assert "broken.jpg: unreadable" in text and "gone.png: unreadable" in text
    assert "1 images, 2 skipped (named above)" in text and "Speed: " in text
    assert sorted(p.name for p in out.iterdir()) == ["good.png", "labels"]


def test_run_takes_the_options_as_keywords():
    for entry in (trainer, validator, predictor):
        with pytest.raises(TypeError, match="unknown option.*'conf'"):
            entry.run(weights="w.pt", source="s", conf=0.5)
    with pytest.raises(TypeError, match="missing option.*'source'"):
        predictor.run(weights="w.pt")


@pytest.mark.slow
def test_two_ranks_write_what_one_process_writes(fixtures_dir, tmp_path):
    fx = fixtures_dir / "predict"
    images = sorted((fx / "images").iterdir())[::4]  # 10: all kinds of shapes
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in images))
    args = (
        f"--weights {fx / 'seg.pt'} --source {tmp_path / 'list.txt'} --project {tmp_path}".split()
    )
    args += "--imgsz 160 --save-txt --save-conf --save-json --nosave --device cpu".split()
    one = run_cli(*args, "--name", "one")
    cmd = [*TORCHRUN, str(ROOT / "predict.py"), *args, "--name", "two"]
    two = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("Speed: ") == 1 and "10 images" in two.stdout
    a, b = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.txt", "one", "two"]
    assert (a / "predictions.json").read_text() == (b / "predictions.json").read_text()
    names = sorted(p.name for p in (a / "labels").iterdir())
    assert names == sorted(p.name for p in (b / "labels").iterdir()) and len(names) >= 8
    assert all((a / "labels" / n).read_text() == (b / "labels" / n).read_text() for n in names)


@pytest.mark.slow
def test_train_run_under_torchrun(tmp_path, tiny):
    """A script calling yolo_min.trainer.run(...) launched by torchrun trains data-parallel: one run
    folder, written by rank 0, with a results.csv row; every rank gets the result."""
    script = tmp_path / "script.py"
    kwargs = dict(data=tiny[1], imgsz=64, batch_size=8, workers=0, epochs=1, noautoanchor=True)
    kwargs |= dict(log_every=2, project=str(tmp_path / "runs"))
    script.write_text(
        f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom yolo_min import trainer\n"
        f"res = trainer.run(**{kwargs!r})\n"
        "line = f\"RESULT {os.environ['RANK']} {res['epochs']} {res['save_dir']}\\n\"\n"
        "os.write(1, line.encode())  # one write: the ranks share the pipe\n"
    )
    cmd = [*TORCHRUN, str(script)]
    r = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "exp"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["exp"]
    # two processes share the pipe: a rank's line may land inside the other's output
    ranks = sorted(re.findall(r"RESULT (\d) ", r.stdout))
    assert ranks == ["0", "1"] and "2 rank(s)" in r.stdout, r.stdout[-3000:]
    assert f"RESULT 0 1 {run_dir}" in r.stdout
    assert len((run_dir / "results.csv").read_text().splitlines()) == 2
    assert (run_dir / "weights" / "last.pt").is_file()
