"""Shared test fixtures: paths to ../shared (skipping with a reason when it is absent), and small
generated datasets (tiny, small_shapes) for fast end-to-end runs."""

import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "yolov5"
DATA = SHARED / "data"


def pytest_configure(config):
    """The suite runs on the CPU wherever it runs (its runs use the default device, a GPU where
    there is one, and its 2-rank runs gloo); `pytest -m cuda` runs tests/test_cuda.py on a GPU."""
    if config.getoption("markexpr") != "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def need(path: Path) -> Path:
    """Return path, or skip the test when the read-only ../shared tree is not beside the repo."""
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared holds the reference fixtures and COCO samples)")
    return path


@pytest.fixture
def sigint_raises():
    """SIGINT raising KeyboardInterrupt as in a terminal, even where the suite was started with it
    ignored (a background job's SIGINT is SIG_IGN, and Python then keeps it so)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def fixtures_dir() -> Path:
    return need(FIXTURES)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A writable copy of ../shared/data (17 MB): runs write label caches beside the labels, and
    the suite never writes under ../shared."""
    copy = tmp_path_factory.mktemp("shared") / "data"
    shutil.copytree(need(DATA), copy)
    for path in copy.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    copy.chmod(0o755)
    return copy


def shared_state() -> dict:
    """Every file under ../shared with its size and modification time (empty when absent)."""
    files = sorted(p for p in SHARED.rglob("*") if p.is_file()) if SHARED.is_dir() else []
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def pytest_sessionstart(session):
    session.config.shared_before = shared_state()


def pytest_sessionfinish(session, exitstatus):
    """The suite fails if it added, changed or removed a file under ../shared."""
    before, after = session.config.shared_before, shared_state()
    changed = sorted(set(before.items()) ^ set(after.items()))
    if changed:
        names = sorted({name for name, _ in changed})
        print(f"\nthe suite changed {len(names)} file(s) under ../shared: {names[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def small_shapes(tmp_path_factory) -> str:
    """A 48-train / 16-val subset of the embedded shapes dataset (image lists in .txt files): a fast
    stand-in for `--data shapes` in multi-epoch and multi-process tests."""
    from yolo_min.datasets import load_data_config

    full = load_data_config("shapes")
    root = tmp_path_factory.mktemp("small_shapes")
    for split, n in (("train", 48), ("val", 16)):
        files = sorted(p for p in Path(full[split][0]).iterdir() if p.suffix == ".jpg")[:n]
        (root / f"{split}.txt").write_text("".join(f"{p}\n" for p in files))
    names = "".join(f"  {i}: {n}\n" for i, n in enumerate(full["names"]))
    (root / "small_shapes.yaml").write_text(
        f"path: {root}\ntrain: train.txt\nval: val.txt\nnames:\n{names}"
    )
    return str(root / "small_shapes.yaml")


def make_tiny(root: Path, n_train: int = 32, n_val: int = 8) -> Path:
    """A dataset of 64x64 images under root, one or two coloured rectangles each, 2 classes;
    returns its data yaml."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            im, rows = Image.new("RGB", (64, 64), (40, 40, 40)), []
            for _ in range(1 + i % 2):
                (x, y), (w, h) = rng.integers(2, 30, 2), rng.integers(14, 30, 2)
                c = int(rng.integers(0, 2))
                ImageDraw.Draw(im).rectangle(
                    [int(x), int(y), int(x + w), int(y + h)], fill=(220, 60, 60 + 160 * c)
                )
                rows.append(
                    f"{c} {(x + w / 2) / 64:.6f} {(y + h / 2) / 64:.6f} {w / 64:.6f} {h / 64:.6f}\n"
                )
            im.save(root / "images" / split / f"{i}.jpg")
            (root / "labels" / split / f"{i}.txt").write_text("".join(rows))
    yaml_path = root / "data.yaml"
    yaml_path.write_text(
        f"path: {root}\ntrain: images/train\nval: images/val\nnames: [red, blue]\n"
    )
    return yaml_path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> list[str]:
    """train.py arguments for a 32 + 8 image make_tiny dataset: 4 iterations an epoch at batch 8, in
    one process or two, so every run on it takes seconds."""
    data = make_tiny(tmp_path_factory.mktemp("tiny"))
    return [
        "--data",
        str(data),
        "--imgsz",
        "64",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--log-every",
        "2",
        "--noautoanchor",
    ]


def deny_image_open(monkeypatch, suffix: str) -> None:
    """Make PIL's Image.open raise PermissionError for files ending in `suffix`: tests run as root,
    who reads anything, so an unreadable image is simulated at the open() call."""
    real = Image.open

    def deny(f, *a, **k):
        if str(f).endswith(suffix):
            raise PermissionError(13, "Permission denied", str(f))
        return real(f, *a, **k)

    monkeypatch.setattr(Image, "open", deny)
