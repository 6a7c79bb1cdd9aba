"""Validate a checkpoint: COCO-exact box (and mask) mAP, or top-1/5 accuracy.

    python val.py --weights runs/train/exp/weights/best.pt --data coco128.yaml
    torchrun --standalone --nproc_per_node 2 val.py --weights best.pt --data coco128.yaml

Under torchrun each rank scores a shard; the loop is yolo_min/validator.py's."""

from yolo_min import cli, validator

if __name__ == "__main__":
    cli.run_command(validator.main, validator.get_args_parser())
