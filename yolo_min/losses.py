"""YOLOv5's training losses: YOLOLoss (target assignment, CIoU box, objectness, class and mask
BCE; equal to yolov5's ComputeLoss, fixtures loss_*.pt) and ClassifyLoss, a cross-entropy.

nc, nm and nl are the head's: classes, mask coefficients per anchor, levels."""

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .models import de_parallel
from .ops import xywh2xyxy

# Neighbour-cell offsets (x, y), subtracted from a centre: its own cell, left, up, right, down. A
# kept pair is also assigned to the left/up (right/down) cell when its centre lies in the
# left/upper (right/lower) half of its cell.
_OFFSETS = torch.tensor(
    [
        [0.0, 0.0],
        [0.5, 0.0],
        [0.0, 0.5],
        [-0.5, 0.0],
        [0.0, -0.5],
    ]
)


def scale_hyp(hyp, num_classes, image_size, num_levels=3):
    """A copy of hyp with the loss gains box, cls, obj rescaled for the number of classes, the
    image size in pixels and the number of levels."""
    # hyp's gains are tuned for 80 classes, 640 pixels and 3 levels. Training rescales them so
    # that cls follows the number of classes, obj the cells per image, and all 1 / levels.
    gains = {
        "box": 3 / num_levels,
        "cls": num_classes / 80 * 3 / num_levels,
        "obj": (image_size / 640) ** 2 * 3 / num_levels,
    }
    scaled = {key: hyp[key] * gain for key, gain in gains.items()}
    return hyp | scaled


def bbox_ciou(box1, box2, eps=1e-7):
    """Complete IoU (n,) of paired xywh boxes box1, box2 (n, 4), as yolov5's."""
    # CIoU = IoU - centre distance^2 / enclosing diagonal^2 - alpha * v, where v measures the
    # difference in aspect ratio; alpha is a constant for the gradient, as in yolov5.
    x1, y1, w1, h1 = box1.unbind(-1)
    x2, y2, w2, h2 = box2.unbind(-1)
    left1 = x1 - w1 / 2
    right1 = x1 + w1 / 2
    top1 = y1 - h1 / 2
    bottom1 = y1 + h1 / 2
    left2 = x2 - w2 / 2
    right2 = x2 + w2 / 2
    top2 = y2 - h2 / 2
    bottom2 = y2 + h2 / 2
    inter_w = torch.minimum(right1, right2) - torch.maximum(left1, left2)
    inter_h = torch.minimum(bottom1, bottom2) - torch.maximum(top1, top2)
    inter = inter_w.clamp(0) * inter_h.clamp(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    # The squared diagonal of the smallest box enclosing both.
    enclosing_w = torch.maximum(right1, right2) - torch.minimum(left1, left2)
    enclosing_h = torch.maximum(bottom1, bottom2) - torch.minimum(top1, top2)
    diagonal2 = enclosing_w**2 + enclosing_h**2 + eps
    # The squared distance of the centres, from the edges as yolov5 computes it.
    twice_dx = left2 + right2 - left1 - right1
    twice_dy = top2 + bottom2 - top1 - bottom1
    distance2 = (twice_dx**2 + twice_dy**2) / 4
    angle_difference = torch.atan(w2 / h2) - torch.atan(w1 / h1)
    v = (4 / math.pi**2) * angle_difference**2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (distance2 / diagonal2 + v * alpha)


class Assignment(NamedTuple):
    """The positives (prediction, target pairs) of one level, n of them, in yolov5's order
    (offset, anchor, target); grid units are the level's cells.

    image, anchor, grid_y, grid_x (n,): the prediction's image, anchor and cell (row, column);
    target_box (n, 4): the target's grid xywh, xy from the cell's corner; anchor_wh (n, 2): the
    anchor's size in grid units; target (n,): the target's row in targets; box_normalised (n, 4):
    its xywh normalised back from grid units as yolov5 does (the mask crop sees the rounding)."""

    image: Tensor
    anchor: Tensor
    grid_y: Tensor
    grid_x: Tensor
    target_box: Tensor
    anchor_wh: Tensor
    target: Tensor
    box_normalised: Tensor

    @property
    def cells(self):
        """The (image, anchor, grid_y, grid_x) indices of the positives into a level's maps."""
        return self.image, self.anchor, self.grid_y, self.grid_x


class MaskPositives(NamedTuple):
    """What a mask loss reads of the n positives of one level: group (n,) their (level, image)
    group, level * bs + image, image (n,) their image, coefs (n, nm) their predicted mask
    coefficients, mask_value (n,) their target's value in the image's overlap mask (see
    mask_values), box (n, 4) their target's xywh, normalised."""

    group: Tensor
    image: Tensor
    coefs: Tensor
    mask_value: Tensor
    box: Tensor


def mask_values(images, batch_size):
    """(N,) each target's value in the overlap masks: its 1-based rank among its image's targets;
    images (N,): the targets' image indices."""
    onehot = F.one_hot(images.long(), batch_size)
    return (onehot.cumsum(0) * onehot).sum(1)


def _runs(lengths):
    """Runs of the given lengths (r,) laid end to end: each element's run, and its place in it."""
    run = torch.repeat_interleave(lengths)
    run_start = lengths.cumsum(0) - lengths
    element = torch.arange(len(run), device=lengths.device)
    return run, element - run_start[run]


def mask_loss_fast(levels, protos, masks):
    """yolov5's mask loss: summed over levels and images, the mean over the image's positives at
    that level of the BCE-with-logits of the predicted mask (coefs @ protos) against the target's
    mask, cropped to its box, mean over the map, divided by the normalised box area.

    levels: MaskPositives per level with positives; protos: (bs, nm, mh, mw); masks: (bs, mh, mw)
    overlap index maps (see mask_values).

    Computed from the pixels inside the boxes alone: equal to the plain per-image loss (mask_loss
    in tests/test_losses.py, which checks the loss and its gradients) to float rounding, as its
    sums associate differently. Faster: on bench/bench_loss.py's batch (yolov5n-seg at 320 px,
    batch 16, 320 targets; CPU, loss forward + backward, both in one run, best of 6) the mask term
    takes 0.65 s instead of 2.3 s (3.5x), the whole YOLOLoss 0.74 s instead of 2.4 s (3.2x).

    A box is a small part of the map: the loss lists its pixels as (positive, pixel) pairs and
    takes the BCE at those only, with one matmul per image for the positives of every level."""
    batch_size, num_masks, mask_h, mask_w = protos.shape
    pixels_per_map = mask_h * mask_w
    # Every level's positives, grouped by image (in order within one).
    joined = MaskPositives._make(torch.cat(field) for field in zip(*levels))
    order = torch.argsort(joined.image, stable=True)
    group, image, coefs, mask_value, box = (field[order] for field in joined)
    # The box in mask pixels. Column c is in it iff x1 <= c < x2, that is iff
    # ceil(x1) <= c < ceil(x2), with x1 = x - w / 2; likewise the rows.
    pixel_scale = box.new_tensor([mask_w, mask_h] * 2)
    corners = xywh2xyxy(box * pixel_scale).ceil()
    col_start, row_start, col_end, row_end = corners.clamp(min=0).minimum(pixel_scale).long().T
    box_w = (col_end - col_start).clamp(min=0)
    box_h = (row_end - row_start).clamp(min=0)
    positives_per_image = torch.bincount(image, minlength=batch_size)
    first_positive = positives_per_image.cumsum(0) - positives_per_image
    pairs_per_image = torch.zeros_like(first_positive).index_add(0, image, box_w * box_h).tolist()
    # When no box holds a pixel, the loss is 0, with no graph to the protos.
    if not sum(pairs_per_image):
        return box.new_zeros(())
    # A run is one row of a box's pixels: the pairs are built run by run, in few passes over them.
    run_positive, row_in_box = _runs(box_h)
    run_pixel = (row_start[run_positive] + row_in_box) * mask_w + col_start[run_positive]
    pair_run, column_in_run = _runs(box_w[run_positive])
    pair_positive = run_positive[pair_run]
    # logit_index and mask_index are the pairs' places in their image's (positives, pixels)
    # logits and in the masks.
    run_image = image[run_positive]
    run_logit = (run_positive - first_positive[run_image]) * pixels_per_map + run_pixel
    logit_index = run_logit[pair_run] + column_in_run
    run_mask = run_image * pixels_per_map + run_pixel
    mask_index = run_mask[pair_run] + column_in_run
    # The protos are unbound per image so that autograd runs one backward for all images.
    per_image = zip(
        coefs.split(positives_per_image.tolist()),
        protos.view(batch_size, num_masks, -1).unbind(0),
        logit_index.split(pairs_per_image),
    )
    logits = torch.cat(
        [
            (image_coefs @ image_protos).view(-1)[index]
            for image_coefs, image_protos, index in per_image
            if len(index)
        ]
    )
    in_mask = (masks.reshape(-1)[mask_index] == mask_value[pair_positive]).to(protos.dtype)
    per_pair = F.binary_cross_entropy_with_logits(logits, in_mask, reduction="none")
    # A positive's loss is the sum over its pairs / the map's pixels / the normalised box area.
    per_positive = box.new_zeros(len(box)).index_add(0, pair_positive, per_pair.float())
    per_positive = per_positive / pixels_per_map / box[:, 2:].prod(1)
    # The loss sums the (level, image) groups' means.
    counts = torch.bincount(group)
    total = per_positive.new_zeros(len(counts)).index_add(0, group, per_positive)
    has_positives = counts > 0
    return (total[has_positives] / counts[has_positives]).sum()


class YOLOLoss:
    """yolov5's loss for a Detect or Segment head (hyp: rescaled by `scale_hyp`):
    `criterion(preds, targets[, masks])` -> (loss, items {"box", ["seg",] "obj", "cls"}).

    preds: train-mode output, nl raw maps (bs, na, ny, nx, 5+nc+nm); segment: (maps, protos
        (bs, nm, Hp, Wp)). targets: (N, 6) [img_idx, cls, cx, cy, w, h], xywh normalised.
    masks (segment): (bs, Hm, Wm) overlap index maps, value k = the image's k-th target (1-based).
    items: detached per-image means; loss = sum(items) * bs * world_size. The mask term is
    `self.mask_loss`: mask_loss_fast (tests swap in a plain reference)."""

    def __init__(self, model, hyp, world_size=1):
        # The head's anchors are read at each call: AutoAnchor may change them.
        self.head = de_parallel(model).head
        self.nl = self.head.nl
        self.nc = self.head.nc
        self.nm = self.head.nm
        self.hyp = dict(hyp)
        self.world_size = world_size
        # The objectness loss weighs the levels, from the finest.
        self.balance = [4.0, 1.0, 0.4]
        if self.nl != 3:
            self.balance = [4.0, 1.0, 0.25, 0.06, 0.02][: self.nl]
        device = next(model.parameters()).device
        self.cls_pw = torch.tensor([hyp["cls_pw"]], device=device)
        self.obj_pw = torch.tensor([hyp["obj_pw"]], device=device)
        # Label smoothing moves the class targets of positives and negatives towards 0.5.
        smoothing = hyp["label_smoothing"]
        self.class_positive = 1.0 - 0.5 * smoothing
        self.class_negative = 0.5 * smoothing
        # ~3.5x faster than the plain per-image loss it equals (see its docstring).
        self.mask_loss = mask_loss_fast

    def _bce(self, logits, target, pos_weight):
        """Mean BCE-with-logits; with fl_gamma > 0 yolov5's focal form (alpha 0.25)."""
        loss = F.binary_cross_entropy_with_logits(
            logits, target, pos_weight=pos_weight, reduction="none"
        )
        gamma = self.hyp["fl_gamma"]
        if gamma > 0:
            prob = logits.sigmoid()
            prob_true = target * prob + (1 - target) * (1 - prob)
            alpha = target * 0.25 + (1 - target) * 0.75
            loss = loss * alpha * (1.0 - prob_true) ** gamma
        return loss.mean()

    def _assign(self, level, targets, ny, nx):
        """The positives of `level`, whose maps are ny x nx cells; targets (N, 6) as __call__'s."""
        # The level's anchors (na, 2) are in grid units, as are the boxes below.
        anchors = self.head.anchors[level].to(targets.device)
        gain = targets.new_tensor([nx, ny] * 2)
        grid_xywh = targets[:, 2:6] * gain
        # An (anchor, target) pair is kept when neither w nor h differ by more than anchor_t.
        ratio = grid_xywh[:, 2:4] / anchors[:, None]
        kept = torch.max(ratio, 1 / ratio).amax(2) < self.hyp["anchor_t"]
        anchor, target = kept.nonzero(as_tuple=True)
        xy = grid_xywh[target, :2]
        # The centre's distances to the left, upper, right and lower borders.
        distances = torch.cat((xy, gain[:2] - xy), 1)
        near = (distances % 1 < 0.5) & (distances > 1)
        # use (5, n) marks the cells a pair is assigned to: its own, and the neighbours near its
        # centre.
        use = F.pad(near, (1, 0), value=True).T
        offset, pair = use.nonzero(as_tuple=True)
        anchor = anchor[pair]
        target = target[pair]
        xy = xy[pair]
        # The cell, clamped to the map: yolov5 measures the target box from the clamped cell too.
        offsets = _OFFSETS.to(xy.device)[offset]
        last_cell = gain[:2].long() - 1
        cell = (xy - offsets).long().clamp(min=0).minimum(last_cell)
        return Assignment(
            image=targets[target, 0].long(),
            anchor=anchor,
            grid_y=cell[:, 1],
            grid_x=cell[:, 0],
            target_box=torch.cat((xy - cell, grid_xywh[target, 2:]), 1),
            anchor_wh=anchors[anchor],
            target=target,
            box_normalised=(grid_xywh / gain)[target],
        )

    def __call__(self, preds, targets, masks=None):
        maps = preds
        if self.nm:
            maps, protos = preds
            if masks is None:
                raise ValueError("YOLOLoss: a segmentation model needs masks (bs, H/4, W/4)")
            # The masks at the protos' size (nearest).
            size = protos.shape[-2:]
            if masks.shape[-2:] != size:
                masks = F.interpolate(masks[None].float(), size, mode="nearest")[0]
        if targets.ndim != 2 or targets.shape[1] != 6:
            raise ValueError(
                f"YOLOLoss: targets must be (N, 6) [img, cls, xywh], not {tuple(targets.shape)}"
            )
        device = maps[0].device
        batch_size = len(maps[0])
        targets = targets.to(device=device, dtype=torch.float32)
        box_loss = torch.zeros(1, device=device)
        obj_loss = torch.zeros(1, device=device)
        cls_loss = torch.zeros(1, device=device)
        seg_loss = torch.zeros(1, device=device)
        if self.nm:
            target_mask_values = mask_values(targets[:, 0], batch_size)
        # found holds the MaskPositives of each level with positives.
        found = []
        for level, level_map in enumerate(maps):
            positives = self._assign(level, targets, *level_map.shape[2:4])
            obj_target = torch.zeros(level_map.shape[:4], dtype=level_map.dtype, device=device)
            if len(positives.image):
                pred = level_map[positives.cells]
                # The predicted boxes (n, 4), grid xywh, xy from the cell's corner.
                xy = pred[:, :2].sigmoid() * 2 - 0.5
                wh = (pred[:, 2:4].sigmoid() * 2) ** 2 * positives.anchor_wh
                iou = bbox_ciou(torch.cat((xy, wh), 1), positives.target_box)
                box_loss += (1.0 - iou).mean()
                self._set_obj_target(obj_target, positives, iou)
                # A single class needs no classifier: objectness covers it.
                if self.nc > 1:
                    classes = targets[positives.target, 1]
                    cls_loss += self._class_loss(pred[:, 5 : 5 + self.nc], classes)
                if self.nm:
                    found.append(
                        MaskPositives(
                            group=level * batch_size + positives.image,
                            image=positives.image,
                            coefs=pred[:, 5 + self.nc :],
                            mask_value=target_mask_values[positives.target],
                            box=positives.box_normalised,
                        )
                    )
            obj_loss += self._bce(level_map[..., 4], obj_target, self.obj_pw) * self.balance[level]
        if found:
            seg_loss += self.mask_loss(found, protos, masks) * self.hyp["box"] / batch_size
        items = {"box": box_loss * self.hyp["box"]}
        if self.nm:
            items["seg"] = seg_loss
        items["obj"] = obj_loss * self.hyp["obj"]
        items["cls"] = cls_loss * self.hyp["cls"]
        # The summed per-image losses of the global batch, as DDP averages gradients over ranks.
        loss = sum(items.values()) * batch_size * self.world_size
        return loss, {name: value.detach()[0] for name, value in items.items()}

    @staticmethod
    def _set_obj_target(obj_target, positives, iou):
        """Write the positives' detached IoU (n,) into obj_target (bs, na, ny, nx), in place."""
        # Several positives may share a cell: the last in assignment order wins (what yolov5's
        # index assignment does), made explicit here so that it is deterministic on every device:
        # all of them write the last one's IoU.
        # Each positive's flat index into the (contiguous) obj_target.
        cell = sum(index * stride for index, stride in zip(positives.cells, obj_target.stride()))
        order = torch.arange(len(cell), device=cell.device)
        last = cell.new_full((obj_target.numel(),), -1)
        last.scatter_reduce_(0, cell, order, "amax")
        iou_target = iou.detach().clamp(0).to(obj_target.dtype)
        obj_target.view(-1)[cell] = iou_target[last[cell]]

    def _class_loss(self, logits, classes):
        """BCE of the positives' class logits (n, nc) against their classes (n,), smoothed."""
        target = torch.full_like(logits, self.class_negative)
        target.scatter_(1, classes.long()[:, None], self.class_positive)
        return self._bce(logits, target, self.cls_pw)


class ClassifyLoss(nn.CrossEntropyLoss):
    """yolov5's classification loss: `ClassifyLoss(label_smoothing=...)(logits (bs, nc), targets
    (bs, 2) [image, cls])` -> (the batch mean cross-entropy, {"cls"})."""

    def forward(self, logits, targets):
        classes = targets[:, 1].long().to(logits.device)
        loss = super().forward(logits.float(), classes)
        return loss, {"cls": loss.detach()}
