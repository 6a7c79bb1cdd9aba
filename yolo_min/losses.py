"""YOLOv5's training losses: YOLOLoss (target assignment, CIoU box, objectness, class and mask
BCE; equal to yolov5's ComputeLoss, fixtures loss_*.pt) and ClassifyLoss, a cross-entropy."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import de_parallel

# Neighbour-cell offsets (x, y): self, left, up, right, down. A kept pair is also assigned to the
# left/up (right/down) cell when its centre lies in the left/upper (right/lower) half of its cell.
_OFFSETS = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]) * 0.5


def scale_hyp(hyp: dict, nc: int, imgsz: int, nl: int = 3) -> dict:
    """A copy of hyp with the loss gains box, cls, obj rescaled for nc classes, imgsz, nl levels."""
    # hyp's gains are tuned for 80 classes, 640 pixels and 3 levels; training rescales them so:
    # cls ~ classes, obj ~ cells per image, all ~ 1 / levels
    gains = dict(box=3 / nl, cls=nc / 80 * 3 / nl, obj=(imgsz / 640) ** 2 * 3 / nl)
    return hyp | {k: hyp[k] * gain for k, gain in gains.items()}


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Complete IoU (n,) of paired xywh boxes box1, box2 (n, 4), as yolov5's."""
    # IoU - centre distance^2 / enclosing diagonal^2 - alpha * v (aspect term), alpha constant for
    # the gradient (as yolov5)
    (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.unbind(-1), box2.unbind(-1)
    l1, r1, t1, b1 = x1 - w1 / 2, x1 + w1 / 2, y1 - h1 / 2, y1 + h1 / 2
    l2, r2, t2, b2 = x2 - w2 / 2, x2 + w2 / 2, y2 - h2 / 2, y2 + h2 / 2
    inter_w = (torch.minimum(r1, r2) - torch.maximum(l1, l2)).clamp(0)
    inter = inter_w * (torch.minimum(b1, b2) - torch.maximum(t1, t2)).clamp(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = torch.maximum(r1, r2) - torch.minimum(l1, l2)  # enclosing box
    ch = torch.maximum(b1, b2) - torch.minimum(t1, t2)
    c2 = cw**2 + ch**2 + eps
    rho2 = ((l2 + r2 - l1 - r1) ** 2 + (t2 + b2 - t1 - b1) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


class YOLOLoss:
    """yolov5's loss for a Detect or Segment head (hyp: rescaled by `scale_hyp`):
    `criterion(preds, targets[, masks])` -> (loss, items {"box", ["seg",] "obj", "cls"}).

    preds: train-mode output, nl raw maps (bs, na, ny, nx, 5+nc+nm); segment: (maps, protos
        (bs, nm, Hp, Wp)). targets: (N, 6) [img_idx, cls, cx, cy, w, h], xywh normalised.
    masks (segment): (bs, Hm, Wm) overlap index maps, value k = the image's k-th target (1-based).
    items: detached per-image means; loss = sum(items) * bs * world_size."""

    def __init__(self, model: nn.Module, hyp: dict, world_size: int = 1):
        self.head = de_parallel(model).head  # anchors read per call: AutoAnchor may change them
        self.nl, self.nc, self.nm = self.head.nl, self.head.nc, self.head.nm
        self.hyp, self.world_size = dict(hyp), world_size
        self.balance = [4.0, 1.0, 0.4] if self.nl == 3 else [4.0, 1.0, 0.25, 0.06, 0.02][: self.nl]
        pos_weights = [[hyp["cls_pw"]], [hyp["obj_pw"]]]
        self.cls_pw, self.obj_pw = torch.tensor(pos_weights, device=next(model.parameters()).device)
        eps = hyp.get("label_smoothing", 0.0)
        self.cp, self.cn = 1.0 - 0.5 * eps, 0.5 * eps  # positive / negative class targets

    def _bce(self, logits: torch.Tensor, target: torch.Tensor, pos_weight) -> torch.Tensor:
        """Mean BCE-with-logits; with fl_gamma > 0 yolov5's focal form (alpha 0.25)."""
        bce = F.binary_cross_entropy_with_logits
        loss = bce(logits, target, pos_weight=pos_weight, reduction="none")
        if (gamma := self.hyp.get("fl_gamma", 0.0)) > 0:
            p = logits.sigmoid()
            p_t = target * p + (1 - target) * (1 - p)
            loss = loss * (target * 0.25 + (1 - target) * 0.75) * (1.0 - p_t) ** gamma
        return loss.mean()

    def _assign(self, i: int, targets: torch.Tensor, ny: int, nx: int):
        """Positives of level i in yolov5's order (offset, anchor, target): b, a, gj, gi (n,) cells;
        tbox (n, 4) grid xywh, xy from the cell; anchor wh (n, 2) grid; k (n,) the target's row;
        xywhn (n, 4) its box normalised back from grid units as yolov5 (the mask crop sees ulps)."""
        anchors = self.head.anchors[i].to(targets.device)  # (na, 2) grid units
        gain = targets.new_tensor([nx, ny, nx, ny])
        gxywh = targets[:, 2:6] * gain  # (nt, 4) grid units
        r = gxywh[None, :, 2:4] / anchors[:, None]  # (na, nt, 2) wh ratios
        a, k = (torch.max(r, 1 / r).amax(2) < self.hyp["anchor_t"]).nonzero(as_tuple=True)
        gxy = gxywh[k, :2]
        inv = gain[:2] - gxy  # distance to the right / lower border
        near = torch.cat(((gxy % 1 < 0.5) & (gxy > 1), (inv % 1 < 0.5) & (inv > 1)), 1).T  # (4, n)
        o, p = torch.cat((torch.ones_like(near[:1]), near)).nonzero(as_tuple=True)
        a, k, gxy = a[p], k[p], gxy[p]
        # the cell, clamped to the map: yolov5 measures tbox from the clamped cell too
        gij = (gxy - _OFFSETS.to(gxy.device)[o]).long().clamp(min=0).minimum(gain[:2].long() - 1)
        tbox = torch.cat((gxy - gij, gxywh[k, 2:]), 1)
        return targets[k, 0].long(), a, gij[:, 1], gij[:, 0], tbox, anchors[a], k, (gxywh / gain)[k]

    def __call__(self, preds, targets: torch.Tensor, masks: torch.Tensor | None = None) -> tuple:
        maps, protos = preds if self.nm else (preds, None)
        if protos is not None and masks is None:
            raise ValueError("YOLOLoss: a segmentation model needs masks (bs, H/4, W/4)")
        if targets.ndim != 2 or targets.shape[1] != 6:
            shape = tuple(targets.shape)
            raise ValueError(f"YOLOLoss: targets must be (N, 6) [img, cls, xywh], not {shape}")
        device, bs = maps[0].device, maps[0].shape[0]
        targets = targets.to(device=device, dtype=torch.float32)
        lbox, lobj, lcls, lseg = (torch.zeros(1, device=device) for _ in range(4))
        seg_parts = []  # per level with positives: (b, level * bs + b, coefs, k, xywhn)
        for i, pi in enumerate(maps):
            _, na, ny, nx, _ = pi.shape
            b, a, gj, gi, tbox, anch, k, xywhn = self._assign(i, targets, ny, nx)
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=device)
            if n := b.shape[0]:
                ps = pi[b, a, gj, gi]  # (n, no)
                pxy, pwh = ps[:, :2].sigmoid() * 2 - 0.5, (ps[:, 2:4].sigmoid() * 2) ** 2 * anch
                iou = bbox_ciou(torch.cat((pxy, pwh), 1), tbox)
                lbox += (1.0 - iou).mean()
                # Objectness target = detached IoU. Several positives may share a cell: the last in
                # assignment order wins (what yolov5's index assignment does), made explicit here
                # so that it is deterministic on every device: all of them write the last one's IoU.
                cell = ((b * na + a) * ny + gj) * nx + gi
                order = torch.arange(n, device=device)
                last = cell.new_full((tobj.numel(),), -1).scatter_reduce_(0, cell, order, "amax")
                tobj.view(-1)[cell] = iou.detach().clamp(0)[last[cell]].to(tobj.dtype)
                if self.nc > 1:  # a single class needs no classifier: objectness covers it
                    pcls = ps[:, 5 : 5 + self.nc]
                    t = torch.full_like(pcls, self.cn)
                    t[order, targets[k, 1].long()] = self.cp
                    lcls += self._bce(pcls, t, self.cls_pw)
                if protos is not None:
                    seg_parts.append((b, i * bs + b, ps[:, 5 + self.nc :], k, xywhn))
            lobj += self._bce(pi[..., 4], tobj, self.obj_pw) * self.balance[i]
        if seg_parts:
            lseg += self._seg_loss(seg_parts, protos, masks, targets[:, 0]) * self.hyp["box"] / bs
        hyp = self.hyp
        items = dict(box=lbox * hyp["box"], seg=lseg, obj=lobj * hyp["obj"], cls=lcls * hyp["cls"])
        if protos is None:
            del items["seg"]
        # the summed per-image losses of the global batch, as DDP averages gradients over ranks
        loss = sum(items.values()) * bs * self.world_size
        return loss, {k: v.detach()[0] for k, v in items.items()}

    def _seg_loss(self, parts: list, protos, masks, images: torch.Tensor) -> torch.Tensor:
        """Sum over levels and images of the mean mask loss of the positives (see the comments);
        parts: per level (b (n,), level * bs + b (n,), coefs (n, nm), target rows k (n,), xywhn
        (n, 4)); images (N,): the targets' image indices."""
        # a positive's loss: BCE of (coefs @ its image's protos) against its mask, inside its box
        # only, mean over the map / box area
        bs, nm, mh, mw = protos.shape
        if masks.shape[-2:] != (mh, mw):
            masks = F.interpolate(masks[None].float(), (mh, mw), mode="nearest")[0]
        # the positives grouped by image: one matmul per image
        order = torch.argsort(torch.cat([b for b, *_ in parts]), stable=True)
        b, group, coefs, k, xywhn = (torch.cat(x)[order] for x in zip(*parts))
        onehot = F.one_hot(images.long(), bs)  # masks: value j = the image's j-th target (1-based)
        idx = (onehot.cumsum(0) * onehot).sum(1)[k]  # the positives' values in masks
        # Only the pixels inside the box count, and a box is a small part of the map: list them
        # as (positive p, pixel) pairs instead of a BCE over every map. Pixel column c is in the
        # box iff x1 <= c < x2, i.e. ceil(x1) <= c < ceil(x2) (likewise rows), x1 = x - w/2.
        x, y, w, h = (xywhn * xywhn.new_tensor([mw, mh, mw, mh])).unbind(1)  # box in proto pixels
        c0, c1 = ((x - w / 2).ceil().clamp(0, mw).long(), (x + w / 2).ceil().clamp(0, mw).long())
        r0, r1 = ((y - h / 2).ceil().clamp(0, mh).long(), (y + h / 2).ceil().clamp(0, mh).long())
        bw, bh, hw = (c1 - c0).clamp(min=0), (r1 - r0).clamp(min=0), mh * mw
        # the pairs are built from box rows (runs of bw pixels): few passes over the many pairs
        run = torch.repeat_interleave(bh)  # run -> its positive
        row = torch.arange(len(run), device=b.device) - (bh.cumsum(0) - bh)[run] + r0[run]
        run_w, pixel0 = bw[run], row * mw + c0[run]  # the run's width and first pixel in the map
        run_first = run_w.cumsum(0) - run_w  # the run's first pair
        pair_run = torch.repeat_interleave(run_w)  # pair -> its run
        pairs = torch.arange(len(pair_run), device=b.device)
        along = lambda v: (v - run_first)[pair_run] + pairs  # noqa: E731  a run's v, + place in it
        p = run[pair_run]  # pair -> positive
        pos_per_img = torch.bincount(b, minlength=bs)
        first = pos_per_img.cumsum(0) - pos_per_img  # each image's first positive
        pairs_per_img = torch.zeros_like(first).index_add(0, b, bw * bh).tolist()
        if not sum(pairs_per_img):  # no box holds a pixel: loss 0, and no graph to the protos
            return x.new_zeros(())
        at = along((run - first[b[run]]) * hw + pixel0).split(pairs_per_img)  # in (npos_i, hw)
        # the protos unbound per image: one backward for all images, not one each
        parts = zip(coefs.split(pos_per_img.tolist()), protos.view(bs, nm, -1).unbind(0), at)
        logits = torch.cat([(c @ protos_i).view(-1)[a] for c, protos_i, a in parts if len(a)])
        gt = masks.reshape(-1)[along(b[run] * hw + pixel0)] == idx[p]
        per_pair = F.binary_cross_entropy_with_logits(logits, gt.to(protos.dtype), reduction="none")
        # per positive: the sum over its pairs / the map's pixels / the normalised box area
        per_pos = torch.zeros_like(x).index_add(0, p, per_pair.float()) / hw / xywhn[:, 2:].prod(1)
        total = per_pos.new_zeros(self.nl * bs).index_add(0, group, per_pos)  # per (level, image)
        counts = torch.bincount(group, minlength=self.nl * bs)
        return (total[counts > 0] / counts[counts > 0]).sum()


class ClassifyLoss(nn.CrossEntropyLoss):
    """yolov5's classification loss: `ClassifyLoss(label_smoothing=...)(logits (bs, nc), targets
    (bs, 2) [image, cls])` -> (the batch mean cross-entropy, {"cls"})."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = super().forward(logits.float(), targets[:, 1].long().to(logits.device))
        return loss, {"cls": loss.detach()}
