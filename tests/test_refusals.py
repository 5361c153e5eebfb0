"""The refusal reasons and what follows from each (node/refusals.py): whose fault, "not now", the
step window, the ledger. The expected sets below are the classification as it stood before the
table (each module kept its own set); the table must give the same answer for every reason."""

from __future__ import annotations

from node.net.reqres import NOT_FAULTS
from node.rollouts.steps import KEEPS_WINDOW
from node.inference.outbox import TRANSIENT_REASONS, UNCOUNTED_REASONS
from node.trainer.intake import NOT_ATTRIBUTABLE, NOT_STRIKES
from node.validator import service as validator_service
from node.wire import TRANSPORT_FAILURES

QUOTA = {"quota", "quota-new"}
# Not struck by the trainer's intake: lag, replays, our load, the step window, a broken stream, the quota.
WAS_NOT_STRIKES = {"stale", "future", "duplicate", "busy", "banned", "step-ahead", "step-behind",
                   "stream-error", "truncated"} | QUOTA
# Not reported to the peer table by a request/response handler.
WAS_NOT_FAULTS = {"stream-error", "truncated", "peer-streams", "busy", "peer-bytes", "busy-bytes", "timeout",
                  "banned", "stalled"}
# "not-ready" (a trainer still loading, node/trainer/readiness.py) judged nothing: no step, no entry.
WAS_NOT_ATTRIBUTABLE = {"duplicate", "busy", "not-ready"} | QUOTA
WAS_KEEPS_WINDOW = {"duplicate", "duplicate-step", "step-ahead", "step-behind", "busy", "banned", "not-ready"} | QUOTA
WAS_TRANSIENT = {"busy", "overloaded", "not-ready", "shutting-down"} | QUOTA
WAS_TRANSPORT = {"stream-error", "truncated"}
WAS_VALIDATOR_KEEPS_WINDOW = {"step_ahead", "step_behind", "banned"}
WAS_VALIDATOR_WINDOW = {"step-ahead": "step_ahead", "step-behind": "step_behind", "duplicate-step": "replayed"}


def test_the_trainer_strikes_what_it_struck():
    assert NOT_STRIKES >= WAS_NOT_STRIKES


def test_a_handler_reports_what_it_reported():
    assert NOT_FAULTS >= WAS_NOT_FAULTS - {"stalled"}


def test_the_ledger_records_what_it_recorded():
    assert NOT_ATTRIBUTABLE == WAS_NOT_ATTRIBUTABLE


def test_the_step_window_keeps_what_it_kept():
    assert KEEPS_WINDOW == WAS_KEEPS_WINDOW == UNCOUNTED_REASONS
    assert validator_service.KEEPS_WINDOW == WAS_VALIDATOR_KEEPS_WINDOW


def test_not_now_is_what_it_was():
    assert TRANSIENT_REASONS == WAS_TRANSIENT


def test_a_broken_stream_is_what_it_was():
    assert TRANSPORT_FAILURES == WAS_TRANSPORT


# --- the table (node/refusals.py) gives each of those answers from one member's property

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from node.refusals import Refusal  # noqa: E402
from node.validator.pipeline import BatchReason  # noqa: E402

NODE = Path(__file__).resolve().parents[1] / "node"
# The modules that emit or classify refusal reasons.
EMITTERS = ["wire.py", "net/budget.py", "net/reqres.py", "rollouts/schema.py", "rollouts/quota.py",
            "rollouts/steps.py", "trainer/intake.py", "trainer/service.py", "validator/service.py"]
# A refusing call, and the position of its reason argument.
REFUSING_CALLS = {"RemoteProtocolError": 0, "Refused": 0, "QuotaRefusal": 0, "count": 0, "garbage": 0, "_refuse": 1,
                  "fault": 1}
REASON_FUNCTIONS = ("reason",)  # a function named *reason* returns a reason code (or None)
BUDGET_CONSTANTS = {"PEER_STREAMS", "BUSY", "PEER_BYTES", "BYTES", "OVERSIZED", "STALLED"}


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value else None


def emitted_reasons(source: str) -> set[str]:
    """The reason codes a module's source emits as string literals: the reason argument of a
    refusing call, a ``reason=`` keyword, a ``*reason*`` function's return value, the stream budget's constants."""
    out: set[str] = set()
    tree = ast.parse(source)
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name in REFUSING_CALLS and len(n.args) > REFUSING_CALLS[name]:
                out.update(r for r in [_literal(n.args[REFUSING_CALLS[name]])] if r)
            out.update(r for k in n.keywords if k.arg == "reason" and (r := _literal(k.value)))
        elif isinstance(n, ast.FunctionDef) and any(w in n.name for w in REASON_FUNCTIONS):
            out.update(r for s in ast.walk(n) if isinstance(s, ast.Return) and s.value and (r := _literal(s.value)))
        elif isinstance(n, ast.Assign) and any(getattr(t, "id", "") in BUDGET_CONSTANTS for t in n.targets):
            out.update(r for r in [_literal(n.value)] if r)
    return out


def test_the_scan_finds_a_planted_reason():
    planted = 'def f():\n    raise RemoteProtocolError("made-up", "x")\ndef step_reason():\n    return "other"\n'
    assert emitted_reasons(planted) == {"made-up", "other"}


@pytest.mark.parametrize("module", EMITTERS)
def test_the_table_holds_every_reason_the_module_emits(module):
    reasons = emitted_reasons((NODE / module).read_text())
    assert reasons, f"{module}: the scan found no reason at all"
    missing = reasons - {r.value for r in Refusal}
    assert not missing, f"{module} emits reasons node/refusals.py does not hold: {sorted(missing)}"


ALL = {r.value for r in Refusal}


# Reasons no set named that never reach a strike: a stream refused because we stop (counted only),
# a validator's answer that it could not judge yet.
NEVER_STRUCK = {"stopping", "no-checkpoint"}


def test_fault_is_what_was_struck_and_reported():
    # Every reason either set saw is classified as it was; "stalled" is a fault, struck by the
    # stream budget itself (it never reaches a protocol handler's fault report).
    was_not = WAS_NOT_STRIKES | WAS_NOT_FAULTS - {"stalled"}
    assert Refusal.STALLED.fault
    transient = {r.value for r in Refusal if r.transient}
    assert {r.value for r in Refusal if r.fault} == ALL - was_not - transient - NEVER_STRUCK


def test_transient_is_not_now():
    assert {r.value for r in Refusal if r.transient} == WAS_TRANSIENT
    assert not any(r.fault for r in Refusal if r.transient)


def test_keeps_window_is_what_the_window_kept():
    assert {r.value for r in Refusal if r.keeps_window} == WAS_KEEPS_WINDOW


def test_recorded_is_what_the_ledger_recorded():
    assert {r.value for r in Refusal if not r.recorded} == WAS_NOT_ATTRIBUTABLE


def test_transport_is_a_broken_stream():
    assert {r.value for r in Refusal if r.transport} == WAS_TRANSPORT


def test_the_validator_spells_window_refusals_as_it_did():
    assert {r.value: r.verdict for r in Refusal if r.verdict and r.value != "banned"} == WAS_VALIDATOR_WINDOW
    for r in Refusal:
        if r.verdict:
            assert BatchReason(r.verdict)


def test_wire_spellings_are_unique_and_compare_as_strings():
    assert len(ALL) == len(list(Refusal))
    assert Refusal.STEP_AHEAD == "step-ahead" and f"{Refusal.QUOTA_NEW}" == "quota-new"
