"""Hostile input to predict.py and val.py (and their Python faces): each crafted file or option is
made here, in tmp_path. Each must end in one line naming the file or option (exit 2 before any
work for a bad option, a named, skipped and counted image otherwise), write nothing outside the
run folder and leave the source files as they were (md5)."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, need
from PIL import Image

from yolo_min import YOLO, cli, datasets, dist, predictor, validator
from yolo_min.safe_load import load_model

BAD_OPTIONS = [
    ("--imgsz", "0", "--imgsz 0: must be from 32 to 8192"),
    ("--imgsz", "-64", "--imgsz -64: must be from 32 to 8192"),
    ("--imgsz", "20000", "--imgsz 20000: must be from 32 to 8192"),
    ("--batch-size", "0", "--batch-size 0: must be at least 1"),
    ("--batch-size", "-1", "--batch-size -1: must be at least 1"),
    ("--workers", "-1", "--workers -1: must be at least 0"),
    ("--max-det", "-1", "--max-det -1: must be at least 1"),
    ("--max-det", "0", "--max-det 0: must be at least 1"),
    ("--conf-thres", "1.5", "--conf-thres 1.5: must be from 0 to 1"),
    ("--conf-thres", "-0.1", "--conf-thres -0.1: must be from 0 to 1"),
    ("--conf-thres", "nan", "--conf-thres nan: must be from 0 to 1"),
    ("--iou-thres", "2", "--iou-thres 2.0: must be from 0 to 1"),
    ("--iou-thres", "-1", "--iou-thres -1.0: must be from 0 to 1"),
]


# ---------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def fx() -> Path:
    return need(FIXTURES / "predict")


@pytest.fixture(scope="module")
def det(fx):
    return load_model(fx / "det.pt")


def run_cli(monkeypatch, capsys, command: str, *args) -> tuple:
    """(exit code, stdout, stderr) of `python <command>.py args`, in this process."""
    entry = {"predict": predictor, "val": validator}[command]
    monkeypatch.setattr(sys, "argv", [f"{command}.py", *map(str, args)])
    code = 0
    try:
        cli.run_command(entry.main, entry.get_args_parser())
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def predict_cli(monkeypatch, capsys, weights, source, project, *more) -> tuple:
    """run_cli of predict.py on the CPU at --imgsz 64 into project/exp."""
    common = ["--weights", weights, "--source", source, "--project", project, "--device", "cpu"]
    return run_cli(monkeypatch, capsys, "predict", *common, "--imgsz", "64", *more)


def digests(folder: Path) -> dict:
    """{path relative to folder: md5} of every file below folder (through links)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_fifo():
            out[str(p.relative_to(folder))] = hashlib.md5(p.read_bytes()).hexdigest()
    return out


def only_run_folder_added(before: dict, after: dict, run: str) -> bool:
    """Whether the files added are all in the run folder and every earlier one is unchanged."""
    added = [k for k in after if k not in before]
    kept = all(after.get(k) == v for k, v in before.items())
    return kept and all(k.startswith(f"{run}/") for k in added)


@contextlib.contextmanager
def deadline(seconds: float):
    """TimeoutError instead of a hang: a blocking open() or endless walk is interrupted."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def copy_images(fx: Path, folder: Path, names: dict) -> None:
    """names: {new name: fixture image name} copied into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for new, old in names.items():
        shutil.copy(fx / "images" / old, folder / new)


def one_line_error(err: str, command: str, words: str) -> bool:
    return err.startswith(f"{command}.py: error: {words}") and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- 1: crops outside the run folder
def test_crop_folders_are_one_safe_component_each():
    names = ["/abs/dir", "../../x", "..", "a/b", "a_b", "Cat", "cat", "", " . ", "x" * 300, "ok 1"]
    want = ["_abs_dir", "_.._x", "class2", "a_b", "a_b_4", "Cat", "cat_6", "class7", "class8"]
    assert predictor.crop_folders(names) == [*want, "x" * 200, "ok 1"]
    assert predictor.crop_folders(["é/ü" * 100])[0].encode() == ("é_ü" * 40).encode()


def test_class_names_cannot_put_crops_outside(fx, det, tmp_path, monkeypatch, capsys):
    """A checkpoint's class names /abs/dir, ../../x and .. as crop folders: all crops land in
    crops/<safe name>/ of the run folder."""
    outside = tmp_path / "outside"
    model = load_model(fx / "det.pt")
    model.names = [str(outside), "../../escaped", ".."]
    weights = YOLO(model).save(tmp_path / "hostile.pt")
    copy_images(fx, tmp_path / "src", {"a.png": "sq00.png", "b.jpg": "sq01.jpg"})
    before = digests(tmp_path)
    code, out, err = predict_cli(
        monkeypatch, capsys, weights, tmp_path / "src", tmp_path / "runs", "--save-crop"
    )
    assert code == 0, err
    crops = tmp_path / "runs" / "exp" / "crops"
    folders = sorted(p.name for p in crops.iterdir())
    assert len(folders) >= 2 and set(folders) <= set(predictor.crop_folders(model.names))
    assert all(p.parent.parent == crops for p in crops.rglob("*.jpg"))
    assert only_run_folder_added(before, digests(tmp_path), "runs/exp")
    assert not outside.exists() and not (tmp_path / "escaped").exists()


# ---------------------------------------------------------------- 3: hangs in the sources
def test_fifos_are_never_read(fx, det, tmp_path, monkeypatch, capsys):
    """A FIFO named x.jpg in a source folder, or as the source: named, skipped, counted."""
    src = tmp_path / "src"
    copy_images(fx, src, {"good.png": "sq00.png"})
    os.mkfifo(src / "x.jpg")
    os.mkfifo(tmp_path / "alone.jpg")
    with deadline(60):
        code, out, err = predict_cli(monkeypatch, capsys, fx / "det.pt", src, tmp_path / "runs")
        (alone,) = predictor.predict(det, str(tmp_path / "alone.jpg"), imgsz=64)
    assert code == 0, err
    assert f"WARNING {src / 'x.jpg'}: unreadable (ValueError: not a regular file); skipped" in out
    assert "1 images, 1 skipped (named above)" in out
    assert sorted(p.name for p in (tmp_path / "runs" / "exp").iterdir()) == ["good.png"]
    assert alone["error"] == "unreadable (ValueError: not a regular file)"


def test_links_to_folders_are_walked_once(tmp_path, monkeypatch):
    """`**` through a folder linked into itself and into its parent (glob.glob: 2^40 paths) and
    a list naming one file five ways: each real file once, where it is first met."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name in ("good.png", "sub/b.png"):
        Image.new("RGB", (16, 16)).save(src / name)
    (src / "self").symlink_to(".")
    (src / "up").symlink_to("..")
    (src / "sub" / "back").symlink_to("..")
    same = ["good.png", "./good.png", "self/good.png", str(src / "good.png"), "sub/../good.png"]
    (src / "list.txt").write_text("\n".join(same) + "\n")
    monkeypatch.chdir(tmp_path)
    with deadline(30):
        walked = predictor.find_images(f"{src}/**/*.png")
        relative = predictor.find_images("src/**/*.png")
        listed = predictor.find_images(str(src / "list.txt"))
    assert walked == [str(src / "good.png"), str(src / "sub" / "b.png")]
    assert relative == ["src/good.png", "src/sub/b.png"]
    assert listed == [str(src / "good.png")]


# ---------------------------------------------------------------- 4, 8: numeric options
@pytest.mark.parametrize("command", ["predict", "val"])
def test_numbers_out_of_range_stop_before_any_work(tmp_path, monkeypatch, capsys, command):
    """Each option out of range, NaN too: exit 2, one line naming it, before the process group
    (so before the model: --weights names a file that does not exist), no run folder."""

    def no_work(*args, **kwargs):
        raise AssertionError("the options were not checked before the work began")

    monkeypatch.setattr(dist, "setup", no_work)
    common = ["--weights", tmp_path / "missing.pt", "--project", tmp_path / "runs"]
    if command == "predict":
        common += ["--source", tmp_path / "missing"]
        cases = [*BAD_OPTIONS, ("--line-width", "0", "--line-width 0: must be at least 1")]
    else:
        common += ["--data", tmp_path / "missing.yaml"]
        cases = BAD_OPTIONS
    for option, value, words in cases:
        code, _, err = run_cli(monkeypatch, capsys, command, *common, option, value)
        assert code == 2 and one_line_error(err, command, words), (option, value, err)
    assert sorted(os.listdir(tmp_path)) == []


def test_numbers_out_of_range_in_python(det, tmp_path):
    """validator.run, predictor.run, predictor.predict, YOLO.val and YOLO.predict: ValueError
    naming the option (TypeError for a value that is no number), before any work."""
    image = np.zeros((32, 32, 3), np.uint8)
    missing = dict(weights=str(tmp_path / "missing.pt"), project=str(tmp_path / "runs"))
    calls = {
        "validator.run": lambda **kw: validator.run(**missing, data="missing.yaml", **kw),
        "predictor.run": lambda **kw: predictor.run(**missing, source="missing", **kw),
        "predictor.predict": lambda **kw: predictor.predict(det, image, **kw),
        "YOLO.val": lambda **kw: YOLO(det).val(data="missing.yaml", **kw),
        "YOLO.predict": lambda **kw: YOLO(det).predict(image, stream=True, **kw),
    }
    for name, call in calls.items():
        for option, value, words in BAD_OPTIONS:
            number = float(value) if "thres" in option else int(value)
            with pytest.raises(ValueError, match=f"^{words}$"):
                call(**{option[2:].replace("-", "_"): number})
    with pytest.raises(TypeError, match="--imgsz '64': expected int"):
        predictor.predict(det, image, imgsz="64")
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- 5: 16-bit and float images
def test_to_rgb8_scales_wide_modes():
    """16-bit by >> 8, 32-bit integers as 16-bit (or >> 23 past 65535), floats in 0..1 by 255
    (else clipped, NaN 0); other modes as PIL's convert."""
    v = np.arange(256, dtype=np.uint8).reshape(16, 16)
    want = np.asarray(Image.fromarray(v).convert("RGB"))
    wide = {
        "I;16": Image.fromarray(v.astype(np.uint16) * 257),
        "I": Image.fromarray(v.astype(np.int32) * 257),
        "I past 16 bits": Image.fromarray(v.astype(np.int32) << 23),
        "F in 0..1": Image.fromarray(v.astype(np.float32) / 255),
        "F in 0..255": Image.fromarray(v.astype(np.float32)),
        "P": Image.fromarray(v).convert("P"),
        "RGBA": Image.fromarray(v).convert("RGBA"),
    }
    for kind, image in wide.items():
        assert np.array_equal(np.asarray(datasets.to_rgb8(image)), want), kind
    assert np.asarray(Image.fromarray(v.astype(np.uint16) * 257).convert("RGB")).min() == 0
    odd = np.array([[np.nan, -5.0, 300.0, 2.5]], np.float32)
    assert np.asarray(datasets.to_rgb8(Image.fromarray(odd)))[0, :, 0].tolist() == [0, 0, 255, 2]
    negative = Image.fromarray(np.array([[-7, 65535]], np.int32))
    assert np.asarray(datasets.to_rgb8(negative))[0, :, 0].tolist() == [0, 255]


def pattern_files(fx: Path, folder: Path) -> list[Path]:
    """A fixture image's grey pattern as an 8-bit PNG, a 16-bit PNG and a float TIFF in folder."""
    grey = np.asarray(Image.open(fx / "images" / "pair00.png").convert("L"))
    folder.mkdir()
    Image.fromarray(grey).save(folder / "a8.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(folder / "b16.png")
    Image.fromarray(grey.astype(np.float32) / 255).save(folder / "c_float.tif")
    files = [folder / "a8.png", folder / "b16.png", folder / "c_float.tif"]
    assert [Image.open(f).mode for f in files] == ["L", "I;16", "F"]
    return files


def test_16bit_and_float_files_load_as_8bit_in_training(fx, tmp_path):
    """YOLODataset (train and val) and the classifier's loader read a 16-bit PNG and a float TIFF
    of a pattern as its 8-bit PNG."""
    files = pattern_files(fx, tmp_path / "imgs")
    dataset = datasets.YOLODataset(str(tmp_path / "imgs"), imgsz=64, nc=3, verbose=False)
    assert dataset.im_files == list(map(str, files))
    loaded = [dataset.load_image(i)[0] for i in range(3)]
    assert all(torch.equal(im, loaded[0]) for im in loaded) and loaded[0].float().std() > 10
    rgb = [np.asarray(datasets.load_rgb(str(f))) for f in files]
    assert all(np.array_equal(im, rgb[0]) for im in rgb)


def test_16bit_and_float_files_predict_as_8bit(fx, det, tmp_path):
    """The 16-bit PNG and the float TIFF, as files and as PIL images, predict the same boxes as
    the 8-bit PNG."""
    files = pattern_files(fx, tmp_path / "imgs")
    sources = [*map(str, files), Image.open(files[1]), Image.open(files[2])]
    first, *others = predictor.predict(det, sources, imgsz=128)
    assert len(first["boxes"]) > 0
    for r in others:
        assert torch.equal(r["image"], first["image"]) and torch.equal(r["boxes"], first["boxes"])


# ---------------------------------------------------------------- 6: one image stops the run
@pytest.mark.slow
@pytest.mark.parametrize("weights,workers", [("det.pt", "0"), ("seg.pt", "2")])
def test_degenerate_images_do_not_stop_the_run(fx, tmp_path, monkeypatch, capsys, weights, workers):
    """5000 x 1, 1 x 3000 and 1 x 1 images (zero-area boxes) beside a broken one: all predicted,
    crops saved, predictions.json written; the broken one named, skipped and counted."""
    src = tmp_path / "src"
    copy_images(fx, src, {"a_good.png": "sq00.png"})
    for name, size in (("b_wide.png", (5000, 1)), ("c_tall.png", (1, 3000)), ("d_one.png", (1, 1))):
        Image.new("RGB", size, (200, 40, 40)).save(src / name)
    (src / "e_broken.jpg").write_bytes(b"\xff\xd8\xff not a JPEG")
    before = digests(tmp_path)
    saves = ["--save-crop", "--save-txt", "--save-json"]
    more = [*saves, "--conf-thres", "0.001", "--max-det", "5", "--workers", workers]
    code, out, err = predict_cli(monkeypatch, capsys, fx / weights, src, tmp_path / "runs", *more)
    assert code == 0, err
    assert f"WARNING {src / 'e_broken.jpg'}: unreadable (" in out
    assert "4 images, 1 skipped (named above)" in out
    run = tmp_path / "runs" / "exp"
    entries = json.loads((run / "predictions.json").read_text())
    assert [Path(e["file"]).name for e in entries] == sorted(os.listdir(src))[:4]
    assert all(len(e["detections"]) > 0 for e in entries)
    crops = [p.name for p in (run / "crops").rglob("*.jpg")]
    assert len(crops) == sum(len(e["detections"]) for e in entries)
    assert any(name.startswith("d_one_") for name in crops)
    assert only_run_folder_added(before, digests(tmp_path), "runs/exp")
    images = [Image.new("RGB", (5000, 1)), np.zeros((1, 1, 3), np.uint8), str(src / "a_good.png")]
    for r in YOLO(fx / weights).predict(images, imgsz=64, workers=int(workers)):
        assert "error" not in r and len(r["boxes"]) >= 0


def test_failures_after_decoding_are_named_and_skipped(fx, tmp_path, monkeypatch, capsys):
    """An image whose post-processing raises and one whose picture cannot be saved: each named,
    skipped and counted; the others' files and predictions.json are written."""
    src = tmp_path / "src"
    copy_images(fx, src, {"a.png": "sq00.png", "b.png": "sq01.jpg", "c.png": "wide00.png"})
    to_original = predictor.to_original
    draw = predictor.draw

    def post_processing(sample, **kw):
        if sample["path"].endswith("a.png"):
            raise RuntimeError("a mask the size of nothing")
        return to_original(sample=sample, **kw)

    def drawing(result, *args, **kwargs):
        if result["path"].endswith("b.png"):
            raise OSError("No space left on device")
        return draw(result, *args, **kwargs)

    monkeypatch.setattr(predictor, "to_original", post_processing)
    monkeypatch.setattr(predictor, "draw", drawing)
    more = ["--save-json", "--save-txt"]
    code, out, err = predict_cli(monkeypatch, capsys, fx / "det.pt", src, tmp_path / "runs", *more)
    assert code == 0, err
    why = "post-processing failed (RuntimeError: a mask the size of nothing); skipped"
    assert f"WARNING {src / 'a.png'}: {why}" in out
    why = "saving failed (OSError: No space left on device); skipped"
    assert f"WARNING {src / 'b.png'}: {why}" in out
    assert "1 images, 2 skipped (named above)" in out
    run = tmp_path / "runs" / "exp"
    assert [e["file"] for e in json.loads((run / "predictions.json").read_text())] == [
        str(src / "c.png")
    ]
    assert sorted(os.listdir(run)) == ["c.png", "labels", "predictions.json"]


# ---------------------------------------------------------------- 7: outputs overwritten
def test_repeated_names_are_kept_apart(fx, tmp_path, monkeypatch, capsys):
    """a/x.jpg, a/x.png, b/x.png (a .txt list, relative to its folder, read from elsewhere): their
    pictures, labels and crops are x, x_2, x_3; two emulated ranks write the same files."""
    data = tmp_path / "data"
    copy_images(fx, data / "a", {"x.jpg": "sq01.jpg", "x.png": "wide00.png"})
    copy_images(fx, data / "b", {"x.png": "tall00.png"})
    (data / "list.txt").write_text("a/x.jpg\na/x.png\nb/x.png\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    before = digests(tmp_path)
    more = ["--save-txt", "--save-crop", "--save-json", "--name", "one"]
    code, out, err = predict_cli(monkeypatch, capsys, fx / "det.pt", data / "list.txt", ".", *more)
    assert code == 0 and "3 images" in out, err
    run = Path("one")
    names = sorted(p.name for p in run.iterdir())
    assert names == ["crops", "labels", "predictions.json", "x.jpg", "x_2.png", "x_3.png"]
    entries = json.loads((run / "predictions.json").read_text())
    for stem, entry in zip(["x", "x_2", "x_3"], entries):
        picture = Image.open(run / f"{stem}{Path(entry['file']).suffix}")
        assert picture.size == (entry["width"], entry["height"])
        lines = (run / "labels" / f"{stem}.txt").read_text().splitlines()
        crops = [c for c in (run / "crops").rglob("*.jpg") if re.fullmatch(rf"{stem}_\d+", c.stem)]
        assert len(lines) == len(crops) == len(entry["detections"]) > 0, stem
    info = dist.DistInfo(0, 2, 2, torch.device("cpu"))
    monkeypatch.setattr(dist, "all_gather_object", lambda obj: [obj])
    for rank in (0, 1):
        monkeypatch.setattr(dist, "setup", lambda device: info._replace(rank=rank))
        more = ["--save-txt", "--save-crop", "--name", "two", "--exist-ok"]
        predict_cli(monkeypatch, capsys, fx / "det.pt", data / "list.txt", ".", *more)
    one, two = digests(run), digests(Path("two"))
    assert {k: v for k, v in one.items() if k != "predictions.json"} == two
    assert only_run_folder_added(before, digests(tmp_path), "elsewhere")


def test_a_run_folder_holding_sources_is_refused(fx, tmp_path, monkeypatch, capsys):
    """--project/--name onto the source folder (directly, through a link to it, or holding the
    .txt list): exit 2, one line, nothing written. A run folder with a link to a source image
    gets a file of its own there; the source stays as it was."""
    photos = tmp_path / "photos"
    copy_images(fx, photos, {"x.png": "sq00.png", "y.png": "sq01.jpg"})
    (tmp_path / "link").symlink_to("photos")
    (photos / "list.txt").write_text("x.png\n")
    before = digests(tmp_path)
    for name, source in (("photos", photos), ("link", photos), ("photos", photos / "list.txt")):
        more = ["--name", name, "--exist-ok"]
        code, _, err = predict_cli(monkeypatch, capsys, fx / "det.pt", source, tmp_path, *more)
        words = f"--project/--name: the run folder {tmp_path / name} holds the source file"
        assert code == 2 and one_line_error(err, "predict", words), err
    assert digests(tmp_path) == before and sorted(os.listdir(photos)) == [
        "list.txt",
        "x.png",
        "y.png",
    ]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "x.png").symlink_to(photos / "x.png")
    more = ["--name", "out", "--exist-ok"]
    code, _, err = predict_cli(
        monkeypatch, capsys, fx / "det.pt", photos / "x.png", tmp_path, *more
    )
    assert code == 0 and not (out_dir / "x.png").is_symlink(), err
    assert digests(photos) == {k[7:]: v for k, v in before.items() if k.startswith("photos/")}


# ---------------------------------------------------------------- 12: sources and the API
def test_a_path_is_one_source_and_the_mode_is_kept(fx, tmp_path):
    """predict(model, "img.png") is one image, a folder its images; the caller's model leaves
    predict and YOLO.predict (streamed too) in the mode it came in."""
    copy_images(fx, tmp_path, {"a.png": "sq00.png", "b.png": "sq01.jpg"})
    model = load_model(fx / "det.pt").train()
    (one,) = predictor.predict(model, str(tmp_path / "a.png"), imgsz=64)
    assert one["path"] == str(tmp_path / "a.png") and model.training
    assert [r["path"] for r in predictor.predict(model, tmp_path, imgsz=64)] == [
        str(tmp_path / "a.png"),
        str(tmp_path / "b.png"),
    ]
    assert model.training
    assert len(list(YOLO(model).predict(tmp_path / "b.png", stream=True, imgsz=64))) == 1
    assert model.training
    model.eval()
    predictor.predict(model, str(tmp_path / "a.png"), imgsz=64)
    assert not model.training


def test_a_binary_list_is_one_line(fx, tmp_path, monkeypatch, capsys):
    (tmp_path / "list.txt").write_bytes(b"\xff\xfe\x00 binary \x80\x81")
    code, _, err = predict_cli(monkeypatch, capsys, fx / "det.pt", tmp_path / "list.txt", tmp_path)
    words = f"--source {tmp_path / 'list.txt'}: cannot read the list (UnicodeDecodeError: "
    assert code == 2 and one_line_error(err, "predict", words), err
    assert sorted(os.listdir(tmp_path)) == ["list.txt"]


def corrupt_exif_jpeg(path: Path) -> None:
    """A JPEG whose EXIF tag 270 claims 1000 bytes past the end: PIL warns, naming no file."""
    entry = struct.pack("<HHII", 0x010E, 2, 1000, 26)
    ifd = struct.pack("<H", 1) + entry + struct.pack("<I", 0)
    exif = b"Exif\x00\x00II*\x00" + struct.pack("<I", 8) + ifd
    Image.new("RGB", (64, 48), (90, 90, 90)).save(path, exif=exif)


def test_pil_warnings_and_the_pixel_limit_name_the_file(fx, det, tmp_path, monkeypatch, capsys):
    """PIL's EXIF warning: a WARNING line naming the file (predict.py), an ImageWarning naming it
    (the API); an image over PIL's pixel limit: named, skipped, counted."""
    corrupt_exif_jpeg(tmp_path / "exif.jpg")
    copy_images(fx, tmp_path, {"big.png": "sq00.png"})
    with pytest.warns(predictor.ImageWarning, match=f"^{tmp_path / 'exif.jpg'}: Tag data larger"):
        (result,) = predictor.predict(det, str(tmp_path / "exif.jpg"), imgsz=64)
    named = f"{tmp_path / 'exif.jpg'}: Tag data larger than file. Skipping tag 270"
    assert result["warnings"] == [named] and "error" not in result
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 128 * 80)
    code, out, err = predict_cli(monkeypatch, capsys, fx / "det.pt", tmp_path, tmp_path / "runs")
    assert code == 0, err
    assert f"WARNING {named}" in out
    why = "unreadable (ValueError: 128x128 pixels, more than PIL's limit of 10,240); skipped"
    assert f"WARNING {tmp_path / 'big.png'}: {why}" in out
    assert "1 images, 1 skipped (named above)" in out
