"""Several processes on CPU (gloo), launched by the tests with torchrun: 2 ranks, 2 "nodes" on
loopback, and the DDP step equivalence. The project code itself never starts a process."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yolo_min import dist, trainer  # noqa: E402
from yolo_min.datasets import YOLODataset, build_dataloader, load_data_config  # noqa: E402
from yolo_min.safe_load import load_model  # noqa: E402
from yolo_min.validator import evaluate  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TWO_NODE_PORT = "29517"  # fixed: the two launchers must agree on it
AMP_TOL = 0.05  # bf16: max weight difference / max weight movement (classify measured 0.022)
# 1 vs 2 ranks' epoch losses (relative): yolov5's per-rank means over positives (a rank without
# positives at a level adds 0 there) and BatchNorm statistics of 8 images, not 16: measured 0.130
# (--seed 0, the runs'; 0.207 at seeds 1-3; obj 0.03). reduce_mean not dividing: +0.74 at least,
# without its all_reduce: -0.46. Slips in the gradients' scale stay well inside it (clipped steps):
# test_ddp_step_equals_single_process is the test of those
LOSS_TOL = 0.3
HELPERS_TIMEOUT = 60  # s: tests/dist_helpers.py takes 7 s on 2 cores
ARGS = ["--imgsz", "64", "--batch-size", "16", "--workers", "0", "--log-every", "4"]


def run(cmd, timeout=300, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def rows(run_dir):
    with open(run_dir / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def shapes_runs(tmp_path_factory, small_shapes):
    """The same 2-epoch training, in 1 process (in-process) and in 2 processes (torchrun), in fp32:
    test_gathered_validation_equals_one_process compares bits."""
    tmp = tmp_path_factory.mktemp("runs")
    args = ["--data", small_shapes, *ARGS, "--epochs", "2", "--amp", "off"]
    one = trainer.main(trainer.get_args_parser().parse_args([*args, "--project", str(tmp / "one")]))
    r = run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node",
            "2",
            "train.py",
            *args,
            "--project",
            str(tmp / "two"),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(one["save_dir"]), tmp / "two" / "exp", r.stdout


@pytest.mark.slow
def test_two_ranks_train_and_only_rank0_writes(shapes_runs):
    one, two, stdout = shapes_runs
    assert sorted(p.name for p in two.parent.iterdir()) == ["exp"]
    assert sorted(p.name for p in (two / "weights").iterdir()) == [
        "best.pt",
        "last.pt",
    ]  # no stray .tmp
    assert (
        stdout.count("epoch 2/2:") == 1 and stdout.count("Results saved") == 1
    )  # rank 0 prints, once
    assert "2 rank(s)" in stdout
    assert list(rows(two)[0]) == list(rows(one)[0]) and len(rows(two)) == len(rows(one)) == 2
    a, b = (torch.load(r / "weights" / "last.pt", weights_only=True) for r in (one, two))
    assert a.keys() == b.keys() and a["rng"]["world_size"] == 1 and b["rng"]["world_size"] == 2
    assert len(b["rng"]["ranks"]) == 2


@pytest.mark.slow
def test_two_ranks_log_the_losses_of_one(shapes_runs):
    """results.csv's train/*_loss columns of the 2-rank run are the 1-process run's, to LOSS_TOL:
    train_one_epoch logs the ranks' mean (reduce_mean) of their loss items, not a sum or one's."""
    one, two, _ = shapes_runs
    for a, b in zip(rows(one), rows(two), strict=True):
        keys = [k for k in a if k.startswith("train/") and k.endswith("_loss")]
        assert len(keys) == 3, keys  # box, obj, cls
        got = {k: float(b[k]) for k in keys}
        assert got == pytest.approx({k: float(a[k]) for k in keys}, rel=LOSS_TOL), (a, b)


@pytest.mark.slow
def test_collective_helpers_on_two_ranks(tmp_path):
    """tests/dist_helpers.py: each helper of yolo_min.dist on 2 ranks, rank-dependent values."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "tests/dist_helpers.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen([*cmd, str(tmp_path)], cwd=ROOT, env=env, **pipes) as p:
        try:
            stdout, stderr = p.communicate(timeout=HELPERS_TIMEOUT)
        except subprocess.TimeoutExpired:  # torchrun passes SIGTERM on to its ranks
            p.terminate()
            stdout, stderr = p.communicate(timeout=60)
            pytest.fail(f"a helper left a rank waiting ({HELPERS_TIMEOUT} s):\n{stderr[-3000:]}")
    assert p.returncode == 0, stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert [r0["info"], r1["info"]] == [[0, 2, 2, "cpu"], [1, 2, 2, "cpu"]]
    assert [r0["is_main"], r1["is_main"]] == [True, False]
    # the mean of [1, 10] and [2, 20] on both ranks; the input left as it was
    assert r0["reduce_mean"] == r1["reduce_mean"] == [1.5, 15.0]
    assert [r0["reduce_mean_input"], r1["reduce_mean_input"]] == [[1.0, 10.0], [2.0, 20.0]]
    assert r0["gather"] == r1["gather"] == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
    assert r0["broadcast"] == r1["broadcast"] == [[0.0] * 3, [0, 1, 2, 3]]  # rank 0's, in place
    # fn ran on rank 0 only, once per call; its result and its ValueError reach rank 1
    assert r0["run_on_main"] == r1["run_on_main"] == {"sum": 5, "by": 0}
    assert [r0["calls"], r1["calls"]] == [2, 0]
    assert r0["raised"] == r1["raised"] == "bad input seen by rank 0"
    assert r1["barrier_saw_flag"], "rank 1 left the barrier before rank 0 reached it"
    assert r1["main_first_saw_flag"], "main_first: rank 1's body ran before rank 0's had ended"
    assert r0["main_first_raised"] == "body failed on rank 0" and "main_first_raised" not in r1
    assert r1["main_first_entered"] and r0["after"] == r1["after"] == [0, 1]
    assert stdout.count("PRINT0") == 1 and "PRINT0 from rank 0" in stdout


def test_collective_helpers_in_one_process(monkeypatch, capsys):
    """Without torchrun each helper is the identity or a no-op, and fn runs once, here."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert not torch.distributed.is_initialized()
    info = dist.setup("cpu")
    assert tuple(info) == (0, 1, 1, torch.device("cpu")) and dist.is_main()
    x = torch.tensor([1.0, 10.0])
    y = dist.reduce_mean(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # an equal copy
    obj = {"a": [1]}
    assert dist.all_gather_object(obj) == [obj]
    a = torch.arange(3.0)
    dist.broadcast_tensors({"a": a}.values())
    assert a.tolist() == [0.0, 1.0, 2.0]
    calls = []
    assert dist.run_on_main(lambda u: calls.append(u) or u + 1, 1) == 2 and calls == [1]

    def bad():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="^bad$"):
        dist.run_on_main(bad)
    entered = []
    with dist.main_first():
        entered.append(1)
    dist.barrier()
    dist.print0("PRINT0", "once")
    assert entered == [1] and capsys.readouterr().out == "PRINT0 once\n"
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_gathered_validation_equals_one_process(shapes_runs, small_shapes):
    """The metrics the 2 ranks computed for the last epoch (sharded, gathered) equal a 1-process
    validation of the same EMA weights, to the last bit."""
    _, two, _ = shapes_runs
    data = load_data_config(small_shapes)
    model = load_model(two / "weights" / "last.pt")
    ds = YOLODataset(
        data["val"], imgsz=64, task="detect", rect=True, batch_size=16, stride=32, nc=data["nc"]
    )
    loader, _ = build_dataloader(ds, 16, 0, shuffle=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran (OMP_NUM_THREADS=1): bit-equal convolutions
    try:
        metrics = evaluate(model, loader)
    finally:
        torch.set_num_threads(threads)
    last = rows(two)[-1]
    got = {k: float(last[f"metrics/{k}"]) for k in metrics["metrics"]}
    assert got == metrics["metrics"] and got["R(B)"] > 0  # non-trivial: something was detected


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["off", "on"])
@pytest.mark.parametrize("task", ["detect", "segment", "classify"])
def test_ddp_step_equals_single_process(task, amp):
    """train.py's wiring and train_one_epoch: 2 ranks x 2 micro-batches of 4 images == 1 process x 2
    batches of 8 (tests/dist_step.py): the weights move, and equally (--amp off), or under bfloat16
    autocast to AMP_TOL of how far they move (bf16 may round batches of 4 and 8 differently)."""
    r = run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node",
            "2",
            "tests/dist_step.py",
            *([f"--{task}"] if task != "detect" else []),
            *(["--amp-on"] if amp == "on" else []),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    diff, moved = map(float, re.search(r"MAXDIFF (\S+) MOVED (\S+)", r.stdout).groups())
    assert moved > 1e-4 and diff < (1e-5 if amp == "off" else AMP_TOL * moved), (diff, moved)


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """torchrun --nproc_per_node 2 on a node with one GPU: every rank stops before the process
    group with the same ValueError (train.py, val.py, predict.py: exit 2, said by rank 0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for rank in (0, 1):
        env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        with pytest.raises(ValueError, match="torchrun started 2 processes on a node with 1 GPU"):
            dist.setup("")
        with pytest.raises(trainer.ConfigError, match="--nproc_per_node 1, or --device cpu"):
            trainer.main(trainer.get_args_parser().parse_args([]))
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path, small_shapes):
    """torchrun --nnodes 2 --node_rank 0/1 --master_addr 127.0.0.1, one process per "node"."""

    def cmd(rank):
        node = f"--nnodes 2 --node_rank {rank} --nproc_per_node 1 --master_addr 127.0.0.1"
        return [
            *TORCHRUN,
            *node.split(),
            "--master_port",
            TWO_NODE_PORT,
            "train.py",
            "--data",
            small_shapes,
            *ARGS,
            "--epochs",
            "1",
            "--project",
            str(tmp_path),
        ]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            cmd(r), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert (
        "2 rank(s)" in outs[0][0] and "epoch 1/1:" not in outs[1][0]
    )  # node 1's rank prints nothing
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["exp"] and len(rows(tmp_path / "exp")) == 1
    )
