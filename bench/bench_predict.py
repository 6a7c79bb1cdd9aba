"""predict.py speed on the 128 images of coco128: end to end next to the model-only inference rate.

    python bench/bench_predict.py [--sizes 640 320] [--batch 8] [--workers 2] [--repeat 1]
                                  [--amp auto]

End to end: `python predict.py --weights W --source coco128/images/train2017 --imgsz S` in a child
process (batch 1, then --batch-size B --workers N), timed from launch to exit: imports, model load,
decoding, letterbox, inference, NMS, drawing and saving the 128 annotated images (as yolov5's
detect.py does by default); also the child's CPU seconds and its own Speed line. Model-only: the
fused model's forward on the same letterboxed inputs in this process, batch 1 and batched, measured
between the end-to-end runs (and its CPU ms per image). Weights: the fixture det.pt (YOLOv5n, nc 3;
any YOLOv5n is as fast). Reference (yolov5's detect.py, same images and machine, batch 1, OpenCV,
fp32): 11.1 s wall at 640, 40.9 ms inference per image. Asserts nothing; on a busy machine wall
times grow, CPU times less (run it with OMP_NUM_THREADS=1 there: 2 threads on a shared core spin).
"""

import argparse
import re
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yolo_min import predictor  # noqa: E402
from yolo_min.safe_load import load_model  # noqa: E402

SHARED = ROOT.parent / "shared"
YOLOV5_WALL_640, YOLOV5_INFER_640 = 11.1, 40.9  # s for the 128 images, ms per image


def end_to_end(weights: str, source: str, imgsz: int, batch: int, workers: int, amp: str) -> dict:
    """predict.py in a child process -> {"wall" s, "cpu" s, "speed" (its Speed line, ms)}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "predict.py"), "--weights", weights, "--source", source]
        cmd += ["--imgsz", str(imgsz), "--batch-size", str(batch), "--workers", str(workers)]
        cmd += ["--amp", amp]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run(cmd + ["--project", tmp], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert len(list(Path(tmp, "exp").glob("*.jpg"))) == 128, out.stdout[-500:]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    speed = re.search(
        r"Speed: ([\d.]+)ms pre-process, ([\d.]+)ms inference, ([\d.]+)ms NMS", out.stdout
    )
    return dict(wall=wall, cpu=cpu, speed=tuple(map(float, speed.groups())))


@torch.inference_mode()
def model_only(model, inputs: dict, batch: int, amp: str) -> tuple[float, float]:
    """(images/s, CPU ms per image) of the model's forward over the letterboxed inputs (grouped
    by shape), after a warm-up batch of each shape, as predict.py runs it on a CPU: --amp off
    fp32, auto fp32 in channels_last, on bf16 autocast in channels_last."""
    groups = [v[i : i + batch] for v in inputs.values() for i in range(0, len(v), batch)]
    model.to(memory_format=torch.contiguous_format if amp == "off" else torch.channels_last)
    forward = torch.autocast("cpu", torch.bfloat16, enabled=amp == "on")(model)
    for v in inputs.values():
        forward(torch.stack(v[:batch]).float() / 255)
    t, cpu = time.perf_counter(), time.process_time()
    for g in groups:
        forward(torch.stack(g).float() / 255)
    n = sum(map(len, groups))
    return n / (time.perf_counter() - t), (time.process_time() - cpu) * 1000 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=str(SHARED / "fixtures" / "yolov5" / "predict" / "det.pt"))
    ap.add_argument("--source", default=str(SHARED / "data" / "coco128" / "images" / "train2017"))
    ap.add_argument("--sizes", nargs="+", type=int, default=[640, 320])
    ap.add_argument("--batch", type=int, default=8, help="the batched case's --batch-size")
    ap.add_argument("--workers", type=int, default=2, help="the batched case's --workers")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case (the best is kept)")
    ap.add_argument("--amp", choices=["auto", "on", "off"], default="auto", help="predict.py's")
    args = ap.parse_args()
    model = load_model(args.weights).fuse()
    files = predictor.find_images(args.source)
    threads = f"{torch.get_num_threads()} threads, --amp {args.amp}"
    print(f"torch {torch.__version__}, {threads}, {len(files)} images")
    head = (
        f"{'imgsz':>5} {'batch':>5} {'wall s':>7} {'img/s':>6} {'cpu s':>6} {'pre/inf/nms ms':>16}"
    )
    print(f"{head} {'model-only img/s (cpu ms/img)':>30} {'vs detect.py wall':>18}")
    for imgsz in args.sizes:
        inputs = {}
        for s in map(
            partial(predictor.read, imgsz=imgsz, stride=32, classify=False), enumerate(files)
        ):
            inputs.setdefault(tuple(s["input"].shape), []).append(s["input"])
        for batch, workers in ((1, 0), (args.batch, args.workers)):
            runs = []
            for _ in range(args.repeat):
                runs.append(
                    (
                        model_only(model, inputs, batch, args.amp),
                        end_to_end(args.weights, args.source, imgsz, batch, workers, args.amp),
                    )
                )
            rate, cpu_ms = max(r[0] for r in runs)
            e2e = min((r[1] for r in runs), key=lambda r: r["wall"])
            ms = "/".join(f"{v:.1f}" for v in e2e["speed"])
            ratio = f"{YOLOV5_WALL_640 / e2e['wall']:.2f}x" if imgsz == 640 else "-"
            row = f"{imgsz:>5} {batch:>5} {e2e['wall']:>7.2f} {len(files) / e2e['wall']:>6.1f}"
            model_rate = f"{rate:.1f} ({cpu_ms:.0f})"
            print(f"{row} {e2e['cpu']:>6.1f} {ms:>16} {model_rate:>30} {ratio:>18}", flush=True)
    print(
        f"yolov5 detect.py at 640: {YOLOV5_WALL_640} s wall, {YOLOV5_INFER_640} ms inference/image"
    )


if __name__ == "__main__":
    main()
