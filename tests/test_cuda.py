"""On a CUDA GPU (skipped without one; bench/gpu_check.sh runs them): a fp16 autocast step with
GradScaler against the float32 step, an AMP run resumed from its checkpoint against the
uninterrupted run, channels_last against contiguous, the classifier's batched augmentation on the
GPU against the CPU, val.py and predict.py on the GPU against the CPU and yolov5, and
SyncBatchNorm in a one-rank process group. Tolerances are stated per test; what was measured on an
H200 is in README's GPU section."""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn as nn
from test_predict import agreement
from test_train import read_csv

from yolo_min import checkpoint, cls_augment, dist, predictor, trainer, validator
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config
from yolo_min.models import Model, amp_dtype

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU, CPU = torch.device("cuda", 0), torch.device("cpu")
CFGS = {"detect": ("yolov5n.yaml", "coco8.yaml"), "segment": ("yolov5n-seg.yaml", "coco8-seg.yaml")}


def fixed_batch(data_dir: Path, task: str) -> dict:
    """coco8(-seg)'s 4 training images at 128 px, letterboxed (no augmentation), as one batch."""
    files = load_data_config(str(data_dir / CFGS[task][1]))["train"]
    ds = YOLODataset(files, 128, task=task, batch_size=4, nc=80, verbose=False)
    return next(iter(build_dataloader(ds, 4, 0, shuffle=False)[0]))


def training_objects(model: Model, amp: str, device: torch.device) -> tuple:
    """train.py's (model, criterion, optimizer, scaler) for one process on device."""
    args = trainer.get_args_parser().parse_args(["--amp", amp, "--imgsz", "128"])
    trainer.check_args(args, model.task, 1)
    info = dist.DistInfo(0, 1, 1, device)
    return trainer.build_training(model.to(device), trainer.load_hyp(""), args, info)[:4]


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_fp16_step_agrees_with_float32(data_dir, task):
    """train.py's step on a fixed batch: under fp16 autocast (channels_last, GradScaler) the loss
    items are within 1% of the float32 step's on the GPU, and those within 1% of the CPU's; the
    unscaled gradients point the same way (cosine > 0.95). A step whose scaled gradients overflow
    is skipped and halves the scale, as GradScaler does; then the step is repeated."""
    batch = fixed_batch(data_dir, task)
    torch.manual_seed(0)
    model = Model(CFGS[task][0], nc=80)
    results = []
    for amp, device in (("off", CPU), ("off", GPU), ("auto", GPU)):
        net, criterion, optimizer, scaler = training_objects(copy.deepcopy(model), amp, device)
        dtype = amp_dtype(device, amp)
        assert scaler.is_enabled() == (dtype == torch.float16)
        layout = torch.channels_last if dtype else torch.contiguous_format
        assert net.model[0].conv.weight.is_contiguous(memory_format=layout)
        for _ in range(5):
            loss, items = trainer.forward_loss(net, criterion, batch, device, dtype)
            scale = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.scale(loss).backward()
            grads = flat_grads(net) / scale
            before = [p.detach().clone() for p in net.parameters()]
            trainer.optimizer_step(net, optimizer, scaler, None)
            moved = any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
            if grads.isfinite().all():
                break
            assert not moved and scaler.get_scale() == scale / 2  # skipped, scale halved
        assert moved and grads.isfinite().all()
        results.append(({k: v.item() for k, v in items.items()}, grads.cpu()))
    (cpu_items, cpu_grads), (fp32, fp32_grads), (fp16, fp16_grads) = results
    cosines = [
        nn.functional.cosine_similarity(a, b, 0).item()
        for a, b in ((cpu_grads, fp32_grads), (fp32_grads, fp16_grads))
    ]
    print(f"\n{task} loss items: cpu {cpu_items}\n  gpu fp32 {fp32}\n  gpu fp16 {fp16}")
    print(f"  gradient cosines: cpu-gpu fp32 {cosines[0]:.6f}, gpu fp32-fp16 {cosines[1]:.6f}")
    for a, b in ((cpu_items, fp32), (fp32, fp16)):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=0.01) for k in a)
    assert min(cosines) > 0.95


@pytest.mark.slow
def test_amp_run_resumes_as_it_would_have_continued(tmp_path, tiny, monkeypatch):
    """3 epochs on the GPU with --amp auto (fp16, GradScaler) against the same run stopped after
    epoch 1 and resumed: the same GradScaler state, epochs and EMA updates; weights within 1e-3 of
    their scale (CUDA's atomic adds make reductions order-dependent, so not bit for bit) and
    training losses within 1e-3; the checkpoint's tensors are on the CPU; the CUDA random state
    saved in it is what set_rng_state restores."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    common = [*tiny, "--epochs", "3", "--device", "0", "--amp", "auto"]
    parse = trainer.get_args_parser().parse_args
    whole = Path(trainer.main(parse([*common, "--project", str(tmp_path / "a")]))["save_dir"])
    save = checkpoint.save

    def save_then_stop(state, path):
        save(state, path)
        if Path(path).name == "last.pt" and state["epoch"] == 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        trainer.main(parse([*common, "--project", str(tmp_path / "b")]))
    last = tmp_path / "b" / "exp" / "weights" / "last.pt"
    first = torch.load(last, weights_only=True)
    monkeypatch.setattr(checkpoint, "save", save)
    resumed = Path(trainer.main(parse(["--resume", str(last)]))["save_dir"])

    saved = first["rng"]["ranks"][0]["cuda"]
    assert len(saved) == torch.cuda.device_count() and first["scaler"]["scale"] > 0
    checkpoint.set_rng_state(first["rng"]["ranks"][0])
    assert torch.equal(torch.cuda.get_rng_state(0), saved[0])
    a, b = (torch.load(r / "weights" / "last.pt", weights_only=True) for r in (whole, resumed))
    assert a["epoch"] == b["epoch"] == 2 and a["ema_updates"] == b["ema_updates"]
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 0
    for key in ("model", "ema"):
        for k, v in a[key].items():
            assert v.device == CPU and b[key][k].device == CPU
            if v.dtype.is_floating_point:
                err = (v - b[key][k]).abs().max().item()
                assert err <= 1e-3 * max(v.abs().max().item(), 1e-3), (key, k, err)
    rows_a, rows_b = read_csv(whole / "results.csv"), read_csv(resumed / "results.csv")
    assert len(rows_a) == len(rows_b) == 3
    for ra, rb in zip(rows_a, rows_b):
        for k in [k for k in ra if k.startswith("train/")]:
            assert float(rb[k]) == pytest.approx(float(ra[k]), rel=1e-3, abs=1e-6), k


def leaves(out) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or nested tuples and lists of them)."""
    return [out] if torch.is_tensor(out) else [t for o in out for t in leaves(o)]


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov5n-seg.yaml", "yolov5n-cls.yaml"])
def test_channels_last_gives_the_same_outputs(cfg):
    """Eval outputs of a channels_last model equal the contiguous one's on the GPU: within 1e-3 of
    their scale in float32, 1e-2 under fp16 autocast."""
    torch.manual_seed(0)
    model = Model(cfg, nc=3).to(GPU).eval()
    fast = copy.deepcopy(model).to(memory_format=torch.channels_last)
    x = torch.rand(2, 3, 128, 160, device=GPU)
    for dtype, tol in ((None, 1e-3), (torch.float16, 1e-2)):
        with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype is not None):
            outs = [model(x), fast(x.contiguous(memory_format=torch.channels_last))]
        a, b = (torch.cat([t.float().flatten() for t in leaves(o)]) for o in outs)
        assert (a - b).abs().max() <= tol * a.abs().max(), (dtype, (a - b).abs().max().item())


def test_fixture_outputs_in_float32(fixtures_dir, monkeypatch):
    """YOLOv5n on the GPU in float32 (TF32 off) reproduces yolov5's CPU outputs within 1e-3."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    fx = torch.load(fixtures_dir / "yolov5n_model.pt", weights_only=True)
    model = Model("yolov5n.yaml", nc=80)
    model.load_state_dict(fx["state_dict"])
    model = model.to(GPU).eval()
    with torch.no_grad():
        out = model(fx["input"].to(GPU)).cpu()
    torch.testing.assert_close(out, fx["eval_out"], rtol=0, atol=1e-3)


def test_classify_augmentation_on_the_gpu_matches_the_cpu():
    """cls_augment on a batch in GPU memory stays there and makes the CPU's images: the same draws,
    so whole numbers 0-255 that differ only where float rounding moves a value across .5 (by 1)."""
    torch.manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 64, 64), dtype=torch.uint8)
    sizes = [(40 + k, 70 - k) for k in range(16)]
    keys = [(0, 2, k) for k in range(16)]
    cpu = cls_augment.augment(images, sizes, keys)
    gpu = cls_augment.augment(images.to(GPU), sizes, keys)
    assert gpu.device == GPU and gpu.dtype == cpu.dtype
    difference = (gpu.cpu() - cpu).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01


@pytest.mark.slow
def test_val_on_the_gpu_agrees_with_the_cpu(fixtures_dir, tmp_path):
    """val.py on the GPU (--amp auto: fp16) and on the CPU in float32 score yolov5-trained YOLOv5n
    and YOLOv5n-seg on the shapes val images within 0.005 mAP."""
    for weights in ("det.pt", "seg.pt"):
        kw = dict(weights=str(fixtures_dir / "predict" / weights), data="shapes", imgsz=128)
        kw |= dict(workers=0, project=str(tmp_path), exist_ok=True)
        cpu = validator.run(**kw, device="cpu", amp="off", name="cpu")["metrics"]
        gpu = validator.run(**kw, device="0", amp="auto", name="gpu")["metrics"]
        print(f"\n{weights}: cpu {cpu}\n  gpu {gpu}")
        assert cpu["mAP50(B)"] > 0.85
        for k in [k for k in cpu if k.startswith("mAP")]:
            assert gpu[k] == pytest.approx(cpu[k], abs=0.005), (weights, k)


@pytest.mark.parametrize("task", ["detect", "segment"])
def test_predict_on_the_gpu_agrees_with_yolov5(fixtures_dir, tmp_path, task):
    """predict.py on the GPU (fp16) against yolov5's detect.py / segment/predict.py labels (the
    CPU test's bar: >= 95% matched, <= 5% extra) and against predict.py on the CPU (>= 95%)."""
    fx = fixtures_dir / "predict"
    weights, ref = ("det.pt", "detect_labels") if task == "detect" else ("seg.pt", "segment_labels")
    opts = dict(weights=str(fx / weights), source=str(fx / "images"), imgsz=160, conf_thres=0.25)
    opts |= dict(iou_thres=0.45, save_txt=True, save_conf=True, nosave=True, exist_ok=True)
    out = {
        d: Path(predictor.run(device=d, project=str(tmp_path), name=d, **opts)["save_dir"])
        for d in ("cpu", "0")
    }
    for reference in (fx / ref, out["cpu"] / "labels"):
        res = agreement(out["0"] / "labels", reference, fx / "images")
        print(
            f"\n{task} vs {reference}: {res['matched']}/{res['ref']} matched, {res['ours']} found"
        )
        assert res["ref"] > 0 and res["matched"] >= 0.95 * res["ref"], res
        assert res["ours"] - res["matched"] <= 0.05 * res["ref"], res


def test_sync_batchnorm_in_a_one_rank_group(tmp_path, data_dir):
    """--sync-bn's conversion in a one-rank nccl group: the converted DDP model trains (its loss
    falls by > 10% over 10 steps at lr 0.1 on a fixed batch, running stats move), and its first
    loss is the plain BatchNorm model's."""
    batch = fixed_batch(data_dir, "detect")
    torch.manual_seed(0)
    plain = Model("yolov5n.yaml", nc=80)
    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
        n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
        assert n_bn > 50 and not any(isinstance(m, nn.BatchNorm2d) for m in synced.modules())
        assert sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == n_bn
        net, criterion, optimizer, scaler = training_objects(synced, "off", GPU)
        groups = [len(g["params"]) for g in optimizer.param_groups]
        assert groups == [
            len(g["params"]) for g in training_objects(plain, "off", GPU)[2].param_groups
        ]
        ddp = nn.parallel.DistributedDataParallel(net, device_ids=[0])
        mean = net.model[0].bn.running_mean.clone()
        for g in optimizer.param_groups:
            g["lr"] = 0.1  # measured on the CPU: the loss falls 12% in 10 steps
        losses = []
        for _ in range(10):
            loss, _ = trainer.forward_loss(ddp, criterion, batch, GPU, None)
            scaler.scale(loss).backward()
            trainer.optimizer_step(ddp, optimizer, scaler, None)
            losses.append(loss.item())
        first, _ = trainer.forward_loss(plain.to(GPU).train(), criterion, batch, GPU, None)
    finally:
        torch_dist.destroy_process_group()
    print(f"\nSyncBatchNorm losses {[round(x, 4) for x in losses]}")
    assert losses[0] == pytest.approx(first.item(), rel=1e-4)
    assert losses[-1] < 0.9 * losses[0]
    assert not torch.equal(net.model[0].bn.running_mean, mean)
