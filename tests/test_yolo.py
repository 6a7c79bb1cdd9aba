"""`yolo_min.YOLO`, the Python face: the seed's script (YOLO("yolov5n-seg.yaml"), train, val,
predict, callbacks) in one process and under torchrun, a custom model and a yolov5 .pt trained
under torchrun, the same best.pt as train.py, save and load, resume, callbacks that raise, and
bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from yolo_min import YOLO, dist, predictor, trainer, validator
from yolo_min.models import Model

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# the scripts below import yolo_min from the checkout, as after `pip install -e .`
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

# the seed's scenario, as a user writes it (data and sizes small)
SEED_SCRIPT = """
import json, sys
from yolo_min import YOLO, dist

def log(event):
    with open(event.save_dir / f"calls_rank{event.rank}.txt", "a") as f:
        f.write(f"{event.name} {event.epoch} {event.metrics is not None}\\n")

model = YOLO()
model.new("yolov5n-seg.yaml")
for event in ("on_train_epoch_end", "on_fit_epoch_end", "on_train_end"):
    model.add_callback(event, log)
result = model.train(data="coco8-seg.yaml", epochs=2, imgsz=64, batch_size=4, workers=0)
metrics = model.val(imgsz=64, batch_size=4, workers=0)
results = model.predict(["coco8-seg/images/val/" + f for f in sys.argv[1:]], imgsz=64)
boxes = [r["boxes"].tolist() for r in results]
out = [result["save_dir"], result["metrics"]["metrics"], metrics, boxes]
open(f"out{dist.env_rank()}.json", "w").write(json.dumps(out))
"""


def run_script(cmd, cwd, timeout=300):
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def outputs(folder: Path) -> list:
    """What the scripts write (out<rank>.json), by rank."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("out*.json"))]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def copy_coco8_seg(data_dir: Path, dst: Path) -> None:
    """coco8-seg and its yaml under dst (training writes label caches beside the labels)."""
    shutil.copytree(data_dir / "coco8-seg", dst / "coco8-seg")
    for p in (dst / "coco8-seg").rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    text = (data_dir / "coco8-seg.yaml").read_text()
    lines = [f"path: {dst / 'coco8-seg'}" if s.startswith("path:") else s for s in text.split("\n")]
    (dst / "coco8-seg.yaml").write_text("\n".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["python", "torchrun"])
def test_the_seed_script(data_dir, tmp_path, ranks):
    """The seed's code runs as written, with python and with torchrun: one training run folder
    (rank 0's), the callback on every rank at each epoch, the same metrics and predictions on
    every rank, and no file written outside the run folders (but the label caches)."""
    copy_coco8_seg(data_dir, tmp_path)
    (tmp_path / "script.py").write_text(SEED_SCRIPT)
    before = files_under(tmp_path)
    images = sorted(os.listdir(tmp_path / "coco8-seg" / "images" / "val"))[:2]
    launcher = [sys.executable] if ranks == 1 else TORCHRUN
    r = run_script([*launcher, "script.py", *images], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = outputs(tmp_path)
    assert len(outs) == ranks and all(o == outs[0] for o in outs)  # the same on every rank
    save_dir, train_metrics, val_metrics, boxes = outs[0]
    assert save_dir == "runs/train/exp" and len(boxes) == 2
    assert sorted(os.listdir(tmp_path / "runs" / "train")) == ["exp"]
    assert sorted(os.listdir(tmp_path / "runs" / "val")) == ["exp"]
    assert set(val_metrics["metrics"]) == set(train_metrics)
    for rank in range(ranks):
        calls = (tmp_path / save_dir / f"calls_rank{rank}.txt").read_text().split("\n")[:-1]
        assert calls == [
            "on_train_epoch_end 1 False",
            "on_fit_epoch_end 1 True",
            "on_train_epoch_end 2 False",
            "on_fit_epoch_end 2 True",
            "on_train_end 2 True",
        ]
    new = files_under(tmp_path) - before
    ours = [f"out{rank}.json" for rank in range(ranks)]
    outside = [f for f in new - set(ours) if not f.startswith("runs/") and not f.endswith(".cache")]
    assert not outside, outside
    assert {"runs/train/exp/weights/best.pt", "runs/val/exp/metrics.json"} <= new


# a layer replaced by one of the script's own classes; a yolov5 .pt fine-tuned; a callback that
# raises on rank 1 only
CUSTOM_SCRIPT = """
import json, sys
import torch
from torch import nn
from yolo_min import YOLO, dist
from yolo_min.models import Model
from yolo_min.trainer import CallbackError

class MyConv(nn.Conv2d):
    pass

data, weights, project = sys.argv[1:]
model = Model("yolov5n.yaml", nc=3)
old = model.model[23].cv3.conv
model.model[23].cv3.conv = MyConv(old.in_channels, old.out_channels, 1, bias=False)
before = model.model[23].cv3.conv.weight.detach().clone()
custom = YOLO(model)
opts = dict(data=data, imgsz=128, batch_size=8, workers=0, project=project, noautoanchor=True)
custom.train(epochs=1, name="custom", **opts)
layer = custom.model.model[23].cv3.conv
moved = (layer.weight.detach() - before).abs().max().item()

tuned = YOLO(weights)
result = tuned.train(epochs=1, name="v5", **opts)

def fail_on_rank1(event):
    if event.rank == 1:
        raise ZeroDivisionError("planted")

failing = YOLO(model)
failing.add_callback("on_fit_epoch_end", fail_on_rank1)
try:
    failing.train(epochs=2, name="failing", **opts)
    error = None
except CallbackError as e:
    error = str(e)
w = [round(v, 6) for v in layer.weight.flatten()[:8].tolist()]
out = [type(layer).__name__, moved, w, result["metrics"]["metrics"], error]
open(f"out{dist.env_rank()}.json", "w").write(json.dumps(out))
"""


@pytest.mark.slow
def test_custom_model_and_yolov5_weights_under_torchrun(small_shapes, fixtures_dir, tmp_path):
    """Under torchrun: a Model whose layer is replaced by the script's own class trains (the
    object's own model: the layer's class kept, its weights moved, the same on both ranks); a
    yolov5 .pt fine-tunes (mAP above 0.3, the same metrics on both ranks); a callback raising on
    rank 1 stops both ranks with one line naming it and its event, last.pt kept."""
    (tmp_path / "script.py").write_text(CUSTOM_SCRIPT)
    weights = str(fixtures_dir / "predict" / "det.pt")
    r = run_script(
        [*TORCHRUN, "script.py", small_shapes, weights, str(tmp_path / "runs")], tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (kind, moved, w0, metrics, error), second = outputs(tmp_path)
    assert kind == "MyConv" and moved > 0 and second[2] == w0
    assert metrics["mAP50(B)"] > 0.3 and second[3] == metrics
    assert error and second[4] == error
    assert error.startswith("callback fail_on_rank1 for on_fit_epoch_end raised ZeroDivisionError")
    assert "(rank 1, epoch 1)" in error and "\n" not in error
    last = torch.load(tmp_path / "runs" / "failing" / "weights" / "last.pt", weights_only=True)
    assert last["epoch"] == 0  # epoch 1's checkpoint, written before the callback ran


@pytest.mark.slow
def test_yolo_train_gives_train_py_best_pt(tiny, tmp_path):
    """YOLO("yolov5n.yaml").train(...) with train.py's seed and options writes the same best.pt as
    `python train.py --cfg yolov5n.yaml ...` (the data's 2 classes: a new head on both ways)."""
    args = [*tiny, "--epochs", "1", "--amp", "off"]
    cli = [sys.executable, "train.py", "--cfg", "yolov5n.yaml", *args, "--project", str(tmp_path)]
    r = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    options = vars(trainer.get_args_parser().parse_args([*args, "--project", str(tmp_path)]))
    options = {k: v for k, v in options.items() if k not in ("cfg", "weights")}
    model = YOLO("yolov5n.yaml")
    out = model.train(**options | {"name": "api"})
    a = torch.load(tmp_path / "exp" / "weights" / "best.pt", weights_only=True)
    b = torch.load(Path(out["save_dir"]) / "weights" / "best.pt", weights_only=True)
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    # afterwards the object holds best.pt's weights, and val() defaults to the data trained on
    assert model.ckpt_path == Path(out["save_dir"]) / "weights" / "best.pt"
    ema = b["ema"]
    assert all(torch.equal(v, ema[k]) for k, v in model.model.state_dict().items())
    again = model.val(imgsz=64, amp="off", workers=0, project=str(tmp_path / "val"))
    assert again["metrics"] == out["metrics"]["metrics"]


def test_save_load_and_predict_round_trip(tmp_path, fixtures_dir):
    """A yolov5 .pt loaded, saved and loaded again predicts the same; val.py and predict.py read
    the saved file; calling the object is predict; stream=True yields the same results."""
    images = sorted((fixtures_dir / "predict" / "images").iterdir())[:3]
    model = YOLO(fixtures_dir / "predict" / "det.pt")
    assert model.task == "detect" and model.names == ["circle", "rectangle", "triangle"]
    first = model.predict([str(p) for p in images], imgsz=128)
    saved = model.save(tmp_path / "det.pt")
    again = YOLO(saved)
    assert again.ckpt_path == saved
    second = again(str(images[0].parent), imgsz=128)[:3]
    assert [r["path"] for r in second] == [str(p) for p in images]
    for a, b in zip(first, second):
        assert torch.equal(a["boxes"], b["boxes"]) and len(a["boxes"]) > 0
    streamed = list(again.predict(Image.open(images[0]), stream=True, imgsz=128))
    assert len(streamed) == 1 and torch.equal(streamed[0]["boxes"], first[0]["boxes"])
    out = predictor.run(weights=str(saved), source=str(images[0]), imgsz=128, project=str(tmp_path))
    assert out["detections"] == len(first[0]["boxes"])


@pytest.mark.slow
def test_resume_through_the_object(tiny, tmp_path):
    """A run stopped by a raising callback after epoch 1 of 2 is resumed by
    YOLO(last.pt).train(resume=True) and finishes; the callback error names the function."""

    def stop(event):
        raise RuntimeError("stop here")

    opts = vars(trainer.get_args_parser().parse_args([*tiny, "--project", str(tmp_path)]))
    opts = {k: v for k, v in opts.items() if k not in ("cfg", "weights")} | {"epochs": 2}
    model = YOLO("yolov5n.yaml")
    model.add_callback("on_fit_epoch_end", stop)
    with pytest.raises(trainer.CallbackError, match=r"callback .*stop for on_fit_epoch_end raised"):
        model.train(**opts)
    last = tmp_path / "exp" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["epoch"] == 0
    resumed = YOLO(last)
    out = resumed.train(resume=True)
    assert out["epochs"] == 2 and out["save_dir"] == str(tmp_path / "exp")
    rows = (tmp_path / "exp" / "results.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"]


def test_bad_input_is_one_clear_error_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    model = YOLO("yolov5n.yaml")
    cases = [
        (
            TypeError,
            r"unknown option 'epoch' \(did you mean 'epochs'\?\).*data, hyp",
            dict(epoch=1),
        ),
        (TypeError, r"option data=5: expected str", dict(data=5)),
        (TypeError, r"option imgsz=\[64\]: expected int", dict(imgsz=[64])),
        (TypeError, r"option freeze=3: expected a list of int", dict(freeze=3)),
        (ValueError, r"option cache='disk': expected one of auto, ram, off", dict(cache="disk")),
        (TypeError, r"train\(\): weights is not an option here", dict(weights="a.pt")),
        (
            ValueError,
            r"--device 0,1: one process per GPU, started by torchrun: torchrun "
            r"--standalone --nproc_per_node 2 ",
            dict(data="shapes", device="0,1"),
        ),
    ]
    for error, words, options in cases:
        with pytest.raises(error, match=words):
            model.train(**options)
    with pytest.raises(ValueError, match=r"val\(\): no data: give data=\.\.\., or train"):
        model.val()
    with pytest.raises(TypeError, match=r"unknown option 'save_txt'; the options are: imgsz"):
        model.predict("x.jpg", save_txt=True)
    with pytest.raises(TypeError, match=r"predict\(source\): int is not an image path"):
        model.predict(3)
    with pytest.raises(ValueError, match=r"model cfg 'nope.yaml' not found"):
        YOLO("nope.yaml")
    with pytest.raises(ValueError, match=r"missing.pt: cannot read it"):
        YOLO("missing.pt")
    with pytest.raises(ValueError, match=r"notes.pt: not a PyTorch checkpoint"):
        YOLO("notes.pt")
    with pytest.raises(TypeError, match=r"YOLO\(source\): int is not a cfg name"):
        YOLO(5)
    with pytest.raises(ValueError, match=r"unknown event 'on_epoch_end'"):
        model.add_callback("on_epoch_end", print)
    with pytest.raises(ValueError, match=r"no model yet"):
        YOLO().train(data="shapes")
    assert sorted(os.listdir(tmp_path)) == ["notes.pt"]  # nothing written


def test_device_lists(monkeypatch):
    """--device 0,1: under torchrun local rank i takes the i-th listed GPU, the list as long as the
    node's processes; in one process, the torchrun command to use instead."""
    assert dist.listed_gpus("0,1", local_rank=1, local_world_size=2, world_size=2) == "1"
    assert dist.listed_gpus("2, 3", local_rank=0, local_world_size=2, world_size=4) == "2"
    with pytest.raises(ValueError, match="lists 3 GPUs, but torchrun started 2 processes"):
        dist.listed_gpus("0,1,2", local_rank=0, local_world_size=2, world_size=2)
    with pytest.raises(ValueError, match="not a list of GPU indices"):
        dist.listed_gpus("0,cuda", local_rank=0, local_world_size=2, world_size=2)
    monkeypatch.setattr(sys, "argv", ["my_script.py", "--x", "1"])
    with pytest.raises(ValueError) as e:
        dist.setup("0,1")
    assert str(e.value).endswith("torchrun --standalone --nproc_per_node 2 my_script.py --x 1")
    # without CUDA the message echoes what was typed
    with pytest.raises(ValueError, match=r"^--device 0 asks for CUDA, but torch sees no CUDA"):
        dist.select_device("0")


def test_device_list_on_the_command_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "train.py", "--device", "0,1", "--project", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    want = "torchrun --standalone --nproc_per_node 2 train.py --device 0,1 --project"
    assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "exp").exists()


def test_validator_and_predict_take_a_model_in_memory(fixtures_dir, small_shapes, tmp_path):
    """The loops take the object's model: val on it equals val.py on its file."""
    weights = fixtures_dir / "predict" / "det.pt"
    kw = dict(data=small_shapes, imgsz=128, workers=0, project=str(tmp_path))
    from_file = validator.run(weights=str(weights), **kw)
    from_object = YOLO(weights).val(**kw)
    assert from_object["metrics"] == from_file["metrics"]
    assert from_file["metrics"]["mAP50(B)"] > 0.5
    array = np.array(Image.open(sorted((fixtures_dir / "predict" / "images").iterdir())[0]))
    assert len(YOLO(Model("yolov5n.yaml", nc=3)).predict(array, imgsz=64)) == 1
