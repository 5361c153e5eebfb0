"""The validator service in-process: intake, verdict delivery, ledger entries, bans, back-pressure.

A "trainer" here is a plain node whose peer id is in run.trainers: it publishes the checkpoint
through the shard swarm, forwards batches over /swarm/verify/1.0.0 and collects verdicts on
/swarm/verdicts/1.0.0, acknowledging each (the trainer role's side of the contract).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import trio
from swarmtest import node_config, open_nodes
from waiting import wait_for

from node.config import RunConfig
from node.engines.torch_engine import TorchEngine
from node.identity import Identity, load_or_create_identity
from node.metrics import Metrics
from node.engines.model import create_tiny_model
from node.rl.config import RLConfig
from node.roles.sections import RunSections
from node.rl.spec import sampling_seed, step_key
from node.trainer.testing import FakeLedger, FakeShards
from node.rollouts.schema import (
    UNJUDGED_NO_CHECKPOINT,
    VERDICTS_PROTOCOL,
    VERIFY_PROTOCOL,
    RolloutAck,
    open_verdict,
)
from node.validator import testing as T
from node.app.commands.penalties import cmd_penalties
from node.validator.config import ValidatorSections
from node.validator.pipeline import BatchReason, BatchRules
from node.validator.service import ValidatorService, batch_rules
from node.validator.store import ValidatorStore
from node.validator.tasks import RunTasks
from node.wire import decode_as, read_frame, write_frame

RL = {"group_size": 4, "prompts_per_batch": 2, "max_new_tokens": 8}
FAST_SHARDS = {"announce_interval": 0.5, "request_timeout": 2.0, "progress": False}


async def send_batch(trainer_node, validator_id: str, envelope: bytes) -> RolloutAck:
    stream = await trainer_node.host.open_stream(validator_id, VERIFY_PROTOCOL)
    try:
        await write_frame(stream, envelope)
        return decode_as(RolloutAck, await read_frame(stream))
    finally:
        await stream.close()


async def test_verdicts_reach_the_trainer_and_the_ledger_and_cheats_get_banned(tmp_path: Path, capsys) -> None:
    tid, _ = load_or_create_identity(tmp_path / "t")
    vid, _ = load_or_create_identity(tmp_path / "v")
    run = RunConfig(name="test", trainers=[tid.peer_id], validators=[vid.peer_id],
                    tables={"rl": RL, "shards": FAST_SHARDS, "validator": {"ban_threshold": 2}})
    folder = create_tiny_model(tmp_path / "model")
    engine = TorchEngine("cpu")
    engine.load(folder)
    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    tasks = RunTasks(RLConfig(**RL))
    honest_w, cheat_w = Identity.generate(), Identity.generate()
    honest, cheats = [], []

    def make_batches(root: bytes) -> None:  # the draw is keyed by v0's manifest root: known once published
        honest.extend(T.make_batch(engine, honest_w, rules, tasks, step=s, policy_version=0, policy_root=root)
                      for s in range(2))
        for s in range(3):
            b = T.make_batch(engine, cheat_w, rules, tasks, step=s, policy_version=0, policy_root=root)
            inflated = [replace(x, reward=1.0, task_reward=1.0) for x in b.batch.samples]
            cheats.append(T.sign_batch(cheat_w, replace(b.batch, samples=T.regroup_advantages(inflated))))
        expected.update(b.batch_id for b in honest + cheats)

    received: dict[bytes, object] = {}
    raw_by_id: dict[bytes, list[bytes]] = {}
    got_all = trio.Event()
    expected: set[bytes] = set()

    async def handle_verdicts(stream):
        while (data := await read_frame(stream)) is not None:
            v = open_verdict(data, run.name, set(run.validators))
            received[v.batch_id] = v
            raw_by_id.setdefault(v.batch_id, []).append(data)
            await write_frame(stream, RolloutAck(batch_id=v.batch_id, accepted=True))
            if expected and expected <= set(received):
                got_all.set()

    with trio.fail_after(180):
        async with open_nodes([
            node_config(tmp_path, "t", role="relay", run=run),
            node_config(tmp_path, "v", role="validator", run=run),
        ]) as (trainer, validator):
            trainer.host.set_handler(VERDICTS_PROTOCOL, handle_verdicts)
            make_batches((await trainer.shards.publish(folder, 0)).root)
            # Until the validator holds v0 it says "cannot judge yet" at once, as a trainer then retries.
            first = await send_batch(trainer, validator.peer_id, honest[0].envelope)
            assert first.accepted or first.reason == UNJUDGED_NO_CHECKPOINT
            await wait_for(lambda: validator.shards.path_of(0) is not None, what="the validator fetching v0")
            for b in honest + cheats:
                ack = await send_batch(trainer, validator.peer_id, b.envelope)
                assert ack.accepted and ack.batch_id == b.batch_id
            await got_all.wait()

            for b in honest:
                assert received[b.batch_id].accepted, received[b.batch_id].reasons
            first, second, third = (received[b.batch_id] for b in cheats)
            assert set(first.reasons) == set(second.reasons) == {"reward_mismatch"}
            assert set(third.reasons) == {BatchReason.BANNED.value}  # banned after two offences
            assert all(v.validator == validator.peer_id for v in received.values())

            # A verdict is handed to the trainer before its ledger entry is appended: wait for the fifth.
            await wait_for(lambda: validator.ledger.totals().get(validator.peer_id, {}).get("verdicts") == 5,
                           what="five verdict entries in the validator's ledger")
            # Where its time went (node/steptime.py): the four batches judged with the model (the
            # banned worker's third is refused before), each verified and re-scored; v0's load was the
            # validator's first, its start-up, not a version's cost.
            phases = validator.validator.status()["phases_s"]
            assert {p: f["n"] for p, f in phases.items()} == {"verify": 4, "rescore": 4}
            assert phases["verify"]["mean_s"] > 0
            assert 'swarm_phase_seconds_count{phase="verify"} 4.0' in validator.metrics.render().decode()
            totals = validator.ledger.totals()
            assert totals[cheat_w.peer_id]["verdicts_failed"] == 3
            assert totals[cheat_w.peer_id]["penalties"] == 2 and totals[cheat_w.peer_id]["bans"] == 1
            assert totals.get(honest_w.peer_id, {}).get("penalties", 0) == 0
            status = validator.status["validator"]()
            assert cheat_w.peer_id in status["bans"] and status["bans"][cheat_w.peer_id]["reason"] == "reward_mismatch"
            assert status["verdicts"]["accepted"] == 2 and status["verdicts"]["rejected"] == 3
            # Only accepted batches' proofs measure honest error (the cheats failed before the model).
            assert status["proof_margins"]["rollouts"] == sum(len(b.batch.samples) for b in honest)
            # The ban travels in the ledger: the other node's replica holds it too (a trainer's intake
            # consults exactly this), and its status shows who banned whom and why.
            await wait_for(lambda: trainer.ledger.ban_of(cheat_w.peer_id) is not None, what="ban replicated")
            ban = trainer.ledger.status()["bans"][cheat_w.peer_id]
            assert ban["by"] == validator.peer_id and ban["reason"] == "reward_mismatch"
            assert trainer.ledger.ban_of(honest_w.peer_id) is None

            # The same batch sent again (the trainer lost our ack) gets the same signed verdict again.
            again = await send_batch(trainer, validator.peer_id, honest[0].envelope)
            assert again.accepted
            await wait_for(lambda: len(raw_by_id[honest[0].batch_id]) >= 2, what="the verdict sent again")
            assert raw_by_id[honest[0].batch_id][0] == raw_by_id[honest[0].batch_id][1]

    # `swarm-node penalties` reads the same facts (with reasons) back from the validator's ledger.
    args = SimpleNamespace(run=None, data_dir=str(tmp_path / "v"), json=True)
    assert cmd_penalties(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["reason"] for p in report["penalties"]] == ["reward_mismatch"] * 2
    assert report["bans"][cheat_w.peer_id]["reason"] == "reward_mismatch"
    assert report["failed_verdicts"][cheat_w.peer_id] == {"reward_mismatch": 2, "banned": 1}  # verdicts naming each reason


def _stub_node(tmp_path: Path, trainer: str, queue_size: int):
    ident = Identity.generate()
    run = RunConfig(name="test", trainers=[trainer], validators=[ident.peer_id],
                    tables={"rl": RL, "validator": {"queue_size": queue_size}})
    return SimpleNamespace(config=SimpleNamespace(run=run, role="validator"), identity=ident, peer_id=ident.peer_id,
                           metrics=Metrics(), status={}, data_dir=tmp_path)


class _NoTasks:
    def draw(self, key, index):
        raise AssertionError("intake must not draw tasks")

    def score(self, task, text, n):
        raise AssertionError("intake must not score")


def test_full_queue_answers_busy_and_status_says_behind(tmp_path: Path) -> None:
    trainer = Identity.generate().peer_id
    node = _stub_node(tmp_path, trainer, queue_size=2)
    sections = RunSections.of(node.config.run).pick(ValidatorSections)
    rules = BatchRules(run="test", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8,
                       group_size=1, prompts_per_batch=1, async_level=2)
    svc = ValidatorService(node, sections, rules, _NoTasks(), ValidatorStore(tmp_path / "v.sqlite"),
                           shards=FakeShards(held=held_nowhere(0)), ledger=FakeLedger())
    worker = Identity.generate()
    batches = [T.sign_batch(worker, _tiny_batch(worker.peer_id, step)) for step in range(3)]
    answers = [svc.submit(trainer, b.envelope, 0.0) for b in batches]
    assert [a[1:] for a in answers] == [(True, ""), (True, ""), (False, "busy")]
    assert svc.submit(trainer, batches[0].envelope, 0.0)[1:] == (True, "")  # already queued: not twice
    assert svc.status()["behind"] and svc.status()["queue"] == 2
    assert svc.submit(trainer, b"\x00garbage", 0.0)[1:] == (False, BatchReason.MALFORMED.value)
    forged = T.sign_batch(Identity.generate(), _tiny_batch(worker.peer_id, 9))
    assert svc.submit(trainer, forged.envelope, 0.0)[1:] == (False, BatchReason.FORGED.value)


def _tiny_batch(worker: str, step: int):
    from node.rollouts.schema import RolloutBatch, RolloutSample

    s = RolloutSample(prompt_index=0, sample_index=0, task_id="t", prompt_ids=[5], completion_ids=[1], logprobs=[-0.1],
                      finish_reason="stop", reward=0.0, task_reward=0.0, advantage=0.0, proof=b"")
    return RolloutBatch(run="test", worker=worker, step=step, policy_version=0, taskset="synthetic", seed=0,
                        temperature=1.0, top_p=1.0, max_new_tokens=8, group_size=1, created_ms=0, samples=[s])


def held_nowhere(*versions: int) -> dict[int, Path]:
    """Versions the fake shards hold, at folders no check gets to load here."""
    return {v: Path(f"/nonexistent/v{v}") for v in versions}


def _stub_service(tmp_path: Path, trainer: str, store: ValidatorStore, shards=None) -> ValidatorService:
    node = _stub_node(tmp_path, trainer, queue_size=4)
    sections = RunSections.of(node.config.run).pick(ValidatorSections)
    rules = BatchRules(run="test", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8,
                       group_size=1, prompts_per_batch=1, async_level=2)
    return ValidatorService(node, sections, rules, _NoTasks(), store, shards=shards or FakeShards(),
                            ledger=FakeLedger(), wall_clock=lambda: 1000.0)


def test_bans_and_undelivered_verdicts_survive_a_restart(tmp_path: Path) -> None:
    trainer = Identity.generate().peer_id
    store = ValidatorStore(tmp_path / "v.sqlite")
    store.save_ban("cheat", 1500.0, "wrong_task")
    store.save_ban("old", 900.0, "wrong_task")  # expired before "now" (1000)
    store.record(b"\x01" * 32, "w", 0, [0], True, ["ok"], trainer, b"verdict-1", 1)
    store.record(b"\x02" * 32, "w", 1, [0], True, ["ok"], trainer, b"verdict-2", 2)
    store.mark_delivered(b"\x01" * 32)
    svc = _stub_service(tmp_path, trainer, store)
    assert svc.book.is_banned("cheat", 1000.0) and not svc.book.is_banned("old", 1000.0)
    assert dict(svc.pending[trainer]) == {b"\x02" * 32: b"verdict-2"}
    assert svc.status()["undelivered"] == 1 and "cheat" in svc.status()["bans"]


async def test_a_batch_for_an_unknown_checkpoint_is_left_to_another_validator(tmp_path: Path, autojump_clock) -> None:
    """No verdict (the worker may be honest and we just lack the version): the trainer re-assigns."""
    trainer = Identity.generate().peer_id
    shards = FakeShards()
    svc = _stub_service(tmp_path, trainer, ValidatorStore(tmp_path / "v.sqlite"), shards=shards)
    worker = Identity.generate()
    job = SimpleNamespace(trainer=trainer, signed=T.sign_batch(worker, _tiny_batch(worker.peer_id, 0)), received_at=0.0)
    start = trio.current_time()
    assert await svc.judge(job) == UNJUDGED_NO_CHECKPOINT
    assert 5.0 <= trio.current_time() - start < 6.0  # waited FUTURE_GRACE for an announcement, no longer


def test_a_batch_whose_checkpoint_is_not_held_is_refused_at_once_and_its_fetch_started(tmp_path: Path) -> None:
    """Issue 15: "cannot judge yet" at intake, not a place in the queue while a download runs (which
    held the trainer's slot on us until its verify timeout). No quota is taken, nothing is recorded."""
    trainer = Identity.generate().peer_id
    shards = FakeShards(held=held_nowhere(0), announced={1: (b"r" * 32, "trainer-peer")})
    ledger = FakeLedger()
    svc = _stub_service(tmp_path, trainer, ValidatorStore(tmp_path / "v.sqlite"), shards=shards)
    svc.ledger = ledger
    worker = Identity.generate()
    v1 = T.sign_batch(worker, replace(_tiny_batch(worker.peer_id, 0), policy_version=1))
    assert svc.submit(trainer, v1.envelope, 0.0)[1:] == (False, UNJUDGED_NO_CHECKPOINT)
    assert shards.fetches == [1] and svc.status()["queue"] == 0 and ledger.entries == []
    v0 = T.sign_batch(worker, _tiny_batch(worker.peer_id, 1))
    assert svc.submit(trainer, v0.envelope, 0.0)[1:] == (True, "")  # a held version is queued as before
    shards.hold(1, held_nowhere(1)[1])  # the download finished: the same batch is taken when the trainer asks again
    assert svc.submit(trainer, v1.envelope, 3.0)[1:] == (True, "")


async def test_a_batch_that_cannot_be_judged_gets_a_signed_unjudged_verdict_at_once(tmp_path: Path, autojump_clock) -> None:
    """Not silence until the trainer's verify timeout: a signed "cannot judge yet" the trainer can
    act on, neither stored as a verdict nor in the ledger (no blame on the worker)."""
    trainer = Identity.generate().peer_id
    store = ValidatorStore(tmp_path / "v.sqlite")
    svc = _stub_service(tmp_path, trainer, store, shards=FakeShards())
    worker = Identity.generate()
    signed = T.sign_batch(worker, _tiny_batch(worker.peer_id, 0))
    await svc.check_one(SimpleNamespace(trainer=trainer, signed=signed, received_at=0.0))
    [raw] = svc.pending[trainer].values()
    verdict = open_verdict(raw, "test", {svc.node.peer_id})
    assert verdict.unjudged == UNJUDGED_NO_CHECKPOINT and not verdict.accepted and verdict.reasons == []
    assert verdict.batch_id == signed.batch_id and verdict.worker == worker.peer_id
    assert store.verdict_of(signed.batch_id) is None and svc.ledger.entries == []


async def test_a_batch_claiming_a_future_version_is_rejected_after_the_grace(tmp_path: Path, autojump_clock) -> None:
    trainer = Identity.generate().peer_id
    shards = FakeShards(announced={3: (b"r", "p")})
    svc = _stub_service(tmp_path, trainer, ValidatorStore(tmp_path / "v.sqlite"), shards=shards)
    worker = Identity.generate()
    batch = replace(_tiny_batch(worker.peer_id, 0), policy_version=9,
                    seed=sampling_seed(step_key("test", worker.peer_id, bytes(32), 0)))
    job = SimpleNamespace(trainer=trainer, signed=T.sign_batch(worker, batch), received_at=0.0)
    start = trio.current_time()
    j = await svc.judge(job)
    assert set(j.reasons) == {"future_policy"}
    assert 5.0 <= trio.current_time() - start < 6.0


def test_a_validator_refuses_as_stale_only_what_the_trainer_could_no_longer_train() -> None:
    """Issue 15: the trainer judged staleness at intake and keeps a batch trainable for
    verify_grace_steps more steps; a validator that judged it again by version alone threw that away."""
    from node.proofs.checks import check_policy_version

    run = RunConfig(name="test", tables={"rl": RL, "grpo": {"async_level": 2, "verify_grace_steps": 3}})
    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    assert rules.async_level == 5
    assert check_policy_version(5, current_step=10, async_level=rules.async_level).ok  # 5 behind: still usable
    assert not check_policy_version(4, current_step=10, async_level=rules.async_level).ok


def test_an_unjudged_verdict_that_also_judges_is_refused() -> None:
    """"Cannot judge yet" carries no judgement: one that also accepts (or gives reasons) is garbage
    from the validator, not a pass the trainer could be tricked into training on."""
    import pytest
    from node.rollouts.schema import DOMAIN_VERDICT, Verdict
    from node.wire import RemoteProtocolError, encode, seal

    v = Identity.generate()
    for fields in ({"accepted": True, "reasons": []}, {"accepted": False, "reasons": ["ok"]}):
        bad = Verdict(run="test", batch_id=b"\x01" * 32, worker="w", validator=v.peer_id, policy_version=0,
                      created_ms=0, unjudged=UNJUDGED_NO_CHECKPOINT, **fields)
        with pytest.raises(RemoteProtocolError, match="contradictory-verdict"):
            open_verdict(encode(seal(v, DOMAIN_VERDICT, bad)), "test", {v.peer_id})


def test_the_scoring_budget_comes_from_the_run_file(tmp_path) -> None:
    """Issue 42, hole 2: verifier time per batch is bounded; an operator whose code tasks run longer
    sets the bound in [validator], and the pipeline's rules carry it."""
    from node.config import load_config

    path = tmp_path / "run.toml"
    path.write_text('[run]\nname = "test"\n[validator]\nscore_budget_s = 7.5\n')
    cfg = load_config(path, {}, {"data_dir": str(tmp_path)})
    assert batch_rules(cfg.run.name, RunSections.of(cfg.run).pick(ValidatorSections)).score_budget_s == 7.5
    assert batch_rules(cfg.run.name, ValidatorSections()).score_budget_s == BatchRules.score_budget_s
