"""Losses: exact equality with yolov5's ComputeLoss (fixtures), assignment edge cases, gradients,
the batch/DDP scaling rule, focal loss and label smoothing."""

import pytest
import torch
import torch.nn.functional as F
import torchvision
import yaml

from yolo_min.losses import YOLOLoss, bbox_ciou, mask_loss_fast, scale_hyp
from yolo_min.models import CFG_DIR, Model
from yolo_min.ops import xywh2xyxy

DEFAULT_HYP = yaml.safe_load((CFG_DIR / "hyp.scratch-low.yaml").read_text())


class Loss(YOLOLoss):
    """YOLOLoss with its named items stacked in yolov5's order, as the fixtures hold them."""

    def __call__(self, *args):
        loss, items = super().__call__(*args)
        assert list(items) == (["box", "seg", "obj", "cls"] if self.nm else ["box", "obj", "cls"])
        return loss, torch.stack(list(items.values()))


FIXTURES = [
    ("loss_det_nc80", "yolov5n.yaml"),
    ("loss_det_nc1", "yolov5n.yaml"),
    ("loss_seg_nc80", "yolov5n-seg.yaml"),
]
LOSS_KEYS = ("box", "obj", "cls", "anchor_t", "cls_pw", "obj_pw", "fl_gamma", "label_smoothing")
_MODELS = {}


def model_for(cfg: str, nc: int) -> Model:
    if (cfg, nc) not in _MODELS:  # building a model costs a dummy forward pass: reuse it
        torch.manual_seed(0)
        _MODELS[cfg, nc] = Model(cfg, nc=nc)
    return _MODELS[cfg, nc]


def load(fixtures_dir, name):
    fx = torch.load(fixtures_dir / f"{name}.pt", weights_only=True)
    preds = (fx["preds"], fx["protos"]) if "protos" in fx else fx["preds"]
    return fx, preds, fx.get("masks_overlap")


def rel_close(a, b, rtol=1e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-7)


def synthetic(seg: bool, nc: int = 80, bs: int = 2, hw=(64, 96), seed: int = 0):
    """Random raw maps (and protos) shaped like the model's train output for input hw."""
    g = torch.Generator().manual_seed(seed)
    no = 5 + nc + (32 if seg else 0)
    maps = [torch.randn(bs, 3, hw[0] // s, hw[1] // s, no, generator=g) for s in (8, 16, 32)]
    if not seg:
        return maps
    return maps, torch.randn(bs, 32, hw[0] // 4, hw[1] // 4, generator=g)


def crit_for(seg: bool, nc: int = 80, **hyp) -> YOLOLoss:
    model = model_for("yolov5n-seg.yaml" if seg else "yolov5n.yaml", nc)
    return Loss(model, {**scale_hyp(DEFAULT_HYP, nc, 96), **hyp})


def boxes_to_masks(targets: torch.Tensor, bs: int, hw) -> torch.Tensor:
    """Overlap index maps at hw: each target's box painted with its 1-based index in its image."""
    masks = torch.zeros(bs, *hw)
    counts = [0] * bs
    for img, _, cx, cy, w, h in targets.tolist():
        b = int(img)
        counts[b] += 1
        x1, x2 = int((cx - w / 2) * hw[1]), int((cx + w / 2) * hw[1])
        y1, y2 = int((cy - h / 2) * hw[0]), int((cy + h / 2) * hw[0])
        masks[b, max(y1, 0) : y2 + 1, max(x1, 0) : x2 + 1] = counts[b]
    return masks


@pytest.mark.parametrize("name, cfg", FIXTURES)
def test_fixtures(fixtures_dir, name, cfg):
    fx, preds, masks = load(fixtures_dir, name)
    model = model_for(cfg, fx["nc"])
    torch.testing.assert_close(model.model[-1].anchors, fx["anchors_grid_units"])
    assert model.stride.tolist() == fx["stride"].tolist()
    for (
        k
    ) in LOSS_KEYS:  # the fixture hyp is what scale_hyp makes of DEFAULT_HYP at imgsz = max side
        assert scale_hyp(DEFAULT_HYP, fx["nc"], max(fx["imgsz_hw"]))[k] == pytest.approx(
            fx["hyp"][k]
        )
    loss, items = Loss(model, fx["hyp"])(preds, fx["targets"], masks)
    assert loss.shape == (1,) and items.shape == fx["loss_items"].shape and not items.requires_grad
    rel_close(items, fx["loss_items"])
    rel_close(loss, fx["loss"])
    rel_close(Loss(model, fx["hyp"], world_size=4)(preds, fx["targets"], masks)[0], 4 * fx["loss"])


def test_seg_masks_resized_and_targets_order(fixtures_dir):
    """Masks at twice the proto resolution are resized (nearest) to the same maps; targets of
    different images interleaved keep each image's own order, so the loss is unchanged."""
    fx, preds, masks = load(fixtures_dir, "loss_seg_nc80")
    crit = Loss(model_for("yolov5n-seg.yaml", 80), fx["hyp"])
    big = masks.repeat_interleave(2, 1).repeat_interleave(2, 2)
    rel_close(crit(preds, fx["targets"], big)[1], fx["loss_items"])
    t = fx["targets"]
    order = torch.argsort(t[:, 0], descending=True, stable=True)  # image 1's targets first
    rel_close(crit(preds, t[order], masks)[1], fx["loss_items"])


@pytest.mark.parametrize("seg", [False, True])
def test_empty_targets_only_objectness(seg):
    crit = crit_for(seg)
    preds = synthetic(seg)
    masks = torch.zeros(2, 16, 24) if seg else None
    loss, items = crit(preds, torch.zeros(0, 6), masks)
    obj = items[2] if seg else items[1]
    assert obj > 0 and items.sum() == obj and torch.isfinite(loss)
    # objectness alone, by hand: BCE towards 0 at every cell, level weights 4, 1, 0.4
    maps = preds[0] if seg else preds
    want = (
        sum(
            w * F.binary_cross_entropy_with_logits(p[..., 4], torch.zeros_like(p[..., 4]))
            for w, p in zip([4.0, 1.0, 0.4], maps)
        )
        * crit.hyp["obj"]
    )
    rel_close(obj, want)


@pytest.mark.parametrize("seg", [False, True])
def test_target_matching_no_anchor(seg):
    """A 1x1-pixel box is > 4x smaller than every anchor: no positive anywhere, no fallback."""
    crit = crit_for(seg)
    preds = synthetic(seg)
    tiny = torch.tensor([[0, 3, 0.5, 0.5, 1 / 96, 1 / 64]])
    assert all(
        crit._assign(i, tiny, *p.shape[2:4])[0].numel() == 0
        for i, p in enumerate(preds[0] if seg else preds)
    )
    masks = boxes_to_masks(tiny, 2, (16, 24)) if seg else None
    torch.testing.assert_close(crit(preds, tiny, masks), crit(preds, torch.zeros(0, 6), masks))
    real = torch.tensor([[1, 5, 0.4, 0.6, 0.3, 0.4]])
    both = torch.cat((tiny, real))  # the unmatched target changes nothing for the others
    if seg:  # index maps: the real target is the only one of image 1
        torch.testing.assert_close(
            crit(preds, both, boxes_to_masks(both, 2, (16, 24))),
            crit(preds, real, boxes_to_masks(real, 2, (16, 24))),
        )
    else:
        torch.testing.assert_close(crit(preds, both), crit(preds, real))


def test_targets_on_border():
    """Centres exactly on the right/bottom border land in the last cell (clamped), left/top
    borders in the first; the loss and its gradient stay finite."""
    crit = crit_for(False)
    t = torch.tensor(
        [
            [0, 1, 1.0, 1.0, 0.3, 0.4],
            [0, 2, 0.0, 0.0, 0.3, 0.3],
            [1, 3, 1.0, 0.5, 0.6, 0.9],
            [1, 4, 0.999, 0.001, 0.2, 0.25],
        ]
    )
    maps = [p.requires_grad_() for p in synthetic(False)]
    for i, p in enumerate(maps):
        ny, nx = p.shape[2:4]
        positives = crit._assign(i, t, ny, nx)
        gi, gj, tbox = positives.grid_x, positives.grid_y, positives.target_box
        assert positives.image.numel() > 0
        assert gi.min() >= 0 and gi.max() <= nx - 1 and gj.min() >= 0 and gj.max() <= ny - 1
        assert tbox[:, :2].min() >= -0.5 and tbox[:, :2].max() <= 1.5
        assert ((gi == nx - 1) & (tbox[:, 0] == 1.0)).any()  # cx = 1.0: last cell, offset 1
    loss, items = crit(maps, t)
    loss.backward()
    assert torch.isfinite(loss) and (items > 0).all()
    assert all(torch.isfinite(p.grad).all() for p in maps)


def test_single_class_no_class_loss():
    crit = crit_for(False, nc=1)
    maps = [p.requires_grad_() for p in synthetic(False, nc=1)]
    t = torch.tensor([[0, 0, 0.5, 0.5, 0.3, 0.3], [1, 0, 0.3, 0.6, 0.5, 0.4]])
    loss, items = crit(maps, t)
    loss.backward()
    assert items[0] > 0 and items[1] > 0 and items[2] == 0
    assert all(p.grad[..., 5].abs().sum() == 0 for p in maps)  # the class logit gets no gradient


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov5n-seg.yaml"])
def test_gradients_reach_every_head(cfg):
    torch.manual_seed(0)
    model = Model(cfg, nc=3).train()
    crit = Loss(model, scale_hyp(DEFAULT_HYP, 3, 96))
    t = torch.tensor(
        [[0, 0, 0.5, 0.5, 0.45, 0.5], [0, 1, 0.25, 0.3, 0.2, 0.3], [1, 2, 0.6, 0.4, 0.9, 0.8]]
    )
    seg = cfg.endswith("-seg.yaml")
    loss, items = crit(
        model(torch.rand(2, 3, 64, 96)), t, boxes_to_masks(t, 2, (16, 24)) if seg else None
    )
    loss.backward()
    assert (items > 0).all()
    head = model.model[-1]
    for conv in head.m:
        g = conv.weight.grad
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        g = g.view(3, head.no, -1)  # per anchor: box, obj, cls (and mask coefs) channels all learn
        assert (g.abs().sum((0, 2)) > 0).all()
    if seg:
        assert all(p.grad.abs().sum() > 0 for p in head.proto.parameters())


@pytest.mark.parametrize("seg", [False, True])
def test_batch_equals_sum_of_images(seg):
    """loss(batch) == sum of loss(image) when it must, and only for the terms where it must.

    loss = bs * (box + obj + cls [+ seg]). obj is a mean over all cells of a level, each image
    having the same number of cells, so bs * obj(batch) = sum of obj(image) always; seg is already
    a mean per image (times 1/bs), so likewise. box and cls are means over all positives of the
    batch, equal to the mean of the per-image means only when every image has the same number of
    positives per level: here every image holds the same boxes (classes and predictions differ)."""
    bs = 3
    crit = crit_for(seg)
    preds = synthetic(seg, bs=bs, seed=1)
    maps, protos = preds if seg else (preds, None)
    boxes = torch.tensor([[0.5, 0.5, 0.3, 0.4], [0.2, 0.3, 0.1, 0.15]])
    t = torch.cat(
        [
            torch.cat((torch.full((2, 1), b), torch.tensor([[b + 1.0], [7.0 * b]]), boxes), 1)
            for b in range(bs)
        ]
    )
    masks = boxes_to_masks(t, bs, (16, 24)) if seg else None
    loss, items = crit(preds, t, masks)
    per_image = []
    for b in range(bs):
        ti = t[t[:, 0] == b].clone()
        ti[:, 0] = 0
        mi = [p[b : b + 1] for p in maps]
        pi = (mi, protos[b : b + 1]) if seg else mi
        per_image.append(crit(pi, ti, masks[b : b + 1] if seg else None))
    rel_close(loss, sum(total for total, _ in per_image))
    rel_close(items * bs, sum(i for _, i in per_image))
    # different boxes per image: obj (and seg) still add up exactly, box in general does not
    t2 = t.clone()
    t2[2:4, 4:6] *= 0.5
    _, items2 = crit(preds, t2, boxes_to_masks(t2, bs, (16, 24)) if seg else None)
    parts = []
    for b in range(bs):
        ti = t2[t2[:, 0] == b].clone()
        ti[:, 0] = 0
        mi = [p[b : b + 1] for p in maps]
        parts.append(
            crit(
                (mi, protos[b : b + 1]) if seg else mi,
                ti,
                boxes_to_masks(ti, 1, (16, 24)) if seg else None,
            )[1]
        )
    summed = sum(parts)
    for k in [1, 2] if seg else [1]:
        rel_close(items2[k] * bs, summed[k])
    assert not torch.isclose(items2[0] * bs, summed[0], rtol=1e-4)


def test_focal_loss_and_label_smoothing():
    crit = crit_for(False, fl_gamma=1.5)
    x, y = torch.randn(200), (torch.rand(200) > 0.7).float()
    want = torchvision.ops.sigmoid_focal_loss(x, y, alpha=0.25, gamma=1.5, reduction="mean")
    rel_close(crit._bce(x, y, crit.obj_pw), want)
    # label smoothing eps: class targets 1 - eps/2 and eps/2, checked against a hand-built BCE
    eps, nc = 0.2, 80
    crit = crit_for(False, label_smoothing=eps)
    maps = synthetic(False, nc=nc)
    t = torch.tensor([[0, 7, 0.5, 0.5, 0.3, 0.4], [1, 9, 0.3, 0.7, 0.2, 0.2]])
    want = 0.0
    for i, p in enumerate(maps):
        positives = crit._assign(i, t, *p.shape[2:4])
        if not positives.image.numel():  # a level without positives adds no class loss
            continue
        onehot = F.one_hot(t[positives.target, 1].long(), nc).float()
        want += F.binary_cross_entropy_with_logits(
            p[positives.cells][:, 5:], onehot * (1 - eps) + eps / 2
        )
    rel_close(crit(maps, t)[1][2], want * crit.hyp["cls"])


def seg_edge_case():
    """Segment maps, protos, targets and masks (16 x 24) with box edges exactly on pixel borders,
    boxes running off the image, and a mask that is not a box."""
    maps, protos = synthetic(True, bs=2, seed=3)
    t = torch.tensor(
        [
            [0, 1, 0.5, 0.5, 0.25, 0.5],
            [0, 2, 0.375, 0.25, 0.5, 0.25],
            [0, 3, 1.0, 1.0, 0.4, 0.6],
            [1, 4, 0.02, 0.3, 0.3, 0.5],
            [1, 5, 0.61, 0.47, 0.33, 0.71],
        ]
    )
    masks = boxes_to_masks(t, 2, (16, 24))
    masks[1, 3:9, 2:20] = 2
    return maps, protos, t, masks


def test_seg_loss_against_dense_reference():
    """The mask term, evaluated only at box pixels, equals the dense formula: BCE over the whole
    proto map, times the crop (pixel c kept iff x1 <= c < x2, rows alike), mean over the map /
    normalised box area, mean per image and level, summed, * box / bs. Boxes with edges exactly on
    pixel borders and boxes running off the image check the crop's boundaries."""
    crit = crit_for(True)
    bs, (mh, mw) = 2, (16, 24)
    maps, protos, t, masks = seg_edge_case()
    onehot = F.one_hot(t[:, 0].long(), bs)
    rank = (onehot.cumsum(0) * onehot).sum(1)
    want = 0.0
    for i, p in enumerate(maps):
        positives = crit._assign(i, t, *p.shape[2:4])
        b, k, xywhn = positives.image, positives.target, positives.box_normalised
        for bi in b.unique():
            j = b == bi
            logits = torch.einsum("nc,chw->nhw", p[positives.cells][j, 85:], protos[bi])
            gt = (masks[bi] == rank[k[j]].view(-1, 1, 1)).float()
            x, y, w, h = (xywhn[j] * torch.tensor([mw, mh, mw, mh])).unbind(1)
            cols, rows = torch.arange(mw).view(1, 1, -1), torch.arange(mh).view(1, -1, 1)
            crop = (
                (cols >= (x - w / 2).view(-1, 1, 1))
                & (cols < (x + w / 2).view(-1, 1, 1))
                & (rows >= (y - h / 2).view(-1, 1, 1))
                & (rows < (y + h / 2).view(-1, 1, 1))
            )
            loss = F.binary_cross_entropy_with_logits(logits, gt, reduction="none") * crop
            want += (loss.mean((1, 2)) / (xywhn[j, 2] * xywhn[j, 3])).mean()
    rel_close(crit((maps, protos), t, masks)[1][1], want * crit.hyp["box"] / bs)


def loss_and_gradients(crit, preds, targets, masks):
    """crit's loss items, and the gradients of its loss on the maps and on the protos."""
    maps = [p.detach().clone().requires_grad_() for p in preds[0]]
    protos = preds[1].detach().clone().requires_grad_()
    loss, items = crit((maps, protos), targets, masks)
    loss.backward()
    return items, [p.grad for p in maps] + [protos.grad]


def mask_loss(levels, protos, masks):
    """yolov5's mask loss, plainly: the reference of YOLOLoss's mask_loss_fast. Summed over levels
    and images, the mean over the image's positives at that level of the BCE-with-logits of the
    predicted mask (coefs @ protos) against the target's mask, cropped to its box, mean over the
    map, divided by the normalised box area.

    levels: MaskPositives per level with positives; protos: (bs, nm, mh, mw); masks: (bs, mh, mw)
    overlap index maps (see yolo_min.losses.mask_values)."""
    _, _, mask_h, mask_w = protos.shape
    rows = torch.arange(mask_h, device=protos.device)[:, None]
    cols = torch.arange(mask_w, device=protos.device)
    total = protos.new_zeros(())
    for level in levels:
        for image in level.image.unique().tolist():
            mine = level.image == image
            box = level.box[mine]
            logits = (level.coefs[mine] @ protos[image].flatten(1)).view(-1, mask_h, mask_w)
            value = level.mask_value[mine].view(-1, 1, 1)
            target_mask = (masks[image] == value).float()
            bce = F.binary_cross_entropy_with_logits(logits, target_mask, reduction="none")
            # A pixel is in the box when x1 <= column < x2 and y1 <= row < y2, in mask pixels.
            pixel_box = xywh2xyxy(box * box.new_tensor([mask_w, mask_h] * 2))
            x1, y1, x2, y2 = pixel_box.T[..., None, None]
            in_columns = (cols >= x1) & (cols < x2)
            in_rows = (rows >= y1) & (rows < y2)
            per_positive = (bce * (in_columns & in_rows)).mean((1, 2))
            area = box[:, 2:].prod(1)
            total = total + (per_positive / area).mean()
    return total


def test_fast_mask_loss_equals_the_plain_one(fixtures_dir):
    """YOLOLoss uses mask_loss_fast; it equals the plain per-image mask_loss to float rounding:
    the loss items and the gradients on every map and on the protos, on the segment fixture and
    on the edge cases of seg_edge_case."""
    fx, preds, masks = load(fixtures_dir, "loss_seg_nc80")
    model = model_for("yolov5n-seg.yaml", 80)
    maps, protos, t, edge_masks = seg_edge_case()
    cases = [
        (Loss(model, fx["hyp"]), preds, fx["targets"], masks),
        (crit_for(True), (maps, protos), t, edge_masks),
    ]
    for crit, preds, targets, masks in cases:
        assert crit.mask_loss is mask_loss_fast
        fast_items, fast_grads = loss_and_gradients(crit, preds, targets, masks)
        crit.mask_loss = mask_loss
        plain_items, plain_grads = loss_and_gradients(crit, preds, targets, masks)
        assert plain_items[1] > 0
        rel_close(fast_items, plain_items)
        for fast, plain in zip(fast_grads, plain_grads):
            torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-9)


def test_ciou_hand_values():
    """Identical boxes: 1. Disjoint equal squares side by side (centres 2 apart, enclosing 3x1):
    IoU 0, distance term 4/10, no aspect term."""
    a = torch.tensor([[1.0, 1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([[1.0, 1.0, 2.0, 3.0], [2.0, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(bbox_ciou(a, b), torch.tensor([1.0, -0.4]), atol=1e-6, rtol=0)


def test_bad_input_messages():
    crit = crit_for(True)
    with pytest.raises(ValueError, match="masks"):
        crit(synthetic(True), torch.zeros(0, 6))
    with pytest.raises(ValueError, match=r"\(N, 6\)"):
        crit_for(False)(synthetic(False), torch.zeros(3, 5))
