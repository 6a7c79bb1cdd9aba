"""Run by tests/test_dist.py under `torchrun --nproc_per_node 2`: one optimizer step of train.py's recipe
with 2 ranks x 4 images must give the weights of 1 process x 8 images (computed here on every rank).

BatchNorm is in eval mode so that per-rank batch statistics do not enter. Rank 1's images are rank 0's
mirrored left-right: the loss means over positives (box, cls) then have equal counts on both ranks,
which is when yolov5's DDP loss equals the single-process one exactly. Prints `MAXDIFF <value>` on rank 0.
"""
import sys
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from yolo_min import dist  # noqa: E402
from yolo_min.losses import DEFAULT_HYP, YOLOLoss, scale_hyp  # noqa: E402
from yolo_min.models import Model  # noqa: E402


def bn_eval(model: nn.Module) -> nn.Module:
    model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def step(model, batch, world_size, hyp):
    crit = YOLOLoss(model, hyp, world_size)
    opt = train.build_optimizer(model, 0.01, 0.937, 5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    loss, _ = train.forward_loss(model, crit, batch, torch.device("cpu"), False)
    scaler.scale(loss).backward()
    train.optimizer_step(model, opt, scaler, None)


def make_batch(segment: bool) -> dict:
    """4 random images with 6 targets; masks: each target's box filled with its 1-based index in its image."""
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8, generator=g)
    targets = torch.tensor([[0, 0, 0.31, 0.42, 0.30, 0.20], [0, 1, 0.62, 0.71, 0.12, 0.33],
                            [1, 2, 0.47, 0.27, 0.52, 0.40], [2, 0, 0.23, 0.64, 0.21, 0.19],
                            [3, 1, 0.71, 0.36, 0.61, 0.58], [3, 2, 0.18, 0.83, 0.09, 0.11]])
    masks = torch.zeros(4, 16, 16)
    for row, (b, _, cx, cy, w, h) in enumerate((targets * torch.tensor([1, 1, 16, 16, 16, 16])).tolist()):
        k = (targets[:row + 1, 0] == b).sum()
        masks[int(b), round(cy - h / 2):round(cy + h / 2), round(cx - w / 2):round(cx + w / 2)] = k
    return {"images": images, "targets": targets, "masks": masks if segment else None}


def mirrored(batch: dict) -> dict:
    targets = batch["targets"].clone()
    targets[:, 2] = 1 - targets[:, 2]
    masks = batch["masks"].flip(2) if batch["masks"] is not None else None
    return {"images": batch["images"].flip(3), "targets": targets, "masks": masks}


def main():
    info = dist.setup("cpu")
    try:
        segment = "--segment" in sys.argv
        torch.manual_seed(0)
        model = bn_eval(Model("yolov5n-seg.yaml" if segment else "yolov5n.yaml", nc=3))
        hyp = scale_hyp(DEFAULT_HYP, 3, 64)
        halves = [make_batch(segment)]
        halves.append(mirrored(halves[0]))
        shift = torch.tensor([4.0, 0, 0, 0, 0, 0])  # rank 1's images are 4..7 of the whole batch
        whole = {"images": torch.cat([h["images"] for h in halves]),
                 "targets": torch.cat([halves[0]["targets"], halves[1]["targets"] + shift]),
                 "masks": torch.cat([h["masks"] for h in halves]) if segment else None}

        single = deepcopy(model)
        step(single, whole, 1, hyp)
        ddp = DDP(deepcopy(model))
        step(ddp, halves[info.rank], info.world_size, hyp)
        diff = max((a - b).abs().max().item() for a, b in zip(single.parameters(), ddp.module.parameters()))
        moved = max((a - b).abs().max().item() for a, b in zip(single.parameters(), model.parameters()))
        diff = max(dist.all_gather_object(diff))
        dist.print0(f"MAXDIFF {diff:.3e} MOVED {moved:.3e}")
    finally:
        dist.cleanup()


if __name__ == "__main__":
    main()
