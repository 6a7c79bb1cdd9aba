"""README's Python snippets run as pasted, one after another in one folder (a snippet may read what
the one before wrote), with their epochs and image sizes scaled down."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the test scales down: a snippet's own numbers are README's
SCALED = {r"epochs=\d+": "epochs=1", r"imgsz=\d+": "imgsz=64"}


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_python_snippets():
    blocks = python_blocks()
    assert len(blocks) >= 3 and any("from yolo_min import YOLO" in b for b in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_snippet_runs(tmp_path_factory, index):
    folder = tmp_path_factory.getbasetemp() / "readme"
    folder.mkdir(exist_ok=True)
    code = python_blocks()[index]
    for pattern, value in SCALED.items():
        code = re.sub(pattern, value, code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README snippet {index}:\n{code}\n{r.stderr[-3000:]}"
