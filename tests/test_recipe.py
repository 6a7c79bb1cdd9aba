"""train.py's recipe and flags, checked from the outside: the command line, train.main's return
value, the files a run writes (results.csv, weights/*.pt, args.yaml) and the lines it prints.

These tests pin behaviour, not internals, so that a refactor of train.py (builders, the epoch loop,
the checkpoint code) that changes what a user sees fails here.
Runs are tiny (64-pixel images, a few iterations an epoch, --workers 0) and in-process unless an
exit code or stderr is the point.
"""

import csv
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import make_tiny  # noqa: E402

from yolo_min import trainer  # noqa: E402
from yolo_min.models import Model  # noqa: E402
from yolo_min.safe_load import load_model  # noqa: E402

PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if not k.startswith("YOLO_MIN_TEST_")}
ENV["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread in-process, like the launched processes (2 CI cores, often shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_train(*argv) -> dict:
    return trainer.main(trainer.get_args_parser().parse_args([str(a) for a in argv]))


def cli(cmd, timeout: float = 300) -> tuple[int, str, str]:
    """Run cmd from the repo root in its own session: (exit code, stdout, stderr); on a timeout the
    whole process group (torchrun and its workers) is killed and the test fails."""
    p = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {cmd}\n{out[-2000:]}\n{err[-3000:]}")
    return p.returncode, out, err


def read_csv(run: Path) -> list[dict]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def epochs_in_csv(run: Path) -> list[str]:
    return [r["epoch"] for r in read_csv(run)]


def fitness(row: dict) -> float:
    """A results.csv row's box fitness: 0.1 mAP50 + 0.9 mAP50-95 (detection runs)."""
    return 0.1 * float(row["metrics/mAP50(B)"]) + 0.9 * float(row["metrics/mAP50-95(B)"])


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def stop_in_epoch_2(monkeypatch) -> None:
    """Make a run stop as epoch 2 starts (as a kill would), once epoch 1's checkpoints are
    written."""
    real = trainer.train_one_epoch

    def one_epoch(training, setup, epoch, **kwargs):
        if epoch == 1:
            raise KeyboardInterrupt("test stop")
        return real(training, setup, epoch, **kwargs)

    monkeypatch.setattr(trainer, "train_one_epoch", one_epoch)


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory) -> Path:
    """The folder of a finished 1-epoch run on the tiny dataset (tests copy it to change it)."""
    return Path(
        run_train(*tiny, "--epochs", "1", "--project", tmp_path_factory.mktemp("fin"))["save_dir"]
    )


@pytest.fixture(scope="module")
def unfinished(tiny, tmp_path_factory) -> Path:
    """The folder of a 2-epoch run on the tiny dataset that failed at epoch 2's first iteration
    (train.py's test-only fault hook): last.pt holds epoch 1 (tests copy it before changing it)."""
    project = tmp_path_factory.mktemp("unfin")
    with pytest.MonkeyPatch.context() as mp:
        stop_in_epoch_2(mp)
        with pytest.raises(KeyboardInterrupt, match="test stop"):
            run_train(*tiny, "--epochs", "2", "--project", project)
    run = project / "exp"
    assert load(run / "weights" / "last.pt")["epoch"] == 0 and epochs_in_csv(run) == ["1"]
    return run


# ---------------------------------------------------------------- the learning-rate schedule
LR0, LRF, WARMUP_BIAS_LR = 0.02, 0.1, 0.1  # the hyp file below; warmup_bias_lr is the default
N_TRAIN, EPOCHS = 13, 10  # batch 1: 13 iterations an epoch, warmup ends in epoch 8


def expected_lrs(epoch: int, epochs: int, nb: int, cos: bool) -> list[float]:
    """lr of groups 0 (biases), 1 and 2 at the last iteration of `epoch` (0-based), by hand:
    warmup (>= 100 iterations) from warmup_bias_lr (biases) or 0 (others) to lr0 * lf(epoch),
    then lr0 * lf(epoch); lf linear (1 - e/E)(1 - lrf) + lrf, or cosine
    ((1 - cos(e pi/E))/2)(lrf - 1) + 1."""
    if cos:
        lf = (1 - math.cos(epoch * math.pi / epochs)) / 2 * (LRF - 1) + 1
    else:
        lf = (1 - epoch / epochs) * (1 - LRF) + LRF
    nw = max(round(0.0 * nb), 100)  # warmup_epochs 0: still 100 iterations
    ni = nb * (epoch + 1) - 1  # the epoch's last iteration
    if ni > nw:
        return [LR0 * lf] * 3
    bias = float(np.interp(ni, [0, nw], [WARMUP_BIAS_LR, LR0 * lf]))
    return [bias] + [float(np.interp(ni, [0, nw], [0.0, LR0 * lf]))] * 2


@pytest.mark.slow
@pytest.mark.parametrize("cos", [False, True], ids=["linear", "cos"])
def test_results_csv_lr_is_the_schedule(tmp_path_factory, tmp_path, cos):
    """Every lr/pg0..2 value in results.csv is the hand-computed schedule, through the warmup (7
    epochs) and after it (3 epochs); --hyp's values reach the schedule and args.yaml."""
    root = tmp_path_factory.mktemp("tiny13")
    data = make_tiny(root, n_train=N_TRAIN, n_val=2)
    (root / "hyp.yaml").write_text(f"lr0: {LR0}\nlrf: {LRF}\nwarmup_epochs: 0\n")
    flags = (
        f"--epochs {EPOCHS} --imgsz 64 --batch-size 1 --workers 0 --noautoanchor --noval --nosave"
    )
    flags += " --cos-lr" if cos else ""
    out = run_train(
        "--data", data, "--hyp", root / "hyp.yaml", *flags.split(), "--project", tmp_path
    )
    run = Path(out["save_dir"])
    rows = read_csv(run)
    assert [r["epoch"] for r in rows] == [str(e + 1) for e in range(EPOCHS)]
    warm = [N_TRAIN * (e + 1) - 1 <= 100 for e in range(EPOCHS)]
    assert sum(warm) >= 3 and EPOCHS - sum(warm) >= 3  # the setup checks both phases
    for e, row in enumerate(rows):
        got = [float(row[f"lr/pg{j}"]) for j in range(3)]
        assert got == pytest.approx(expected_lrs(e, EPOCHS, N_TRAIN, cos), rel=1e-9, abs=1e-15), e
    hyp = yaml.safe_load((run / "hyp.yaml").read_text())  # the recipe the run used
    assert hyp["lr0"] == LR0 and hyp["lrf"] == LRF and hyp["warmup_epochs"] == 0
    assert hyp["momentum"] == 0.937  # the keys not in the file keep their defaults
    assert yaml.safe_load((run / "args.yaml").read_text())["cos_lr"] is cos


# ---------------------------------------------------------------- AutoAnchor
def test_autoanchor_writes_grid_units(capsys):
    """Labels no default anchor can recall at thr 2 (5x40 and 40x5 pixels at imgsz 64): AutoAnchor
    re-fits; the head's anchors buffer holds grid units (pixels / stride): buffer * stride gives the
    pixel anchors it printed, and those recall the label sizes in pixels."""
    thr, imgsz = 2.0, 64
    sizes = np.array([[5.0, 40.0], [40.0, 5.0], [20.0, 20.0]])  # pixels at imgsz
    orig_hw = (96, 128)  # images are 128x96: pixel sizes at imgsz are half the original ones
    gain = imgsz / max(orig_hw)
    norm = sizes / gain / np.array([orig_hw[1], orig_hw[0]])

    class Labels:
        labels = [{"bboxes": np.array([[0.5, 0.5, *wh] for wh in norm] * 4), "shape": orig_hw}] * 6

    model = Model("yolov5n.yaml", nc=1)
    stride = model.stride.view(-1, 1, 1)

    def bpr(anchors_px: np.ndarray, wh: np.ndarray) -> float:  # a box is recallable by an anchor
        r = wh[:, None] / anchors_px[None]  # when both its w and h ratios lie in (1/thr, thr)
        return float(((r > 1 / thr) & (r < thr)).all(2).any(1).mean())

    before = (model.head.anchors * stride).view(-1, 2).numpy()
    assert bpr(before, sizes) < 0.5  # the default anchors (10..373 px) miss the thin boxes
    trainer.autoanchor(model, Labels(), thr, SimpleNamespace(imgsz=imgsz, seed=0))
    line = [ln for ln in capsys.readouterr().out.splitlines() if "new anchors" in ln]
    assert len(line) == 1, line
    printed = np.array(re.findall(r"(\d+),(\d+)", line[0].split(":", 2)[-1]), float)
    assert printed.shape == (9, 2)
    anchors = model.head.anchors.detach()
    pixels = (anchors * stride).view(-1, 2).numpy()
    assert np.abs(pixels - printed).max() <= 0.5 + 1e-4  # printed rounded to whole pixels
    for k in (1.0, 0.9, 1.1):  # the sizes and training's scale jitter
        assert bpr(pixels, sizes * k) > 0.98, k
    assert (anchors <= imgsz / stride).all()  # grid units: none spans more cells than the image


# ---------------------------------------------------------------- flags
@pytest.mark.slow
def test_patience_stops_when_fitness_stops_improving(tiny, tmp_path, capsys):
    """--patience 2: the run stops at the first epoch 2 epochs after the best one (an equal fitness
    counts as an improvement), says so, and results.csv has fewer rows than --epochs. A constant
    fitness never stops a run (every epoch ties the best), so this setup relies on the fitness of
    the untrained model's first epoch falling as training starts."""
    out = run_train(*tiny, "--epochs", "8", "--patience", "2", "--project", tmp_path)
    rows = read_csv(Path(out["save_dir"]))
    fit = [fitness(r) for r in rows]
    best_f, best, stop = 0.0, 0, None
    for e, f in enumerate(fit):
        if f >= best_f:
            best_f, best = f, e
        if e - best >= 2:
            stop = e
            break
    assert stop is not None, f"fitness never fell for 2 epochs; the test needs a new setup: {fit}"
    assert len(rows) == stop + 1 < 8 and out["epochs"] == stop + 1
    lines = capsys.readouterr().out.splitlines()
    early = [ln for ln in lines if "Early stop" in ln]
    assert len(early) == 1 and f"epoch {best + 1}" in early[0], early
    assert any(ln.startswith("Validating") and ln.endswith("best.pt") for ln in lines)
    assert out["metrics"]["fitness"] == pytest.approx(fit[best])  # best.pt validated again


@pytest.mark.slow
def test_noval_validates_the_final_epoch_only(tiny, tmp_path):
    out = run_train(*tiny, "--epochs", "3", "--noval", "--project", tmp_path)
    run = Path(out["save_dir"])
    rows = read_csv(run)
    metrics = [k for k in rows[0] if k.startswith("metrics/")]
    assert [r["epoch"] for r in rows] == ["1", "2", "3"] and len(metrics) == 4
    assert all(r[k] == "" for r in rows[:2] for k in metrics)
    assert all(math.isfinite(float(rows[2][k])) for k in metrics)
    assert all(math.isfinite(float(r["train/box_loss"])) for r in rows)
    assert load(run / "weights" / "last.pt")["epoch"] == 2
    assert load(run / "weights" / "best.pt")["epoch"] == 2  # the only validated epoch is the best


@pytest.mark.slow
def test_nosave_writes_the_final_checkpoint_only(tiny, tmp_path, monkeypatch):
    """--nosave: no checkpoint before the final epoch; then last.pt, and best.pt only if the final
    epoch is the best one (else the final validation uses last.pt)."""
    saved, real_save = [], torch.save

    def spy(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj:
            saved.append(obj["epoch"])
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    out = run_train(*tiny, "--epochs", "3", "--nosave", "--project", tmp_path)
    run = Path(out["save_dir"])
    fit = [fitness(r) for r in read_csv(run)]
    final_is_best = fit[2] >= max(0.0, *fit[:2])
    # best.pt is a copy of the last.pt just saved
    assert saved == [2], (saved, fit)
    names = sorted(p.name for p in (run / "weights").iterdir())
    assert names == (["best.pt", "last.pt"] if final_is_best else ["last.pt"])
    if final_is_best:
        weights = run / "weights"
        assert (weights / "best.pt").read_bytes() == (weights / "last.pt").read_bytes()
    assert load(run / "weights" / "last.pt")["epoch"] == 2
    assert out["epochs"] == 3 and "fitness" in out["metrics"]


@pytest.mark.slow
def test_cache_modes_and_exist_ok(tiny, tmp_path, capsys):
    """--cache off decodes every time (no cache line), --cache ram says it cached; --exist-ok reuses
    project/name, without it the next run gets name2."""
    first = run_train(*tiny, "--epochs", "1", "--cache", "off", "--project", tmp_path)
    off = capsys.readouterr().out
    again = run_train(*tiny, "--epochs", "1", "--cache", "ram", "--exist-ok", "--project", tmp_path)
    ram = capsys.readouterr().out.splitlines()
    other = run_train(*tiny, "--epochs", "1", "--project", tmp_path)
    assert [Path(r["save_dir"]).name for r in (first, again, other)] == ["exp", "exp", "exp2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp2"]
    assert "cached in RAM" not in off
    assert any(ln.startswith("train: 32 images cached in RAM") for ln in ram), ram
    assert any(ln.startswith("val: 8 images cached in RAM") for ln in ram), ram
    assert load(tmp_path / "exp" / "weights" / "last.pt")["args"]["cache"] == "ram"


def test_hyp_with_an_unknown_key_exits_2(tiny, tmp_path):
    (tmp_path / "hyp.yaml").write_text("lr0: 0.02\nlr_zero: 0.01\n")
    rc, _, err = cli(
        [PY, "train.py", *tiny, "--hyp", tmp_path / "hyp.yaml", "--project", tmp_path / "runs"]
    )
    assert rc == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert "lr_zero" in err
    assert not (tmp_path / "runs").exists()


def test_freeze_listed_layers(tiny, finished, tmp_path):
    """--freeze 1 4 24 (a list: those layers, not the first N): after training steps their
    parameters equal the initial weights (--weights), every other layer's have changed. (BN running
    stats of frozen layers still update: only parameters are compared.)"""
    weights = finished / "weights" / "last.pt"
    initial = load_model(weights).state_dict()
    freeze = ["--freeze", "1", "4", "24"]
    out = run_train(*tiny, "--epochs", "1", "--weights", weights, *freeze, "--project", tmp_path)
    final = load(Path(out["save_dir"]) / "weights" / "last.pt")["model"]
    layers: dict[int, list[str]] = {}
    for k, _ in Model("yolov5n.yaml", nc=2).named_parameters():
        layers.setdefault(int(k.split(".")[1]), []).append(k)
    assert {1, 4, 24} < set(layers) and {0, 2, 3} < set(layers)
    for i, keys in layers.items():
        same = [torch.equal(final[k], initial[k]) for k in keys]
        if i in (1, 4, 24):
            assert all(same), f"frozen layer {i} changed"
        else:
            assert not all(same), f"layer {i} did not train"


@pytest.mark.slow
def test_bare_resume_continues_the_newest_run(finished, unfinished, tmp_path, capsys):
    """Bare --resume takes the newest weights/last.pt under --project (not the first or last by
    name) and continues that run in its own folder; the other run is left alone."""
    project = tmp_path / "runs"
    old, new = copy_run(finished, project / "zzz"), copy_run(unfinished, project / "aaa")
    now = time.time()
    os.utime(old / "weights" / "last.pt", (now - 60, now - 60))
    os.utime(new / "weights" / "last.pt", (now, now))
    before = (old / "weights" / "last.pt").read_bytes(), (old / "results.csv").read_text()
    out = run_train("--resume", "--project", project)
    assert Path(out["save_dir"]) == new and out["epochs"] == 2
    assert f"Resuming {new} at epoch 2/2" in capsys.readouterr().out
    assert epochs_in_csv(new) == ["1", "2"] and load(new / "weights" / "last.pt")["epoch"] == 1
    assert ((old / "weights" / "last.pt").read_bytes(), (old / "results.csv").read_text()) == before
    assert sorted(p.name for p in project.iterdir()) == ["aaa", "zzz"]


@pytest.mark.slow
def test_segment_resume_continues_exactly(data_dir, tmp_path, monkeypatch):
    """A segmentation run stopped after epoch 1 and resumed ends with the checkpoint (model, EMA,
    optimizer momentum) and results.csv of an uninterrupted run."""
    data = ["--data", data_dir / "coco8-seg.yaml"]
    flags = "--cfg yolov5n-seg.yaml --imgsz 64 --batch-size 2 --workers 0 --epochs 2 --noautoanchor"
    common = [*data, *flags.split()]
    whole = Path(run_train(*common, "--project", tmp_path / "a")["save_dir"])
    with pytest.MonkeyPatch.context() as mp:
        stop_in_epoch_2(mp)
        with pytest.raises(KeyboardInterrupt, match="test stop"):
            run_train(*common, "--project", tmp_path / "b")
    run = tmp_path / "b" / "exp"
    assert load(run / "weights" / "last.pt")["epoch"] == 0
    out = run_train("--resume", run / "weights" / "last.pt")
    assert Path(out["save_dir"]) == run and out["epochs"] == 2
    a, b = (load(r / "weights" / "last.pt") for r in (whole, run))
    assert a["task"] == b["task"] == "segment"
    assert a["epoch"] == b["epoch"] == 1 and a["ema_updates"] == b["ema_updates"]
    for key in ("model", "ema"):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), f"{key}.{k}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        assert torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]), i
    assert read_csv(whole) == read_csv(run)


# ---------------------------------------------------------------- resume: warnings and refusals
@pytest.mark.slow
def test_resume_under_another_world_size_warns(unfinished, tmp_path):
    """A run saved by 1 process and resumed by 2 cannot restore the per-rank random states: it says
    so on stdout (a line naming the world sizes) and finishes."""
    run = copy_run(unfinished, tmp_path / "exp")
    last = run / "weights" / "last.pt"
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    rc, out, err = cli([*torchrun, "train.py", "--resume", last])
    assert rc == 0, err[-3000:]
    assert epochs_in_csv(run) == ["1", "2"] and load(last)["epoch"] == 1
    assert any("world size" in ln and "1" in ln and "2" in ln for ln in out.splitlines()), out


def test_resume_of_a_finished_run_is_refused(finished, tmp_path):
    """train.py --resume of a run whose last epoch is done: one line on stderr saying it is
    finished, exit code 2, no training, nothing rewritten."""
    run = copy_run(finished, tmp_path / "exp")
    last = run / "weights" / "last.pt"
    before = last.read_bytes(), (run / "results.csv").read_text()
    rc, out, err = cli([PY, "train.py", "--resume", last])
    assert rc == 2 and len(err.strip().splitlines()) == 1, (rc, err[-3000:])
    assert "already finished" in err or "is finished" in err
    assert (last.read_bytes(), (run / "results.csv").read_text()) == before
    assert "epoch 1/1" not in out


def test_flags_beside_resume_are_named_in_one_warning(unfinished, tmp_path, capsys):
    """A resumed run keeps its own arguments (all but --device); flags given beside --resume are
    named in one warning line, and the run continues with its own settings."""
    run = copy_run(unfinished, tmp_path / "exp")
    out = run_train(
        "--resume", run / "weights" / "last.pt", "--epochs", "5", "--imgsz", "96", "--device", "cpu"
    )
    assert out["epochs"] == 2 and epochs_in_csv(run) == ["1", "2"]  # the run's own --epochs 2
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if "--epochs" in ln]
    assert len(lines) == 1 and "--imgsz" in lines[0], lines
    assert "warn" in lines[0].lower() and "--device" not in lines[0]
