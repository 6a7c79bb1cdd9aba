"""Run by tests/test_dist.py under `torchrun --nproc_per_node 2 tests/dist_helpers.py OUT_DIR`:
every collective helper of yolo_min.dist with rank-dependent values. Each rank writes what it saw
to OUT_DIR/rank<r>.json (the test checks it) and print0 prints `PRINT0 from rank <r>` (once).

A helper that fails to synchronise must not hang the test: rank 0 sleeps before the writes that
rank 1 looks for, so a missing barrier shows as a file not there yet, not as a wait.
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from yolo_min import dist  # noqa: E402

SLEEP = 0.5  # rank 0's head start on the writes rank 1 must wait for (s)


def main():
    out = Path(sys.argv[1])
    info = dist.setup("cpu")
    rank, res = info.rank, {}
    res["info"] = [info.rank, info.world_size, info.local_world_size, str(info.device)]
    res["is_main"] = dist.is_main()
    try:
        x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        y = dist.reduce_mean(x)
        res["reduce_mean"], res["reduce_mean_input"] = y.tolist(), x.tolist()

        res["gather"] = dist.all_gather_object({"rank": rank, "name": f"r{rank}"})

        a, b = torch.full((3,), float(rank)), torch.arange(4) * (rank + 1)  # float and int64
        state = {"a": a, "b": b}  # as train.py passes a state_dict's values, in place
        dist.broadcast_tensors(state.values())
        res["broadcast"] = [a.tolist(), b.tolist()]

        calls = []

        def fn(u, v):
            calls.append(rank)
            return {"sum": u + v, "by": rank}

        res["run_on_main"] = dist.run_on_main(fn, 2, 3)

        def bad():
            calls.append(rank)
            raise ValueError(f"bad input seen by rank {rank}")

        try:
            dist.run_on_main(bad)
            res["raised"] = None
        except ValueError as e:
            res["raised"] = str(e)
        res["calls"] = len(calls)

        dist.barrier()  # both start together: rank 1 sees rank 0's write only if it waited
        flag = out / "barrier.flag"
        if rank == 0:
            time.sleep(SLEEP)
            flag.write_text("0")
        dist.barrier()
        res["barrier_saw_flag"] = flag.exists()

        dist.barrier()
        flag = out / "main_first.flag"
        with dist.main_first():
            if rank == 0:  # local rank 0 (one node)
                time.sleep(SLEEP)
                flag.write_text("0")
            res["main_first_saw_flag"] = flag.exists()

        try:  # the body raising on local rank 0 still releases the others
            with dist.main_first():
                res["main_first_entered"] = True
                if rank == 0:
                    raise ValueError("body failed on rank 0")
        except ValueError as e:
            res["main_first_raised"] = str(e)
        res["after"] = dist.all_gather_object(rank)  # the ranks still call collectives in step

        dist.print0(f"PRINT0 from rank {rank}")
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(res))
        dist.cleanup()


if __name__ == "__main__":
    main()
