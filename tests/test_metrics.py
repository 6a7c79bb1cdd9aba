"""metrics: hand-computed AP, COCO matching rules, pycocotools agreement on real annotations,
2-rank gathering."""

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from yolo_min.metrics import (
    IOU_THRESHOLDS,
    fitness,
    image_record,
    match_predictions,
    merge_records,
    summarize,
)
from yolo_min.ops import box_iou, mask_iou, polygons_to_masks, rle_encode

SQ = [0.0, 0.0, 100.0, 100.0]


def records(images):
    """images: list of (dets [(xyxy, score, cls)], gts [(xyxy, cls)]) -> per-image records."""
    out = []
    for i, (dets, gts) in enumerate(images):
        pb = torch.tensor([d[0] for d in dets], dtype=torch.float64).reshape(-1, 4)
        gb = torch.tensor([g[0] for g in gts], dtype=torch.float64).reshape(-1, 4)
        out.append(
            image_record(
                i,
                [d[1] for d in dets],
                [d[2] for d in dets],
                [g[1] for g in gts],
                {"box": box_iou(pb, gb).numpy()},
            )
        )
    return out


def strip(metrics: dict, suffix: str = "(B)") -> dict:
    """{"mAP50(B)": x, ...} -> {"mAP50": x, ...} for one kind."""
    return {k[: -len(suffix)]: v for k, v in metrics.items() if k.endswith(suffix)}


def box_metrics(images):
    return strip(summarize(records(images))["metrics"])


def test_thresholds_are_cocoevals():
    cocoeval = pytest.importorskip("pycocotools.cocoeval")
    params = cocoeval.Params("bbox")
    assert np.array_equal(IOU_THRESHOLDS, params.iouThrs)


def test_ap_perfect_none_and_one_miss():
    gts = [([0, 0, 10, 10], 0), ([20, 20, 40, 50], 0)]
    perfect = box_metrics([([(g[0], 0.9 - 0.1 * i, 0) for i, g in enumerate(gts)], gts)])
    assert perfect == {"P": 1.0, "R": 1.0, "mAP50": 1.0, "mAP50-95": 1.0}
    none = box_metrics([([], gts)])
    assert none == {"P": 0.0, "R": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
    one_miss = box_metrics(
        [([(gts[0][0], 0.8, 0)], gts)]
    )  # recall reaches 0.5: 51 of 101 recall points
    assert one_miss["mAP50"] == pytest.approx(51 / 101) and one_miss["mAP50-95"] == pytest.approx(
        51 / 101
    )
    assert (one_miss["P"], one_miss["R"]) == (1.0, 0.5)


def test_ap_duplicates_and_greedy_score_order():
    # a duplicate of a matched box is a false positive after the true positive: AP stays 1
    dup = box_metrics([([(SQ, 0.9, 0), (SQ, 0.8, 0)], [(SQ, 0)])])
    assert dup["mAP50-95"] == pytest.approx(1.0)
    # the higher-scored box has IoU 0.62 and takes the GT for t <= 0.6; above that it is a FP and
    # the
    # exact lower-scored box is a TP at precision 1/2: AP = (3 * 1 + 7 * 0.5) / 10
    loose = [0.0, 0.0, 100.0, 62.0]
    m = box_metrics([([(loose, 0.9, 0), (SQ, 0.8, 0)], [(SQ, 0)])])
    assert m["mAP50"] == pytest.approx(1.0) and m["mAP50-95"] == pytest.approx(0.65)


def test_ap_classes_without_detections_or_without_gt():
    gts = [(SQ, 0), ([200, 200, 300, 300], 1)]
    # class 1 has GT but no detections (AP 0); class 5 has detections but no GT (ignored)
    m = box_metrics(
        [([(SQ, 0.9, 0), ([200, 200, 300, 300], 0.95, 5)], gts), ([([0, 0, 5, 5], 0.3, 5)], [])]
    )
    assert m["mAP50"] == pytest.approx(0.5) and m["mAP50-95"] == pytest.approx(0.5)
    # a wrong-class box on a GT does not match it; detections in an image without GT are false
    # positives
    m = box_metrics([([(SQ, 0.5, 1)], [(SQ, 0)]), ([(SQ, 0.9, 0)], [])])
    assert m["mAP50"] == 0.0
    m = box_metrics(
        [([(SQ, 0.5, 0)], [(SQ, 0)]), ([(SQ, 0.9, 0)], [])]
    )  # precision 1/2 at recall 1
    assert m["mAP50"] == pytest.approx(0.5)
    assert summarize([])["metrics"]["mAP50(B)"] == 0.0


def test_matching_takes_best_unmatched_gt_and_last_on_ties():
    iou = np.array(
        [
            [0.70, 0.90],  # first (higher score): best GT is 1
            [0.60, 0.95],
        ]
    )  # second: GT 1 taken, falls back to GT 0 where t <= 0.6
    tp = match_predictions(iou, np.array([0.9, 0.8]), np.array([0, 0]), np.array([0, 0]))
    assert tp[0].tolist() == [t <= 0.9 for t in IOU_THRESHOLDS]
    assert tp[1].tolist() == [
        t <= 0.6 + 1e-12 or t == 0.95 for t in IOU_THRESHOLDS
    ]  # 0.95: GT 1 still free
    # the input order does not matter, only the scores
    swapped = match_predictions(iou[::-1], np.array([0.8, 0.9]), np.array([0, 0]), np.array([0, 0]))
    assert np.array_equal(swapped, tp[::-1])
    # equal IoU with two GTs: COCO takes the later one, so a second detection can still take the
    # first
    tie = match_predictions(
        np.array([[0.8, 0.8], [0.8, 0.0]]), np.array([0.9, 0.8]), np.zeros(2), np.zeros(2)
    )
    assert tie[:, 0].tolist() == [True, True]


def test_fitness_weights():
    assert fitness({"mAP50(B)": 0.5, "mAP50-95(B)": 0.3, "P(B)": 1.0}) == pytest.approx(0.32)
    both = {"mAP50(B)": 0.5, "mAP50-95(B)": 0.3, "mAP50(M)": 0.4, "mAP50-95(M)": 0.2}
    assert fitness(both) == pytest.approx(0.54)


# ------------------------------------------------------------------ pycocotools agreement


def synthetic_results(ann, seed, max_per_image, masks=False):
    """COCO results near the GT: jittered copies (some relabelled, some duplicated), misses, random
    FPs."""
    rng = np.random.default_rng(seed)
    by_image = {}
    for a in ann["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    results = []
    for im in sorted(ann["images"], key=lambda i: i["id"]):
        w, h = im["width"], im["height"]
        dets = []
        for a in by_image.get(im["id"], []):
            for _ in range(int(rng.random() > 0.15) + int(rng.random() < 0.2)):
                s = rng.uniform(0.02, 0.25)
                cls = a["category_id"] if rng.random() > 0.1 else int(rng.integers(1, 81))
                if masks:
                    p = np.reshape(a["segmentation"][0], (-1, 2))
                    c = p.mean(0)
                    geom = (
                        (p - c) * np.exp(rng.normal() * s)
                        + c
                        + rng.normal(size=2) * s * np.ptp(p, 0)
                    )
                else:
                    x, y, bw, bh = a["bbox"]
                    geom = [
                        x + rng.normal() * s * bw,
                        y + rng.normal() * s * bh,
                        bw * np.exp(rng.normal() * s),
                        bh * np.exp(rng.normal() * s),
                    ]
                dets.append((geom, cls))
        for _ in range(rng.integers(0, 15)):
            x, y = rng.uniform(0, w), rng.uniform(0, h)
            if masks:
                geom = np.array([x, y]) + rng.normal(size=(6, 2)) * 30
            else:
                geom = [x, y, rng.uniform(5, w - x + 5), rng.uniform(5, h - y + 5)]
            dets.append((geom, int(rng.integers(1, 81))))
        for geom, cls in dets[:max_per_image]:
            results.append(
                {
                    "image_id": im["id"],
                    "category_id": cls,
                    "score": float(rng.random()),
                    ("poly" if masks else "bbox"): geom,
                }
            )
    return results


def ours_from_results(ann, results, kind):
    """Our metrics on the same detections: GT boxes from the json bbox, GT masks rasterised from
    the polygons."""
    gts, dets = {}, {}
    for a in ann["annotations"]:
        gts.setdefault(a["image_id"], []).append(a)
    for r in results:
        dets.setdefault(r["image_id"], []).append(r)
    recs = []
    for index, im in enumerate(sorted(ann["images"], key=lambda i: i["id"])):
        g, d = gts.get(im["id"], []), sorted(dets.get(im["id"], []), key=lambda r: -r["score"])
        if kind == "box":
            gb = torch.tensor([a["bbox"] for a in g], dtype=torch.float64).reshape(-1, 4)
            pb = torch.tensor([r["bbox"] for r in d], dtype=torch.float64).reshape(-1, 4)
            gb[:, 2:] += gb[:, :2]
            pb[:, 2:] += pb[:, :2]
            iou = box_iou(pb, gb)
        else:
            hw = (im["height"], im["width"])
            gm = polygons_to_masks([np.reshape(a["segmentation"][0], (-1, 2)) for a in g], hw)
            pm = polygons_to_masks([r.pop("poly") for r in d], hw)
            for r, m in zip(d, pm):
                r["segmentation"] = rle_encode(
                    m
                )  # pycocotools reads our RLE of the same predicted masks
            iou = mask_iou(pm, gm)
        recs.append(
            image_record(
                index,
                [r["score"] for r in d],
                [r["category_id"] - 1 for r in d],
                [a["category_id"] - 1 for a in g],
                {kind: iou.numpy()},
            )
        )
    return strip(summarize(recs, (kind,))["metrics"], "(B)" if kind == "box" else "(M)")


def cocoeval(gt_file, results, kind, max_dets):
    coco, cocoeval = (
        pytest.importorskip("pycocotools.coco"),
        pytest.importorskip("pycocotools.cocoeval"),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        gt = coco.COCO(str(gt_file))
        ev = cocoeval.COCOeval(gt, gt.loadRes(results), "bbox" if kind == "box" else "segm")
        ev.params.maxDets = list(max_dets)
        ev.evaluate()
        ev.accumulate()
        if max_dets[-1] == 100:
            ev.summarize()
            return ev.stats[0], ev.stats[1]
    prec = ev.eval["precision"][:, :, :, 0, -1]  # areaRng "all", the largest maxDets
    prec = prec[:, :, prec[0, 0] > -1]
    return prec.mean(), prec[0].mean()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "name, max_dets",
    [
        ("coco8/annotations/instances_val.json", (1, 10, 100)),
        ("coco128/annotations/instances_train2017.json", (1, 10, 100)),
        ("coco128/annotations/instances_train2017.json", (1, 10, 300)),
    ],
)
def test_box_map_equals_pycocotools(data_dir, name, max_dets):
    ann = json.loads((data_dir / name).read_text())
    for seed in range(2):
        results = synthetic_results(ann, seed, max_per_image=max_dets[-1])
        if (
            max_dets[-1] > 100
        ):  # more than COCO's default 100 per image: compare with maxDets[-1] = 300
            results += [dict(r, score=r["score"] * 0.01) for r in results for _ in range(3)]
        ours = ours_from_results(ann, results, "box")
        ap, ap50 = cocoeval(data_dir / name, results, "box", max_dets)
        assert 0.05 < ap < 0.95
        assert ours["mAP50-95"] == pytest.approx(ap, abs=1e-4) and ours["mAP50"] == pytest.approx(
            ap50, abs=1e-4
        )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "name",
    [
        "coco8-seg/annotations/instances_val.json",
        pytest.param("coco128-seg/annotations/instances_train2017.json", marks=pytest.mark.slow),
    ],
)
def test_mask_map_equals_pycocotools(data_dir, name):
    # the spec allows 0.005; GT polygons rasterise pixel-exactly as COCO's, so the masks AP agrees
    # to 1e-4
    ann = json.loads((data_dir / name).read_text())
    results = synthetic_results(ann, 0, max_per_image=100, masks=True)
    ours = ours_from_results(ann, results, "mask")
    ap, ap50 = cocoeval(data_dir / name, results, "mask", (1, 10, 100))
    assert 0.05 < ap < 0.95
    assert ours["mAP50-95"] == pytest.approx(ap, abs=1e-4) and ours["mAP50"] == pytest.approx(
        ap50, abs=1e-4
    )


# ------------------------------------------------------------------ gathering over 2 processes


def synthetic_records(n_images, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_images):
        gt = rng.uniform(0, 200, (rng.integers(0, 6), 2))
        gb = torch.tensor(np.hstack([gt, gt + rng.uniform(10, 80, gt.shape)]))
        gc = rng.integers(0, 3, len(gb))
        fp = torch.tensor(rng.uniform(0, 200, (3, 2)))
        pb = torch.cat([gb + torch.tensor(rng.normal(0, 4, gb.shape)), torch.cat([fp, fp + 30], 1)])
        pc = np.concatenate(
            [
                np.where(rng.random(len(gb)) < 0.9, gc, rng.integers(0, 3, len(gb))),
                rng.integers(0, 3, 3),
            ]
        )
        ious = box_iou(pb, gb).numpy()
        out.append(image_record(i, rng.random(len(pb)), pc, gc, {"box": ious, "mask": ious**1.1}))
    return out


CASES = (9, 3, 1)  # images over 2 ranks: uneven shards, one rank with a single image, one with none


def _gather_worker(rank, world, init, out_dir):
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for n_images in CASES:
            recs = synthetic_records(n_images)
            mine = recs[rank::world]
            if rank == 1 and n_images > 3:
                mine = mine + recs[:1]  # a duplicate, as a padding sampler would give
            parts = [None] * world
            tdist.all_gather_object(parts, mine)  # as the entry scripts gather them
            res = summarize(merge_records(parts), ("box", "mask"))
            with open(os.path.join(out_dir, f"{n_images}_rank{rank}.json"), "w") as f:
                json.dump(res, f)
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_get_the_single_process_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_gather_worker, args=(2, f"file://{tmp_path}/pg", str(tmp_path)), nprocs=2, join=True)
    for n_images in CASES:
        want = summarize(synthetic_records(n_images), ("box", "mask"))
        assert want["images"] == n_images and want["metrics"]["mAP50(B)"] > 0
        for rank in range(2):
            assert json.loads((tmp_path / f"{n_images}_rank{rank}.json").read_text()) == json.loads(
                json.dumps(want)
            )
