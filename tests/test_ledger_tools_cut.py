"""The ledger tools on a data dir based on a trainer-signed cut (node/app/commands/penalties.py, ledger.py).

A data dir whose database adopted a cut holds no entries at or below the cut's heads: the tools rebuild
from the cut with the run's trainers (as the node does), and ``ledger verify`` checks the cut itself
(signature, run, signer among the trainers, the stored bases) and counts only the entries it holds.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from node.app.commands.ledger import cmd_verify
from node.app.commands.penalties import cmd_penalties, collect
from node.config import RunConfig, write_run_record
from node.identity import Identity
from node.ledger.cut import make_cut, sign_cut
from node.ledger.store import open_ledger_store
from test_ledger_cut import BANNED, NOW, RUN, T1, T2, VALIDATOR, deliver, history, new_ledger
from test_ledger_cut_store import heads_of, stored_with_cut

THE_RUN = RunConfig(name=RUN, trainers=[T1.peer_id, T2.peer_id], validators=[VALIDATOR.peer_id])


def data_dir_with_cut(path, signer=T1):
    """A data dir whose database adopted ``signer``'s cut of the first half of a run's entries, and the
    run.json its node leaves; (the opened cut, entries stored above it)."""
    entries = history(6, seed=5)
    k = len(entries) // 2
    store, opened, raw = stored_with_cut(path, entries, k)
    if signer is not T1:
        maker = new_ledger()
        assert deliver(maker, entries[:k]) == []
        raw = sign_cut(signer, make_cut(maker, time_ms=NOW, keep_versions=4, keep_steps=4))
    with store:
        store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        above = store.count()
    write_run_record(path, THE_RUN)
    return opened, above


def test_penalties_reads_a_data_dir_based_on_a_cut(tmp_path, capsys):
    opened, _above = data_dir_with_cut(tmp_path)
    assert cmd_penalties(SimpleNamespace(run=None, data_dir=str(tmp_path), json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cut"] == {"number": 1, "signer": T1.peer_id}
    with open_ledger_store(tmp_path, read_only=True) as store:
        at_cut = collect(store, NOW / 1000 + 60, THE_RUN)
    # the ban's penalty entry was pruned with the cut; the cut carries the ban still running
    assert at_cut["bans"][BANNED.peer_id]["reason"] == "cheat" and at_cut["penalties"] == []


def test_verify_checks_the_stored_cut_and_counts_only_the_entries_above_it(tmp_path, capsys):
    opened, above = data_dir_with_cut(tmp_path)
    assert cmd_verify(SimpleNamespace(run=None, data_dir=str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert f"based on cut 1 signed by {T1.peer_id}" in out
    assert f"{above} entries above it verified" in out and "FAIL" not in out
    pruned = sum(log.seq for log in opened.cut.logs)
    assert pruned > 0 and above + pruned == len(history(6, seed=5))  # the pruned ones are not claimed verified


def test_verify_fails_a_stored_cut_not_signed_by_a_trainer_of_the_run(tmp_path, capsys):
    data_dir_with_cut(tmp_path, signer=Identity.generate())
    assert cmd_verify(SimpleNamespace(run=None, data_dir=str(tmp_path))) == 1
    out = capsys.readouterr().out
    assert "FAIL cut 1" in out and "unauthorized" in out


def test_verify_fails_a_cut_whose_signer_it_cannot_check(tmp_path, capsys):
    data_dir_with_cut(tmp_path)
    (tmp_path / "run.json").unlink()  # no run file, no run.json: the trainers are unknown
    assert cmd_verify(SimpleNamespace(run=None, data_dir=str(tmp_path))) == 1
    assert "FAIL cut 1" in capsys.readouterr().out
