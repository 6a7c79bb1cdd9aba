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
