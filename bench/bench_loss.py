"""Micro-benchmark: the loss's share of one training step (forward + loss + backward).

Default: YOLOv5n-seg at 320, batch 16, on CPU, synthetic targets (rectangles, also painted as
overlap index masks). The loss is timed in isolation on detached copies of the predictions (its
forward and its own backward), and the full step (model forward, loss, backward through everything)
separately; the share is loss / step. Target: under 20%. Prints figures, asserts nothing. --amp as
train.py's: the network under autocast (bfloat16 on a CPU with native bf16, channels_last), the
loss in float32.

    python bench/bench_loss.py [--cfg yolov5n-seg.yaml] [--imgsz 320] [--batch 16] [--iters 3]
                               [--amp auto]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_min.losses import YOLOLoss, scale_hyp  # noqa: E402
from yolo_min.models import Model, amp_dtype  # noqa: E402
from yolo_min.trainer import load_hyp  # noqa: E402


def synthetic_batch(bs: int, imgsz: int, per_image: int, nc: int, g: torch.Generator):
    """Targets (N, 6) [img, cls, cx, cy, w, h] normalised, overlap index masks (bs, H/4, W/4)."""
    n = bs * per_image
    wh = torch.rand(n, 2, generator=g) * 0.4 + 0.02
    xy = wh / 2 + torch.rand(n, 2, generator=g) * (1 - wh)
    img = torch.arange(bs).repeat_interleave(per_image).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    targets = torch.cat((img[:, None], cls[:, None], xy, wh), 1)
    m = imgsz // 4
    masks = torch.zeros(bs, m, m)
    for i in torch.argsort(-(wh[:, 0] * wh[:, 1])).tolist():  # largest first, small ones on top
        b, k = int(img[i]), i % per_image + 1
        x1, y1 = ((xy[i] - wh[i] / 2) * m).long().tolist()
        x2, y2 = ((xy[i] + wh[i] / 2) * m).long().tolist()
        masks[b, y1 : y2 + 1, x1 : x2 + 1] = k
    return targets, masks


def loss_share(
    cfg: str = "yolov5n-seg.yaml",
    imgsz: int = 320,
    batch: int = 16,
    iters: int = 3,
    per_image: int = 20,
    device: str = "cpu",
    amp: str = "off",
) -> dict:
    """Best-of-`iters` times (s) of the full step and of the loss alone: {"step", "loss", "share",
    "targets", "items", "threads"}; share = loss / step."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    dtype = amp_dtype(device, amp)
    model = Model(cfg).to(device, memory_format=torch.channels_last if dtype else None).train()
    head = model.head
    crit = YOLOLoss(model, scale_hyp(load_hyp(""), head.nc, imgsz, head.nl))
    g = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, imgsz, imgsz, generator=g).to(device)
    targets, masks = synthetic_batch(batch, imgsz, per_image, head.nc, g)
    targets, masks = targets.to(device), (masks.to(device) if model.task == "segment" else None)

    def detach(preds):
        if model.task == "segment":
            return [p.detach().requires_grad_() for p in preds[0]], preds[
                1
            ].detach().requires_grad_()
        return [p.detach().requires_grad_() for p in preds]

    step, loss_only = [], []
    for it in range(iters + 1):  # the first iteration warms up and is not counted
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            preds = model(images)
        loss, items = crit(preds, targets, masks)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        leaf = detach(preds)
        sync()
        t2 = time.perf_counter()
        crit(leaf, targets, masks)[0].backward()
        sync()
        t3 = time.perf_counter()
        if it:
            step.append(t1 - t0)
            loss_only.append(t3 - t2)
    s, lo = min(step), min(loss_only)  # least disturbed by other load on the machine
    return dict(
        step=s,
        loss=lo,
        share=lo / s,
        targets=len(targets),
        items=items,
        threads=torch.get_num_threads(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", default="yolov5n-seg.yaml")
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--per-image", type=int, default=20, help="synthetic objects per image")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args()
    r = loss_share(
        args.cfg, args.imgsz, args.batch, args.iters, args.per_image, args.device, args.amp
    )
    print(
        f"{args.cfg} imgsz {args.imgsz} batch {args.batch} {args.device} --amp {args.amp} "
        f"({r['threads']} threads), {r['targets']} targets, best of {args.iters} iters"
    )
    print(f"train step (forward + loss + backward): {r['step'] * 1000:.0f} ms")
    print(f"loss (its forward + its backward):      {r['loss'] * 1000:.0f} ms")
    print(f"loss share of the step: {100 * r['share']:.1f}% (target < 20%)")
    print("items:", {k: round(v.item(), 4) for k, v in r["items"].items()})


if __name__ == "__main__":
    main()
