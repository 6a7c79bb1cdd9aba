"""Where a detection run's wall time goes: `train.py` on coco128 (3 epochs, imgsz 320, batch 16,
2 workers, from scratch, validation and checkpoints as a user runs it), from the process's start
to its exit, by stage.

    python bench/bench_breakdown.py                      # the working tree, once
    python bench/bench_breakdown.py --before HEAD~3      # that commit against the working tree
    python bench/bench_breakdown.py --before main --repeat 2 --epochs 3

Each run is a fresh child process on a fresh copy of ../shared/data/coco128 (so the label cache is
built, as on a first run). The child wraps the trainer's functions with timers (the library has
no timing code of its own): start-up (Python and the imports, up to trainer.main), label checks
(list_images + load_labels, train and val), RAM cache (the decoding thread_map), model and
optimizer, AutoAnchor, each epoch's training (inside it: train_batch0.jpg), each validation
(inside it: NMS and the val_batch pictures), checkpoint writes (training_state + save_epoch),
the validation of best.pt, and exit (trainer.main's return to the process's end). "other" is the
rest. With --before REV the commit REV (`git archive`d to a temporary folder) and the working
tree alternate, --repeat rounds, and the table shows both means and after/before. Asserts
nothing; the machine's load moves every figure: compare ratios of the same invocation.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
# (stage, module, function): the functions timed (main thread); an indented stage is part of the
# one above it; the calls of NUMBERED stages are numbered
STAGES = [
    ("label checks", "datasets", "list_images"),
    ("label checks", "datasets", "load_labels"),
    ("RAM cache", "datasets", "thread_map"),
    ("model", "trainer", "build_model"),
    ("AutoAnchor", "trainer", "autoanchor"),
    ("optimizer, EMA", "trainer", "build_training"),
    ("train epoch", "trainer", "train_one_epoch"),
    ("  train_batch0.jpg", "trainer", "draw_batch"),
    ("  train_batch0.jpg", "trainer", "draw_later"),
    ("  waiting for pictures", "trainer", "finish_drawing"),
    ("validation", "validator", "evaluate"),
    ("  model + NMS", "validator", "infer"),
    ("  NMS", "ops", "non_max_suppression"),
    ("  scoring", "validator", "score_image"),
    ("  AP", "metrics", "summarize"),
    ("  val pictures", "validator", "plot_batch"),
    ("  waiting for pictures", "plots", "finish_drawing"),
    ("checkpoint writes", "checkpoint", "training_state"),
    ("checkpoint writes", "trainer", "save_epoch"),
    ("validate best.pt", "trainer", "validate_saved"),
]
NUMBERED = ("train epoch", "validation")


def child(root: str, args: list[str], launched: float) -> None:
    """Run trainer.main(args) with STAGES timed; print a RESULT line of spans [(stage, s, e)]."""
    started = time.time()
    sys.path.insert(0, root)
    import importlib

    from yolo_min import trainer

    spans = [("python start", launched, started)]
    calls = {}

    def wrap(stage: str, module, name: str) -> None:
        inner = getattr(module, name)

        def timed(*a, **kw):
            if stage in NUMBERED:
                calls[stage] = calls.get(stage, 0) + 1
            label = f"{stage} {calls[stage]}" if stage in NUMBERED else stage
            t0 = time.time()
            try:
                return inner(*a, **kw)
            finally:
                spans.append((label, t0, time.time()))

        setattr(module, name, timed)

    for stage, module, name in STAGES:
        module = importlib.import_module(f"yolo_min.{module}")
        # a revision without the function (draw_later: pictures drawn in the main thread)
        if hasattr(module, name):
            wrap(stage, module, name)
    parsed = trainer.get_args_parser().parse_args(args)
    spans.append(("imports", started, time.time()))
    trainer.main(parsed)
    print("RESULT " + json.dumps({"spans": spans, "returned": time.time()}), flush=True)


def one_run(root: Path, epochs: int) -> dict:
    """One train.py run of `root`'s code on a fresh coco128 copy: {stage: seconds}, with "total"
    (launch to exit), "exit" and "other"; or {"error": text}."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(DATA / "coco128", Path(tmp) / "coco128")
        yaml = (DATA / "coco128.yaml").read_text().replace("path: coco128", f"path: {tmp}/coco128")
        (Path(tmp) / "coco128.yaml").write_text(yaml)
        args = ["--data", f"{tmp}/coco128.yaml", "--imgsz", "320", "--batch-size", "16"]
        args += ["--workers", "2", "--epochs", str(epochs), "--project", tmp]
        launched = time.time()
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import "
        code += f"bench_breakdown as b; b.child({str(root)!r}, {args!r}, {launched!r})"
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True)
        ended = time.time()
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        return {"error": p.stderr[-800:]}
    result = json.loads(line[7:])
    out = {"total": ended - launched, "exit": ended - result["returned"]}
    for label, t0, t1 in result["spans"]:
        out[label] = out.get(label, 0.0) + t1 - t0
    # Time inside no top-level span (validate best.pt holds a validation: counted once).
    covered, reach = 0.0, launched
    for _, t0, t1 in sorted(
        (s for s in result["spans"] if not s[0].startswith(" ")), key=lambda s: s[1]
    ):
        covered += max(t1 - max(t0, reach), 0.0)
        reach = max(reach, t1)
    out["other"] = result["returned"] - launched - covered
    return out


def order(rows: list[dict]) -> list[str]:
    """The stages of the runs in the order they happen, "other" and "total" last."""
    names = []
    for row in rows:
        names += [k for k in row if k not in names and k not in ("other", "total", "exit")]
    return [*names, "exit", "other", "total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="a git revision to time against the working tree")
    p.add_argument("--repeat", type=int, default=1, help="runs of each side, alternating")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} is absent: the benchmark needs ../shared/data/coco128")
    sides = {"after": ROOT} if args.before else {"now": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            sides = {"before": Path(tmp), **sides}
        runs = {name: [] for name in sides}
        for _ in range(args.repeat):
            for name, root in sides.items():
                res = one_run(root, args.epochs)
                if "error" in res:
                    sys.exit(f"{name} failed:\n{res['error']}")
                runs[name].append(res)
    names = order([r for rs in runs.values() for r in rs])
    means = {
        s: {k: statistics.mean(r.get(k, 0.0) for r in rs) for k in names} for s, rs in runs.items()
    }
    print(f"train.py coco128, {args.epochs} epochs, imgsz 320, batch 16, 2 workers (seconds)")
    head = f"{'stage':24s}" + "".join(f"{s:>9s}" for s in sides)
    print(head + ("    after/before" if args.before else ""))
    for k in names:
        cells = "".join(f"{means[s][k]:9.2f}" for s in sides)
        ratio = ""
        if args.before and means["before"][k] > 0.005:
            ratio = f"{means['after'][k] / means['before'][k]:12.2f}"
        print(f"{k:24s}{cells}{ratio}")


if __name__ == "__main__":
    main()
