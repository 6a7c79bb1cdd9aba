"""Classification: YOLOv5-cls models against yolov5 fixtures, the yolov5 classifier import, the
ImageFolder data (errors, corrupt images, transforms, per-sample seeding), top-k metrics, the
embedded shapes-cls dataset, and predict.py and val.py on a classifier (its input, its top 5)."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from yolo_min import predictor, shapes, validator
from yolo_min.cls_augment import augment
from yolo_min.datasets import ClassifyDataset, build_dataloader, collate, load_data_config
from yolo_min.labels import DataError
from yolo_min.losses import ClassifyLoss
from yolo_min.metrics import class_records, merge_records, metric_names, summarize_classes
from yolo_min.models import Classify, Model
from yolo_min.safe_load import load_model

ATOL = 1e-4


# ---------------------------------------------------------------- models
@pytest.mark.parametrize(
    "size, params",
    [("n", 2_493_000), ("s", 5_453_480), ("m", 12_957_640), ("l", 26_552_680), ("x", 48_097_160)],
)
def test_cls_cfgs(size, params):
    model = Model(f"yolov5{size}-cls.yaml")  # nc 1000, as yolov5's ImageNet classifiers
    assert model.task == "classify" and model.nc == 1000 and isinstance(model.head, Classify)
    assert sum(p.numel() for p in model.parameters()) == params
    assert int(model.stride.max()) == 32


def test_fixture_parity(fixtures_dir):
    fx = torch.load(fixtures_dir / "yolov5n-cls_model.pt", weights_only=True)
    model = Model("yolov5n-cls.yaml", nc=10)
    assert sum(p.numel() for p in model.parameters()) == fx["param_count"] == 1_224_810
    model.load_state_dict(fx["state_dict"], strict=True)
    head_bn, backbone_bn = model.head.conv.bn, model.model[8].cv3.bn
    assert (head_bn.eps, head_bn.momentum) == (fx["head_bn"]["eps"], fx["head_bn"]["momentum"])
    assert (
        (backbone_bn.eps, backbone_bn.momentum) == (1e-3, 0.03) == tuple(fx["backbone_bn"].values())
    )
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert sum(m.eps == 1e-5 for m in bns) == 1  # only the head's keeps torch's default
    with torch.no_grad():
        logits = model.eval()(fx["input"])  # eval: logits, as yolov5 (softmax is the caller's)
        torch.testing.assert_close(logits, fx["eval_logits"], atol=ATOL, rtol=1e-6)
        assert model.train()(fx["input"]).shape == (2, 10)


def test_yolov5_classifier_import(fixtures_dir):
    """yolov5 pickles the classifier without a config: it is derived from the weights."""
    model = load_model(fixtures_dir / "yolov5n-cls_v5format.pt")
    fx = torch.load(fixtures_dir / "yolov5n-cls_v5format_expected.pt", weights_only=True)
    assert model.task == "classify" and model.nc == 10 and not model.training
    assert (model.yaml["depth_multiple"], model.yaml["width_multiple"]) == (1 / 3, 0.25)
    with torch.no_grad():
        torch.testing.assert_close(model(fx["input"]), fx["eval_logits"], atol=ATOL, rtol=1e-6)


def test_cfg_derived_for_every_size():
    from yolo_min.safe_load import _classifier_cfg

    for size in "mx":  # depth 2/3 and 4/3, width 0.75 and 1.25
        state = Model(f"yolov5{size}-cls.yaml", nc=7).state_dict()
        Model(_classifier_cfg(state)).load_state_dict(state, strict=True)


def test_detector_weights_initialise_the_backbone(fixtures_dir):
    """train.py's --weights transfer (every tensor whose name and shape fit) takes a detector's
    layers 0-8 into a classifier, and nothing of its head."""
    src = torch.load(fixtures_dir / "yolov5n_model.pt", weights_only=True)["state_dict"]
    model = Model("yolov5n-cls.yaml", nc=3)
    have = model.state_dict()
    keep = {k: v for k, v in src.items() if k in have and v.shape == have[k].shape}
    assert set(keep) == {k for k in have if int(k.split(".")[1]) <= 8}
    model.load_state_dict(keep, strict=False)
    assert torch.equal(model.model[8].cv3.conv.weight, src["model.8.cv3.conv.weight"])


# ---------------------------------------------------------------- data
def make_folder(root, splits=("train", "val"), classes=("a", "b"), n=3, size=(40, 24)):
    """root/<split>/<class>/<i>.jpg: flat colours, class a red, b green."""
    for split in splits:
        for k, c in enumerate(classes):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                colour = (200, 40, 10 * i) if k == 0 else (40, 200, 10 * i)
                Image.new("RGB", size, colour).save(root / split / c / f"{i}.jpg")
    return root


def test_folder_data_config(tmp_path):
    data = load_data_config(str(make_folder(tmp_path / "ok")))
    assert data["names"] == ["a", "b"] and data["nc"] == 2
    assert data["train"] == [str(tmp_path / "ok" / "train")]
    assert data["val"] == [str(tmp_path / "ok" / "val")]
    test = load_data_config(str(make_folder(tmp_path / "t", ("train", "test"))))
    assert test["val"] == [str(tmp_path / "t" / "test")]  # no val/: test/
    with pytest.raises(DataError, match="noval: a classification dataset has train/ and val/"):
        load_data_config(str(make_folder(tmp_path / "noval", ("train",))))
    with pytest.raises(DataError, match="notrain: a classification dataset has train/"):
        load_data_config(str(make_folder(tmp_path / "notrain", ("val",))))
    root = make_folder(tmp_path / "diff")
    (root / "val" / "b").rename(root / "val" / "c")
    with pytest.raises(DataError, match="val: class folders differ from train/'s .*: b, c\\)"):
        load_data_config(str(root))
    empty = tmp_path / "empty"
    for split in ("train", "val"):
        (empty / split).mkdir(parents=True)
    with pytest.raises(DataError, match="empty/train: no class folders"):
        load_data_config(str(empty))


def test_corrupt_images_skipped_and_counted(tmp_path, capsys):
    root = make_folder(tmp_path, n=3)
    (root / "train" / "a" / "zero.jpg").write_bytes(b"")
    good = (root / "train" / "b" / "0.jpg").read_bytes()
    (root / "train" / "b" / "trunc.jpg").write_bytes(good[: len(good) // 2])
    ds = ClassifyDataset(root / "train", imgsz=32, prefix="train: ")
    assert ds.stats == {"images": 8, "corrupt": 2} and len(ds) == 6
    assert ds.classes == ["a", "b"] and ds.targets == [0, 0, 0, 1, 1, 1]
    out = capsys.readouterr().out
    assert "WARNING train: " in out and "zero.jpg: empty (0-byte) file; image skipped" in out
    assert "trunc.jpg: corrupt image" in out and "train: 8 images, 2 corrupt" in out
    ClassifyDataset(root / "train", imgsz=32, verbose=False)
    assert capsys.readouterr().out == ""
    for f in (root / "val" / "a").iterdir():
        f.write_bytes(b"")
    for f in (root / "val" / "b").iterdir():
        f.write_bytes(b"")
    with pytest.raises(DataError, match="no usable images .*: all are corrupt"):
        ClassifyDataset(root / "val", verbose=False)


def test_transforms(tmp_path):
    root = tmp_path / "d"
    (root / "x").mkdir(parents=True)
    im = np.zeros((40, 100, 3), np.uint8)  # a white centre square between black sides
    im[:, 30:70] = 255
    Image.fromarray(im).save(root / "x" / "0.png")
    val = ClassifyDataset(root, imgsz=32, verbose=False)
    s = val[0]
    assert s["image"].shape == (3, 32, 32) and s["image"].dtype == torch.uint8
    assert s["image"].min() == 255  # the centre square of side min(h, w), resized
    assert s["targets"].tolist() == [[0]] and s["index"] == 0 and s["path"].endswith("0.png")
    assert s["shape"] == (40, 100)  # the original (h, w)
    train = ClassifyDataset(root, imgsz=48, augment=True, verbose=False)
    whole = train[(0, 1, 0)]["image"]  # the whole image stretched, for cls_augment's crops
    assert whole.shape == (3, 48, 48) and whole.dtype == torch.uint8
    # laid out as indexed (not a view of PIL's (h, w, 3)): a batch is stacked without a reorder
    assert whole.is_contiguous() and s["image"].is_contiguous()
    assert whole[:, :, :10].max() == 0 and whole[:, :, 19:29].min() == 255  # black sides kept
    assert torch.equal(train[(5, 0, 0)]["image"], whole)  # no randomness in the workers
    assert train[0]["shape"] == (40, 100)


def test_batches_do_not_depend_on_workers(tmp_path):
    root = make_folder(tmp_path, n=5)
    ds = ClassifyDataset(root / "train", imgsz=32, augment=True, verbose=False)

    def batches(workers, seed=0, rank=0, world=1, dataset=ds):
        """The loader's batches with cls_augment's images, as train_one_epoch makes them
        (augment_batch)."""
        kw = dict(shuffle=True, rank=rank, world_size=world, seed=seed)
        loader, sampler = build_dataloader(dataset, 4, workers, **kw)
        # images cached in RAM: the main process takes the batches itself
        assert (loader.num_workers == 0) == (dataset.in_ram or workers == 0)
        sampler.set_epoch(2)
        out = []
        for b in loader:
            keys = [(seed, 2, k) for k in b["indices"].tolist()]
            out.append((b["indices"], augment(b["images"], b["shapes"], keys), b["targets"]))
        return out

    a = batches(0)
    assert all(torch.equal(t[:, 0], torch.arange(len(t))) for _, _, t in a)  # [image, cls]
    assert all(torch.equal(t[:, 1], (i >= 5).long()) for i, _, t in a)
    cached = ClassifyDataset(root / "train", imgsz=32, augment=True, verbose=False, cache="ram")
    assert cached.in_ram and not ds.in_ram
    for b in (batches(2), batches(0), batches(2, dataset=cached)):
        assert all(all(map(torch.equal, x, y)) for x, y in zip(a, b))
    assert not all(torch.equal(x[1], y[1]) for x, y in zip(a, batches(0, seed=1)))
    two = batches(0, rank=0, world=2) + batches(0, rank=1, world=2)
    one = {int(i): im for idx, ims, _ in a for i, im in zip(idx, ims)}
    assert all(torch.equal(one[int(i)], im) for idx, ims, _ in two for i, im in zip(idx, ims))


# ---------------------------------------------------------------- metrics
def test_topk_accuracy():
    scores = torch.tensor(
        [
            [0.9, 0.1, 0.0, 0.0, 0.0, 0.0],  # label 0: top-1 right
            [0.0, 0.1, 0.2, 0.3, 0.4, 0.5],  # label 1: 5th best: top-5 right, top-1 wrong
            [0.0, 0.6, 0.2, 0.3, 0.4, 0.5],  # label 0: last: both wrong
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],  # label 5: top-1 right
        ]
    )
    records = class_records([7, 3, 5, 1], scores, [0, 1, 0, 5], [0.5, 1.0, 2.0, 0.5])
    assert records[1]["top5"].tolist() == [5, 4, 3, 2, 1]
    res = summarize_classes(records)
    assert res["metrics"] == {"top1_acc": 0.5, "top5_acc": 0.75, "val_loss": 1.0}
    assert res["fitness"] == 0.5
    assert res["images"] == 4 and list(res["metrics"]) == metric_names(("class",))
    assert res["per_class"] == [
        {"class": 0, "images": 2, "top1_acc": 0.5, "top5_acc": 0.5},
        {"class": 1, "images": 1, "top1_acc": 0.0, "top5_acc": 1.0},
        {"class": 5, "images": 1, "top1_acc": 1.0, "top5_acc": 1.0},
    ]
    # shards merged by dataset index (duplicates once) equal one process
    merged = merge_records([records[::2], records[1::2] + records[:1]])
    assert [r["index"] for r in merged] == [1, 3, 5, 7] and summarize_classes(merged) == res
    few = summarize_classes(class_records([0, 1], [[0.2, 0.8], [0.3, 0.7]], [0, 1], [1, 1]))
    assert few["metrics"] == {"top1_acc": 0.5, "top5_acc": 1.0, "val_loss": 1.0}  # nc < 5: top-5 1
    assert summarize_classes([])["metrics"] == {"top1_acc": 0.0, "top5_acc": 0.0, "val_loss": 0.0}


# ---------------------------------------------------------------- embedded shapes-cls
def test_shapes_cls(tmp_path, monkeypatch):
    for d in ("a", "b"):
        shapes.generate_cls(tmp_path / d, n_train=9, n_val=3, seed=2)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 12 and {f.parts[1] for f in files} <= set(shapes.NAMES)
    assert all(
        (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files
    )
    assert sorted(p.name for p in (tmp_path / "a" / "val").iterdir()) == shapes.NAMES
    real = shapes.generate_cls
    monkeypatch.setattr(shapes, "generate_cls", lambda root: real(root, 30, 6))
    monkeypatch.setenv("YOLO_MIN_CACHE", str(tmp_path / "cache"))
    data = load_data_config("shapes-cls")
    assert data["names"] == ["circle", "rectangle", "triangle"] and data["nc"] == 3
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"shapes-cls-v{shapes.VERSION}"]
    ds = ClassifyDataset(data["train"][0], imgsz=32, verbose=False)
    assert len(ds) == 30 and ds.stats["corrupt"] == 0 and set(ds.targets) == {0, 1, 2}


# ---------------------------------------------------------------- predict.py and val.py
NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]  # sorted: class folders in this order


def make_classifier(path: Path, images: torch.Tensor, names=NAMES) -> None:
    """A yolov5n-cls checkpoint as train.py saves its weights, untrained but telling images apart:
    random weights, BatchNorm statistics of these uint8 (n, 3, s, s) images, logits x 10."""
    torch.manual_seed(2)  # on test_predict_top5's images: 4 top-1 classes, >2e-3 apart
    model = Model("yolov5n-cls.yaml", nc=len(names))
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # one batch: its statistics
    with torch.no_grad():
        model.train()(validator.preprocess(images, torch.device("cpu"), normalize=True))
        model.head.linear.weight *= 10
    torch.save({"model_cfg": model.yaml, "model": model.state_dict(), "names": names}, path)


def capture_inputs(monkeypatch) -> list:
    """The tensors the models that predict.py loads receive (their forward's input)."""
    seen, real = [], predictor.load_model

    def load(*args, **kwargs):
        model = real(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
        return model

    monkeypatch.setattr(predictor, "load_model", load)
    return seen


def test_predict_top5_on_a_classifier_is_vals_ranking(tmp_path):
    """predict.py on a classifier: per image its 5 likeliest classes by descending probability,
    the softmax of the logits val.py computes on the same images (64x64, 64x96 and 96x64 ones:
    the centre square); --save-txt `prob name` lines and --save-json classes say the same; val's
    evaluate scores predict's top-1 classes as right and its 5th as top-5 only."""
    rng = np.random.default_rng(0)
    src = tmp_path / "data" / "val" / "any"
    src.mkdir(parents=True)
    for k, (h, w) in enumerate([(64, 64), (64, 64), (64, 96), (96, 64)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(src / f"{k}.png")
    ds = ClassifyDataset(src.parent, imgsz=64, verbose=False)
    batch = collate([ds[i] for i in range(len(ds))])
    make_classifier(tmp_path / "cls.pt", batch["images"])
    model = load_model(tmp_path / "cls.pt")
    with torch.no_grad():
        logits = validator.infer(model, batch["images"], {}, None)[0]
    want = {Path(f).name: p for (f, _), p in zip(ds.samples, logits.softmax(1))}
    for p in want.values():  # far enough apart for the orders to be told apart
        assert (p.sort(descending=True).values[:6].diff() < -1e-3).all(), p
    assert len({int(p.argmax()) for p in want.values()}) > 1  # not one class for all

    results = predictor.predict(
        tmp_path / "cls.pt", [str(f) for f in sorted(src.iterdir())], imgsz=64
    )
    for r in results:
        p = want[Path(r["path"]).name]
        assert r["probs"].shape == (7,) and r["probs"].sum().item() == pytest.approx(1, abs=1e-6)
        torch.testing.assert_close(r["probs"], p, atol=1e-5, rtol=0)
        top = predictor.top5(r)
        assert [c for c, _ in top] == p.argsort(descending=True)[:5].tolist()
        assert [q for _, q in top] == sorted((q for _, q in top), reverse=True)

    opts = dict(imgsz=64, save_txt=True, save_json=True, device="cpu", project=str(tmp_path))
    out = predictor.run(weights=str(tmp_path / "cls.pt"), source=str(src), **opts)
    save_dir = Path(out["save_dir"])
    assert out["images"] == 4 and out["detections"] == 0
    entries = json.loads((save_dir / "predictions.json").read_text())
    assert [e["file"] for e in entries] == [str(f) for f in sorted(src.iterdir())]
    for e in entries:
        name, p = Path(e["file"]).name, want[Path(e["file"]).name]
        w, h = Image.open(e["file"]).size
        assert (e["width"], e["height"]) == (w, h) and Image.open(save_dir / name).size == (w, h)
        ids = p.argsort(descending=True)[:5].tolist()
        assert [c["class_id"] for c in e["classes"]] == ids
        assert [c["name"] for c in e["classes"]] == [NAMES[c] for c in ids]
        conf = [c["confidence"] for c in e["classes"]]
        assert np.allclose(conf, p[ids], atol=1e-4, rtol=0)
        lines = (save_dir / "labels" / f"{Path(name).stem}.txt").read_text().splitlines()
        assert [line.split()[1] for line in lines] == [NAMES[c] for c in ids]
        assert [line.split()[0] for line in lines] == [f"{q:.2f}" for q in conf]
        assert all(
            abs(float(line.split()[0]) - p[c]) <= 0.005 + 1e-4 for line, c in zip(lines, ids)
        )

    # val's scoring: each image in its predicted top-1 class's folder, then in its 5th's
    for k, metrics in (
        (0, {"top1_acc": 1.0, "top5_acc": 1.0}),
        (4, {"top1_acc": 0.0, "top5_acc": 1.0}),
    ):
        root = tmp_path / f"by_rank{k}"
        for c in NAMES:
            (root / c).mkdir(parents=True)
        for e in entries:
            shutil.copy(e["file"], root / e["classes"][k]["name"] / Path(e["file"]).name)
        loader, _ = build_dataloader(ClassifyDataset(root, imgsz=64, verbose=False), 4, 0, False)
        res = validator.evaluate(model, loader)
        assert {m: res["metrics"][m] for m in metrics} == metrics, k


def test_classifier_input_is_imagenet_normalised_rgb(tmp_path, monkeypatch):
    """What the network receives from uint8 files through val.py (ClassifyDataset, evaluate) and
    predict.py: per channel (v / 255 - mean) / std, ImageNet's RGB mean and std, R first."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, R, G, B

    def want(rgb) -> torch.Tensor:
        return torch.tensor([(v / 255 - m) / s for v, m, s in zip(rgb, mean, std)])

    colours = {"a.png": ((200, 100, 30), (40, 24)), "b.png": ((10, 128, 250), (24, 50))}
    src = tmp_path / "data" / "x"
    src.mkdir(parents=True)
    for name, (rgb, size) in colours.items():
        Image.new("RGB", size, rgb).save(src / name)
    x = torch.tensor([200, 100, 30], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    got = validator.preprocess(x, torch.device("cpu"), normalize=True)
    torch.testing.assert_close(got, want((200, 100, 30)).view(1, 3, 1, 1).expand_as(got))
    torch.testing.assert_close(validator.preprocess(x, torch.device("cpu")), x / 255)

    model, seen = Model("yolov5n-cls.yaml", nc=1).eval(), []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    ds = ClassifyDataset(src.parent, imgsz=32, verbose=False)
    validator.evaluate(model, build_dataloader(ds, 2, 0, False)[0])
    (x,) = seen
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    for k, (f, _) in enumerate(ds.samples):
        rgb = colours[Path(f).name][0]
        torch.testing.assert_close(
            x[k], want(rgb).view(3, 1, 1).expand(3, 32, 32), atol=1e-6, rtol=0
        )

    seen = capture_inputs(monkeypatch)
    state = {"model_cfg": model.yaml, "model": model.state_dict(), "names": ["x"]}
    torch.save(state, tmp_path / "cls.pt")
    opts = dict(imgsz=32, device="cpu", project=str(tmp_path), nosave=True)
    predictor.run(weights=str(tmp_path / "cls.pt"), source=str(src), **opts)
    assert len(seen) == 2 and all(x.shape == (1, 3, 32, 32) for x in seen)
    for x, name in zip(seen, sorted(colours)):  # a.png, b.png: one batch each, in order
        rgb = colours[name][0]
        torch.testing.assert_close(
            x[0], want(rgb).view(3, 1, 1).expand(3, 32, 32), atol=1e-6, rtol=0
        )


# ---------------------------------------------------------------- training end to end
def test_classify_recipe_as_train_builds_it(tmp_path):
    """train.py's classification setup as fit builds it (prepare, then build_training): the recipe
    is hyp.cls.yaml's; the criterion is the cross-entropy with its label smoothing (a hand-computed
    case, not the unsmoothed value); Adam at its lr0 and beta1, its weight decay on weights only,
    unscaled; the training loader is the EpochSampler seeded with --seed: each epoch's order is
    torch.randperm seeded with seed + epoch, a new one every epoch."""
    import yaml

    from yolo_min import trainer
    from yolo_min.datasets import EpochSampler
    from yolo_min.dist import DistInfo
    from yolo_min.models import CFG_DIR

    recipe = yaml.safe_load((CFG_DIR / "hyp.cls.yaml").read_text())
    eps = recipe["label_smoothing"]
    assert eps == 0.1
    root = make_folder(tmp_path / "data", classes=("a", "b", "c"), n=4)  # 12 training images
    flags = "--cfg yolov5n-cls.yaml --imgsz 32 --batch-size 4 --workers 0 --seed 3 --amp off"
    argv = [*flags.split(), "--data", str(root), "--project", str(tmp_path / "runs")]
    info = DistInfo(0, 1, 1, torch.device("cpu"))
    args, ckpt, hyp, model, loader, _, _ = trainer.prepare(
        trainer.get_args_parser().parse_args(argv), info
    )
    assert ckpt is None and model.task == "classify" and hyp == recipe
    training = trainer.build_training(model, hyp, args, info)
    criterion, optimizer = training.criterion, training.optimizer

    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [-1.0, 1.0, 3.0]])
    targets = torch.tensor([[0, 0], [1, 0], [2, 1]])  # [image, cls]

    def by_hand(eps):  # mean over images of -(1 - eps) log p_y - eps / nc * sum_k log p_k
        total = 0.0
        for row, y in zip(logits.tolist(), (0, 0, 1)):
            log_p = [v - np.log(sum(np.exp(row))) for v in row]
            total += -(1 - eps) * log_p[y] - eps / 3 * sum(log_p)
        return total / 3

    loss, items = criterion(logits, targets)
    assert loss.item() == pytest.approx(by_hand(eps), rel=1e-6)
    assert abs(by_hand(eps) - by_hand(0.0)) > 0.04  # the case tells smoothing from none
    assert list(items) == ["cls"] and items["cls"].item() == loss.item()

    assert type(optimizer) is torch.optim.Adam
    assert all(
        g["lr"] == recipe["lr0"] and g["betas"] == (0.9, 0.999) for g in optimizer.param_groups
    )
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0, recipe["weight_decay"]]

    sampler = loader.sampler
    assert type(sampler) is EpochSampler and sampler.shuffle and sampler.seed == 3
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append([i for b in loader for i in b["indices"].tolist()])
        perm = torch.randperm(12, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert orders[-1] == perm, epoch
    assert orders[0] != orders[1]


def test_forward_loss_normalises_classifier_input():
    """train.forward_loss feeds a classifier the uint8 RGB images / 255 standardised with the
    ImageNet mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225), channel by channel in RGB
    order, under autocast (bf16) for the model and float32 logits for the loss."""
    from yolo_min import trainer

    torch.manual_seed(0)
    model = Model("yolov5n-cls.yaml", nc=3).train()
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    images[:, 0], images[:, 2] = 250, 5  # red and blue far apart: a BGR swap shows
    seen = {}

    def pre_hook(module, inputs):
        seen["input"], seen["autocast"] = inputs[0].clone(), torch.is_autocast_enabled("cpu")

    model.register_forward_pre_hook(pre_hook)
    criterion = ClassifyLoss()

    def loss_fn(logits, targets):
        seen["logits"] = logits.dtype
        return criterion(logits, targets)

    batch = {"images": images, "targets": torch.tensor([[0, 2], [1, 0]])}
    loss, _ = trainer.forward_loss(model, loss_fn, batch, torch.device("cpu"), torch.bfloat16)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(seen["input"], (images.float() / 255 - mean) / std)
    assert seen["input"].dtype == torch.float32 and seen["autocast"]
    assert seen["logits"] == torch.bfloat16 and loss.dtype == torch.float32


@pytest.mark.slow
def test_classifier_learns_and_resumes_exactly(tmp_path, monkeypatch):
    """train.py on a small shapes-cls folder: top-1 well above chance (1/3) in 10 epochs, the
    training loss falls; a run stopped as epoch 2 starts and resumed ends with the checkpoint of
    an uninterrupted one."""
    from yolo_min import trainer

    shapes.generate_cls(tmp_path / "data", n_train=90, n_val=30)
    common = dict(cfg="yolov5n-cls.yaml", data=str(tmp_path / "data"), imgsz=32, batch_size=8)
    common |= dict(workers=0, log_every=100)
    out = trainer.run(**common, epochs=10, project=str(tmp_path / "learn"))
    with open(Path(out["save_dir"]) / "results.csv") as f:
        losses = [float(r["train/cls_loss"]) for r in csv.DictReader(f)]
    assert out["best_fitness"] >= 0.6 and losses[-1] < 0.8 * losses[0], (out["metrics"], losses)

    whole = Path(trainer.run(**common, epochs=3, project=str(tmp_path / "a"))["save_dir"])
    real = trainer.train_one_epoch

    def stop_in_epoch_2(training, setup, epoch, **kwargs):
        if epoch == 1:
            raise KeyboardInterrupt
        return real(training, setup, epoch, **kwargs)

    monkeypatch.setattr(trainer, "train_one_epoch", stop_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(**common, epochs=3, project=str(tmp_path / "b"))
    monkeypatch.setattr(trainer, "train_one_epoch", real)
    resumed = Path(
        trainer.run(resume=str(tmp_path / "b" / "exp" / "weights" / "last.pt"))["save_dir"]
    )
    a, b = (torch.load(r / "weights" / "last.pt", weights_only=True) for r in (whole, resumed))
    assert a["epoch"] == b["epoch"] == 2 and a["task"] == "classify"
    for key in ("model", "ema"):
        assert all(torch.equal(v, b[key][k]) for k, v in a[key].items()), key
