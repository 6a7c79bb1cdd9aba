"""train.py with a fault injected at a planned step; tests/test_reliability.py launches it (with
python or torchrun) in place of train.py, with the same arguments.

YOLO_MIN_TEST_KILL, _FAIL or _NAN set to "epoch:iteration:rank" (1-based) make that rank SIGKILL
itself (on torchrun's first attempt only), raise an error, or see a NaN loss at that step.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from yolo_min import trainer  # noqa: E402

FAULTS = {}
for kind in ("KILL", "FAIL", "NAN"):
    if value := os.environ.get(f"YOLO_MIN_TEST_{kind}"):
        FAULTS[kind] = tuple(map(int, value.split(":")))
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
    FAULTS.pop("KILL", None)  # the restarted run goes through
AT = {"epoch": 0, "iteration": 0}
train_one_epoch, forward_loss = trainer.train_one_epoch, trainer.forward_loss


def faulty_epoch(training, setup, epoch, **kwargs):
    AT.update(epoch=epoch + 1, iteration=0)
    return train_one_epoch(training, setup, epoch, **kwargs)


def faulty_forward(*args, **kwargs):
    AT["iteration"] += 1
    at = (AT["epoch"], AT["iteration"], int(os.environ.get("RANK", "0")))
    if FAULTS.get("KILL") == at:
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULTS.get("FAIL") == at:
        raise RuntimeError(f"test fault: rank {at[2]} fails at epoch {at[0]}, iteration {at[1]}")
    loss, items = forward_loss(*args, **kwargs)
    if FAULTS.get("NAN") == at:
        items = {k: v * float("nan") for k, v in items.items()}
    return loss, items


trainer.train_one_epoch, trainer.forward_loss = faulty_epoch, faulty_forward
train.main()
