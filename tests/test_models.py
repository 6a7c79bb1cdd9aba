"""Models: architecture, exact numerics against yolov5 fixtures, config errors, checkpoint
import."""

import math
from copy import deepcopy

import pytest
import torch
import torch.nn as nn

from yolo_min import models
from yolo_min.models import CFG_DIR, Model, amp_dtype
from yolo_min.safe_load import CheckpointError, load_model

ATOL = 1e-4


def close(a, b, atol=ATOL, rtol=1e-6):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name, task", [("yolov5n", "detect"), ("yolov5n-seg", "segment")])
def test_fixture_outputs(fixtures_dir, name, task):
    fx = torch.load(fixtures_dir / f"{name}_model.pt", weights_only=True)
    model = Model(f"{name}.yaml")
    assert model.task == task
    assert sum(p.numel() for p in model.parameters()) == fx["param_count"]
    model.load_state_dict(fx["state_dict"], strict=True)
    close(model.head.anchors, fx["anchors_grid_units"])
    assert model.stride.tolist() == list(fx["stride"])
    model.eval()
    with torch.no_grad():
        out = model(fx["input"])
    if task == "segment":
        decoded, protos = out
        close(protos, fx["eval_protos"])
    else:
        decoded = out
    assert decoded.shape == fx["eval_out"].shape
    close(decoded, fx["eval_out"])

    model.train()  # train mode: BatchNorm on batch statistics, raw maps
    with torch.no_grad():
        out = model(fx["input"])
    maps = out[0] if task == "segment" else out
    if task == "segment":
        close(out[1], fx["train_protos"], rtol=1e-4)
    assert len(maps) == 3
    for got, want in zip(maps, fx["train_out"]):
        assert got.shape == want.shape
        close(got, want)


def test_param_counts_nc3():
    assert sum(p.numel() for p in Model("yolov5n.yaml", nc=3).parameters()) == 1_767_976
    assert sum(p.numel() for p in Model("yolov5n-seg.yaml", nc=3).parameters()) == 1_887_368


def test_all_shipped_configs_build():
    names = sorted(p.stem for p in CFG_DIR.glob("yolov5*.yaml"))
    assert names == sorted(f"yolov5{s}{t}" for s in "nsmlx" for t in ("", "-seg", "-cls"))
    m = Model("yolov5s-seg.yaml", nc=2)
    assert m.task == "segment" and m.head.proto.cv1.conv.out_channels == 128  # 256 * 0.5


def test_output_shapes_and_modes():
    model = Model("yolov5n-seg.yaml", nc=3)
    x = torch.rand(2, 3, 64, 96)
    maps, protos = model(x)
    assert [tuple(m.shape) for m in maps] == [(2, 3, 8, 12, 40), (2, 3, 4, 6, 40), (2, 3, 2, 3, 40)]
    assert protos.shape == (2, 32, 16, 24)
    model.eval()
    decoded, protos = model(x)
    assert decoded.shape == (2, 3 * (96 + 24 + 6), 40) and protos.shape == (2, 32, 16, 24)
    det = Model("yolov5n.yaml", nc=3).eval()
    assert det(x).shape == (2, 378, 8)


def test_fresh_init_follows_yolov5():
    model = Model("yolov5n.yaml", nc=80)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.eps == 1e-3 and m.momentum == 0.03 for m in bns)
    head = model.head
    for conv, s in zip(head.m, head.stride):
        b = conv.bias.detach().view(head.na, -1)
        bound = 1 / math.sqrt(conv.in_channels)  # PyTorch's default bias init is U(-bound, bound)
        obj = b[:, 4] - math.log(8 / (640 / s) ** 2)
        cls = b[:, 5:] - math.log(0.6 / (80 - 0.99999))
        assert obj.abs().max() <= bound and cls.abs().max() <= bound


def test_fuse_keeps_outputs():
    model = Model("yolov5n-seg.yaml", nc=4).eval()
    for m in model.modules():  # non-trivial BN statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
        after = model.fuse()(x)
    close(after[0], before[0])
    close(after[1], before[1])
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_parameter_count():
    assert sum(p.numel() for p in Model("yolov5n.yaml").parameters()) == 1_872_157


def cfg_dict(**changes):
    import yaml

    d = yaml.safe_load((CFG_DIR / "yolov5n.yaml").read_text())
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda d: d["head"].__setitem__(0, [-1, 1, "Foo", [512]]),
            "layer 10: unknown module 'Foo'",
        ),
        (
            lambda d: d["head"].__setitem__(2, [[-1, 99], 1, "Concat", [1]]),
            "layer 12: [[-1, 99], 1, 'Concat', [1]] is not [from (-1 or earlier layers)",
        ),
        (lambda d: d.pop("anchors"), "missing key 'anchors'"),
        (
            lambda d: d["backbone"].__setitem__(1, [-1, 1, "Conv"]),
            "layer 1: [-1, 1, 'Conv'] is not [from",
        ),
    ],
)
def test_parse_errors(mutate, message):
    d = cfg_dict()
    mutate(d)
    with pytest.raises(ValueError, match=None) as info:
        Model(d)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_parse_error_names_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CFG_DIR / "yolov5n.yaml").read_text().replace("SPPF", "SPPX"))
    with pytest.raises(ValueError, match=r"bad\.yaml: layer 9: unknown module 'SPPX'"):
        Model(bad)
    with pytest.raises(FileNotFoundError, match="yolov5q.yaml"):
        Model("yolov5q.yaml")


def test_load_yolov5_checkpoint(fixtures_dir):
    model = load_model(fixtures_dir / "yolov5n_random_v5format.pt")
    expected = torch.load(fixtures_dir / "yolov5n_random_v5format_expected.pt", weights_only=True)
    assert not model.training and model.task == "detect"
    with torch.no_grad():
        close(model(expected["input"]), expected["eval_out"])


class _Evil:
    def __reduce__(self):
        import os

        return os.system, ("touch PWNED_MARKER",)


def test_malicious_checkpoint_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"model": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt: refusing '(posix|os)\.system'"):
        load_model(path)
    assert not (tmp_path / "PWNED_MARKER").exists()


def test_amp_dtype(monkeypatch):
    """--amp: float16 on CUDA; on a CPU bfloat16 where it is native (auto) or asked for (on)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert amp_dtype(cuda, "auto") == amp_dtype(cuda, "on") == torch.float16
    assert amp_dtype(cuda, "off") is None and amp_dtype(cpu, "off") is None
    bf16 = torch.bfloat16
    cases = [({"avx512_bf16": True}, bf16), ({"amx_bf16": True}, bf16), ({"bf16": True}, bf16)]
    for caps, auto in [*cases, ({"avx512_bf16": False, "avx2": True}, None)]:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
        assert amp_dtype(cpu, "auto") == auto and amp_dtype(cpu, "on") == torch.bfloat16


def test_channels_last_does_not_change_checkpoints(tmp_path):
    """A channels_last model (as --amp trains it) saves the values of the contiguous one: its
    checkpoint equals that one's and loads into a contiguous model with the same outputs."""
    torch.manual_seed(0)
    model = Model("yolov5n-seg.yaml", nc=3).eval()
    fast = deepcopy(model).to(memory_format=torch.channels_last)
    assert fast.model[0].conv.weight.is_contiguous(memory_format=torch.channels_last)
    for m, name in ((model, "a.pt"), (fast, "b.pt")):
        torch.save({"model_cfg": m.yaml, "model": m.state_dict(), "names": []}, tmp_path / name)
    a, b = (torch.load(tmp_path / name, weights_only=True)["model"] for name in ("a.pt", "b.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = load_model(tmp_path / "b.pt")
    assert all(p.is_contiguous() for p in loaded.parameters())
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        assert all(torch.equal(u, v) for u, v in zip(loaded(x), model(x)))


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov5n-seg.yaml"])
def test_head_runs_in_fp32_under_bf16_autocast(cfg):
    """Under bfloat16 autocast (train.py and val.py --amp on a CPU) the backbone's convs run in
    bfloat16 but the Detect head's final 1x1 convs (and a Segment head's prototypes) in float32:
    their outputs' dtypes, read by forward hooks, in train and in eval mode."""
    model = Model(cfg, nc=2)
    head, seen = model.head, {}

    def record(name):
        return lambda module, inputs, output: seen.setdefault(name, []).append(output.dtype)

    model.model[0].conv.register_forward_hook(record("backbone"))
    model.model[23].cv3.conv.register_forward_hook(record("neck"))  # the head's input at P5
    for i, conv in enumerate(head.m):
        conv.register_forward_hook(record(f"m{i}"))
    if model.task == "segment":
        head.proto.register_forward_hook(record("proto"))
        head.proto.cv1.conv.register_forward_hook(record("proto.cv1"))
    x = torch.rand(2, 3, 64, 64)
    for mode in ("train", "eval"):
        seen.clear()
        model.train(mode == "train")
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        assert seen.pop("backbone") == seen.pop("neck") == [torch.bfloat16], mode
        fp32 = [f"m{i}" for i in range(head.nl)] + ["proto", "proto.cv1"] * (head.nm > 0)
        assert seen == {k: [torch.float32] for k in fp32}, mode
        maps, protos = out if model.task == "segment" else (out, None)
        assert all(t.dtype == torch.float32 for t in (maps if mode == "train" else [maps]))
        assert protos is None or protos.dtype == torch.float32


@pytest.mark.parametrize("cfg", ["yolov5n-cls.yaml", "yolov5n-seg.yaml"])
def test_conv_gradients_reach_silu_dense_in_channels_last(cfg):
    """A channels_last model on a CPU (as --amp trains it): every SiLU, BatchNorm and conv
    backward gets a dense channels_last gradient (a cat's backward hands out strided channel
    slices, the classifier's pool an NCHW one; the Detect head's maps are views of it), and the
    gradients are plain nn.Sequential's: to float rounding in fp32, and no farther from fp32's
    than plain's under bf16 autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = Model(cfg, nc=3).to(memory_format=torch.channels_last)
    x = torch.rand(4, 3, 64, 64).to(memory_format=torch.channels_last)
    aten = torch.ops.aten
    ops = (aten.silu_backward, aten.native_batch_norm_backward, aten.convolution_backward)
    dense = []

    class RecordLayouts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in ops:
                dense.append(args[0].is_contiguous(memory_format=torch.channels_last))
            return func(*args, **(kwargs or {}))

    def gradients(amp):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            out = model(x)
        maps = [out] if model.task == "classify" else [*out[0], out[1]]
        loss = sum(t.float().square().mean() for t in maps)
        dense.clear()
        with RecordLayouts():
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    convs = sum(isinstance(m, models.Conv) for m in model.modules())
    conv2ds = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    hooked = {}
    for amp in (False, True):
        hooked[amp] = gradients(amp)
        assert dense == [True] * (2 * convs + conv2ds)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models.Conv, "forward", nn.Sequential.forward)
        plain = {amp: gradients(amp) for amp in (False, True)}
    assert not all(dense)
    torch.testing.assert_close(hooked[False], plain[False], rtol=1e-5, atol=1e-6)
    hooked_error = (hooked[True] - plain[False]).norm()
    plain_error = (plain[True] - plain[False]).norm()
    assert hooked_error <= 1.05 * plain_error
