"""Shared test fixtures: paths to ../shared (skipping with a reason when it is absent)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "yolov5"
DATA = SHARED / "data"


def need(path: Path) -> Path:
    """Return path, or skip the test when the read-only ../shared tree is not beside the repo."""
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared holds the reference fixtures and COCO samples)")
    return path


@pytest.fixture
def fixtures_dir() -> Path:
    return need(FIXTURES)


@pytest.fixture
def data_dir() -> Path:
    return need(DATA)


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
    (root / "small_shapes.yaml").write_text(f"path: {root}\ntrain: train.txt\nval: val.txt\nnames:\n{names}")
    return str(root / "small_shapes.yaml")


def deny_image_open(monkeypatch, suffix: str) -> None:
    """Make PIL's Image.open raise PermissionError for files ending in `suffix`: tests run as root, who
    reads anything, so an unreadable image is simulated at the open() call."""
    from PIL import Image
    real = Image.open

    def deny(f, *a, **k):
        if str(f).endswith(suffix):
            raise PermissionError(13, "Permission denied", str(f))
        return real(f, *a, **k)

    monkeypatch.setattr(Image, "open", deny)
