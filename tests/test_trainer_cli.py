"""``swarm-node trainer-steps``: the steps table from a trainer's spool, JSON, the PNG, and bad input."""

from __future__ import annotations

import argparse
import json
import struct
import zlib

import pytest

from node.app.commands import trainer_steps as cli
from node.trainer.plot import HEIGHT, WIDTH, render_curve
from node.trainer.spool import StepRecord, open_spool


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_prints_the_steps_and_writes_a_png(tmp_path, capsys):
    with open_spool(tmp_path / "trainer" / "spool.sqlite") as spool:
        for step, reward in ((1, 0.1), (2, 0.25), (3, 0.4)):
            spool.finish_step(StepRecord(step, reward, 16, 2, 80, -0.1, 0.5))
    png = tmp_path / "reward.png"
    assert run(["trainer-steps", "--data-dir", str(tmp_path), "--json", "--png", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["mean_reward"]) for r in rows] == [(1, 0.1), (2, 0.25), (3, 0.4)]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
    assert run(["trainer-steps", "--data-dir", str(tmp_path)]) == 0
    assert "0.4000" in capsys.readouterr().out


def test_png_decodes_and_the_curve_is_drawn():
    data = render_curve([(1, 0.0), (2, 1.0)])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == HEIGHT * (1 + 3 * WIDTH)
    assert bytes((31, 119, 180)) in raw  # the line colour is somewhere on the canvas
    assert render_curve([]) != b""  # no steps yet: an empty chart, not a crash


def test_not_a_trainer_data_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert run(["trainer-steps", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no trainer spool" in err


def test_a_step_is_recorded_before_its_model_and_never_as_nan(tmp_path):
    """record_step comes before the save: a crash between them leaves a record without a model,
    which recover() (restarting at the saved step) drops. A NaN figure is our bug, not a NULL row."""
    with open_spool(tmp_path / "spool.sqlite") as spool:
        spool.record_step(StepRecord(1, 0.5, 16, 2, 80, -0.1, 0.5))
        spool.recover(saved_step=0)  # the model of step 1 was never saved
        assert spool.steps() == []
        with pytest.raises(ValueError, match="non-finite"):
            spool.record_step(StepRecord(1, 0.5, 16, 2, 80, float("nan"), 0.5))


def test_moving_average_trails_over_its_window():
    from node.trainer.plot import moving_average

    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([], 3) == []


def test_without_matplotlib_the_png_is_drawn_by_hand(tmp_path, monkeypatch):
    from node.trainer import plot

    monkeypatch.setattr(plot, "have_matplotlib", lambda: False)
    path = plot.write_curve_png([(1, 0.1), (2, 0.3)], tmp_path / "r.png")
    assert path.read_bytes() == plot.render_curve([(1, 0.1), (2, 0.3)])


def test_with_matplotlib_the_png_has_a_title_axes_and_ticks(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional extra `plot` (not in the lock)")
    from node.trainer import plot

    points = [(s, 0.1 + 0.01 * s) for s in range(1, 41)]
    ax = plot.curve_figure(points).axes[0]
    assert ax.get_title() == "Mean reward per trainer step"
    assert ax.get_xlabel().startswith("trainer step") and ax.get_ylabel() == "mean task reward"
    assert len(ax.get_xticks()) >= 3 and len(ax.get_yticks()) >= 3
    assert [l.get_label() for l in ax.get_lines()] == ["mean reward", "moving average (4 steps)"]
    path = plot.write_curve_png(points, tmp_path / "r.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data != plot.render_curve([(s, 0.1 + 0.01 * s) for s in range(1, 41)])
    assert struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
