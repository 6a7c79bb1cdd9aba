"""What happens when things go wrong: the nine reliability guarantees of issue 5, each proven on
CPU.

1 a SIGKILLed worker: torchrun restarts the group, the run resumes from last.pt by itself;
2 a kill during a checkpoint write leaves the previous last.pt whole, and --resume uses it;
3 an exception on one rank ends the whole job quickly, with the error on screen;
4 SIGTERM / Ctrl-C stop a single-process run with one line and an intact last.pt;
5 a NaN loss stops every rank together, naming the epoch and iteration, keeping the last good
checkpoint;
6 a hostile dataset trains end to end on its good files, with exact counts and a warning per bad
file;
7 bad configuration: one line, exit code 2, before any work (complements test_train's missing
files);
8 checkpoints never run pickled code: ours load with weights_only=True, a malicious .pt is refused;
9 a full disk or an unwritable run folder is an error at start-up, not after an epoch.

Faults are injected by tests/faulty_train.py, launched in place of train.py: YOLO_MIN_TEST_KILL /
_FAIL / _NAN = "epoch:iter:rank" (train.py itself holds no test code).
Processes are launched here (torchrun, train.py, val.py); the project code itself never starts one.
"""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import deny_image_open  # noqa: E402
from test_datasets import make_hostile  # noqa: E402

from yolo_min import datasets, dist, trainer  # noqa: E402
from yolo_min.models import CFG_DIR  # noqa: E402
from yolo_min.safe_load import load_model  # noqa: E402

PY = sys.executable
FAULTY = "tests/faulty_train.py"  # train.py with a planned fault
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("YOLO_MIN_TEST_")} | {
    "OMP_NUM_THREADS": "1"
}
LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap():
    """One torch thread in-process, as in the launched processes (2 CI cores, often shared); and
    whatever a test asserts, no process it launched (torchrun with its workers) outlives it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    while LAUNCHED:
        p = LAUNCHED.pop()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def launch(cmd, cwd=ROOT, **env) -> subprocess.Popen:
    """Start cmd in its own session (so torchrun and its workers can be killed together)."""
    p = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**ENV, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # even if CI ignores it
    LAUNCHED.append(p)
    return p


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(
            f"timed out after {timeout} s: {' '.join(p.args)}\n{out[-2000:]}\n{err[-3000:]}"
        )
    return p.returncode, out, err


def epochs_in_csv(run: Path) -> list[str]:
    with open(run / "results.csv") as f:
        return [r["epoch"] for r in csv.DictReader(f)]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


ONE_CPU_PROCESS = dist.DistInfo(0, 1, 1, torch.device("cpu"))


def args_for(tiny, tmp_path, *extra):
    return trainer.get_args_parser().parse_args(
        [*tiny, "--project", str(tmp_path / "runs"), *extra]
    )


# ---------------------------------------------------------------- 1 killed worker
@pytest.mark.slow
def test_killed_worker_is_restarted_and_resumes(tiny, tmp_path):
    """Rank 1 SIGKILLs itself in epoch 2 of 3; torchrun --max-restarts 1 restarts both ranks, which
    resume from epoch 1's last.pt (the kill hook fires on the first attempt only) and finish with
    exactly the weights and results of an uninterrupted run, launched meanwhile into the same
    --project (exp2): the restarted run finds its own folder, not the newest one."""
    cmd = [*TORCHRUN, "--max-restarts", "1", FAULTY, *tiny, "--epochs", "3", "--project", tmp_path]
    killed = launch(cmd, YOLO_MIN_TEST_KILL="2:2:1")
    deadline = time.time() + 120
    while not (tmp_path / "exp").exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    whole = launch(cmd)
    rc, out, err = finish(killed)
    assert rc == 0, err[-3000:]
    assert finish(whole)[0] == 0
    run, ref = tmp_path / "exp", tmp_path / "exp2"
    assert "exitcode: -9" in err and "local_rank: 1" in err  # torchrun saw the SIGKILL
    assert f"torchrun restart: resuming from {run / 'weights' / 'last.pt'}" in out
    assert f"Resuming {run} at epoch 2/3" in out
    assert [out.count(f"epoch {e}/3:") for e in (1, 2, 3)] == [
        1,
        1,
        1,
    ]  # each epoch finished exactly once
    assert epochs_in_csv(run) == ["1", "2", "3"]
    assert (run / "results.csv").read_text() == (ref / "results.csv").read_text()
    a, b = load(run / "weights" / "last.pt"), load(ref / "weights" / "last.pt")
    assert a["epoch"] == b["epoch"] == 2 and a["ema_updates"] == b["ema_updates"]
    for key in ("model", "ema"):
        assert all(torch.equal(v, b[key][k]) for k, v in a[key].items()), key
    assert sorted(p.name for p in run.parent.iterdir()) == [
        "exp",
        "exp2",
    ]  # the restart kept its folder
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["best.pt", "last.pt"]


# ---------------------------------------------------------------- 2 crash while writing a
# checkpoint
DIE_WHILE_SAVING = r"""
import io, os, signal, sys
import torch
sys.path.insert(0, os.getcwd())
import train
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("epoch") == 1:  # epoch 2's last.pt: half reaches disk
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: buf.tell() // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)
torch.save = save
from yolo_min import trainer
trainer.main(trainer.get_args_parser().parse_args(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_last_good(tiny, tmp_path, monkeypatch):
    rc, _, err = finish(
        launch([PY, "-c", DIE_WHILE_SAVING, *tiny, "--epochs", "2", "--project", tmp_path])
    )
    assert rc == -signal.SIGKILL, err[-3000:]
    weights = tmp_path / "exp" / "weights"
    assert sorted(p.name for p in weights.iterdir()) == ["best.pt", "last.pt", "last.pt.tmp"]
    with pytest.raises(Exception):
        load(weights / "last.pt.tmp")  # the half-written file ...
    assert load(weights / "last.pt")["epoch"] == 0  # ... never replaced the previous one
    # epoch 2's row is written after its checkpoint: results.csv lists what last.pt holds
    assert epochs_in_csv(tmp_path / "exp") == ["1"]

    # --resume continues from it (and every checkpoint read goes through weights_only=True:
    # guarantee 8)
    real_load, modes = torch.load, []
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: modes.append(k.get("weights_only")) or real_load(*a, **k)
    )
    out = trainer.main(trainer.get_args_parser().parse_args(["--resume", str(weights / "last.pt")]))
    assert out["epochs"] == 2 and epochs_in_csv(tmp_path / "exp") == ["1", "2"]
    assert load_model(weights / "last.pt").task == "detect"
    assert len(modes) >= 3 and set(modes) == {True}
    assert sorted(p.name for p in weights.iterdir()) == [
        "best.pt",
        "last.pt",
    ]  # the stale .tmp was replaced
    assert load(weights / "last.pt")["epoch"] == 1


# ---------------------------------------------------------------- 3 a rank fails
@pytest.mark.slow
def test_failing_rank_ends_the_job_quickly(tiny, tmp_path):
    """Rank 1 raises while rank 0 waits for it in an all-reduce: the job ends (no hang), non-zero,
    error shown."""
    t0 = time.time()
    rc, out, err = finish(
        launch(
            [*TORCHRUN, FAULTY, *tiny, "--epochs", "3", "--project", tmp_path],
            YOLO_MIN_TEST_FAIL="1:2:1",
        ),
        timeout=120,
    )
    assert rc != 0 and time.time() - t0 < 60
    assert "RuntimeError: test fault: rank 1 fails at epoch 1, iteration 2" in err
    assert not (tmp_path / "exp" / "weights" / "last.pt").exists()


def test_process_group_is_destroyed_on_error(tiny, tmp_path, monkeypatch):
    """train.main tears the process group down whatever ends the run (here an error
    mid-training)."""
    calls = []
    monkeypatch.setattr(trainer.dist, "cleanup", lambda: calls.append("cleanup"))
    monkeypatch.setattr(trainer, "fit", lambda *args: calls.append("train") or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        trainer.main(args_for(tiny, tmp_path))
    assert calls == ["train", "cleanup"]


# ---------------------------------------------------------------- 4 SIGTERM and Ctrl-C
@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_cleanly(tiny, tmp_path):
    sigs = {"SIGTERM": (signal.SIGTERM, 143), "SIGINT": (signal.SIGINT, 130)}
    procs = {
        name: launch([PY, "train.py", *tiny, "--epochs", "100", "--project", tmp_path / name])
        for name in sigs
    }
    for name, p in procs.items():  # both run at once; each is stopped once it has written a last.pt
        last, deadline = tmp_path / name / "exp" / "weights" / "last.pt", time.time() + 180
        while not last.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert last.exists(), finish(p, 10)[2][-3000:]
        os.kill(p.pid, sigs[name][0])
    for name, p in procs.items():
        rc, _, err = finish(p, 120)
        assert rc == sigs[name][1], err[-3000:]
        assert err.strip().splitlines() == [
            f"train.py: stopped by {name}; weights/last.pt holds the last completed epoch"
        ]  # one line, no traceback
        run = tmp_path / name / "exp"
        ckpt = load(run / "weights" / "last.pt")
        # the checkpoint is written before its row, both before a signal takes effect
        assert ckpt["epoch"] < 99 and len(epochs_in_csv(run)) == ckpt["epoch"] + 1
        assert not (run / "train.lock").exists()  # released on the stop
        assert load_model(run / "weights" / "last.pt").task == "detect"


# ---------------------------------------------------------------- 5 NaN loss
@pytest.mark.slow
def test_nan_loss_stops_every_rank(tiny, tmp_path):
    """A NaN loss on rank 1 only (epoch 2, iteration 2): both ranks stop there, each saying so; in
    one process the same. --monitor-interval 15 lets both ranks exit by themselves before torchrun
    would stop the other."""
    two = launch(
        [
            *TORCHRUN,
            "--monitor-interval",
            "15",
            FAULTY,
            *tiny,
            "--epochs",
            "3",
            "--project",
            tmp_path / "two",
        ],
        YOLO_MIN_TEST_NAN="2:2:1",
    )
    one = launch(
        [PY, FAULTY, *tiny, "--epochs", "3", "--project", tmp_path / "one"],
        YOLO_MIN_TEST_NAN="2:1:0",
    )
    for name, p, at, ranks in (("one", one, "iteration 1", 1), ("two", two, "iteration 2", 2)):
        rc, _, err = finish(p, 180)
        run = tmp_path / name / "exp"
        msg = (
            f"train.py: non-finite loss [nan, nan, nan] at epoch 2, {at}: training stopped; "
            f"the last good checkpoint is {run / 'weights' / 'last.pt'}"
        )
        assert rc != 0 and err.count(msg) == ranks, err[-3000:]
        if ranks == 1:
            assert rc == 1 and err.strip() == msg
        assert load(run / "weights" / "last.pt")["epoch"] == 0 and epochs_in_csv(run) == ["1"]


# ---------------------------------------------------------------- 6 hostile dataset
def test_hostile_dataset_trains_end_to_end(tiny, tmp_path, capsys, monkeypatch):
    """tests/test_datasets.py's every-bad-file dataset, through train.main: 1 epoch on the 6 good
    images."""
    d = tmp_path / "d"
    exp = make_hostile(d)
    if (
        os.geteuid() == 0
    ):  # root reads anything: an unreadable image is simulated at the open() call
        Image.new("RGB", (64, 48)).save(d / "images" / "train" / "noperm.jpg")
        deny_image_open(monkeypatch, "noperm.jpg")
        exp = {
            **exp,
            "images": exp["images"] + 1,
            "corrupt": exp["corrupt"] + 1,
            "corrupt_files": exp["corrupt_files"] + ["noperm"],
        }
    out = trainer.main(
        args_for(
            tiny, tmp_path, "--data", str(d / "data.yaml"), "--epochs", "1", "--batch-size", "2"
        )
    )
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert (
        f"train: {exp['images']} images: 4 labelled, 1 missing labels, 1 empty, "
        f"{exp['corrupt']} corrupt; 6 instances; label rows: 8 dropped, 1 fixed"
    ) in lines
    assert (
        "val: 2 images: 0 labelled, 2 missing labels, 0 empty, 0 corrupt; 0 instances; "
        "label rows: 0 dropped, 0 fixed" in lines
    )
    for stem in exp["corrupt_files"]:  # each bad image named once, as skipped
        assert (
            sum(
                ln.startswith("WARNING train: ") and f"/{stem}." in ln and "image skipped" in ln
                for ln in lines
            )
            == 1
        ), stem
    for frag in [
        "pngdata.jpg: PNG data with a .jpg extension",
        "1 file(s) without an image extension",
        "rows.txt:3: NaN",
        "rows.txt:4: class -1",
        "rows.txt:5: class 3",
        "rows.txt:6: coordinates outside",
        "rows.txt:7: duplicate of line 1",
        "rows.txt:8: polygon with an odd",
        "labels folder",
    ]:
        assert any(ln.startswith("WARNING") and frag in ln for ln in lines), frag
    run = Path(out["save_dir"])
    assert epochs_in_csv(run) == ["1"] and load(run / "weights" / "last.pt")["epoch"] == 0
    assert (run / "train_batch0.jpg").is_file()

    (d / "empty.yaml").write_text(
        "path: .\ntrain: images/train\nval: images/none\nnames: [a, b, c]\n"
    )
    with pytest.raises(
        trainer.ConfigError, match="val: no images found in .*images/none"
    ):  # an empty split
        trainer.main(
            args_for(tiny, tmp_path / "e", "--data", str(d / "empty.yaml"), "--epochs", "1")
        )
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------- 7 bad configuration
def test_bad_configuration_is_one_line_exit_2(tiny, tmp_path):
    """Each problem: `train.py: error: ...` on one line, exit code 2, no run folder. (Missing cfg,
    data and hyp files and --device cuda:0 are in test_train.py; an unwritable --project, guarantee
    9, is here.)"""
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        Image.new("RGB", (64, 64)).save(tmp_path / split / "a.jpg")
    (tmp_path / "no_names.yaml").write_text(f"path: {tmp_path}\ntrain: train\nval: val\n")
    (tmp_path / "nc.yaml").write_text(
        f"path: {tmp_path}\ntrain: train\nval: val\nnames: [a, b]\nnc: 3\n"
    )
    (tmp_path / "foo.yaml").write_text(
        (CFG_DIR / "yolov5n.yaml").read_text().replace("SPPF", "Foo")
    )
    (tmp_path / "a_file").write_text("")
    cases = {
        "missing key(s) names": ["--data", tmp_path / "no_names.yaml"],
        "nc is 3": ["--data", tmp_path / "nc.yaml"],
        "train: a segmentation model needs polygon labels: boxes only": [
            "--cfg",
            "yolov5n-seg.yaml",
        ],
        "foo.yaml: layer 9: unknown module 'Foo'": ["--cfg", tmp_path / "foo.yaml"],
        f"cannot write the run folder {tmp_path / 'a_file' / 'runs' / 'exp'}": [
            "--project",
            tmp_path / "a_file" / "runs",
        ],
    }
    if not torch.cuda.is_available():
        cases |= {
            "--device cuda asks for CUDA": ["--device", "cuda"],
            "--device 0 asks for CUDA": ["--device", "0"],
        }
    procs = {
        msg: launch(
            [PY, ROOT / "train.py", *tiny, "--project", tmp_path / f"runs{i}", *extra], cwd=tmp_path
        )
        for i, (msg, extra) in enumerate(cases.items())
    }
    two = launch(
        [
            *TORCHRUN,
            ROOT / "train.py",
            *tiny,
            "--batch-size",
            "1",
            "--project",
            tmp_path / "runs_ddp",
        ],
        cwd=tmp_path,
    )
    for i, (msg, p) in enumerate(procs.items()):
        rc, _, err = finish(p, 180)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
        assert err.startswith("train.py: error: ") and msg in err, err
        assert not (tmp_path / f"runs{i}").exists()
    rc, _, err = finish(two, 180)  # torchrun itself exits 1 and prints its own failure report
    msg = "train.py: error: --batch-size 1 must be a multiple of the world size 2"
    assert rc != 0 and err.count(msg) == 1 and "[rank0]: Traceback" not in err, err[
        -3000:
    ]  # said once
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("runs")) == []


def test_cache_that_does_not_fit_is_a_config_error(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(
        datasets, "available_memory", lambda: 1000
    )  # bytes: far less than the images need
    with pytest.raises(
        trainer.ConfigError, match="train: caching the images in RAM needs .*: use --cache off"
    ):
        trainer.prepare(args_for(tiny, tmp_path, "--cache", "ram"), ONE_CPU_PROCESS)
    assert not (tmp_path / "runs").exists()
    trainer.prepare(args_for(tiny, tmp_path), ONE_CPU_PROCESS)  # --cache auto: simply no cache


def test_imgsz_is_rounded_up_with_a_warning(tiny, tmp_path, capsys):
    args = args_for(tiny, tmp_path, "--imgsz", "65")
    trainer.check_args(args, "detect", world_size=1)
    assert (
        args.imgsz == 96
        and "warning: --imgsz 65 is not a multiple of 32, using 96" in capsys.readouterr().out
    )


# ---------------------------------------------------------------- 8 untrusted checkpoints
class _Evil:
    """Unpickling this runs `touch <marker>` unless the loader refuses os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_checkpoint_is_refused_everywhere(tiny, tmp_path):
    """val.py --weights, train.py --weights and train.py --resume: one line, non-zero, the code
    never ran. (The restricted unpickler itself: test_models.py; weights_only=True on our own
    files: the resume test above.)"""
    evil, marker = tmp_path / "evil.pt", tmp_path / "PWNED"
    torch.save({"model": _Evil(marker), "ema": None}, evil)
    cmds = {
        "val": [
            PY,
            ROOT / "val.py",
            "--weights",
            evil,
            *tiny[:2],
            "--imgsz",
            "64",
            "--project",
            tmp_path / "runs",
        ],
        "train": [PY, ROOT / "train.py", *tiny, "--weights", evil, "--project", tmp_path / "runs"],
        "resume": [PY, ROOT / "train.py", "--resume", evil],
    }
    procs = {name: launch(cmd, cwd=tmp_path) for name, cmd in cmds.items()}
    for name, p in procs.items():
        rc, _, err = finish(p, 180)
        head = f"{'val' if name == 'val' else 'train'}.py: error: {evil}: refusing '"
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith(head), err[-3000:]
        assert ".system'" in err
    assert not marker.exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- 9 full disk
def test_full_disk_is_an_error_at_start_up(tiny, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=5_000_000))
    with pytest.raises(
        trainer.ConfigError, match=r"exp: only 5\.0 MB free on disk, checkpoints need about \d+ MB"
    ):
        trainer.main(args_for(tiny, tmp_path))
    assert not (tmp_path / "runs").exists()  # nothing written, no epoch run


FULL_DISK = r"""
import errno, os, sys
import torch
sys.path.insert(0, os.getcwd())
import train
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("epoch") == 1:  # epoch 2's last.pt: the disk is full
        f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    real_save(obj, f, *args, **kwargs)
torch.save = save
train.main()
"""


@pytest.mark.slow
def test_disk_that_fills_during_a_save_is_one_line(tiny, tmp_path):
    """The disk fills while epoch 2's last.pt is written: one line, exit code 1, epoch 1's last.pt
    intact and no temporary file left behind."""
    rc, _, err = finish(
        launch([PY, "-c", FULL_DISK, *tiny, "--epochs", "3", "--project", tmp_path])
    )
    weights = tmp_path / "exp" / "weights"
    assert rc == 1 and err.strip().splitlines() == [
        f"train.py: cannot write {weights / 'last.pt'} ([Errno 28] No space left on device); "
        "the previous one is intact"
    ], err[-3000:]
    assert sorted(p.name for p in weights.iterdir()) == ["best.pt", "last.pt"]
    assert load(weights / "last.pt")["epoch"] == 0
