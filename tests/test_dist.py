"""Several processes on CPU (gloo), launched by the tests with torchrun: 2 ranks, 2 "nodes" on
loopback, and the DDP step equivalence. The project code itself never starts a process."""

import csv
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
