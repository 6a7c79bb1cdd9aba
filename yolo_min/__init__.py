"""yolo_min: a minimal, pure-PyTorch reference implementation of YOLOv5."""

__version__ = "0.1.0"
