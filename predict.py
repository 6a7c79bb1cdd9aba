"""Predict boxes (and masks), or a classifier's top 5, on images, as yolov5's detect.py.

    python predict.py --weights runs/train/exp/weights/best.pt --source images/ --save-txt

Under torchrun each rank predicts its share of the files; the loop is yolo_min/predictor.py's."""

from yolo_min import cli, predictor

if __name__ == "__main__":
    cli.run_command(predictor.main, predictor.get_args_parser())
