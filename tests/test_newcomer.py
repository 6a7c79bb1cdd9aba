"""What a new user meets first: the messages of common mistakes, and one rounding rule for --imgsz
in train.py, val.py and predict.py."""

import sys

import pytest

from yolo_min import cli, dist, predictor, trainer, validator
from yolo_min.datasets import load_data_config
from yolo_min.labels import DataError


def test_a_misspelt_embedded_dataset_names_the_embedded_ones():
    with pytest.raises(DataError) as e:
        load_data_config("shape")
    message = str(e.value)
    assert message.startswith("data yaml shape not found; the embedded datasets are shapes")
    assert "shapes-cls" in message and "\n" not in message


def test_a_gpu_asked_for_without_cuda_echoes_what_was_typed(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for typed in ("0", "cuda:1", "CUDA"):
        with pytest.raises(
            ValueError, match=rf"^--device {typed} asks for CUDA, but torch sees no"
        ):
            dist.select_device(typed)


def test_val_and_predict_round_imgsz_as_train_does(fixtures_dir, small_shapes, tmp_path, capsys):
    """--imgsz 100 becomes 128 with the same warning line in all three."""
    warning = "warning: --imgsz 100 is not a multiple of 32, using 128"
    weights = str(fixtures_dir / "predict" / "det.pt")
    image = str(sorted((fixtures_dir / "predict" / "images").iterdir())[0])
    common = dict(imgsz=100, workers=0, project=str(tmp_path))
    validator.run(weights=weights, data=small_shapes, **common)
    assert warning in capsys.readouterr().out
    predictor.run(weights=weights, source=image, **common)
    assert warning in capsys.readouterr().out
    args = trainer.get_args_parser().parse_args(["--imgsz", "100"])
    trainer.check_args(args, "detect", 1)
    assert args.imgsz == 128 and warning in capsys.readouterr().out


def test_an_unknown_option_on_the_command_line_is_one_line(monkeypatch, capsys, tmp_path):
    """An abbreviation is unknown too: --epoch is not --epochs, as in the Python API."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--epoch", "3"])
    with pytest.raises(SystemExit) as stop:
        cli.run_command(trainer.main, trainer.get_args_parser(), errors=(cli.ConfigError,))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unrecognized arguments: --epoch 3" in err
    assert not (tmp_path / "runs").exists()


def test_val_and_predict_take_no_abbreviations():
    val_args = ["--weights", "w.pt", "--data", "shapes"]
    predict_args = ["--weights", "w.pt", "--source", "x"]
    assert validator.get_args_parser().parse_args(val_args + ["--conf-thres", "0.5"])
    assert predictor.get_args_parser().parse_args(predict_args + ["--conf-thres", "0.5"])
    with pytest.raises(SystemExit):
        validator.get_args_parser().parse_args(val_args + ["--conf", "0.5"])
    with pytest.raises(SystemExit):
        predictor.get_args_parser().parse_args(predict_args + ["--conf", "0.5"])


def test_cache_and_freeze_are_checked_apart():
    """A resumed args.yaml bypasses argparse: each bad value gets its own message."""
    parser = trainer.get_args_parser()
    args = parser.parse_args([])
    args.cache = "disk"
    with pytest.raises(cli.ConfigError, match=r"^--cache disk: one of auto, ram, off$"):
        trainer.check_args(args, "detect", 1)
    args = parser.parse_args([])
    args.freeze = ["3"]
    message = r"^--freeze \['3'\]: layer numbers must be integers$"
    with pytest.raises(cli.ConfigError, match=message):
        trainer.check_args(args, "detect", 1)
