"""Red team: a hostile worker grinding step numbers, reusing draws across versions, or drawing across runs.

Each test is an attack tried with the public behaviour of the code (issue 13). The attacker's
batches are otherwise honest, so only the rule under test can stop them: the step window
(node/rollouts/steps.py) enforced by the trainer's intake and the validator, and the task draw keyed
by (run, worker, policy root, step) (node/rl/spec.py ``step_key``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from node.config import RunConfig
from node.identity import Identity
from node.metrics import Metrics
from node.engines.model import build_tokenizer
from node.rl import spec
from node.rl.config import GRPOConfig, RLConfig
from node.rl.tasks import load_taskset
from node.rollouts.config import WorkerConfig
from node.rollouts.schema import UNJUDGED_NO_CHECKPOINT
from node.rollouts.steps import VALIDATOR_WINDOW, StepWindow, step_window_size
from node.trainer.config import TrainerConfig, TrainerSections
from node.trainer.service import Trainer
from node.trainer.spool import open_spool
from node.trainer.testing import FakeLedger, FakeShards, fake_context, fake_wiring, reversal_batch, sign_batch
from node.validator import testing as VT
from node.validator.config import ValidatorSections
from node.validator.pipeline import BatchReason, BatchRules
from node.validator.service import ValidatorService
from node.validator.store import ValidatorStore

RUN = "test"
WORKER = Identity.from_seed(b"g" * 32)
TOK = build_tokenizer()
ROOT = b"\x11" * 32  # the manifest root the trainer announced for the version the batches claim
WINDOW = step_window_size(WorkerConfig().max_pending_batches)
FAR = 10_000  # a step a grinder picked after scanning thousands of free draws


# -- the draw -------------------------------------------------------------------------------------


def test_the_draw_depends_on_the_run_name():
    """Attack: the same worker key in two runs (or a run file copied under a new name) got the same
    tasks, so work solved for one run could be replayed into the other. The run is a draw input."""
    ts, rl = load_taskset("synthetic"), RLConfig(prompts_per_batch=8)
    a = spec.draw_step(ts, rl, "run-a", "peer", ROOT, 3)
    b = spec.draw_step(ts, rl, "run-b", "peer", ROOT, 3)
    assert [t.id for t in a.tasks] != [t.id for t in b.tasks]
    assert a.seed != b.seed


def test_the_draw_depends_on_the_policy_root():
    """Attack: draws computable before a version exists let a worker scan and pre-solve them offline.
    Keyed by the root of the manifest the batch claims, a draw exists only once that version does,
    and one step's draw is a different one under every version."""
    ts, rl = load_taskset("synthetic"), RLConfig(prompts_per_batch=8)
    a = spec.draw_step(ts, rl, RUN, "peer", ROOT, 3)
    b = spec.draw_step(ts, rl, RUN, "peer", b"\x22" * 32, 3)
    assert [t.id for t in a.tasks] != [t.id for t in b.tasks]
    assert a.seed != b.seed
    assert spec.draw_step(ts, rl, RUN, "peer", ROOT, 3) == a  # still deterministic


# -- the step window (pure) -----------------------------------------------------------------------


def test_step_window_bounds_how_far_ahead_a_worker_may_jump():
    w = StepWindow.EMPTY
    assert w.reason(FAR, WINDOW) is None  # first sight: a fresh identity is free anyway (see steps.py)
    w = w.after(FAR, WINDOW)
    assert w.reason(FAR, WINDOW) == "duplicate-step"
    assert w.reason(FAR + WINDOW, WINDOW) is None
    assert w.reason(FAR + WINDOW + 1, WINDOW) == "step-ahead"
    assert w.reason(FAR + 2 * FAR, WINDOW) == "step-ahead"
    assert w.reason(FAR - 1, WINDOW) is None  # late delivery of an older batch: allowed once
    assert w.reason(FAR - WINDOW, WINDOW) == "step-behind"  # below the window: its draw may be reused
    w2 = w.after(FAR - 1, WINDOW)
    assert w2.reason(FAR - 1, WINDOW) == "duplicate-step" and w2.high == FAR
    w3 = w2.after(FAR + 5, WINDOW)
    assert w3.reason(FAR, WINDOW) == "duplicate-step" and w3.reason(FAR - 1, WINDOW) == "duplicate-step"
    assert w3.reason(FAR + 1, WINDOW) is None


def test_honest_step_sequences_never_trip_the_window():
    """What an honest worker does: consecutive steps, gaps from a restart (the outbox is lost) and
    from stale batches dropped, and out-of-order delivery of retried batches within its outbox."""
    pending = WorkerConfig().max_pending_batches
    seq = list(range(0, 10))
    seq += list(range(10 + pending + 1, 30))  # restart: the outbox and the step in generation were lost
    seq += list(range(30 + pending + 1, 50))  # then a burst of stale drops
    late = [53, 51, 52, 50, 55, 54, 56, 57]  # retries arriving out of order
    w = StepWindow.EMPTY
    for s in seq + late:
        assert w.reason(s, step_window_size(pending)) is None, s
        w = w.after(s, step_window_size(pending))


# -- the trainer ----------------------------------------------------------------------------------


def _fake_node():
    return fake_context(RunConfig(name=RUN))


_SECTIONS = TrainerSections(grpo=GRPOConfig(async_level=2, pack_length=64),
                            trainer=TrainerConfig(max_pending_batches=64))


@pytest.fixture
def trainer(tmp_path):
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    wiring = fake_wiring()
    wiring["shards"].announced = {v: (ROOT, "t") for v in range(6)}
    with open_spool(tmp_path / "spool.sqlite") as spool:
        yield Trainer(_fake_node(), policy, spool, _SECTIONS, clock=lambda: 0.0, **wiring)


def _batch(step, root=ROOT, seed=0):
    return reversal_batch(WORKER, RUN, step=step, policy_version=5, tokenizer=TOK, seed=seed, policy_root=root)


async def test_trainer_refuses_a_step_ground_far_ahead(trainer):
    assert (await trainer.judge(sign_batch(WORKER, _batch(0)), WORKER.peer_id)).accepted
    ack = await trainer.judge(sign_batch(WORKER, _batch(FAR)), WORKER.peer_id)
    assert not ack.accepted and ack.reason == "step-ahead"
    assert (await trainer.judge(sign_batch(WORKER, _batch(WINDOW)), WORKER.peer_id)).accepted


async def test_trainer_step_window_survives_a_restart(tmp_path):
    """The window is durable: a restarted trainer does not give a grinder a fresh first sight."""
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    for attempt, (step, ok) in enumerate([(3, True), (FAR, False)]):
        with open_spool(tmp_path / "spool.sqlite") as spool:
            t = Trainer(_fake_node(), policy, spool, _SECTIONS, clock=lambda: 0.0, **fake_wiring())
            assert (await t.judge(sign_batch(WORKER, _batch(step)), WORKER.peer_id)).accepted is ok, attempt


async def test_trainer_refuses_a_batch_claiming_another_versions_root(trainer):
    """Reusing draws across versions: a batch made on v5 that claims the draw of another root."""
    ack = await trainer.judge(sign_batch(WORKER, _batch(0, root=b"\x22" * 32)), WORKER.peer_id)
    assert not ack.accepted and ack.reason == "wrong-root"


# -- the validator --------------------------------------------------------------------------------


class _NoTasks:
    def draw(self, key, index):
        raise AssertionError("the step window is checked before any draw")

    def score(self, task, text, n):
        raise AssertionError("the step window is checked before any score")


def _validator(tmp_path: Path, store: ValidatorStore) -> ValidatorService:
    ident = Identity.generate()
    trainer = Identity.generate().peer_id
    run = RunConfig(name=RUN, trainers=[trainer], validators=[ident.peer_id],
                    tables={"rl": {"group_size": 1, "prompts_per_batch": 1, "max_new_tokens": 8}})
    node = SimpleNamespace(config=SimpleNamespace(run=run, role="validator"), identity=ident, peer_id=ident.peer_id,
                           metrics=Metrics(), status={}, data_dir=tmp_path)
    rules = BatchRules(run=RUN, taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8,
                       group_size=1, prompts_per_batch=1, async_level=2)
    return ValidatorService(node, ValidatorSections(), rules, _NoTasks(), store,
                            shards=FakeShards(announced={0: (ROOT, "t")}), ledger=FakeLedger(), wall_clock=lambda: 1000.0)


def _tiny(step, root=ROOT):
    from node.rollouts.schema import RolloutBatch, RolloutSample

    s = RolloutSample(prompt_index=0, sample_index=0, task_id="t", prompt_ids=[5], completion_ids=[1], logprobs=[-0.1],
                      finish_reason="stop", reward=0.0, task_reward=0.0, advantage=0.0, proof=b"")
    return RolloutBatch(run=RUN, worker=WORKER.peer_id, step=step, policy_version=0, policy_root=root,
                        taskset="synthetic", seed=spec.sampling_seed(spec.step_key(RUN, WORKER.peer_id, root, step)),
                        temperature=1.0, top_p=1.0, max_new_tokens=8, group_size=1, created_ms=0, samples=[s])


async def test_validator_leaves_step_ahead_to_the_trainer_and_follows_the_worker(tmp_path: Path, autojump_clock) -> None:
    """Issue 39: the trainer expires batches before any validator sees them, so the worker's steps
    climb past the last one the validator judged; a validator that refused ``step-ahead`` then
    refused every later batch of that honest worker for good, across restarts (the window is on
    disk). The grinder is stopped by the trainer, which sees every batch (the trainer tests above);
    here a validator restarted on that store goes past the window check to the checkpoint."""
    store = ValidatorStore(tmp_path / "v.sqlite")
    store.record(b"\x01" * 32, WORKER.peer_id, 0, [0], True, ["ok"], "t", b"verdict", 1, window=WINDOW)
    store.close()
    svc = _validator(tmp_path, ValidatorStore(tmp_path / "v.sqlite"))
    job = SimpleNamespace(trainer="t", signed=VT.sign_batch(WORKER, _tiny(FAR)), received_at=0.0)
    assert await svc.judge(job) == UNJUDGED_NO_CHECKPOINT  # past every window rule: no model here


async def test_validator_refuses_a_step_used_twice_even_far_apart(tmp_path: Path, autojump_clock) -> None:
    """What the validator still bounds: one step, one draw, whichever trainer forwards it (a second
    batch for a step is a replay of its draw), and nothing from far below its window."""
    store = ValidatorStore(tmp_path / "v.sqlite")
    store.record(b"\x01" * 32, WORKER.peer_id, FAR, [0], True, ["ok"], "t", b"verdict", 1, window=VALIDATOR_WINDOW)
    svc = _validator(tmp_path, store)
    for step, reason in ((FAR, BatchReason.REPLAYED), (FAR - VALIDATOR_WINDOW, BatchReason.STEP_BEHIND)):
        job = SimpleNamespace(trainer="t", signed=VT.sign_batch(WORKER, _tiny(step)), received_at=0.0)
        assert set((await svc.judge(job)).reasons) == {reason.value}, step
    # Deadline order is not step order: a batch a whole trainer queue older is judged, not refused.
    job = SimpleNamespace(trainer="t", signed=VT.sign_batch(WORKER, _tiny(FAR - 1024)), received_at=0.0)
    assert await svc.judge(job) == UNJUDGED_NO_CHECKPOINT


async def test_validator_says_cannot_judge_at_once_when_the_checkpoint_is_gone(tmp_path: Path, autojump_clock) -> None:
    """Issue 39: a batch queued while its checkpoint was held, checked after it was pruned, held the
    validator's only check slot for ``checkpoint_timeout`` (120 s) per batch. Now: "cannot judge"
    at once (no blame), a fetch started, and the trainer offers the batch again later."""
    svc = _validator(tmp_path, ValidatorStore(tmp_path / "v.sqlite"))
    job = SimpleNamespace(trainer="t", signed=VT.sign_batch(WORKER, _tiny(0)), received_at=0.0)
    t0 = trio.current_time()
    assert await svc.judge(job) == UNJUDGED_NO_CHECKPOINT
    assert trio.current_time() == t0
    assert svc.shards.fetches == [0]


async def test_validator_rejects_a_batch_claiming_another_versions_root(tmp_path: Path, autojump_clock) -> None:
    svc = _validator(tmp_path, ValidatorStore(tmp_path / "v.sqlite"))
    job = SimpleNamespace(trainer="t", signed=VT.sign_batch(WORKER, _tiny(0, root=b"\x22" * 32)), received_at=0.0)
    j = await svc.judge(job)
    assert set(j.reasons) == {BatchReason.WRONG_ROOT.value}


def test_validator_store_window_is_durable(tmp_path: Path) -> None:
    store = ValidatorStore(tmp_path / "v.sqlite")
    store.record(b"\x01" * 32, WORKER.peer_id, 7, [0], True, ["ok"], "t", b"verdict", 1, window=WINDOW)
    store.close()
    again = ValidatorStore(tmp_path / "v.sqlite")
    w = again.step_window(WORKER.peer_id)
    assert w.high == 7 and w.reason(7, WINDOW) == "duplicate-step" and w.reason(FAR, WINDOW) == "step-ahead"
    assert dataclasses.replace(w) == w
