"""Hostile weights files (issue 13). Each crafted file is built here (small, no shipped binaries);
each must end in one CheckpointError line naming the file and the reason (in-process), or exit 2
with one line on stderr (val.py), within seconds and without a memory blow-up, running nothing and
opening no file that it names."""

import collections
import copy
import os
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yolo_min import anchors, checkpoint, labels, safe_load, trainer  # noqa: E402
from yolo_min.models import CFG_DIR, Model  # noqa: E402
from yolo_min.safe_load import CheckpointError, load_model  # noqa: E402

TINY_CFG = yaml.safe_load((CFG_DIR / "yolov5n.yaml").read_text()) | {"width_multiple": 0.0625}
HUGE = 500_000_000  # elements a crafted tensor declares (2 GB as float32)


# ---------------------------------------------------------------- building crafted files
@pytest.fixture
def v5(monkeypatch):
    """Stand-ins for yolov5's classes, pickled under yolov5's names (models.yolo.DetectionModel,
    models.common.Conv); `v5.module(cls, **attrs)` makes a module-like object as yolov5 pickles."""
    ns = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "models", types.ModuleType("models"))
    for name, cls in (("models.yolo", "DetectionModel"), ("models.common", "Conv")):
        mod = types.ModuleType(name)
        setattr(mod, cls, type(cls, (), {"__module__": name}))
        setattr(ns, cls, getattr(mod, cls))
        monkeypatch.setitem(sys.modules, name, mod)

    def module(cls, **attrs):
        m = cls()
        m.__dict__.update({"_modules": {}, "_parameters": {}, "_buffers": {}} | attrs)
        return m

    ns.module = module
    return ns


def v5_file(path: Path, v5, conv_weight=None, **model_attrs) -> Path:
    """A yolov5-style .pt: {"model": DetectionModel(model.0.conv.weight), "ema": None, ...}."""
    conv = v5.module(v5.Conv, _parameters={"weight": conv_weight})
    layer = v5.module(v5.Conv, _modules={"conv": conv})
    layers = v5.module(v5.Conv, _modules={"0": layer})
    model = v5.module(v5.DetectionModel, _modules={"model": layers})
    model.__dict__.update(model_attrs)
    torch.save({"epoch": -1, "model": model, "ema": None}, path)
    return path


def torch_zip(path: Path, pkl: bytes) -> Path:
    """A file in torch.save's layout (a zip of stored members) whose data.pkl is `pkl`."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
    return path


@pytest.fixture(scope="module")
def last_pt() -> dict:
    """What a yolo_min run saves after its first epoch (a small model, 3 epochs planned)."""
    model = Model(TINY_CFG, nc=2)
    opt = trainer.build_optimizer(model, 0.01, 0.9, 0.0)
    scaler, ema = torch.amp.GradScaler("cuda", enabled=False), trainer.ModelEMA(model)
    args = trainer.get_args_parser().parse_args(["--epochs", "3"])
    trainer.check_args(args, "detect", 1)  # as train.py saves them: the task's defaults filled in
    hyp, rngs = trainer.load_hyp(""), [checkpoint.rng_state()]
    return checkpoint.training_state(model, ema, opt, scaler, 0, (0.1, 0), args, hyp, rngs)


def training_file(path: Path, last_pt: dict, **changes) -> Path:
    """last_pt saved to path with some of its values changed ("a.b": last_pt["a"]["b"])."""
    state = copy.deepcopy(last_pt)
    for key, value in changes.items():
        *parents, last = key.split(".")
        d = state
        for k in parents:
            d = d[int(k) if k.isdigit() else k]
        d[last] = value
    torch.save(state, path)
    return path


def zip_bomb(path: Path, inflated: int = 100_000_000) -> Path:
    """~100 KB whose data.pkl inflates to 100 MB."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("archive/data.pkl", "w") as f:
            for _ in range(inflated // 1_000_000):
                f.write(bytes(1_000_000))
    return path


class _BadStorage:
    """Pickles as a tensor of HUGE elements over a 1-element storage."""

    def __reduce__(self):
        args = (torch.zeros(1)._typed_storage(), 0, (HUGE,), (1,), False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def deep_list(depth: int) -> bytes:
    """A pickle of a list nested `depth` deep (built by the unpickler without recursion)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def refused(path, *words, load=load_model, seconds=5.0) -> str:
    """The one-line CheckpointError of loading path, after checking it names the file and words and
    came within `seconds`."""
    t0 = time.time()
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert time.time() - t0 < seconds and msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert len(msg) < len(str(path)) + 250 and all(w in msg for w in words), msg
    return msg


# ---------------------------------------------------------------- the file itself
def test_not_a_zip_of_stored_members(tmp_path):
    """Random bytes, text, an empty file, a legacy (non-zip) torch file and a zip bomb are refused
    before anything is unpickled or inflated."""
    (tmp_path / "random.pt").write_bytes(np.random.default_rng(0).bytes(10_000))
    (tmp_path / "text.pt").write_text("these are not weights\n" * 10)
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    zip_bomb(tmp_path / "bomb.pt")
    assert (tmp_path / "bomb.pt").stat().st_size < 200_000
    for name in ("random", "text", "empty", "legacy", "bomb"):
        refused(tmp_path / f"{name}.pt", "not a PyTorch checkpoint", seconds=2)


def test_refused_globals(tmp_path):
    """Exact names only: no dotted name, no other torch global, no os.system; a CUDA storage class
    becomes torch's inert StorageType (CUDA is not initialised)."""
    cases = [
        ("torch", "cuda.FloatStorage", "refusing 'torch.cuda.FloatStorage'"),
        ("torch._guards", "_TLSStorage", "refusing 'torch._guards._TLSStorage'"),
        ("posix", "system", "refusing 'posix.system'"),
        ("torch.cuda", "FloatStorage", "TypeError: 'StorageType' object is not callable"),
    ]
    for i, (module, name, words) in enumerate(cases):
        pkl = f"c{module}\n{name}\nK\n\x85R".encode("latin-1")  # name(10)
        with pytest.raises(CheckpointError):  # by torch's weights_only unpickler
            load_model(torch_zip(tmp_path / f"{i}.pt", b"\x80\x02" + pkl + b"."))
        after_yolov5 = b"\x80\x02(cmodels.common\nConv\n)R" + pkl + b"l."  # by ours
        refused(torch_zip(tmp_path / f"v5{i}.pt", after_yolov5), words)
    assert not torch.cuda.is_initialized()
    called = torch_zip(tmp_path / "called.pt", b"\x80\x02cmodels.common\nConv\nK\x01K\x02\x86R.")
    refused(called, "neither a yolo_min nor a yolov5 checkpoint")  # a record, nothing run


def test_object_trees(tmp_path, v5):
    """2^40 paths through 41 shared modules (too deep), 2^30 through 31 (each visited once), a
    module that contains itself, a list nested 100,000 deep, and tuple keys: each ends at once."""
    for depth, words in ((40, "nested over 64 deep"), (30, "its tensors do not fit its model")):
        child = v5.module(v5.Conv)
        for _ in range(depth):
            child = v5.module(v5.Conv, _modules={"a": child, "b": child})
        shared = v5.module(v5.DetectionModel, _modules={"model": child}, yaml=TINY_CFG)
        torch.save({"model": shared}, tmp_path / "shared.pt")
        refused(tmp_path / "shared.pt", words)
    loop = v5.module(v5.Conv)
    loop._modules["self"] = loop
    torch.save({"model": loop}, tmp_path / "loop.pt")
    refused(tmp_path / "loop.pt", "'model.self' contains itself")
    refused(torch_zip(tmp_path / "deep.pt", deep_list(100_000)), "nested over 64 deep")
    # tuples as dict keys are hashed while unpickling: 40 shared levels (2^40 visits) or 100,000
    # nested ones (a crash in C) are refused before torch.load
    shared = b")q\x000" + b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(40)) + b"h("
    for name, key in (("dag", shared), ("nested", b")" + b"\x85" * 100_000)):
        path = torch_zip(tmp_path / f"{name}.pt", b"\x80\x02}" + key + b"K\x01s.")
        refused(path, "its tuples nest too deep or too often to be hashed")


def test_tensors_that_expand(tmp_path, v5):
    """A 2-byte storage seen as 5e8 elements (stride 0), one too small for its shape, and views
    that together declare more bytes than the file holds are refused before any is used."""
    weight = torch.zeros(1, dtype=torch.half).expand(HUGE)
    v5_file(tmp_path / "stride0.pt", v5, weight, yaml=TINY_CFG)
    assert (tmp_path / "stride0.pt").stat().st_size < 10_000
    words = f"tensor 'model.model.0.conv.weight' declares {HUGE} elements but stores 1"
    refused(tmp_path / "stride0.pt", words)
    v5_file(tmp_path / "small.pt", v5, _BadStorage(), yaml=TINY_CFG)
    refused(tmp_path / "small.pt", "storage")  # torch itself refuses to resize a loaded storage
    base = torch.zeros(25_000)
    torch.save({"model": [base.view(100, 250) for _ in range(1000)]}, tmp_path / "views.pt")
    refused(tmp_path / "views.pt", "its tensors hold 100000000 bytes, more than the file's")


def test_fixtures_pass_the_checks(fixtures_dir, monkeypatch):
    """Every yolov5 file users have passes the zip, pickle and tree checks (the classifier too,
    whose model is built by a later issue); the segmentation one pickles getattr(Detect, ...).
    A model's dummy pass runs on the meta device only: a file cannot make it allocate."""
    for name in (
        "yolov5n_random_v5format.pt",
        "yolov5n-cls_v5format.pt",
        "predict/det.pt",
        "predict/seg.pt",
    ):
        assert isinstance(safe_load.read_checked(fixtures_dir / name), dict)
    devices, forward = [], Model.forward
    monkeypatch.setattr(
        Model, "forward", lambda self, x: devices.append(x.device.type) or forward(self, x)
    )
    model = load_model(fixtures_dir / "predict" / "seg.pt")
    assert model.task == "segment" and model.names == ["circle", "rectangle", "triangle"]
    assert devices == ["meta"] and next(model.parameters()).device.type == "cpu"


# ---------------------------------------------------------------- the model config
def test_model_config_is_a_checked_dict(tmp_path, monkeypatch):
    """A path is never opened; bounds are checked before anything is built; messages never expand
    an untrusted object (a row of lists shared 40 deep would print as 2^40 items)."""
    secret = tmp_path / "secret.yaml"
    secret.write_text("nc: 1\nbackbone: [[-1, 1, SECRET_TOKEN, []]]\n")
    opened = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: opened.append(self) or "")
    weights = Model(TINY_CFG).state_dict()
    for i, cfg in enumerate([str(secret), "/dev/stdin"]):
        torch.save({"model": weights, "model_cfg": cfg}, tmp_path / f"path{i}.pt")
        msg = refused(tmp_path / f"path{i}.pt", "its model config is not a config dict")
        assert "SECRET" not in msg
    assert opened == []
    monkeypatch.undo()
    nested = [-1]
    for _ in range(40):
        nested = [nested, nested]
    head = [*TINY_CFG["head"][:-1], [nested, nested, "Conv", nested]]
    bad = {"depth_multiple": 1e7, "head": head, "nc": -1, "anchors": [[1, 2], "x"], "mystery": 1}
    words = {
        "depth_multiple": "'depth_multiple': 10000000.0 is out of range",
        "head": "layer 24: [[[[[[",
        "nc": "'nc': -1 is out of range",
        "anchors": "'anchors': [[1, 2], 'x'] is",
        "mystery": "'mystery': 1 is out of range",
    }
    for key, value in bad.items():
        torch.save({"model": weights, "model_cfg": TINY_CFG | {key: value}}, tmp_path / f"{key}.pt")
        refused(tmp_path / f"{key}.pt", f"model cfg: {words[key]}")
    many = r"layer 2: \[-1, 1000, 'C3', \[128\]\] is not \[from .*, repeats \(1-16 after depth"
    with pytest.raises(ValueError, match=many):  # a user's yaml config: the same checks
        Model(TINY_CFG | {"backbone": [*TINY_CFG["backbone"][:2], [-1, 1000, "C3", [128]]]})


# ---------------------------------------------------------------- --resume
def test_resume_state_is_checked(tmp_path, last_pt):
    """A last.pt's values are checked as train.py saves them (types, ranges, random states, the
    config against the weights, optimizer buffers): one line, before training starts."""
    cases = {
        "optimizer.state": (
            {0: {"momentum_buffer": torch.zeros(1).expand(HUGE)}},
            f"tensor 'optimizer.state.0.momentum_buffer' declares {HUGE} elements",
        ),
        "epoch": (-1, "its values are not of the types and ranges train.py saves"),
        "ema_updates": ("7", "its values are not of the types"),
        "rng.world_size": (2, "its values are not of the types"),
        "model_cfg": ("yolov5n.yaml", "its values are not of the types"),  # a path: not opened
        "model_cfg.depth_multiple": (1e7, "'depth_multiple': 10000000.0 is out of range"),
    }
    for i, (key, (value, words)) in enumerate(cases.items()):
        path = training_file(tmp_path / f"{i}.pt", last_pt, **{key: value})
        refused(path, words, load=checkpoint.load)
    # in a run folder, as --resume takes it: the same checks as the command line's
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (run / "args.yaml").write_text(yaml.safe_dump(last_pt["args"]))
    for key, value, words in [
        ("args.epochs", "x", "its option epochs='x': expected int"),
        ("args.cache", "disk", "its option cache='disk': expected one of auto, ram, off"),
        ("args.bogus", 1, "not train.py's arguments"),
        ("hyp.lr0", "x", "its hyp: lr0 is 'x', not a finite number"),
    ]:
        path = training_file(run / "weights" / "last.pt", last_pt, **{key: value})
        with pytest.raises(trainer.ConfigError, match=words):
            trainer.main(trainer.get_args_parser().parse_args(["--resume", str(path)]))


def test_restore_refuses_what_does_not_fit(tmp_path, last_pt):
    """Optimizer buffers of other shapes and settings that are not numbers end before training."""
    model = Model(TINY_CFG, nc=2)
    for key, value in [
        ("optimizer.state", {0: {"momentum_buffer": torch.zeros(3)}}),
        ("optimizer.param_groups.0.lr", "x"),
        ("rng.ranks.0.numpy", "x"),
    ]:
        ckpt = checkpoint.load(training_file(tmp_path / "last.pt", last_pt, **{key: value}))
        opt = trainer.build_optimizer(model, 0.01, 0.9, 0.0)
        scaler, ema = torch.amp.GradScaler("cuda", enabled=False), trainer.ModelEMA(model)
        with pytest.raises(CheckpointError, match="cannot restore its training state: "):
            checkpoint.restore(ckpt, model, ema, opt, scaler, 0, 1)


# ---------------------------------------------------------------- val.py end to end
def test_val_refuses_in_one_line_fast_and_small(tmp_path, v5, data_dir):
    """val.py on a zip bomb and a stride-0 tensor, side by side with a text file as the baseline:
    exit 2, one line, each within twice the baseline's time + 10 s (a hang or blow-up takes
    minutes) and under 1.5 GB peak memory (per process, from wait4)."""
    (tmp_path / "text.pt").write_text("not weights\n")
    weight = torch.zeros(1).expand(HUGE)
    files = {
        "text": tmp_path / "text.pt",
        "bomb": zip_bomb(tmp_path / "bomb.pt"),
        "stride0": v5_file(tmp_path / "s0.pt", v5, weight, yaml=TINY_CFG),
    }
    env, procs, t0 = {**os.environ, "OMP_NUM_THREADS": "1"}, {}, time.time()
    for name, path in files.items():
        cmd = [
            sys.executable,
            str(ROOT / "val.py"),
            "--weights",
            str(path),
            "--data",
            str(data_dir / "coco8.yaml"),
            "--imgsz",
            "64",
            "--project",
            str(tmp_path / "runs"),
        ]
        with open(tmp_path / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
    ended = {}  # name: (seconds, exit code, peak GB)
    while len(ended) < len(procs) and time.time() - t0 < 300:
        for name, p in procs.items():
            if name not in ended and (done := os.wait4(p.pid, os.WNOHANG))[0]:
                code = os.waitstatus_to_exitcode(done[1])
                ended[name] = (time.time() - t0, code, done[2].ru_maxrss / 1e6)  # kB on Linux
        time.sleep(0.05)
    for name, p in procs.items():
        if name not in ended:
            p.kill()
    assert set(ended) == set(procs), f"val.py did not end on {set(procs) - set(ended)}"
    for name, (seconds, code, peak_gb) in ended.items():
        err = (tmp_path / f"{name}.err").read_text()
        assert code == 2 and len(err.strip().splitlines()) == 1, (name, code, err[-2000:])
        assert err.startswith(f"val.py: error: {files[name]}: "), err
        assert seconds < 2 * ended["text"][0] + 10 and peak_gb < 1.5, (name, ended)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- data
def test_images_over_the_pixel_limit_are_skipped(tmp_path, monkeypatch):
    """An image PIL would only warn about (between 1x and 2x its limit) is named and skipped as
    corrupt, before it is decoded."""
    from PIL import Image

    Image.new("RGB", (120, 100)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    status, _, _, msgs, _, _ = labels.verify(str(tmp_path / "big.png"), str(tmp_path / "big.txt"))
    assert status == labels.CORRUPT
    why = "120x100 pixels, more than PIL's limit of 10,000; image skipped"
    assert msgs == [f"{tmp_path / 'big.png'}: {why}"]


def test_autoanchor_fits_a_bounded_seeded_sample(monkeypatch):
    """A million label boxes: AutoAnchor measures and fits a seeded sample of 10,000 (its time is
    bounded whatever the labels); fewer boxes are all used, as before."""
    fitted, fit = [], anchors.fit_anchors

    def spy(wh, *args, **kwargs):
        fitted.append(wh)
        return fit(wh, *args, **kwargs, gens=10)

    monkeypatch.setattr(anchors, "fit_anchors", spy)
    rng = np.random.default_rng(0)
    xy, wh = rng.uniform(0.3, 0.7, (1_000_000, 2)), rng.uniform(0.01, 0.05, (1_000_000, 2))
    boxes = np.concatenate([xy, wh], 1).astype(np.float32)
    poor = np.full((9, 2), 400.0, np.float32)  # BPR 0: a fit runs
    for n in (1_000_000, 1_000_000, 5_000):
        anchors.check_anchors([dict(bboxes=boxes[:n], shape=(640, 640))], poor, 4.0, 640, seed=0)
    assert [len(w) for w in fitted] == [10_000, 10_000, 5_000]
    assert (fitted[0] == fitted[1]).all()  # seeded
    assert (
        fitted[2]
        == anchors.label_wh(
            [dict(bboxes=boxes[:5000], shape=(640, 640))], 640, np.random.default_rng(0)
        )
    ).all()
