"""Train a YOLOv5 detection, segmentation or classification model, in one process or many.

    python train.py --cfg yolov5n-seg.yaml --data coco128-seg.yaml --epochs 100 --imgsz 640
    torchrun --standalone --nproc_per_node 4 train.py --data coco.yaml --batch-size 64  # global

--resume continues a run exactly; after a torchrun restart it does so by itself. The loops are
yolo_min/trainer.py's; this is their command line."""

import os
import signal
import sys

from yolo_min import checkpoint, cli, dist, trainer


def stop_on_sigterm(signum, frame):
    """SIGTERM stops a one-process run like Ctrl-C; a second one ends it at once."""
    signal.signal(signum, signal.SIG_DFL)
    raise KeyboardInterrupt("SIGTERM")


def main():
    """The command line: exit 2 for a bad configuration (said once, by rank 0), 1 for a non-finite
    loss or a checkpoint that cannot be written, 130 / 143 when stopped by Ctrl-C / SIGTERM."""
    # under torchrun SIGTERM ends a rank at once
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        cli.run_command(trainer.main, trainer.get_args_parser(), errors=(cli.ConfigError,))
    except (FloatingPointError, checkpoint.SaveError) as e:
        # last.pt holds the last good epoch
        sys.exit(f"train.py: {e}")
    except KeyboardInterrupt as e:
        # trainer.Stopped: (the signal, what the run folder holds); else stopped before training
        why = e.args[0] if e.args else "SIGINT"
        note = e.args[1] if len(e.args) > 1 else "no run folder was written"
        # under torchrun every rank is stopped: rank 0 says it once
        if dist.env_rank() == 0:
            print(f"train.py: stopped by {why}; {note}", file=sys.stderr)
        sys.exit(143 if why == "SIGTERM" else 130)


if __name__ == "__main__":
    main()
