"""Run by tests/test_dist.py under `torchrun --nproc_per_node 2`: train.py's own wiring
(`build_training`: loss scale, DDP, optimizer) and its `train_one_epoch` (no_sync, accumulation,
step) on 2 ranks x 2 micro-batches of 4 images must give the weights of 1 process x 2 batches of 8.

BatchNorm stays in eval mode so that per-rank batch statistics do not enter. Rank 1's images are
rank 0's mirrored left-right: the loss means over positives then have equal counts on both ranks,
which is when yolov5's DDP loss equals the single-process one exactly. The epoch is one after the
warmup, so weights and biases move alike. Prints `MAXDIFF <value> MOVED <value>` on rank 0.
`--amp-on`: both under bfloat16 autocast and channels_last (train.py --amp on, on a CPU), which
round batches of 4 and of 8 differently: equal to a tolerance only.
"""

import sys
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_min import dist, trainer
from yolo_min.models import Model  # noqa: E402


def frozen_bn(model: nn.Module) -> nn.Module:
    """BatchNorm layers that stay in eval mode when train_one_epoch calls model.train()."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            m.train = lambda mode=True, m=m: m
    return model


def make_batch(seed: int, segment: bool) -> dict:
    """4 random images with 6 targets; masks: each target's box filled with its index in its
    image."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8, generator=g)
    targets = torch.tensor(
        [
            [0, 0, 0.31, 0.42, 0.30, 0.20],
            [0, 1, 0.62, 0.71, 0.12, 0.33],
            [1, 2, 0.47, 0.27, 0.52, 0.40],
            [2, 0, 0.23, 0.64, 0.21, 0.19],
            [3, 1, 0.71, 0.36, 0.61, 0.58],
            [3, 2, 0.18, 0.83, 0.09, 0.11],
        ]
    )
    targets[:, 2:4] += seed * 0.02
    masks = torch.zeros(4, 16, 16)
    for row, (b, _, cx, cy, w, h) in enumerate(
        (targets * torch.tensor([1, 1, 16, 16, 16, 16])).tolist()
    ):
        k = (targets[: row + 1, 0] == b).sum()
        masks[
            int(b), round(cy - h / 2) : round(cy + h / 2), round(cx - w / 2) : round(cx + w / 2)
        ] = k
    return {"images": images, "targets": targets, "masks": masks if segment else None}


def classify_batch(seed: int) -> dict:
    """4 random images of classes 0, 1, 2, 0 (batch dicts as ClassifyDataset's collate: indices
    and original sizes, from which train_one_epoch's augmentation draws)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8, generator=g)
    targets = torch.tensor([[0, 0], [1, 1], [2, 2], [3, 0]])
    shapes = [(64, 64)] * 4
    return {"images": images, "targets": targets, "indices": torch.arange(4), "shapes": shapes}


def mirrored(batch: dict) -> dict:
    if "masks" not in batch:  # classify: other images (indices 4-7), the same classes
        return batch | {"images": batch["images"].flip(3), "indices": batch["indices"] + 4}
    targets = batch["targets"].clone()
    targets[:, 2] = 1 - targets[:, 2]
    masks = batch["masks"].flip(2) if batch["masks"] is not None else None
    return {"images": batch["images"].flip(3), "targets": targets, "masks": masks}


def joined(a: dict, b: dict) -> dict:
    """One batch of 8: a's images, then b's (their targets' image indices shifted by 4)."""
    shift = torch.zeros_like(b["targets"][:1])
    shift[0, 0] = 4
    masks = torch.cat([a["masks"], b["masks"]]) if a.get("masks") is not None else None
    images = torch.cat([a["images"], b["images"]])
    whole = {
        "images": images,
        "targets": torch.cat([a["targets"], b["targets"] + shift]),
        "masks": masks,
    }
    if "shapes" in a:  # classify: each image keeps its index, so its augmentation
        indices = torch.cat([a["indices"], b["indices"]])
        whole |= {"indices": indices, "shapes": a["shapes"] + b["shapes"]}
    return whole


def one_epoch(model, loader, info, args, hyp) -> nn.Module:
    """train.py's wiring and train_one_epoch, at an epoch after the warmup (200 of 300)."""
    training = trainer.build_training(model, hyp, args, info)
    setup = trainer.Setup(args, None, hyp, model, loader, val_loader=None, save_dir=Path("."))
    trainer.train_one_epoch(training, setup, 200)
    model = training.model
    return model.module if info.world_size > 1 else model


def main():
    info = dist.setup("cpu")
    try:
        segment, classify = "--segment" in sys.argv, "--classify" in sys.argv
        cfg = "yolov5n-seg.yaml" if segment else "yolov5n-cls.yaml" if classify else "yolov5n.yaml"
        torch.manual_seed(0)
        model = frozen_bn(Model(cfg, nc=3))
        hyp = trainer.load_hyp("", model.task)
        amp = ["--amp", "on" if "--amp-on" in sys.argv else "off"]
        args = trainer.get_args_parser().parse_args(["--imgsz", "64", "--epochs", "300", *amp])
        args.batch_size = 8  # the global batch, 2 x 4 or 1 x 8
        trainer.check_args(args, model.task, 1)
        batch = classify_batch if classify else lambda seed: make_batch(seed, segment)
        halves = [batch(seed) for seed in (1, 2)]  # rank 0's micro-batches
        halves = [halves, [mirrored(b) for b in halves]]  # rank 1's
        single_info = dist.DistInfo(0, 1, 1, torch.device("cpu"))
        whole = [joined(a, b) for a, b in zip(*halves)]
        single = one_epoch(deepcopy(model), whole, single_info, args, hyp)
        ddp = one_epoch(deepcopy(model), halves[info.rank], info, args, hyp)
        pairs = list(zip(single.parameters(), ddp.parameters(), model.parameters()))
        diff = max((a - b).abs().max().item() for a, b, _ in pairs)
        moved = max((a - c).abs().max().item() for a, _, c in pairs)
        diff = max(dist.all_gather_object(diff))
        dist.print0(f"MAXDIFF {diff:.3e} MOVED {moved:.3e}")
    finally:
        dist.cleanup()


if __name__ == "__main__":
    main()
