"""ops: NMS against the yolov5 fixture, box/mask geometry by hand, rasterisation and RLE against
pycocotools."""

import json

import numpy as np
import pytest
import torch

from yolo_min.ops import (
    box_iou,
    mask_iou,
    mask_to_polygon,
    non_max_suppression,
    polygons_to_masks,
    process_mask,
    rle_encode,
    scale_boxes,
    scale_masks,
    xywh2xyxy,
    xyxy2xywh,
)


@pytest.mark.parametrize("setting", ["val", "predict"])
def test_nms_matches_yolov5_fixture(fixtures_dir, setting):
    fx = torch.load(fixtures_dir / "nms.pt", weights_only=True)
    out = non_max_suppression(fx["prediction"], **fx[f"{setting}_kwargs"])
    for got, want in zip(out, fx[f"{setting}_out"], strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_nms_semantics_and_mask_coefs():
    # rows: [cx, cy, w, h, obj, cls0, cls1, coef0, coef1]; coef0 tags the source row
    rows = torch.tensor(
        [
            [50, 50, 20, 20, 0.9, 0.9, 0.1, 0, 7],  # best box of class 0
            [51, 50, 20, 20, 0.8, 0.9, 0.2, 1, 7],  # overlaps row 0, same class -> suppressed
            [51, 50, 20, 20, 0.8, 0.1, 0.95, 2, 7],  # same place, class 1 -> kept (class-aware)
            [150, 50, 20, 20, 0.5, 0.6, 0.56, 3, 7],  # multi-label: both classes above 0.25
            [150, 150, 20, 20, 0.1, 0.9, 0.9, 4, 7],  # score 0.09 < 0.25 -> dropped
        ],
        dtype=torch.float32,
    )[None]
    (best,) = non_max_suppression(rows, conf_thres=0.25, iou_thres=0.45, nm=2)
    assert best[:, 6].tolist() == [0, 2, 3] and (best[:, 7] == 7).all()
    assert best[:, 5].tolist() == [0, 1, 0]
    torch.testing.assert_close(best[:, 4], torch.tensor([0.81, 0.76, 0.30]))
    torch.testing.assert_close(best[0, :4], torch.tensor([40.0, 40, 60, 60]))
    (multi,) = non_max_suppression(rows, conf_thres=0.25, iou_thres=0.45, multi_label=True, nm=2)
    assert sorted(zip(multi[:, 6].tolist(), multi[:, 5].tolist())) == [
        (0, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert (multi[:, 4].diff() <= 0).all()  # sorted by confidence
    (top2,) = non_max_suppression(
        rows, conf_thres=0.25, iou_thres=0.45, multi_label=True, max_det=2, nm=2
    )
    torch.testing.assert_close(top2, multi[:2])
    (empty,) = non_max_suppression(rows, conf_thres=0.99, iou_thres=0.45, nm=2)
    assert empty.shape == (0, 8)
    (only1,) = non_max_suppression(
        rows, 0.25, 0.45, multi_label=True, classes=[1], nm=2
    )  # filtered first
    assert only1[:, 6].tolist() == [2, 3] and (only1[:, 5] == 1).all()
    (agnostic,) = non_max_suppression(
        rows, 0.25, 0.45, agnostic=True, nm=2
    )  # row 0 suppresses row 2 (cls 1)
    assert agnostic[:, 6].tolist() == [0, 3]


def test_mask_to_polygon_as_opencv_find_contours():
    """The outer border's corner pixels (OpenCV's RETR_EXTERNAL, CHAIN_APPROX_SIMPLE output, checked
    by hand and against cv2 5.0), clockwise; the component with the most corners."""
    m = np.zeros((8, 10), bool)
    m[2:6, 3:8] = True
    assert mask_to_polygon(m).tolist() == [[3, 2], [7, 2], [7, 5], [3, 5]]
    m = np.zeros((9, 9), bool)
    m[1:8, 1:8], m[2:7, 2:7], m[4, 4] = True, False, True  # a ring with a pixel in its hole
    assert mask_to_polygon(torch.from_numpy(m)).tolist() == [[1, 1], [7, 1], [7, 7], [1, 7]]
    m = np.zeros((9, 12), bool)
    m[1:4, 1:4], m[5, 5:9], m[6:8, 5:9], m[7, 9:11] = True, True, True, True  # 4 and 6 corners
    assert mask_to_polygon(m).tolist() == [[5, 5], [8, 5], [8, 6], [9, 7], [10, 7], [5, 7]]
    m = np.zeros((6, 7), bool)
    m[[1, 2, 3], [1, 2, 3]] = True  # 8-connected: one diagonal run, traced there and back
    assert mask_to_polygon(m).tolist() == [[1, 1], [3, 3]]
    m[1:4, 1:4] = False
    m[2, 5] = True
    assert mask_to_polygon(m).tolist() == [[5, 2]]
    assert mask_to_polygon(np.zeros((4, 4), bool)).shape == (0, 2)


def test_box_conversions_and_iou():
    xyxy = torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 40]])
    torch.testing.assert_close(xywh2xyxy(xyxy2xywh(xyxy)), xyxy)
    assert xyxy2xywh(xyxy)[2].tolist() == [25, 30, 10, 20]
    iou = box_iou(xyxy, xyxy)
    torch.testing.assert_close(iou.diag(), torch.ones(3))
    assert iou[0, 1].item() == pytest.approx(50 / 150) and iou[0, 2] == 0


def test_scale_boxes_inverts_letterbox():
    # 480x640 image letterboxed into 640x640: ratio 1, 80 px of padding above and below
    boxes = torch.tensor([[10.0, 90, 110, 190], [-5, 70, 700, 600]])
    out = scale_boxes(boxes, ((1.0, 1.0), (0.0, 80.0)), (480, 640))
    assert out.tolist() == [[10, 10, 110, 110], [0, 0, 640, 480]]  # second one clipped
    half = scale_boxes(torch.tensor([[10.0, 45, 60, 95]]), ((0.5, 0.5), (0.0, 40.0)), (480, 640))
    assert half.tolist() == [[20, 10, 120, 110]]


def test_process_mask_crops_to_box_and_scale_masks_cuts_padding():
    protos = torch.zeros(2, 16, 16)
    protos[0] = 5.0  # coef (1, 0) -> sigmoid(5) everywhere: the mask is exactly the box crop
    protos[1] = -5.0
    boxes = torch.tensor([[3.5, 8.0, 20.0, 30.2], [0.0, 0.0, 64.0, 64.0]])
    det = torch.cat((boxes, torch.zeros(2, 2), torch.tensor([[1.0, 0.0], [0.0, 1.0]])), 1)
    masks = process_mask(protos, det, (64, 64))
    want = torch.zeros(64, 64, dtype=torch.bool)
    # cropped at prototype resolution (1/4): columns 0.875 <= c < 5 and rows 2 <= r < 7.55, i.e.
    # 1-4 and 2-7, then upsampled by 4: input columns 4-19 and rows 8-31 (sigmoid(5) ~ 1), but
    # the corners, where bilinear weights 0.625 * 0.625 * sigmoid(5) < 0.5
    want[8:32, 4:20] = True
    want[[8, 8, 31, 31], [4, 19, 4, 19]] = False
    assert torch.equal(masks[0], want) and not masks[1].any()
    orig = scale_masks(
        masks, ((1.0, 1.0), (0.0, 8.0)), (48, 64)
    )  # 8 rows of padding top and bottom
    assert orig.shape == (2, 48, 64) and torch.equal(orig[0], want[8:56])
    small = scale_masks(masks, ((0.5, 0.5), (0.0, 8.0)), (96, 128))  # nearest upsampling by 2
    assert torch.equal(small[0], want[8:56].repeat_interleave(2, 0).repeat_interleave(2, 1))
    assert scale_masks(masks[:0], ((1.0, 1.0), (0.0, 8.0)), (48, 64)).shape == (0, 48, 64)


@pytest.mark.parametrize("portrait", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize(
    "r, pad, orig, H, first",
    [  # letterbox: round(orig * r) rows from round((H - round(orig * r)) / 2 - 0.1)
        (1.0, 5.5, 85, 96, 5),  # 11 rows of padding: 5 above, 6 below
        (0.2, 5.3, 427, 96, 5),  # 85.4 -> 85 rows; the pad is yolov5's (96 - 85.4) / 2
        (0.2, 5.5, 425, 96, 5),  # 85 rows
        (0.2, 5.7, 423, 96, 5),  # 84.6 -> 85 rows, still from row 5 (not round(5.7 - 0.1))
        (0.2, 4.9, 431, 96, 5),  # 86.2 -> 86 rows, 10 of padding: from row 5 (not int(4.9))
        (1.0, 11.0, 41, 64, 11),  # the dataset's pad (val): the whole-pixel offset
    ],
)
def test_scale_masks_cuts_the_padding_where_letterbox_put_it(r, pad, orig, H, first, portrait):
    """A mask on exactly the image's rows covers the whole original; one on its first (last) row
    only, the original's rows that nearest-exact takes from it: floor((i + 0.5) * n / orig)."""
    n, side = round(orig * r), round(128 / r)  # the other side: all 128 input pixels
    masks = torch.zeros(3, H, 128, dtype=torch.bool)
    masks[0, first : first + n] = True
    masks[1, first], masks[2, first + n - 1] = True, True
    ratio_pad, hw = ((r, r), (0.0, pad)), (orig, side)
    if portrait:  # the same along columns
        masks, ratio_pad, hw = masks.transpose(1, 2), ((r, r), (pad, 0.0)), (side, orig)
    out = scale_masks(masks, ratio_pad, hw)
    out = out.transpose(1, 2) if portrait else out
    assert out.shape == (3, orig, side) and out[0].all()
    src = [int((i + 0.5) * n / orig) for i in range(orig)]  # the input row of each original row
    for k, row in ((1, 0), (2, n - 1)):
        want = torch.tensor([s == row for s in src])[:, None].expand(orig, side)
        assert torch.equal(out[k], want), (k, out[k].any(1).nonzero().flatten().tolist())


def test_polygons_to_masks_by_hand_and_mask_iou():
    m = polygons_to_masks([np.array([[2, 2], [6, 2], [6, 5], [2, 5]]), np.zeros((2, 2))], (8, 12))
    want = torch.zeros(8, 12, dtype=torch.bool)
    want[2:5, 2:6] = True  # pixel centres (col + .5, row + .5) inside the square
    assert torch.equal(m[0], want) and not m[1].any()
    other = torch.zeros_like(want)
    other[2:5, 4:8] = True
    torch.testing.assert_close(
        mask_iou(m[:1], torch.stack([want, other, ~want & False])),
        torch.tensor([[1.0, 6 / 18, 0.0]], dtype=torch.float64),
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools vs numpy 2
def test_polygons_to_masks_equal_pycocotools(data_dir):
    mask_utils = pytest.importorskip("pycocotools.mask")
    ann = json.loads((data_dir / "coco8-seg/annotations/instances_val.json").read_text())
    hw = {im["id"]: (im["height"], im["width"]) for im in ann["images"]}
    rng = np.random.default_rng(0)
    cases = [(a["segmentation"][0], hw[a["image_id"]]) for a in ann["annotations"]]
    for _ in range(
        300
    ):  # random polygons: partly outside, repeated vertices, coordinates on 1/10 pixel
        poly = rng.uniform(-10, 70, (rng.integers(3, 9), 2))
        poly[1] = poly[0] if rng.random() < 0.3 else poly[1]
        poly = np.round(poly * 10) / 10 if rng.random() < 0.3 else poly
        cases.append((poly.ravel().tolist(), tuple(int(v) for v in rng.integers(5, 60, 2))))
    for poly, (h, w) in cases:
        want = mask_utils.decode(mask_utils.frPyObjects([poly], h, w))[..., 0].astype(bool)
        got = polygons_to_masks([np.reshape(poly, (-1, 2))], (h, w))[0].numpy()
        assert np.array_equal(got, want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_rle_encode_equals_pycocotools():
    mask_utils = pytest.importorskip("pycocotools.mask")
    rng = np.random.default_rng(0)
    cases = [np.zeros((5, 7), bool), np.ones((5, 7), bool), rng.random((480, 640)) < 0.5]
    for _ in range(100):
        h, w = rng.integers(1, 50, 2)
        m = np.zeros((h, w), bool)
        m[rng.integers(0, h) : rng.integers(0, h + 1), rng.integers(0, w) :] = True
        cases += [m, rng.random((h, w)) < rng.random()]
    for m in cases:
        want = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
        got = rle_encode(torch.from_numpy(m))
        assert got == {"size": list(m.shape), "counts": want["counts"].decode()}
        assert np.array_equal(
            mask_utils.decode({"size": got["size"], "counts": got["counts"].encode()}), m
        )
