"""``[ledger] keep_steps`` against the trainers' step window (node/ledger/config.py ``keep_steps_problem``).

A cut closes each worker's draw steps older than its newest ``keep_steps``, and after it a credit of a
closed step counts nothing (node/ledger/cut.py). A trainer takes a batch up to its step window below the
worker's highest step (node/rollouts/steps.py ``step_window_size`` of ``[worker] max_pending_batches``),
and the validators' lag adds to that; a run file whose keep_steps does not clear both would let cuts
take honest credit, so it is refused at load with one line and exit 2, like any run-file mistake.
"""

from __future__ import annotations

import tomllib

import pytest

from node.app.cli import main
from node.config import RunConfig
from node.ledger.config import keep_steps_floor
from node.roles.sections import RunSections
from node.rollouts.steps import step_window_size
from test_cli import one_line_error


def test_the_floor_is_the_step_window_and_as_much_again():
    assert keep_steps_floor(step_window_size(8)) == 2 * 26 == 52  # the defaults: keep_steps 64 clears it
    assert keep_steps_floor(step_window_size(100)) == 2 * step_window_size(100)


@pytest.mark.parametrize("table, refused", [
    ("[ledger]\ncut_every = 4000\nkeep_steps = 26\n", True),  # the default step window itself
    ("[ledger]\ncut_every = 4000\nkeep_steps = 52\n", True),  # at the floor
    ("[ledger]\ncut_every = 4000\nkeep_steps = 53\n", False),
    ("[worker]\nmax_pending_batches = 32\n[ledger]\ncut_every = 4000\n", True),  # the default keep_steps (64) does not clear it
    ("[worker]\nmax_pending_batches = 32\n[ledger]\ncut_every = 4000\nkeep_steps = 200\n", False),
    ("[worker]\nmax_pending_batches = 32\n", False),  # no cuts: keep_steps closes nothing
    ("", False),
])
def test_a_run_file_whose_keep_steps_does_not_clear_the_step_window_is_refused(tmp_path, capsys, table, refused):
    if not refused:  # the tables are consistent (starting a node is not this test's business)
        RunSections.of(RunConfig(tables=tomllib.loads(table))).cross_check()
        return
    run = tmp_path / "run.toml"
    run.write_text(table)
    data_dir = tmp_path / "d"
    assert main(["--run", str(run), "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "run.ledger.keep_steps" in line and "step window" in line and "worker.max_pending_batches" in line
    assert not data_dir.exists()  # refused before anything was made
