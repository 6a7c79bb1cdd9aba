"""train.py: the recipe parts on hand-computed cases, then short single-process runs (CPU, tiny
data)."""

import copy
import csv
import itertools
import math
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from yolo_min import checkpoint, dist, shapes, trainer, validator  # noqa: E402
from yolo_min.anchors import bpr_and_aat, fit_anchors, kmeans  # noqa: E402
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config  # noqa: E402
from yolo_min.losses import YOLOLoss, scale_hyp  # noqa: E402
from yolo_min.models import Model  # noqa: E402
from yolo_min.safe_load import load_model  # noqa: E402

DEFAULT_HYP = trainer.load_hyp("")


def args_for(tmp_path, *extra):
    return trainer.get_args_parser().parse_args(
        [
            "--project",
            str(tmp_path / "runs"),
            "--imgsz",
            "64",
            "--batch-size",
            "2",
            "--workers",
            "0",
            "--epochs",
            "2",
            "--log-every",
            "1",
            *extra,
        ]
    )


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSProp"])
def test_optimizer_kernels_step_as_torchs_loop(name):
    """build_optimizer's fused (RMSprop: foreach) steps against torch's one tensor at a time."""
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient, 0 but for rounding, Adam would scale up to lr
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Conv2d(8, 2, 1))
    loop = copy.deepcopy(model)
    fast = trainer.build_optimizer(model, 0.01, 0.9, 5e-4, name=name)
    slow = trainer.build_optimizer(loop, 0.01, 0.9, 5e-4, name=name)
    assert bool(fast.defaults.get("fused")) == (name != "RMSProp")
    for group in slow.param_groups:
        group |= {"foreach": False, "fused": None}
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        for m, opt in ((model, fast), (loop, slow)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    # a checkpoint of torch's loop (an earlier version's) fits the fused optimizer
    assert checkpoint._setting_types(fast) == checkpoint._setting_types(slow)
    for a, b in zip(model.parameters(), loop.parameters()):
        if name == "SGD":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- recipe parts
def test_optimizer_groups():
    model = Model("yolov5n.yaml", nc=3)
    opt = trainer.build_optimizer(model, 0.01, 0.937, 5e-4)
    biases, norm_w, weights = (g["params"] for g in opt.param_groups)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {id(p) for p in norm_w} == {id(m.weight) for m in bns}
    assert len(biases) == len(bns) + 3  # every BN bias and the three head convs' biases
    assert all(p.ndim == 4 for p in weights)  # conv kernels only
    assert sum(map(len, (biases, norm_w, weights))) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0, 5e-4]
    assert [g["bias"] for g in opt.param_groups] == [True, False, False]
    assert all(
        g["nesterov"] and g["momentum"] == 0.937 and g["initial_lr"] == 0.01
        for g in opt.param_groups
    )


def test_lr_schedule_and_warmup():
    assert trainer.lr_factor(0, 10, 0.01) == 1.0
    assert trainer.lr_factor(5, 10, 0.01) == pytest.approx(0.505)
    assert trainer.lr_factor(10, 10, 0.01) == pytest.approx(0.01)
    assert trainer.lr_factor(5, 10, 0.01, cos=True) == pytest.approx(0.505)
    assert trainer.lr_factor(10, 10, 0.01, cos=True) == pytest.approx(0.01)
    assert trainer.lr_factor(2, 10, 0.01, cos=True) > trainer.lr_factor(
        2, 10, 0.01
    )  # cosine starts slower
    opt = trainer.build_optimizer(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), 0.01, 0.937, 5e-4
    )
    assert trainer.warmup(opt, 0, 100, 0.9, DEFAULT_HYP, 4.0) == 1
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.0, 0.0]  # bias 0.1 down, others 0 up
    assert all(g["momentum"] == 0.8 for g in opt.param_groups)
    assert trainer.warmup(opt, 50, 100, 0.9, DEFAULT_HYP, 4.0) == 2  # round(2.5) (banker's) = 2
    assert opt.param_groups[0]["lr"] == pytest.approx((0.1 + 0.009) / 2)
    assert opt.param_groups[2]["lr"] == pytest.approx(0.0045)
    assert trainer.warmup(opt, 100, 100, 0.9, DEFAULT_HYP, 4.0) == 4
    assert all(
        g["lr"] == pytest.approx(0.009) and g["momentum"] == pytest.approx(0.937)
        for g in opt.param_groups
    )


def test_ema_updates_all_float_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ema = trainer.ModelEMA(model)
    before = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].running_mean.add_(2.0)
        model[1].num_batches_tracked += 5
    ema.update()
    d = 0.9999 * (1 - math.exp(-1 / 2000))
    now, src = ema.ema.state_dict(), model.state_dict()
    for k in ("0.weight", "1.running_mean"):
        torch.testing.assert_close(now[k], d * before[k] + (1 - d) * src[k])
    assert (
        now["1.num_batches_tracked"] == before["1.num_batches_tracked"]
    )  # integers are not averaged
    assert not any(p.requires_grad for p in ema.ema.parameters()) and not ema.ema.training


def test_checkpoint_is_atomic_and_weights_only(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint.save({"epoch": 1, "rng": checkpoint.rng_state(), "w": torch.ones(3)}, path)
    with pytest.raises(Exception):  # a save that fails half-way ...
        checkpoint.save({"epoch": 2, "bad": lambda: 0}, path)
    ckpt = torch.load(path, weights_only=True)  # ... leaves the previous file whole
    assert ckpt["epoch"] == 1 and torch.equal(ckpt["w"], torch.ones(3))
    a = (torch.rand(3), np.random.rand(3), __import__("random").random())
    checkpoint.set_rng_state(ckpt["rng"])
    b = (torch.rand(3), np.random.rand(3), __import__("random").random())
    checkpoint.set_rng_state(ckpt["rng"])
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("links", [True, False], ids=["hard link", "no links"])
def test_best_is_the_last_saved_and_outlives_the_next_save(tmp_path, monkeypatch, links):
    def no_link(source, target):
        raise PermissionError(f"{target}: this filesystem has no hard links (FAT, some shares)")

    if not links:
        monkeypatch.setattr(os, "link", no_link)
    last = tmp_path / "last.pt"
    best = tmp_path / "best.pt"
    checkpoint.save({"epoch": 1}, last)
    checkpoint.copy(last, best)
    assert best.read_bytes() == last.read_bytes()
    assert best.samefile(last) == links
    checkpoint.save({"epoch": 2}, last)
    assert torch.load(best)["epoch"] == 1 and torch.load(last)["epoch"] == 2
    checkpoint.copy(last, best)
    assert torch.load(best)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_during_checkpoint_write_waits_for_it(tmp_path, monkeypatch, sig):
    real = torch.save

    def save_interrupted(obj, f):
        os.kill(os.getpid(), sig)  # arrives while the checkpoint is being written
        real(obj, f)

    # as train.py installs it (restored below)
    signal.signal(signal.SIGTERM, train.stop_on_sigterm)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if CI ignores SIGINT
    try:
        monkeypatch.setattr(torch, "save", save_interrupted)
        with pytest.raises(KeyboardInterrupt):  # raised once the file is whole and in place
            checkpoint.save({"epoch": 3, "w": torch.ones(3)}, tmp_path / "last.pt")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, old_int)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_run_folders_and_resume_lookup(tmp_path):
    """Two torchrun runs share a --project: after a restart each finds its own folder by its run id,
    not the newest one."""
    args, runs = args_for(tmp_path), tmp_path / "runs"
    assert checkpoint.make_run_dir(args, {}, "run-a", 0) == runs / "exp"
    assert checkpoint.make_run_dir(args, {}, "run-b", 0) == runs / "exp2"  # started meanwhile
    assert checkpoint.make_run_dir(args, {}, None, 0) == runs / "exp3"
    assert checkpoint.make_run_dir(args, {}, "run-a", 0) == runs / "exp"  # run a, restarted
    assert checkpoint.make_run_dir(args, {}, "run-b", 0) == runs / "exp2"
    assert (runs / "exp2" / "weights").is_dir() and (runs / "exp2" / "args.yaml").is_file()
    assert checkpoint.find_resume(args, "run-a") is None  # no last.pt yet: start afresh
    assert checkpoint.find_resume(args, None) is None
    model = Model("yolov5n.yaml", nc=1)
    opt = trainer.build_optimizer(model, 0.01, 0.9, 0.0)
    scaler, ema = torch.amp.GradScaler("cuda", enabled=False), trainer.ModelEMA(model)
    hyp, rngs = trainer.load_hyp(""), [checkpoint.rng_state()]
    state = checkpoint.training_state(model, ema, opt, scaler, 0, (0.0, 0), args, hyp, rngs)
    checkpoint.save(state, runs / "exp" / "weights" / "last.pt")
    assert checkpoint.find_resume(args, "run-a")[0] == str(runs / "exp" / "weights" / "last.pt")
    assert checkpoint.find_resume(args, "run-b") is None
    with pytest.raises(ValueError, match="no run"):
        checkpoint.find_resume(args_for(tmp_path / "empty", "--resume"), None)
    with pytest.raises(checkpoint.CheckpointError, match=r"nope.pt: cannot read it \(No such file"):
        checkpoint.find_resume(args_for(tmp_path, "--resume", str(tmp_path / "nope.pt")), None)


def test_check_anchors_refits_poor_anchors():
    rng = np.random.default_rng(0)
    wh = (
        np.concatenate([rng.normal(c, c / 10, (200, 2)) for c in (10, 40, 160)])
        .clip(3)
        .astype(np.float32)
    )
    good = fit_anchors(wh, 9, 4.0, gens=200)
    assert good.shape == (9, 2) and np.all(np.diff(good.prod(1)) >= 0)  # sorted by area
    assert bpr_and_aat(good, wh, 4.0)[0] > 0.99
    centres = kmeans(np.array([[0.0, 0.0], [0.1, 0.0], [10, 10], [10.1, 10]]), 2, rng)
    assert sorted(centres[:, 0].round(2).tolist()) == [0.05, 10.05]

    # 64x64 images, every box 60x60 pixels: the default anchors (10..373 px) miss most
    class Labels:
        labels = [{"bboxes": np.array([[0.5, 0.5, 60 / 64, 60 / 64]] * 20), "shape": (64, 64)}] * 5

    model = Model("yolov5n.yaml", nc=1)
    old = model.head.anchors.clone()
    trainer.autoanchor(model, Labels(), 1.2, args_for(Path("."), "--imgsz", "64"))
    new = (model.head.anchors * model.stride.view(-1, 1, 1)).view(-1, 2).numpy()
    assert not torch.equal(model.head.anchors, old)
    assert bpr_and_aat(new, np.full((1, 2), 60.0 * 64 / 64, np.float32), 1.2)[0] == 1.0


def test_loss_falls_on_a_fixed_batch():
    torch.manual_seed(0)
    model = Model("yolov5n.yaml", nc=2).train()
    hyp = scale_hyp(DEFAULT_HYP, 2, 64)
    crit = YOLOLoss(model, hyp)
    opt = trainer.build_optimizer(model, 0.1, 0.937, 5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    images = torch.randint(0, 255, (4, 3, 64, 64), dtype=torch.uint8)
    targets = torch.tensor(
        [
            [0, 0, 0.5, 0.5, 0.4, 0.3],
            [1, 1, 0.3, 0.6, 0.2, 0.5],
            [2, 0, 0.7, 0.2, 0.3, 0.3],
            [3, 1, 0.5, 0.5, 0.8, 0.8],
        ]
    )
    losses = []
    for _ in range(12):
        batch = {"images": images, "targets": targets}
        loss, _ = trainer.forward_loss(model, crit, batch, torch.device("cpu"), None)
        loss.backward()
        trainer.optimizer_step(model, opt, scaler, None)
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-3:]) < 0.9 * losses[0]


def test_bad_config_exits_2_before_any_work(tmp_path):
    for bad in (
        ["--cfg", "nope.yaml"],
        ["--data", str(tmp_path / "missing.yaml")],
        ["--device", "cuda:0"],
        ["--hyp", str(tmp_path / "missing_hyp.yaml")],
    ):
        if "cuda:0" in bad and torch.cuda.is_available():
            continue
        r = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "--project", str(tmp_path / "runs"), *bad],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- short runs
def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg, data", [("yolov5n.yaml", "coco8.yaml"), ("yolov5n-seg.yaml", "coco8-seg.yaml")]
)
def test_two_epochs_on_coco8(tmp_path, data_dir, cfg, data):
    out = trainer.main(args_for(tmp_path, "--cfg", cfg, "--data", str(data_dir / data)))
    run = Path(out["save_dir"])
    assert run == tmp_path / "runs" / "exp" and out["epochs"] == 2
    for f in ("weights/last.pt", "weights/best.pt", "args.yaml", "results.csv", "train_batch0.jpg"):
        assert (run / f).is_file(), f
    rows = read_csv(run / "results.csv")
    kinds = ["B", "M"] if "seg" in cfg else ["B"]
    losses = ["box", "seg", "obj", "cls"] if "seg" in cfg else ["box", "obj", "cls"]
    assert list(rows[0]) == [
        "epoch",
        *(f"train/{n}_loss" for n in losses),
        *(f"metrics/{m}({k})" for k in kinds for m in ("P", "R", "mAP50", "mAP50-95")),
        "lr/pg0",
        "lr/pg1",
        "lr/pg2",
    ]
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert all(math.isfinite(float(v)) for r in rows for v in r.values())
    assert {k[-2] for k in out["metrics"]["metrics"]} == ({"B", "M"} if "seg" in cfg else {"B"})
    assert set(out["metrics"]) >= {"metrics", "fitness", "images", "instances"}
    assert (run / "val_batch0_pred.jpg").is_file()
    ckpt = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["task"] == ("segment" if "seg" in cfg else "detect")
    assert ckpt["names"][0] == "person"
    assert (
        ckpt["ema_updates"] == 3
    )  # warmup's accumulate is 1, 1, 2 (iteration 3 waits), then the epoch's end
    assert (
        checkpoint.make_run_dir(args_for(tmp_path), {}, None, 0).name == "exp2"
    )  # the next run increments


@pytest.mark.slow
def test_final_table_is_best_pt(tmp_path, small_shapes, fixtures_dir, capsys):
    """When best.pt is the last epoch's model, train.py reports that epoch's validation (and its
    plots) instead of validating best.pt again: val.py on best.pt scores exactly the same."""
    weights = str(fixtures_dir / "predict" / "det.pt")  # yolov5-trained on shapes: mAP is not 0
    args = ("--data", small_shapes, "--weights", weights, "--imgsz", "128", "--batch-size", "8")
    out = trainer.main(args_for(tmp_path, *args, "--epochs", "1", "--noautoanchor"))
    run = Path(out["save_dir"])
    assert "Validating" not in capsys.readouterr().out and (run / "val_batch0_pred.jpg").is_file()
    kw = dict(data=small_shapes, imgsz=128, batch_size=16, workers=0, project=str(tmp_path))
    again = validator.run(weights=str(run / "weights" / "best.pt"), **kw)
    assert again["metrics"] == out["metrics"]["metrics"] and again["metrics"]["mAP50(B)"] > 0.5


@pytest.mark.slow
def test_bf16_learns_as_fp32_does(tmp_path, small_shapes):
    """train.py's step under --amp on (bfloat16 autocast, channels_last) learns the 48 small-shapes
    training images as fp32 does: 120 steps at lr 0.03 from scratch take either past mAP50 0.5 on
    them (measured: fp32 0.69, bf16 0.77)."""
    data = tmp_path / "memorise.yaml"  # validate on the training images
    data.write_text(Path(small_shapes).read_text().replace("val: val.txt", "val: train.txt"))
    ds = YOLODataset(load_data_config(str(data))["train"], 128, batch_size=16, nc=3, verbose=False)
    batches = list(build_dataloader(ds, 16, 0, shuffle=False)[0])
    torch.manual_seed(0)
    args = args_for(tmp_path, "--imgsz", "128", "--batch-size", "64", "--amp", "on")
    trainer.check_args(args, "detect", 1)  # the task's defaults: --optimizer SGD
    info = dist.DistInfo(0, 1, 1, torch.device("cpu"))
    hyp = trainer.load_hyp({"lr0": 0.03, "weight_decay": 0.0})
    model, criterion, optimizer, scaler, _, _ = trainer.build_training(Model(nc=3), hyp, args, info)
    assert model.model[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    for step in range(120):
        batch = batches[step % len(batches)]
        loss, _ = trainer.forward_loss(model, criterion, batch, info.device, torch.bfloat16)
        loss.backward()
        trainer.optimizer_step(model, optimizer, scaler, None)
    weights = tmp_path / "bf16.pt"
    torch.save({"model_cfg": model.yaml, "model": model.state_dict(), "names": []}, weights)
    kw = dict(data=str(data), imgsz=128, workers=0, amp="off", project=str(tmp_path / "val"))
    assert validator.run(weights=str(weights), **kw)["metrics"]["mAP50(B)"] > 0.5


@pytest.mark.slow
def test_validation_with_amp_matches_fp32(tmp_path, fixtures_dir):
    """val.py --amp on (bf16, channels_last) and --amp off score yolov5-trained YOLOv5n and
    YOLOv5n-seg checkpoints on the shapes val images within 0.005 mAP (measured: at most 0.0048)."""
    for weights in ("det.pt", "seg.pt"):
        kw = dict(weights=str(fixtures_dir / "predict" / weights), data="shapes", imgsz=128)
        kw |= dict(workers=0, project=str(tmp_path), exist_ok=True)
        off, on = (validator.run(**kw, amp=amp, name=amp)["metrics"] for amp in ("off", "on"))
        assert off["mAP50(B)"] > 0.85  # trained models: differences are not noise on a few hits
        for k in [k for k in off if k.startswith("mAP")]:
            assert on[k] == pytest.approx(off[k], abs=0.005), (weights, k)


@pytest.mark.slow
def test_shapes_dataset_is_the_default(tmp_path):
    out = trainer.main(
        args_for(tmp_path, "--batch-size", "16", "--epochs", "1", "--log-every", "4")
    )
    assert read_csv(Path(out["save_dir"]) / "results.csv")[0]["epoch"] == "1"
    assert out["metrics"]["images"] == shapes.N_VAL and out["metrics"]["instances"] > shapes.N_VAL


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, data_dir, monkeypatch):
    """A run of 3 epochs stopped after epoch 1, resumed with --resume, stopped after epoch 2 and
    resumed as after a torchrun restart ends with the checkpoint and results of an uninterrupted
    run (with loader workers: augmentation is seeded per sample)."""
    common = [
        "--data",
        str(data_dir / "coco8.yaml"),
        "--epochs",
        "3",
        "--noautoanchor",
        "--workers",
        "2",
    ]
    whole = Path(trainer.main(args_for(tmp_path / "a", *common))["save_dir"])

    save = checkpoint.save

    def save_then_stop(stop_after):  # the run is killed right after that epoch's last.pt is written
        def f(ckpt, path):
            save(ckpt, path)
            if path.name == "last.pt" and ckpt["epoch"] == stop_after:
                raise KeyboardInterrupt

        return f

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "resume-test")  # as if under torchrun
    monkeypatch.setattr(checkpoint, "save", save_then_stop(0))
    with pytest.raises(KeyboardInterrupt):
        trainer.main(args_for(tmp_path / "b", *common))
    run = tmp_path / "b" / "runs" / "exp"
    monkeypatch.setattr(checkpoint, "save", save_then_stop(1))
    monkeypatch.setattr(trainer, "TRAININGS_STARTED", itertools.count())
    with pytest.raises(KeyboardInterrupt):
        trainer.main(
            trainer.get_args_parser().parse_args(["--resume", str(run / "weights" / "last.pt")])
        )
    monkeypatch.setattr(checkpoint, "save", save)
    # the same command again, as torchrun restarts it: a new process, its first training
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(trainer, "TRAININGS_STARTED", itertools.count())
    assert Path(trainer.main(args_for(tmp_path / "b", *common))["save_dir"]) == run

    a, b = (torch.load(r / "weights" / "last.pt", weights_only=True) for r in (whole, run))
    assert a["epoch"] == b["epoch"] == 2 and a["ema_updates"] == b["ema_updates"]
    for key in ("model", "ema"):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), f"{key}.{k}"
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert read_csv(whole / "results.csv") == read_csv(run / "results.csv")
    assert sorted(p.name for p in run.parent.iterdir()) == ["exp"]


def test_weights_transfer_and_freeze(tmp_path, data_dir, fixtures_dir, capsys):
    """--weights: a yolov5 .pt (nc 80) into an nc-80 model: everything but the anchors is taken
    over."""
    src = fixtures_dir / "yolov5n_random_v5format.pt"
    args = args_for(
        tmp_path, "--data", str(data_dir / "coco8.yaml"), "--weights", str(src), "--freeze", "10"
    )
    model = trainer.build_model(args, load_data_config(args.data), None)
    n = len(model.state_dict())
    assert f"Transferred {n - 1}/{n} items" in capsys.readouterr().out  # all but model.24.anchors
    ref = load_model(src).state_dict()
    assert all(
        torch.equal(v, ref[k]) for k, v in model.state_dict().items() if not k.endswith("anchors")
    )
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(int(k.split(".")[1]) < 10 for k in frozen)  # the backbone, layers 0-9
    assert all(p.requires_grad for k, p in model.named_parameters() if int(k.split(".")[1]) >= 10)


# ---------------------------------------------------------------- the training step, directly
def test_forward_loss_feeds_the_model_and_the_loss():
    """forward_loss (detection): the model gets the uint8 images / 255 (no ImageNet normalisation)
    under autocast to the amp dtype; the loss runs outside autocast, on float32 head outputs."""
    torch.manual_seed(0)
    model = Model("yolov5n.yaml", nc=2).train()
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5]])
    seen, loss_fn = {}, YOLOLoss(model, scale_hyp(DEFAULT_HYP, 2, 64))

    def pre_hook(module, inputs):
        seen["input"], seen["model_autocast"] = inputs[0].clone(), torch.is_autocast_enabled("cpu")

    def criterion(preds, *labels):
        seen["loss_autocast"] = torch.is_autocast_enabled("cpu")
        seen["pred_dtypes"] = {p.dtype for p in preds}
        return loss_fn(preds, *labels)

    model.register_forward_pre_hook(pre_hook)
    batch = {"images": images, "targets": targets}
    loss, items = trainer.forward_loss(model, criterion, batch, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(seen["input"], images.float() / 255)
    assert seen["model_autocast"] and not seen["loss_autocast"]
    assert seen["pred_dtypes"] == {torch.float32} and loss.dtype == torch.float32
    assert list(items) == ["box", "obj", "cls"] and math.isfinite(loss.item())
    trainer.forward_loss(model, criterion, batch, torch.device("cpu"), None)
    assert not seen["model_autocast"]  # amp None: float32, no autocast


def test_loss_scales_with_the_world_size(tmp_path, monkeypatch):
    """YOLOLoss's loss is the global batch's summed per-image loss (DDP averages the ranks'
    gradients): world_size=2 gives exactly twice world_size=1's loss on the same predictions, the
    items (per-image means) unchanged. build_training gives the criterion info.world_size and the
    loss gains scale_hyp rescales; its decay is for 64 images a step (batch x accumulate / 64)."""
    monkeypatch.setattr(trainer, "DDP", lambda model, device_ids=None: model)  # no process group
    args = args_for(tmp_path, "--batch-size", "24", "--amp", "off")
    trainer.check_args(args, "detect", 2)
    torch.manual_seed(0)
    model = Model("yolov5n.yaml", nc=2)
    built = {}
    for ws in (1, 2):
        info = dist.DistInfo(0, ws, ws, torch.device("cpu"))
        built[ws] = trainer.build_training(model, DEFAULT_HYP, args, info)
    one, two = built[1][1], built[2][1]
    assert (one.world_size, two.world_size) == (1, 2)
    assert one.hyp == two.hyp == scale_hyp(DEFAULT_HYP, 2, 64, 3)
    decay = DEFAULT_HYP["weight_decay"] * 24 * 3 / 64  # accumulate round(64 / 24) = 3
    assert built[2][2].param_groups[2]["weight_decay"] == pytest.approx(decay, rel=1e-12)
    images = torch.rand(3, 3, 64, 64)
    targets = torch.tensor(
        [[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5], [2, 0, 0.7, 0.2, 0.3, 0.3]]
    )
    with torch.no_grad():
        preds = model.train()(images)
    (loss1, items1), (loss2, items2) = one(preds, targets), two(preds, targets)
    assert loss1.item() > 0 and torch.equal(loss2, 2 * loss1)
    assert loss1.shape == (1,) and loss1.item() == (sum(items1.values()) * 3).item()  # x batch
    assert items1.keys() == items2.keys()
    assert all(torch.equal(items1[k], items2[k]) for k in items1)


def test_epoch_ends_with_a_step(tmp_path, tiny, monkeypatch):
    """train_one_epoch after warmup (epoch 30 of 40), 6 batches, accumulate 4 (--batch-size 16):
    steps after batches 4 and 6, the last one forced by the epoch's end (6 is no multiple of 4),
    so no gradient is pending at the checkpoint and the last batches' gradients are not lost."""
    data = load_data_config(tiny[tiny.index("--data") + 1])
    ds = YOLODataset(data["train"], 64, nc=2, verbose=False)
    batches = list(build_dataloader(ds, 2, 0, shuffle=False)[0])[:6]
    args = args_for(tmp_path, "--batch-size", "16", "--epochs", "40", "--amp", "off")
    args.log_every = 100
    trainer.check_args(args, "detect", 1)
    torch.manual_seed(0)
    info = dist.DistInfo(0, 1, 1, torch.device("cpu"))
    training = trainer.build_training(Model(nc=2), DEFAULT_HYP, args, info)
    model, ema = training.model, training.ema
    start = {k: v.clone() for k, v in model.state_dict().items()}
    forwards, steps, after = [], [], []
    real_forward, real_step = trainer.forward_loss, trainer.optimizer_step

    def forward(*args, **kwargs):
        forwards.append(len(forwards) + 1)
        return real_forward(*args, **kwargs)

    def step(*args, **kwargs):
        steps.append(len(forwards))  # the batches seen so far
        real_step(*args, **kwargs)
        after.append({k: v.clone() for k, v in model.state_dict().items()})

    monkeypatch.setattr(trainer, "forward_loss", forward)
    monkeypatch.setattr(trainer, "optimizer_step", step)
    setup = trainer.Setup(
        args, None, DEFAULT_HYP, model, batches, val_loader=None, save_dir=tmp_path
    )
    losses, _ = trainer.train_one_epoch(training, setup, 30)
    assert forwards == [1, 2, 3, 4, 5, 6] and steps == [4, 6] and ema.updates == 2
    assert all(p.grad is None for p in model.parameters())  # none pending
    final = model.state_dict()
    assert all(torch.equal(final[k], after[-1][k]) for k in final)
    weights = [k for k, p in model.named_parameters()]
    assert not all(torch.equal(after[0][k], after[1][k]) for k in weights)  # moved at batch 6
    assert not all(torch.equal(start[k], after[0][k]) for k in weights)
    assert set(losses) == {"box", "obj", "cls"} and all(map(math.isfinite, losses.values()))


def test_resume_restores_the_grad_scaler_on_a_cpu(tmp_path):
    """checkpoint.restore loads a saved GradScaler state into the fresh scaler: its scale and
    growth tracker as saved (1024, 3), not a fresh scaler's (65536, 0). A CPU scaler
    (torch.amp.GradScaler("cpu"), enabled) stands in for train.py's CUDA fp16 one, which only a GPU
    run enables; an empty saved state (no scaler) leaves the fresh scaler as it is."""
    torch.manual_seed(0)
    args, hyp, rngs = args_for(tmp_path), trainer.load_hyp(""), [checkpoint.rng_state()]
    model = Model("yolov5n.yaml", nc=1)  # saved, then restored into (only the scaler is new)
    ema, opt = trainer.ModelEMA(model), trainer.build_optimizer(model, 0.01, 0.9, 0.0)
    saved = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    saved.load_state_dict(saved.state_dict() | {"_growth_tracker": 3})
    want = saved.state_dict()
    assert want["scale"] == 1024.0 and want["_growth_tracker"] == 3 and saved.is_enabled()
    state = checkpoint.training_state(model, ema, opt, saved, 0, (0.0, 0), args, hyp, rngs)
    checkpoint.save(state, tmp_path / "last.pt")
    ckpt = checkpoint.load(tmp_path / "last.pt")
    assert ckpt["scaler"] == want
    fresh = torch.amp.GradScaler("cpu")
    assert fresh.state_dict()["scale"] == 65536.0 and fresh.state_dict()["_growth_tracker"] == 0
    assert checkpoint.restore(ckpt, model, ema, opt, fresh, 0, 1) is True
    assert fresh.state_dict() == want and fresh.get_scale() == 1024.0
    untouched = torch.amp.GradScaler("cpu")
    assert checkpoint.restore(ckpt | {"scaler": {}}, model, ema, opt, untouched, 0, 1) is True
    assert untouched.state_dict() == torch.amp.GradScaler("cpu").state_dict()


def test_fit_shuffles_each_epoch_by_the_seeded_sampler(tmp_path, tiny, monkeypatch):
    """fit draws each epoch's training images in the order of the EpochSampler seeded with --seed
    and the epoch: torch.randperm(32) seeded with seed + epoch, a new order every epoch."""
    orders, real = [], trainer.forward_loss

    def forward(model, criterion, batch, device, amp):
        orders.append(batch["indices"].tolist())
        return real(model, criterion, batch, device, amp)

    monkeypatch.setattr(trainer, "forward_loss", forward)
    flags = ["--epochs", "2", "--seed", "3", "--noval", "--nosave", "--amp", "off"]
    out = trainer.main(
        trainer.get_args_parser().parse_args([*tiny, *flags, "--project", str(tmp_path)])
    )
    assert out["epochs"] == 2 and len(orders) == 8  # 32 images, batch 8: 4 batches an epoch
    epochs = [sum(orders[4 * e : 4 * e + 4], []) for e in range(2)]
    for e, order in enumerate(epochs):
        assert order == torch.randperm(32, generator=torch.Generator().manual_seed(3 + e)).tolist()
    assert epochs[0] != epochs[1]


def test_run_reports_precision_device_eta_and_minutes(tmp_path, tiny, capsys):
    """A run's first lines name the device and the precision in use, each progress line gives the
    epoch's eta and the whole run's, and the last line the run's time in minutes."""
    flags = ["--epochs", "2", "--noval", "--nosave", "--amp", "off", "--project", str(tmp_path)]
    trainer.main(trainer.get_args_parser().parse_args([*tiny, *flags]))
    out = capsys.readouterr().out
    assert f"detect training: 1 rank(s) on cpu, batch 8, 2 epochs, in {tmp_path / 'exp'}" in out
    assert "\nprecision: fp32 (--amp off)\n" in out
    clock = r"\d+:\d\d:\d\d"
    progress = rf"epoch (\d)/2 \[(\d)/4\]  [\d.]+ it/s  eta {clock} \(run {clock}\)  box "
    assert re.findall(progress, out) == [("1", "2"), ("1", "4"), ("2", "2"), ("2", "4")]
    assert "epoch 2/2 [4/4]" in out and "eta 0:00:00 (run 0:00:00)" in out.split("[4/4]")[-1]
    assert re.search(r"\n2 epochs in \d+\.\d minutes\n", out) and "hours" not in out


# Page faults of 48 MB tensors, each freed at once, in a fresh process (a used heap may hold a free
# block that large already): before, within and after freed_memory_kept.
FAULTS = """
import resource, torch
from yolo_min import trainer

def faults_of_large_tensors():
    # the first ones warm the heap up
    for _ in range(6):
        torch.empty(12_000_000).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.empty(12_000_000).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults_of_large_tensors()
with trainer.freed_memory_kept():
    kept = faults_of_large_tensors()
print(plain, kept)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_kept_spares_the_page_faults():
    """glibc maps a 48 MB block afresh each time (thousands of page faults); within
    freed_memory_kept (training) a freed one's pages serve the next: none once warm."""
    r = subprocess.run([sys.executable, "-c", FAULTS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    plain, kept = map(int, r.stdout.split())
    assert kept < 50 < plain
