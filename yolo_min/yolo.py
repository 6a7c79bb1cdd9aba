"""`YOLO`, the Python face of the engine: a model object that trains, validates, predicts and saves
through the same functions as train.py, val.py and predict.py.

    model = YOLO("yolov5n-seg.yaml")          # the task comes from the cfg's head
    model.train(data="coco128-seg.yaml", epochs=50, batch_size=16)
    metrics = model.val()
    results = model.predict("images/")

Launched with `torchrun --standalone --nproc_per_node 2 script.py`, the same script trains
data-parallel: torchrun runs it once per rank and every call joins the ranks' process group."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import checkpoint, dist, predictor, trainer, validator
from .cli import parse_kwargs
from .models import Model
from .safe_load import load_model

# predict.py's options that YOLO.predict takes (it returns results and writes no files)
PREDICT_OPTIONS = (
    "imgsz conf_thres iou_thres max_det classes agnostic_nms batch_size workers device amp".split()
)


class YOLO:
    """A YOLOv5 model with its loops. source: a cfg name or yaml path (a new model, its task from
    the head), a yolo_min checkpoint or a yolov5 .pt (loaded as val.py loads it), a `Model` (used
    as it is), or None (then `.new(cfg)` or `.load(path)`)."""

    def __init__(self, source: str | Path | Model | None = None):
        self.model: Model | None = None
        # the cfg a new model was built from (recorded in args.yaml)
        self.cfg = ""
        # the file the weights came from, or were saved to
        self.ckpt_path: Path | None = None
        # the data trained on: val()'s default
        self.data: str | None = None
        self.callbacks: dict[str, list] = {event: [] for event in trainer.EVENTS}
        if isinstance(source, Model):
            self.model = source
        elif isinstance(source, (str, os.PathLike)):
            if Path(source).suffix in (".yaml", ".yml"):
                self.new(source)
            else:
                self.load(source)
        elif source is not None:
            raise TypeError(
                f"YOLO(source): {type(source).__name__} is not "
                "a cfg name or yaml path, a weights file or a Model"
            )

    def new(self, cfg: str | Path | dict) -> YOLO:
        """A new model from a cfg, with the initial weights of `train.py --cfg cfg --seed 0`."""
        # drawn from seed 0, leaving the caller's random state as it was
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            try:
                self.model = Model(cfg)
            except OSError as e:
                raise ValueError(str(e)) from None
        self.cfg = str(cfg) if isinstance(cfg, (str, os.PathLike)) else ""
        self.ckpt_path = None
        return self

    def load(self, weights: str | Path) -> YOLO:
        """The model of a yolo_min checkpoint (its EMA) or a yolov5 .pt, through the checked
        loader; CheckpointError (a ValueError) names a file that is missing or not a checkpoint."""
        self.model = load_model(weights)
        self.cfg = ""
        self.ckpt_path = Path(weights)
        return self

    @property
    def task(self) -> str:
        return self._model().task

    @property
    def names(self) -> list[str]:
        return self._model().names

    def _model(self) -> Model:
        if self.model is None:
            raise ValueError("YOLO(): no model yet: YOLO(cfg or weights), .new(cfg) or .load(path)")
        return self.model

    def add_callback(self, event: str, fn):
        """Call fn(trainer.Event) at event (trainer.EVENTS), on every rank, while training."""
        if event not in self.callbacks:
            raise ValueError(f"add_callback: unknown event {event!r} (events: {trainer.EVENTS})")
        if not callable(fn):
            raise TypeError(f"add_callback: {fn!r} is not callable")
        self.callbacks[event].append(fn)

    def train(self, **options) -> dict:
        """Train this object's model with train.py's options (data=..., epochs=..., ...) in this
        process, or data-parallel under torchrun. Returns, on every rank, {save_dir, data, epochs,
        best_fitness, metrics, img_s}; afterwards the object holds best.pt's weights (else
        last.pt's)."""
        model = self._model()
        for name in ("cfg", "weights"):
            if name in options:
                raise TypeError(
                    f"train(): {name} is not an option here; "
                    "the model trained is this object's: YOLO(cfg or weights)"
                )
        # YOLO("last.pt").train(resume=True) continues that run
        if options.get("resume") is True and self.ckpt_path is not None:
            options["resume"] = str(self.ckpt_path)
        fixed = {"weights": ""}
        # a resumed run takes its own cfg
        if not options.get("resume"):
            fixed["cfg"] = self.cfg
        args = parse_kwargs(trainer.get_args_parser(), options, fixed=fixed)
        callbacks = {event: fns for event, fns in self.callbacks.items() if fns}
        result = trainer.main(args, model=model, callbacks=callbacks)
        self.model = result.pop("model")
        weights = Path(result["save_dir"]) / "weights"
        best = weights / "best.pt"
        self.ckpt_path = best if best.is_file() else weights / "last.pt"
        self.data = result["data"]
        return result

    def val(self, data: str | Path | None = None, **options) -> dict:
        """val.py on this object's model with val.py's options; data: the one trained on unless
        given. Sharded over the ranks under torchrun: the same metrics dict on every rank."""
        model = self._model()
        if "weights" in options:
            raise TypeError("val(): weights is not an option here; the model is this object's")
        data = data or self.data
        if data is None:
            raise ValueError("val(): no data: give data=..., or train this model first")
        args = parse_kwargs(
            validator.get_args_parser(), options, fixed={"weights": "", "data": data}
        )
        return validator.main(args, model=model)

    def predict(self, source, stream: bool = False, **options):
        """stream's results for source (an image file, folder, glob or .txt list of paths, a PIL
        image, a uint8 (h, w, 3) RGB array, or a list of these) with predict.py's options
        (PREDICT_OPTIONS, checked first: ValueError naming one): a list in the source's order, or
        a generator with stream=True. The model keeps its train or eval mode."""
        model = self._model()
        args = parse_kwargs(predictor.get_args_parser(), options, only=PREDICT_OPTIONS)
        validator.check_options(vars(args))
        images = predictor.source_images(source)
        if args.device:
            device = dist.select_device(args.device)
        else:
            device = next(model.parameters()).device
        # stream runs it in eval mode and gives it back in its own mode
        model = model.to(device)
        args.imgsz = validator.round_imgsz(args.imgsz, model.max_stride)
        amp = predictor.predict_amp(device, args.amp)
        results = predictor.stream_args(model, images, args, amp)
        if stream:
            return results
        return sorted(results, key=lambda r: r["index"])

    __call__ = predict

    def save(self, path: str | Path) -> Path:
        """Write the model as a checkpoint that val.py, predict.py and YOLO(path) load (on rank 0
        only under torchrun; atomically)."""
        model = self._model()
        if dist.env_rank() == 0:
            checkpoint.save(checkpoint.model_state(model), path)
        self.ckpt_path = Path(path)
        return self.ckpt_path
