"""Hostile inputs on the training side: each crafted file or argument is made here (in tmp_path)
and must end in one line naming the file or option (exit code 2 before any work, or a warning and
a skipped file), leave what was already written as it was, and write nothing outside the run
folder; no input may hang a run or take unbounded memory.

Errors are checked in-process through cli.run_command (train.py's exit code and stderr line);
two tests launch train.py, where a second process or a signal to a process group is the point."""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import make_tiny  # noqa: E402

import train  # noqa: E402
from yolo_min import checkpoint, cli, datasets, files, labels, trainer  # noqa: E402
from yolo_min.models import CFG_DIR, Model, ModelEMA  # noqa: E402

PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if not k.startswith("YOLO_MIN_TEST_")}
ENV["OMP_NUM_THREADS"] = "1"
TINY_CFG = yaml.safe_load((CFG_DIR / "yolov5n.yaml").read_text()) | {"width_multiple": 0.0625}
# a billion laughs: 9 levels of 9 aliases, under 400 bytes, a billion strings once expanded
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread in-process, like the launched processes (2 CI cores, often shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_cli(monkeypatch, capsys, *argv) -> tuple[int, str, list[str]]:
    """train.py's command line in-process: (exit code, stdout, stderr lines); 0 if it trained."""
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, argv)])
    code = 0
    try:
        cli.run_command(trainer.main, trainer.get_args_parser(), errors=(cli.ConfigError,))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def refused(monkeypatch, capsys, *argv) -> str:
    """The one stderr line of a train.py command line that must exit 2."""
    code, _, err = train_cli(monkeypatch, capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("train.py: error: "), (code, err)
    return err[0]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (by relative path) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def make_run(run: Path, tiny, epochs: int = 2, args_edit=None, hyp_edit=None) -> Path:
    """A run folder as train.py leaves it after epoch 1 of `epochs` (a tiny model): args.yaml,
    hyp.yaml, results.csv, weights/last.pt; its args and hyp edited as given. Returns last.pt."""
    argv = [*tiny, "--epochs", str(epochs), "--project", str(run.parent), "--name", run.name]
    args = trainer.get_args_parser().parse_args(argv)
    trainer.check_args(args, "detect", 1)
    model = Model(TINY_CFG, nc=2)
    optimizer = trainer.build_optimizer(model, 0.01, 0.9, 0.0)
    scaler, ema = torch.amp.GradScaler("cuda", enabled=False), ModelEMA(model)
    hyp = trainer.load_hyp("") | (hyp_edit or {})
    opt = (optimizer, scaler, 0, (0.0, 0), args, hyp, [checkpoint.rng_state()])
    state = checkpoint.training_state(model, ema, *opt)
    state["args"] |= args_edit or {}
    (run / "weights").mkdir(parents=True)
    torch.save(state, run / "weights" / "last.pt")
    (run / "args.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))
    (run / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False))
    (run / "results.csv").write_text("epoch,train/box_loss\n1,0.1\n")
    return run / "weights" / "last.pt"


# ---------------------------------------------------------------- 2 resume writes only into a run
def test_resume_refuses_a_file_outside_a_run(tiny, tmp_path, monkeypatch, capsys):
    """--resume of a valid last.pt that is not <run>/weights/last.pt beside <run>/args.yaml: one
    line naming it, and the folders around it (a user's own args.yaml, results.csv) untouched."""
    user = tmp_path / "user"
    last = make_run(tmp_path / "src", tiny)
    # beside a folder of the user's, or in weights/ beside a user's own args.yaml, or elsewhere
    cases = [user / "some" / "dir" / "last.pt", user / "weights" / "last.pt", user / "ckpt.pt"]
    for path in cases:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(last.read_bytes())
    (user / "args.yaml").write_text("mine: 1\n")
    (user / "results.csv").write_text("mine\n")
    (user / "some" / "results.csv").write_text("mine\n")
    (user / "some" / "args.yaml").write_text("mine: 2\n")
    before = tree(user)
    for path in cases:
        line = refused(monkeypatch, capsys, "--resume", path)
        assert f"--resume {path}: not a run's weights/last.pt" in line, line
    assert tree(user) == before


def test_run_lock_refuses_a_live_holder_and_takes_a_stale_one(tiny, tmp_path, monkeypatch, capsys):
    """A run folder locked by a live process (its pid on this host): --resume and --exist-ok into it
    are refused naming the holder, nothing in the folder changes. Its holder gone (the pid ended),
    the lock is taken over; a torchrun restart's own dead predecessor (same run id, other host) is
    not a holder either; the lock is removed when the run ends, errs or is stopped."""
    last = make_run(tmp_path / "runs" / "exp", tiny)
    run = last.parent.parent
    lock = run / checkpoint.LOCK_FILE
    holder = subprocess.Popen(["sleep", "120"])
    try:
        lock.write_text(f"{holder.pid}\n{socket.gethostname()}\n\n")
        before = tree(run)
        line = refused(monkeypatch, capsys, "--resume", last)
        assert f"{run} is in use by another training (pid {holder.pid} on" in line, line
        argv = [*tiny, "--project", run.parent, "--name", "exp", "--exist-ok"]
        assert f"{run} is in use" in refused(monkeypatch, capsys, *argv)
        assert tree(run) == before
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: taken over (named in a warning), trained, released
    out = trainer.main(trainer.get_args_parser().parse_args(["--resume", str(last)]))
    assert out["epochs"] == 2 and not lock.exists()
    assert "was left by a training that is gone" in capsys.readouterr().out
    # a torchrun restart: the lock of this run id from a dead worker on another host is taken
    lock.write_text("4242\nother-host\nrun-7/training0\n")
    checkpoint.lock_run(run, "run-7/training0")
    assert lock.read_text().startswith(f"{os.getpid()}\n{socket.gethostname()}\n")
    checkpoint.release_locks()
    assert not lock.exists()
    lock.write_text("4242\nother-host\nrun-8/training0\n")  # another run's, on another host
    with pytest.raises(ValueError, match="in use by another training .pid 4242 on other-host"):
        checkpoint.lock_run(run, "run-7/training0")


def test_run_lock_is_released_on_errors_and_stops(tiny, tmp_path, monkeypatch):
    """The lock is released whatever ends the run: a ConfigError after it was taken (the resumed
    checkpoint's hyp) and a Ctrl-C in the first epoch."""
    last = make_run(tmp_path / "a", tiny, hyp_edit={"momentum": -1.0})
    with pytest.raises(cli.ConfigError, match="its hyp: momentum is -1"):
        trainer.main(trainer.get_args_parser().parse_args(["--resume", str(last)]))
    assert not (tmp_path / "a" / checkpoint.LOCK_FILE).exists()

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_one_epoch", stop)
    args = trainer.get_args_parser().parse_args([*tiny, "--project", str(tmp_path / "b")])
    with pytest.raises(trainer.Stopped) as e:
        trainer.main(args)
    run = tmp_path / "b" / "exp"
    assert e.value.args == (
        "SIGINT",
        f"no epoch was completed: {run} has no weights/last.pt to resume",
    )
    assert sorted(p.name for p in run.iterdir()) == [
        ".torchrun_id",
        "args.yaml",
        "hyp.yaml",
        "weights",
    ]
    assert not list((run / "weights").iterdir())


# ---------------------------------------------------------------- 3 only regular files, once each
def run_bounded(fn, unblock: list[Path], timeout: float = 60):
    """fn() on a thread; fails the test if it takes over timeout (then opens the FIFOs in unblock
    for writing, which releases a reader blocked on them)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for fifo in unblock:
            os.close(os.open(fifo, os.O_RDWR))
        pytest.fail(f"{fn} blocked for over {timeout} s")
    return box[0]


def test_label_files_that_are_no_regular_small_file_are_skipped(tmp_path, capsys):
    """A FIFO, a link to /dev/zero and an 11 MB (sparse) file as label files: each image named,
    skipped as corrupt and counted, the others used; nothing blocks or fills memory."""
    make_tiny(tmp_path, n_train=6, n_val=2)
    lbl = tmp_path / "labels" / "train"
    fifo = lbl / "0.txt"
    fifo.unlink()
    os.mkfifo(fifo)
    (lbl / "1.txt").unlink()
    (lbl / "1.txt").symlink_to("/dev/zero")
    with open(lbl / "2.txt", "r+b") as f:
        f.truncate(labels.MAX_LABEL_BYTES + 1_000_000)
    files_ = labels.list_images(str(tmp_path / "images" / "train"))
    keep, _, stats = run_bounded(lambda: labels.load_labels(files_, nc=2), [fifo])
    assert stats["corrupt"] == 3 and stats["found"] == 3 and len(keep) == 3
    out = capsys.readouterr().out.splitlines()
    for name, why in (("0", "a FIFO"), ("1", "a character device"), ("2", "over the size limit")):
        line = [ln for ln in out if f"label file {lbl / name}.txt unreadable" in ln]
        assert len(line) == 1 and why in line[0] and line[0].endswith("image skipped"), out
    assert (tmp_path / "labels" / "train.cache").is_file()


def test_folder_walks_read_each_real_file_once(tmp_path, capsys, monkeypatch):
    """ImageFolder (classification) and image folders (detection) through links to themselves, a
    link to a file already met and a FIFO: 8 files for 8, each opened once, the links and the FIFO
    counted in a warning."""
    root = tmp_path / "cls"
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(root / split / c / f"{i}.jpg")
    train = root / "train"
    (train / "a" / "loop").symlink_to(train)
    (train / "b" / "again").symlink_to(train / "b")
    (train / "b" / "dup.jpg").symlink_to(train / "a" / "0.jpg")
    os.mkfifo(train / "a" / "pipe.jpg")
    opened = []
    real_open = labels.Image.open
    monkeypatch.setattr(labels.Image, "open", lambda f, *a: opened.append(f) or real_open(f, *a))
    ds = run_bounded(
        lambda: datasets.ClassifyDataset(str(train), imgsz=32), [train / "a" / "pipe.jpg"]
    )
    assert len(ds.samples) == 8 and len(opened) == 8
    assert len({os.path.realpath(f) for f, _ in ds.samples}) == 8
    assert [k for _, k in ds.samples] == [0] * 4 + [1] * 4
    out = capsys.readouterr().out
    assert "WARNING 3 link(s) to a folder or file met before skipped" in out, out
    assert "WARNING 1 entries that are not regular files" in out and "pipe.jpg" in out
    found = run_bounded(lambda: labels.list_images(str(train)), [train / "a" / "pipe.jpg"])
    assert len(found) == 8


# ---------------------------------------------------------------- 4 yaml, label and size limits
def test_yaml_alias_bombs_and_huge_yamls_are_refused(tiny, tmp_path, monkeypatch, capsys):
    """--hyp, the data yaml and the model cfg are read by one reader: an alias bomb (or a yaml
    over 1 MB, or a FIFO) is one line naming the file, fast and small; no run folder."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    big = tmp_path / "big.yaml"
    big.write_text("lr0: 0.01\n" + "#" * files.MAX_YAML_BYTES)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    project = tmp_path / "runs"
    cases = {
        "--hyp": [bomb, big, fifo],
        "--data": [bomb, big, fifo],
        "--cfg": [bomb, big, fifo],
    }
    whats = {"--hyp": "--hyp", "--data": "data yaml", "--cfg": "model cfg"}
    for flag, paths in cases.items():
        for path, why in zip(paths, ("an alias (*a)", "over the size limit", "a FIFO")):
            t0 = time.time()
            line = refused(monkeypatch, capsys, *tiny, flag, path, "--project", project)
            assert f"{whats[flag]} {path}: " in line and why in line, line
            assert time.time() - t0 < 30
    assert not project.exists()


def test_shipped_yamls_read_as_before(data_dir, tmp_path):
    """Every shipped model cfg and recipe, and ../shared's data yamls, read as yaml.safe_load
    reads them (none uses an alias); YAML 1.2's exponent floats are numbers."""
    paths = [*CFG_DIR.glob("*.yaml"), *data_dir.glob("*.yaml")]
    assert len(paths) >= 19
    for path in paths:
        assert files.read_yaml(path) == yaml.safe_load(path.read_text()), path
    path = tmp_path / "floats.yaml"
    path.write_text("a: 1.0e9\nb: 1e-3\nc: 10\nd: '1e3'\ne: 2E+2\nf: x1e3\n")
    want = {"a": 1e9, "b": 1e-3, "c": 10, "d": "1e3", "e": 200.0, "f": "x1e3"}
    assert files.read_yaml(path) == want


def test_numeric_options_are_range_checked(tiny, tmp_path, monkeypatch, capsys):
    """--imgsz outside [32, 8192], --batch-size below 1, a negative --seed: one line naming the
    option, no run folder, no label cache (before any work)."""
    data = make_tiny(tmp_path / "d", n_train=4, n_val=2)
    project = tmp_path / "runs"
    cases = {
        "--imgsz 100000: must be in [32, 8192]": ["--imgsz", "100000"],
        "--imgsz 16: must be in [32, 8192]": ["--imgsz", "16"],
        "--batch-size 0: must be >= 1": ["--batch-size", "0"],
        "--batch-size -8: must be >= 1": ["--batch-size", "-8"],
        "--seed -1: must be >= 0": ["--seed", "-1"],
        "--epochs 0: must be >= 1": ["--epochs", "0"],
    }
    for msg, extra in cases.items():
        line = refused(monkeypatch, capsys, *tiny, "--data", data, "--project", project, *extra)
        assert line == f"train.py: error: {msg}", line
    assert not project.exists()
    assert not list((tmp_path / "d").rglob("*.cache"))


# ---------------------------------------------------------------- 9 accepted, then crashing
def test_freeze_that_leaves_nothing_to_train_is_refused(tiny, tmp_path, monkeypatch, capsys):
    project = tmp_path / "runs"
    every = [str(i) for i in range(25)]
    cases = {
        "--freeze 25: the model has 25 layers (0-24): no parameter would be trained": ["25"],
        "--freeze 100: the model has 25 layers (0-24): no parameter would be trained": ["100"],
        f"--freeze {' '.join(every)}: the model has 25 layers (0-24): no parameter": every,
        "--freeze 3 30: the model has 25 layers (0-24)": ["3", "30"],
        "--freeze -1: layer numbers are >= 0": ["-1"],
    }
    for msg, layers in cases.items():
        line = refused(monkeypatch, capsys, *tiny, "--freeze", *layers, "--project", project)
        assert msg in line, line
    assert not project.exists()


@pytest.mark.slow
def test_batches_of_one_image(tmp_path, monkeypatch, capsys):
    """Where BatchNorm cannot take one image (--imgsz 32: a 1x1 last feature map) a batch of one
    per rank is refused up front; an epoch's last batch of one image is dropped (said once) and the
    run trains; at --imgsz 64 nothing changes."""
    data = make_tiny(tmp_path / "d", n_train=9, n_val=2)
    common = ["--data", data, "--workers", "0", "--noautoanchor", "--epochs", "1"]
    line = refused(monkeypatch, capsys, *common, "--imgsz", "32", "--batch-size", "1")
    assert "--batch-size 1 per rank at --imgsz 32: BatchNorm cannot train on 1 image" in line
    args = ["--imgsz", "32", "--batch-size", "8", "--project", tmp_path / "runs"]
    code, out, _ = train_cli(monkeypatch, capsys, *common, *args)
    assert code == 0 and "epoch 1/1 [1/1]" in out and "[2/2]" not in out
    assert out.count("train: the last batch of each epoch, of 1 image, is dropped") == 1
    assert (tmp_path / "runs" / "exp" / "weights" / "last.pt").is_file()
    loader = datasets.build_dataloader(
        datasets.YOLODataset(str(tmp_path / "d" / "images" / "train"), imgsz=64, verbose=False),
        batch_size=8,
        workers=0,
    )[0]
    assert len(loader) == 2 and not loader.drop_last  # --imgsz 64: the recipe as it was


# ---------------------------------------------------------------- 10 the recipe's ranges
def test_every_recipe_key_has_a_range():
    for name in ("hyp.scratch-low.yaml", "hyp.cls.yaml"):
        keys = set(files.read_yaml(CFG_DIR / name))
        assert keys <= set(trainer.HYP_RANGES) | set(trainer.NOT_IMPLEMENTED), name
    yolov5 = "lr0 lrf momentum weight_decay warmup_epochs warmup_momentum warmup_bias_lr box cls"
    yolov5 += " cls_pw obj obj_pw iou_t anchor_t fl_gamma hsv_h hsv_s hsv_v degrees translate"
    yolov5 += " scale shear perspective flipud fliplr mosaic mixup copy_paste"
    assert set(yolov5.split()) <= set(trainer.load_hyp(""))  # yolov5's hyp files load
    for key, bounds in trainer.HYP_RANGES.items():
        for name in ("hyp.scratch-low.yaml", "hyp.cls.yaml"):
            default = files.read_yaml(CFG_DIR / name).get(key)
            assert default is None or trainer.in_range(default, bounds), (key, default)


def test_hyp_values_out_of_range_are_refused(tiny, tmp_path, monkeypatch, capsys):
    """Each value torch rejects and each that trains on garbage: one line naming the key, the value
    and its range, before any work (no label cache, no run folder); a key yolo_min does not
    implement is refused unless 0; YAML 1.2's 1.0e9 is the number."""
    cases = {
        "lr0: -1": "lr0 is -1, outside its range (0, 1]",
        "momentum: -1": "momentum is -1, outside its range (0, 1)",
        "label_smoothing: 2": "label_smoothing is 2, outside its range [0, 1)",
        "anchor_t: 0": "anchor_t is 0, outside its range (1, 100]",
        "lrf: -1": "lrf is -1, outside its range [0, 1]",
        "anchor_t: -1": "anchor_t is -1, outside its range (1, 100]",
        "obj_pw: -1": "obj_pw is -1, outside its range (0, 100]",
        "fl_gamma: 1e6": "fl_gamma is 1e+06, outside its range [0, 10]",
        "lr0: 1.0e9": "lr0 is 1e+09, outside its range (0, 1]",
        "mixup: 0.5": "mixup is 0.5: not implemented by yolo_min (only 0 is accepted)",
        "copy_paste: 0.1": "copy_paste is 0.1: not implemented by yolo_min (only 0 is accepted)",
        "hsv_s: .nan": "hsv_s is nan, not a finite number",
    }
    with pytest.raises(cli.ConfigError, match=r"^--hyp: momentum is -1, outside its range"):
        trainer.load_hyp({"momentum": -1}, "classify")
    assert trainer.load_hyp({"mixup": 0, "copy_paste": 0.0})["mixup"] == 0.0
    data = make_tiny(tmp_path / "d", n_train=4, n_val=2)
    hyp = tmp_path / "hyp.yaml"
    project = tmp_path / "runs"
    for text, msg in cases.items():
        hyp.write_text(text + "\n")
        argv = [*tiny, "--data", data, "--hyp", hyp, "--project", project]
        assert refused(monkeypatch, capsys, *argv) == f"train.py: error: --hyp {hyp}: {msg}"
    hyp.write_text("lr0: 1.0e-2\nmixup: 0\n")
    assert trainer.load_hyp(str(hyp))["lr0"] == 0.01
    assert not project.exists() and not list((tmp_path / "d").rglob("*.cache"))


# ---------------------------------------------------------------- 11 an edited checkpoint's args
def test_edited_checkpoint_arguments_are_checked(tiny, tmp_path, monkeypatch, capsys):
    """A last.pt whose args or hyp were edited: the same checks as the command line's, one line
    naming the checkpoint and the option, nothing in its run folder changed."""
    cases = {
        "its option freeze=[]: expected a list of int": dict(args_edit={"freeze": []}),
        "its option optimizer='LBFGS': expected one of SGD": dict(args_edit={"optimizer": "LBFGS"}),
        "its --imgsz 100000: must be in [32, 8192]": dict(args_edit={"imgsz": 100000}),
        "its --freeze 40: the model has 25 layers": dict(args_edit={"freeze": [40]}),
        "its option epochs=1.5: expected int": dict(args_edit={"epochs": 1.5}),
        "its hyp: momentum is -1, outside its range (0, 1)": dict(hyp_edit={"momentum": -1.0}),
    }
    for i, (msg, edits) in enumerate(cases.items()):
        last = make_run(tmp_path / f"run{i}", tiny, **edits)
        before = tree(last.parent.parent)
        line = refused(monkeypatch, capsys, "--resume", last)
        assert line.startswith(f"train.py: error: --resume: {last}: {msg}"), line
        assert tree(last.parent.parent) == before


# ---------------------------------------------------------------- 12 errors that name the file
def test_errors_name_the_file(tiny, tmp_path, monkeypatch, capsys):
    """A binary --hyp, a binary .txt image list, a FIFO --hyp: one line naming the file."""
    binary = b"\x89PNG\r\n\x1a\n\x00\xff"
    (tmp_path / "hyp.yaml").write_bytes(binary)
    (tmp_path / "list.txt").write_bytes(binary)
    data = make_tiny(tmp_path / "d", n_train=4, n_val=2)
    lists = tmp_path / "lists.yaml"
    lists.write_text(f"path: {tmp_path / 'd'}\ntrain: {tmp_path / 'list.txt'}\nval: images/val\n")
    lists.write_text(lists.read_text() + "names: [red, blue]\n")
    project = tmp_path / "runs"
    line = refused(monkeypatch, capsys, *tiny, "--hyp", tmp_path / "hyp.yaml", "--project", project)
    assert f"--hyp {tmp_path / 'hyp.yaml'}: not UTF-8 text (byte 0x89 at offset 0)" in line
    line = refused(monkeypatch, capsys, *tiny, "--data", lists, "--project", project)
    assert f"train: image list {tmp_path / 'list.txt'}: not UTF-8 text" in line, line
    assert not project.exists() and data.is_file()


def test_resume_warnings_name_only_flags_given(tiny, tmp_path, capsys):
    """Bare --resume --project P uses P (no warning about it); a torchrun restart's arguments are
    the run's own (no warning); an explicit --resume with other flags names them."""
    last = make_run(tmp_path / "runs" / "exp", tiny)
    ckpt = checkpoint.load(last)
    parser = trainer.get_args_parser()
    bare = parser.parse_args(["--resume", "--project", str(tmp_path / "runs")])
    trainer.resumed_args(bare, str(last), ckpt)
    restart = parser.parse_args([*tiny, "--epochs", "2", "--project", str(tmp_path / "runs")])
    trainer.resumed_args(restart, str(last), ckpt)
    assert "warning" not in capsys.readouterr().out
    given = parser.parse_args(["--resume", str(last), "--project", "elsewhere", "--epochs", "9"])
    trainer.resumed_args(given, str(last), ckpt)
    out = capsys.readouterr().out
    assert "ignoring --epochs, --project" in out and len(out.splitlines()) == 1


def test_python_options_of_the_wrong_type_are_type_errors(tmp_path):
    project = str(tmp_path / "runs")
    cases = {"data": 1, "imgsz": [64], "epochs": 1.5, "freeze": 3, "batch_size": True}
    for name, value in cases.items():
        with pytest.raises(TypeError, match=f"option {name}="):
            trainer.run(**{name: value}, project=project)
    with pytest.raises(ValueError, match="option optimizer='LBFGS'"):
        trainer.run(optimizer="LBFGS", project=project)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- 13 stops
def test_bare_resume_never_continues_an_older_run(tiny, tmp_path, monkeypatch, capsys):
    """The newest run under --project has no last.pt (stopped in its first epoch): bare --resume
    refuses naming it instead of continuing an older run."""
    project = tmp_path / "runs"
    old = make_run(project / "exp", tiny)
    new = project / "exp2"
    (new / "weights").mkdir(parents=True)
    (new / "args.yaml").write_bytes((old.parents[1] / "args.yaml").read_bytes())
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    os.utime(old.parent.parent / "args.yaml", (hour_ago, hour_ago))
    before = tree(project)
    line = refused(monkeypatch, capsys, "--resume", "--project", project)
    assert f"the newest run under {project}, {new}, has no weights/last.pt" in line, line
    assert tree(project) == before


def test_checkpoint_is_written_before_the_results_row(tiny, tmp_path, monkeypatch, sigint_raises):
    """A Ctrl-C that arrives as an epoch's last.pt is written takes effect after the checkpoint and
    its results.csv row: the row and the checkpoint agree; a row lost by a kill between the two is
    restored from the checkpoint by --resume."""
    real_save = checkpoint.save

    def interrupted(state, path):
        if Path(path).name == "last.pt":
            assert not (Path(path).parents[1] / "results.csv").exists()  # the checkpoint first
            os.kill(os.getpid(), signal.SIGINT)
        real_save(state, path)

    monkeypatch.setattr(checkpoint, "save", interrupted)
    args = trainer.get_args_parser().parse_args(
        [*tiny, "--project", str(tmp_path), "--epochs", "2"]
    )
    with pytest.raises(trainer.Stopped) as e:
        trainer.main(args)
    assert e.value.args == ("SIGINT", "weights/last.pt holds the last completed epoch")
    run = tmp_path / "exp"
    rows = (run / "results.csv").read_text().splitlines()
    ckpt = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 0 and [r.split(",")[0] for r in rows[1:]] == ["1"]
    assert not (run / checkpoint.LOCK_FILE).exists()
    # killed after last.pt, before its row: the resume restores the rows the checkpoint holds
    (run / "results.csv").write_text(rows[0] + "\n")
    monkeypatch.setattr(checkpoint, "save", real_save)
    last = run / "weights" / "last.pt"
    trainer.main(trainer.get_args_parser().parse_args(["--resume", str(last)]))
    rows = (run / "results.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["epoch", "1", "2"]


def test_stop_line_is_printed_once_by_rank_0(monkeypatch, capsys):
    """train.py's stop line comes from rank 0 only (torchrun stops every rank); exit 130 or 143."""
    note = "weights/last.pt holds the last completed epoch"
    for rank, sig, code in (("0", "SIGINT", 130), ("1", "SIGINT", 130), ("0", "SIGTERM", 143)):
        monkeypatch.setenv("RANK", rank)

        def stopped(*args, sig=sig, **kwargs):
            raise trainer.Stopped(sig, note)

        monkeypatch.setattr(cli, "run_command", stopped)
        with pytest.raises(SystemExit) as e:
            train.main()
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == code
        assert err == ([f"train.py: stopped by {sig}; {note}"] if rank == "0" else []), err


@pytest.mark.slow
def test_a_second_process_is_refused_and_sigterm_to_the_group_is_one_line(tiny, tmp_path):
    """train.py --resume runs (loader workers on); a second --resume of the same run, in this
    process, is refused naming the first's pid; then SIGTERM to the first's process group (as
    timeout, systemd and SLURM send it): exit 143, one line on stderr (no worker traceback), the
    lock released, last.pt and results.csv as they were."""
    # 16 iterations an epoch, 2 loader workers, a line each iteration (resumed: the run's own)
    edit = {"batch_size": 2, "workers": 2, "log_every": 1, "cache": "off"}
    last = make_run(tmp_path / "runs" / "exp", tiny, epochs=50, args_edit=edit)
    run = last.parent.parent
    before = tree(run)
    p = subprocess.Popen(
        [PY, ROOT / "train.py", "--resume", last, "--device", "cpu"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in p.stdout:
            if line.startswith("epoch 2/50 [2/16]"):
                break
        # Stopped, the run stays mid-epoch however slowly this test goes: a loaded machine
        # otherwise lets it finish the epoch and save before SIGTERM comes.
        os.killpg(p.pid, signal.SIGSTOP)
        with pytest.raises(ValueError, match=rf"{run} is in use by another training .pid {p.pid} "):
            checkpoint.find_resume(
                trainer.get_args_parser().parse_args(["--resume", str(last)]), None
            )
        os.killpg(p.pid, signal.SIGTERM)
        os.killpg(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 143, err[-3000:]
    assert err.strip().splitlines() == [
        "train.py: stopped by SIGTERM; weights/last.pt holds the last completed epoch"
    ], err[-3000:]
    after = tree(run)
    assert not (run / checkpoint.LOCK_FILE).exists()
    for name in ("weights/last.pt", "results.csv"):
        assert after[name] == before[name], name


def test_a_worker_stopped_inside_a_lock_it_shares_releases_it_before_it_exits():
    """SIGTERM reaches a data worker while it holds the lock of a multiprocessing Event (as the
    DataLoader's done event, which the main process sets to end the workers): the worker exits,
    with code 0, only once it has let the lock go, so the main process can still take it."""
    context = multiprocessing.get_context("fork")
    event = context.Event()
    condition = event._cond
    # A sleeper that never wakes: set() then waits for it inside the lock.
    condition._sleeping_count.release()

    def worker():
        datasets.yield_cpu(0)
        event.set()

    p = context.Process(target=worker)
    p.start()
    try:
        # set() hands the sleeper its wake-up only while holding the lock
        assert condition._wait_semaphore.acquire(timeout=60)
        os.kill(p.pid, signal.SIGTERM)
        time.sleep(1)
        assert p.is_alive()
        # the sleeper wakes: set() returns, the lock is let go and the worker exits
        condition._woken_count.release()
        p.join(timeout=60)
        assert p.exitcode == 0
        assert condition._lock.acquire(timeout=10)
        condition._lock.release()
    finally:
        if p.is_alive():
            p.kill()


def test_a_worker_is_quiet_when_its_main_process_breaks_a_transfer_off():
    """A data worker hands each batch's shared memory over a socket served by a thread; a main
    process stopped mid-handshake breaks that connection, which the thread reports through
    sys.excepthook: a worker prints nothing for it, and still prints any other error."""
    script = """
import os, socket, sys
from multiprocessing import resource_sharer
from yolo_min import datasets
datasets.yield_cpu(0)
resource_sharer.DupFd(0)
client = socket.socket(socket.AF_UNIX)
client.connect(resource_sharer._resource_sharer._address)
client.close()
# the thread serves connections in turn: this one's fd arrives once the broken one was handled
os.close(resource_sharer.DupFd(0).detach())
sys.excepthook(ValueError, ValueError("any other error"), None)
"""
    p = subprocess.run([PY, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == ["ValueError: any other error"]
    checkpoint.release_locks()
