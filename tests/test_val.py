"""val.py: evaluate() through the real data pipeline with an oracle model (checked against
pycocotools on the written predictions.json), and the command line end to end on real
checkpoints."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import yaml

from yolo_min import validator
from yolo_min.checkpoint import next_run_dir
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config
from yolo_min.models import Model

ROOT = Path(__file__).resolve().parents[1]


def val_args(weights, data, imgsz: int, *more):
    """val.py's arguments for these tests: CPU, no workers, batches of 2, conf 1e-4, then `more`."""
    flags = f"--imgsz {imgsz} --batch-size 2 --device cpu --workers 0 --conf-thres 0.0001".split()
    args = ["--weights", weights, "--data", data, *flags, *more]
    return validator.get_args_parser().parse_args([str(a) for a in args])


class Oracle(nn.Module):
    """Stands in for a network: replays the loader's labels as decoded predictions (jittered,
    random scores, one miss per image, a few false positives); for segmentation, prototype k is the
    k-th GT mask."""

    def __init__(self, dataset, batch_size, task, nc=80, nm=32):
        super().__init__()
        self.task, self.nc, self.nm = task, nc, nm if task == "segment" else 0
        self.head, self.names = SimpleNamespace(nm=self.nm), [str(i) for i in range(nc)]
        self.batches = iter(build_dataloader(dataset, batch_size, workers=0, shuffle=False)[0])
        self.anchor = nn.Parameter(torch.zeros(1))  # gives evaluate() a device
        self.rng = np.random.default_rng(0)

    def forward(self, images):
        batch, rng = next(self.batches), self.rng
        bs, _, h, w = images.shape
        preds = torch.zeros(bs, 40, 5 + self.nc + self.nm)
        for i in range(bs):
            t = batch["targets"][batch["targets"][:, 0] == i]
            for k, (_, c, cx, cy, bw, bh) in enumerate(t.tolist()[:30]):
                if k == 1:
                    continue  # a miss
                s = rng.uniform(0.0, 0.08)
                box = [
                    (cx + rng.normal() * s * bw) * w,
                    (cy + rng.normal() * s * bh) * h,
                    bw * np.exp(rng.normal() * s) * w,
                    bh * np.exp(rng.normal() * s) * h,
                ]
                preds[i, k, :5] = torch.tensor([*box, 1.0])
                preds[i, k, 5 + int(c)] = rng.uniform(0.05, 1.0)
                if self.nm:
                    preds[i, k, 5 + self.nc + k] = 1.0
            for k in range(30, 33):  # false positives
                preds[i, k, :5] = torch.tensor(
                    [rng.uniform(10, w - 10), rng.uniform(10, h - 10), 20, 20, 1.0]
                )
                preds[i, k, 5 + int(rng.integers(0, self.nc))] = rng.uniform(0.05, 1.0)
        if self.task == "detect":
            return preds
        masks = batch["masks"]  # (bs, h/4, w/4) overlap index maps, value k+1 = k-th target
        protos = torch.stack([(masks == k + 1).float() * 20 - 10 for k in range(self.nm)], 1)
        return preds, protos


def cocoeval(gt_file, pred_file, iou_type):
    coco, cocoeval = (
        pytest.importorskip("pycocotools.coco"),
        pytest.importorskip("pycocotools.cocoeval"),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        gt = coco.COCO(str(gt_file))
        ev = cocoeval.COCOeval(gt, gt.loadRes(str(pred_file)), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats[0], ev.stats[1]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name, task", [("coco8", "detect"), ("coco8-seg", "segment")])
def test_evaluate_oracle_matches_pycocotools_on_predictions_json(data_dir, tmp_path, name, task):
    data = load_data_config(str(data_dir / f"{name}.yaml"))
    dataset = YOLODataset(
        data["val"], imgsz=160, task=task, rect=True, batch_size=2, stride=32, nc=80
    )
    loader, _ = build_dataloader(dataset, 2, workers=0, shuffle=False)
    model = Oracle(dataset, 2, task)
    res = validator.evaluate(model, loader, save_json=tmp_path / "p.json")
    m = res["metrics"]
    assert (
        res["images"] == 4
        and res["instances"] == 17
        and set(res["speed"]) == {"preprocess", "inference", "nms"}
    )
    gt_file = data_dir / name / "annotations/instances_val.json"
    ap, ap50 = cocoeval(gt_file, tmp_path / "p.json", "bbox")
    assert 0.2 < ap < 0.95
    assert m["mAP50-95(B)"] == pytest.approx(ap, abs=1e-3)  # GT: label files here, json there
    assert m["mAP50(B)"] == pytest.approx(ap50, abs=1e-3)
    assert 0 < m["P(B)"] <= 1 and 0 < m["R(B)"] < 1
    if task == "segment":
        ap, ap50 = cocoeval(gt_file, tmp_path / "p.json", "segm")
        assert 0.1 < ap < 0.95
        assert m["mAP50-95(M)"] == pytest.approx(ap, abs=0.005)
        assert m["mAP50(M)"] == pytest.approx(ap50, abs=0.005)
        want = sum(0.1 * m[f"mAP50({k})"] + 0.9 * m[f"mAP50-95({k})"] for k in "BM")
        assert res["fitness"] == pytest.approx(want)
    again = validator.evaluate(Oracle(dataset, 2, task), loader)  # no json: pruned mask work
    assert again["metrics"] == res["metrics"]
    table = validator.format_table(res, data["names"], verbose=True)
    assert "person" in table and len(table.splitlines()) == 2 + len(res["per_class"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["yolov5", "yolo_min-seg"])
def test_val_main_on_checkpoints(fixtures_dir, data_dir, tmp_path, kind):
    if kind == "yolov5":
        weights, data = fixtures_dir / "yolov5n_random_v5format.pt", data_dir / "coco8.yaml"
    else:
        model = Model("yolov5n-seg.yaml", nc=80)
        weights, data = tmp_path / "seg.pt", data_dir / "coco8-seg.yaml"
        torch.save(
            {
                "model_cfg": model.yaml,
                "model": model.state_dict(),
                "ema": None,
                "names": model.names,
                "task": model.task,
            },
            weights,
        )
    more = "--max-det 100 --save-json --coco-ids --plots --verbose --name exp".split()
    args = val_args(weights, data, 96, *more, "--project", tmp_path / "runs")
    res = validator.main(args)
    out = tmp_path / "runs" / "exp"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["images"] == 4 and metrics["instances"] == 17
    kinds = "BM" if kind != "yolov5" else "B"
    names = [f"{m}({k})" for k in kinds for m in ("P", "R", "mAP50", "mAP50-95")]
    assert list(metrics["metrics"]) == names and metrics["metrics"] == res["metrics"]
    preds = json.loads((out / "predictions.json").read_text())
    assert preds and {p["image_id"] for p in preds} <= {36, 42, 49, 61}
    assert all(p["category_id"] in validator.COCO91_IDS and len(p["bbox"]) == 4 for p in preds)
    assert all("segmentation" in p for p in preds) == (kind != "yolov5")
    assert (out / "val_batch0_labels.jpg").exists() and (out / "val_batch0_pred.jpg").exists()


def test_save_dir_increments(tmp_path):
    assert next_run_dir(str(tmp_path), "exp", False) == tmp_path / "exp"
    (tmp_path / "exp").mkdir()
    assert next_run_dir(str(tmp_path), "exp", False) == tmp_path / "exp2"
    assert next_run_dir(str(tmp_path), "exp", True) == tmp_path / "exp"


@pytest.mark.slow
def test_val_under_torchrun_equals_one_process(fixtures_dir, data_dir, tmp_path):
    # batch 3 over 2 ranks: rank 0 scores images 0-2, rank 1 image 3; each rank must print the
    # 1-process numbers
    common = [
        str(ROOT / "val.py"),
        "--weights",
        str(fixtures_dir / "yolov5n_random_v5format.pt"),
        "--data",
        str(data_dir / "coco8.yaml"),
        "--imgsz",
        "96",
        "--batch-size",
        "3",
        "--device",
        "cpu",
        "--workers",
        "0",
        "--conf-thres",
        "0.0001",
        "--project",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, *common, "--name", "one"],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *common,
            "--name",
            "two",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    one, two = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("one", "two"))
    assert (
        two["images"] == 4 and two["metrics"] == one["metrics"] and one["metrics"]["mAP50(B)"] > 0
    )


# the official COCO 2017 category id of each of the 80 detection classes, by name (ids 12, 26, 29,
# 30, 45, 66, 68, 69, 71, 83 and 91 are unused); ../shared's annotations number them 1..80 instead
OFFICIAL_COCO_IDS = {
    "person": 1,
    "bicycle": 2,
    "car": 3,
    "motorcycle": 4,
    "airplane": 5,
    "bus": 6,
    "train": 7,
    "truck": 8,
    "boat": 9,
    "traffic light": 10,
    "fire hydrant": 11,
    "stop sign": 13,
    "parking meter": 14,
    "bench": 15,
    "bird": 16,
    "cat": 17,
    "dog": 18,
    "horse": 19,
    "sheep": 20,
    "cow": 21,
    "elephant": 22,
    "bear": 23,
    "zebra": 24,
    "giraffe": 25,
    "backpack": 27,
    "umbrella": 28,
    "handbag": 31,
    "tie": 32,
    "suitcase": 33,
    "frisbee": 34,
    "skis": 35,
    "snowboard": 36,
    "sports ball": 37,
    "kite": 38,
    "baseball bat": 39,
    "baseball glove": 40,
    "skateboard": 41,
    "surfboard": 42,
    "tennis racket": 43,
    "bottle": 44,
    "wine glass": 46,
    "cup": 47,
    "fork": 48,
    "knife": 49,
    "spoon": 50,
    "bowl": 51,
    "banana": 52,
    "apple": 53,
    "sandwich": 54,
    "orange": 55,
    "broccoli": 56,
    "carrot": 57,
    "hot dog": 58,
    "pizza": 59,
    "donut": 60,
    "cake": 61,
    "chair": 62,
    "couch": 63,
    "potted plant": 64,
    "bed": 65,
    "dining table": 67,
    "toilet": 70,
    "tv": 72,
    "laptop": 73,
    "mouse": 74,
    "remote": 75,
    "keyboard": 76,
    "cell phone": 77,
    "microwave": 78,
    "oven": 79,
    "toaster": 80,
    "sink": 81,
    "refrigerator": 82,
    "book": 84,
    "clock": 85,
    "vase": 86,
    "scissors": 87,
    "teddy bear": 88,
    "hair drier": 89,
    "toothbrush": 90,
}


def test_coco_ids_are_the_official_category_ids(fixtures_dir, data_dir, tmp_path):
    """--save-json writes category_id = class + 1 (as ../shared's annotations number them); with
    --coco-ids the same detections, in the same order, carry the official COCO id of their class.
    (Random weights, a low threshold and many detections per image: all 80 classes are
    predicted.)"""
    names = yaml.safe_load((data_dir / "coco8.yaml").read_text())["names"]
    cats = json.loads((data_dir / "coco8" / "annotations" / "instances_val.json").read_text())
    assert {c["id"]: c["name"] for c in cats["categories"]} == {i + 1: names[i] for i in range(80)}
    official = [OFFICIAL_COCO_IDS[names[i]] for i in range(80)]
    assert len(set(official)) == 80
    for name, extra in (("plain", []), ("coco", ["--coco-ids"])):
        weights = fixtures_dir / "yolov5n_random_v5format.pt"
        more = ["--max-det", 3000, "--save-json", "--project", tmp_path, "--name", name, *extra]
        validator.main(val_args(weights, data_dir / "coco8.yaml", 64, *more))
    plain, coco = (
        json.loads((tmp_path / n / "predictions.json").read_text()) for n in ("plain", "coco")
    )
    classes = [p["category_id"] - 1 for p in plain]
    assert len(plain) == len(coco) > 0
    assert sorted(set(classes)) == list(range(80))  # every class, so every id is checked
    assert [{**c, "category_id": 0} for c in coco] == [{**p, "category_id": 0} for p in plain]
    assert [c["category_id"] for c in coco] == [official[k] for k in classes]


def test_bad_input_is_one_line_exit_2(fixtures_dir, data_dir, tmp_path):
    """A missing --data file, and a --weights file that is no checkpoint (text): one line on
    stderr, exit code 2."""
    text = tmp_path / "notes.pt"
    text.write_text("these are not weights\n")
    common = [
        sys.executable,
        str(ROOT / "val.py"),
        "--imgsz",
        "64",
        "--workers",
        "0",
        "--project",
        str(tmp_path / "runs"),
    ]
    cases = {
        "missing.yaml": [
            "--weights",
            str(fixtures_dir / "yolov5n_random_v5format.pt"),
            "--data",
            str(tmp_path / "missing.yaml"),
        ],
        "not a PyTorch checkpoint": [
            "--weights",
            str(text),
            "--data",
            str(data_dir / "coco8.yaml"),
        ],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        msg: subprocess.Popen(
            [*common, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for msg, args in cases.items()
    }
    for msg, p in procs.items():
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"val.py did not end: {cases[msg]}")
        assert p.returncode == 2 and len(err.strip().splitlines()) == 1, (msg, p.returncode, err)
        assert err.startswith("val.py: error: ") and msg in err, err
    assert not (tmp_path / "runs").exists()
