"""GPU benchmark, run by bench/gpu_check.sh: YOLOv5n and YOLOv5n-seg trained on coco128(-seg) at 640
on one CUDA GPU with train.py's defaults there (fp16 autocast, GradScaler, channels_last, pinned
memory, 8 workers), batch 16, a few epochs from scratch with validation; the loop's img/s beside the
model-only step's (forward + loss + backward + step on 8 pre-made batches, float32 and fp16), the
peak GPU memory; then val.py and predict.py with the trained weights. Writes gpu_results.json and
gpu_table.md under --out; asserts nothing.

    python bench/bench_gpu.py --out /tmp/gpu [--epochs 3] [--device 0] [--imgsz 640]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_train import DATA, model_only, step_setup  # noqa: E402

from yolo_min import dist  # noqa: E402
from yolo_min.models import amp_dtype  # noqa: E402


def data_yaml(task: str, folder: Path) -> Path:
    """coco128(-seg).yaml with its path made absolute (train and val: the same 128 images)."""
    name = "coco128-seg" if task == "seg" else "coco128"
    path = folder / f"{name}.yaml"
    path.write_text(
        (DATA / f"{name}.yaml").read_text().replace(f"path: {name}", f"path: {DATA / name}")
    )
    return path


def one_task(task: str, device: torch.device, epochs: int, tmp: Path, imgsz=640) -> dict:
    from yolo_min import predictor, trainer, validator

    data, cfg = data_yaml(task, tmp), "yolov5n-seg.yaml" if task == "seg" else "yolov5n.yaml"
    row = {"task": task}
    setup = step_setup(task, imgsz, data, 8, device=device)
    for amp in ("off", "auto"):  # float32 (TF32 convolutions, torch's default) and fp16
        layout = amp_dtype(device, amp) is not None  # channels_last under autocast, as train.py
        row[f"model_only_{amp}"] = model_only(setup, 16, amp, layout, device)
    del setup
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    args = ["--cfg", cfg, "--data", str(data), "--imgsz", str(imgsz), "--epochs", str(epochs)]
    args += ["--device", str(device), "--project", str(tmp / "train"), "--name", task]
    args += ["--log-every", "4"]
    t0 = time.perf_counter()
    out = trainer.main(trainer.get_args_parser().parse_args(args))
    row["train_s"] = time.perf_counter() - t0
    row["loop"] = max(out["img_s"])  # epoch 1 includes cuDNN's and the allocator's warm-up
    row["loop_per_epoch"] = out["img_s"]
    row["peak_alloc_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else 0.0
    row["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9 if cuda else 0.0
    row["train_metrics"] = out["metrics"]["metrics"]
    weights = Path(out["save_dir"]) / "weights" / "best.pt"
    kw = dict(weights=str(weights), imgsz=imgsz, device=str(device), exist_ok=True)
    t0 = time.perf_counter()
    res = validator.run(data=str(data), project=str(tmp / "val"), name=task, **kw)
    row["val_s"], row["val_speed"] = time.perf_counter() - t0, res["speed"]
    row["val_metrics"] = res["metrics"]
    images = DATA / f"coco128{'-seg' if task == 'seg' else ''}" / "images" / "train2017"
    for batch in (1, 16):
        t0 = time.perf_counter()
        res = predictor.run(source=str(images), project=str(tmp / "predict"), name=f"{task}{batch}",
                          batch_size=batch, workers=4, **kw)  # fmt: skip
        row[f"predict_b{batch}_s"] = time.perf_counter() - t0
        row[f"predict_b{batch}_speed"] = res.get("speed")
    return row


def layouts(task: str, device: torch.device, tmp: Path, imgsz: int, batch: int) -> dict:
    """Model-only img/s of fp32 / fp16 autocast x contiguous / channels_last (best of 2 rounds)."""
    setup = step_setup(task, imgsz, data_yaml(task, tmp), 4, batch, device)
    rates = {}
    for _ in range(2):
        for amp, channels_last in (("off", False), ("off", True), ("auto", False), ("auto", True)):
            name = f"{'fp16' if amp == 'auto' else 'fp32'}{' CL' if channels_last else ''}"
            rate = model_only(setup, 8, amp, channels_last, device)
            rates[name] = max(rates.get(name, 0.0), rate)
    return {"case": f"{task}{imgsz} b{batch}"} | rates


def table(rows: list[dict], env: dict) -> str:
    lines = [
        f"GPU check: {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['cpus']} CPUs",
        "",
    ]
    lines += ["| | " + " | ".join(r["task"] for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    fmt = {
        "model-only step fp32 (TF32), img/s": lambda r: f"{r['model_only_off']:.0f}",
        "model-only step fp16 + channels_last, img/s": lambda r: f"{r['model_only_auto']:.0f}",
        "train.py loop (--amp auto), img/s": lambda r: f"{r['loop']:.0f}",
        "loop / model-only fp16": lambda r: f"{r['loop'] / r['model_only_auto']:.0%}",
        "peak GPU memory allocated / reserved, GB": lambda r: (
            f"{r['peak_alloc_gb']:.2f} / {r['peak_reserved_gb']:.2f}"
        ),
        "train.py wall (epochs, val, checkpoints), s": lambda r: f"{r['train_s']:.1f}",
        "val.py wall, s (128 images)": lambda r: f"{r['val_s']:.1f}",
        "predict.py wall batch 1 / 16, s (128 images)": lambda r: (
            f"{r['predict_b1_s']:.1f} / {r['predict_b16_s']:.1f}"
        ),
    }
    for name, f in fmt.items():
        lines.append(f"| {name} | " + " | ".join(f(r) for r in rows) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/gpu_check")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--device", default="0")
    p.add_argument("--tasks", nargs="+", default=["det", "seg"])
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--layouts", nargs="*", type=int, help="model-only layouts at these batches")
    opt = p.parse_args()
    out, device = Path(opt.out), dist.select_device(opt.device)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (a dry run)"
    env = dict(gpu=gpu, torch=torch.__version__)
    env |= dict(cuda=torch.version.cuda, cpus=len(__import__("os").sched_getaffinity(0)))
    rows = []
    if opt.layouts:
        with tempfile.TemporaryDirectory() as tmp:
            for task in opt.tasks:
                for batch in opt.layouts:
                    rows.append(layouts(task, device, Path(tmp), opt.imgsz, batch))
                    print(json.dumps(rows[-1]), flush=True)
        (out / "gpu_layouts.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for task in opt.tasks:
            try:
                rows.append(one_task(task, device, opt.epochs, Path(tmp), opt.imgsz))
            except Exception as e:  # the other task still runs
                import traceback

                traceback.print_exc()
                rows.append({"task": task, "error": f"{type(e).__name__}: {e}"})
            (out / "gpu_results.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    ok = [r for r in rows if "error" not in r]
    text = table(ok, env) if ok else "no task finished\n"
    (out / "gpu_table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
