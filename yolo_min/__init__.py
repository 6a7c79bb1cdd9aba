"""yolo_min: a minimal, pure-PyTorch reference implementation of YOLOv5."""

from .yolo import YOLO

__all__ = ["YOLO"]
__version__ = "0.1.0"
