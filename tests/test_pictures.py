"""Pictures drawn in background threads (plots.draw_later) are on disk when the call that started
them returns: finish_drawing, an epoch of training, a validation."""

from pathlib import Path

import torch
from PIL import Image

from yolo_min import plots, trainer


def test_draw_later_is_written_by_finish_drawing(tmp_path):
    images = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.4, 0.3], [1, 0, 0.3, 0.6, 0.2, 0.5]])
    for k in range(3):
        plots.draw_later(images, targets, fname=tmp_path / f"{k}.jpg", names=["a", "b"])
    plots.finish_drawing()
    assert not plots.DRAWING
    assert [Image.open(tmp_path / f"{k}.jpg").size for k in range(3)] == [(140, 72)] * 3


def test_a_run_returns_with_its_pictures(tmp_path, tiny):
    args = trainer.get_args_parser().parse_args(
        [*tiny, "--epochs", "1", "--project", str(tmp_path)]
    )
    run = Path(trainer.main(args)["save_dir"])
    names = ["train_batch0.jpg", "val_batch0_labels.jpg", "val_batch0_pred.jpg"]
    assert not plots.DRAWING
    for name in names:
        Image.open(run / name).verify()


def test_a_picture_that_fails_is_one_warning_line(tmp_path, capsys):
    images = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    blocker = tmp_path / "file"
    blocker.write_text("")
    # a folder cannot be made under a file
    plots.draw_later(images, fname=blocker / "x.jpg")
    plots.finish_drawing()
    out = capsys.readouterr()
    assert out.out.startswith(f"warning: {blocker / 'x.jpg'} not drawn: ")
    assert out.out.count("\n") == 1 and not out.err
