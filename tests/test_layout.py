"""The layout the README promises: one engine, two faces. The loops live in yolo_min's engine
modules (the only ones that know ranks, through dist.py); train.py, val.py and predict.py are thin
command lines over them and import no other entry script; nothing launches processes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ("train.py", "val.py", "predict.py")
# the engine: the loops, the command-line plumbing and the Python face
ENGINE = ("dist.py", "trainer.py", "validator.py", "predictor.py", "cli.py", "yolo.py")


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
    """yolo_min's networks, losses, data, metrics and ops import neither yolo_min.dist nor
    torch.distributed and read no rank variables: only the engine modules do."""
    library = [f for f in sorted((ROOT / "yolo_min").glob("*.py")) if f.name not in ENGINE]
    assert {f.name for f in library} >= {"models.py", "losses.py", "datasets.py", "ops.py"}
    for f in library:
        mods, text = imported_modules(f), f.read_text()
        assert not any(m.endswith("dist") or "torch.distributed" in m for m in mods), (f.name, mods)
        assert not any(m.split(".")[-1] in ("trainer", "validator", "predictor") for m in mods)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            assert f'"{var}"' not in text, (f.name, var)


def test_entry_scripts_are_thin_and_import_no_other_entry():
    for name in ENTRIES:
        tree = ast.parse((ROOT / name).read_text())
        mods = imported_modules(ROOT / name)
        assert not mods & {"train", "val", "predict"}, (name, mods)
        assert "YOLO_MIN_TEST" not in (ROOT / name).read_text(), name
        # no loop of their own: the functions they define are the command line's
        loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))]
        assert not loops, name


def test_nothing_launches_processes():
    """The user's script is the DDP program: no subprocess, no multiprocessing launcher, no port
    search, no temporary launcher file anywhere in yolo_min or the entry scripts."""
    files = [*sorted((ROOT / "yolo_min").glob("*.py")), *(ROOT / n for n in ENTRIES)]
    for f in files:
        mods = imported_modules(f)
        assert not mods & {"subprocess", "multiprocessing", "tempfile"}, (f.name, mods)
        assert not any(m.startswith(("torch.multiprocessing", "multiprocessing.")) for m in mods)
        text = f.read_text()
        for word in ("Popen", "mp.spawn", "find_free_port", "os.system", "bind(("):
            assert word not in text, (f.name, word)
