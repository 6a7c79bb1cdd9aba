"""The layout the README promises: only dist.py in yolo_min knows ranks; no test code in
train.py."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names |= {base} | {f"{base}.{a.name}".replace("..", ".") for a in node.names}
    return names


def test_the_library_is_rank_free():
    """yolo_min/*.py (but dist.py) import neither yolo_min.dist nor torch.distributed and read no
    rank variables: gathering, main-first and broadcasting happen in the entry scripts."""
    for f in sorted((ROOT / "yolo_min").glob("*.py")):
        if f.name == "dist.py":
            continue
        mods, text = imported_modules(f), f.read_text()
        assert not any(m.endswith("dist") or "torch.distributed" in m for m in mods), (f.name, mods)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            assert f'"{var}"' not in text, (f.name, var)


def test_entry_scripts_hold_no_test_hooks():
    for name in ("train.py", "val.py", "predict.py"):
        assert "YOLO_MIN_TEST" not in (ROOT / name).read_text(), name
