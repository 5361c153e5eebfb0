"""The trainer's data at rest (issue 14): no NaN checkpoint is written or published, and an
acknowledged batch survives a damaged spool or the node refuses to start with one clear line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import trio
from safetensors.numpy import save_file

from node.atomic import DataDirError
from node.identity import load_or_create_identity
from node.rl.config import GRPOConfig
from node.rollouts.schema import open_batch
from node.trainer import checkpoints
from node.trainer.checkpoints import NonFiniteCheckpoint, check_finite_folder
from node.trainer.config import TrainerConfig, TrainerSections
from node.trainer.policy import Policy
from node.trainer.service import Trainer
from node.trainer.spool import BatchState, open_spool
from node.trainer.testing import fake_wiring, sign_batch
from test_trainer_intake import RUN, TOK, WORKER, batch, fake_node

CFG = GRPOConfig(optimizer_steps=1, pack_length=64, kl_coef=0.0)
TCFG = TrainerConfig(keep_checkpoints=2, init_warmup_steps=0)  # random init: fast


def model_folder(folder: Path, nan: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    w = np.ones((8, 8), np.float32)
    if nan:
        w[3, 3] = np.nan
    save_file({"w": w}, str(folder / "model.safetensors"))
    return folder


def test_a_model_with_nan_is_never_written(tmp_path):
    policy, _ = Policy.open(tmp_path, "", CFG, TCFG)
    with torch.no_grad():
        next(policy.model.parameters())[0] = float("nan")  # what a step that slipped through would leave
    policy.step += 1
    with pytest.raises(NonFiniteCheckpoint, match="v1: not written"):
        policy.save()
    assert not policy.folder(1).exists() and not policy.folder(1).with_name("v1.tmp").exists()
    assert checkpoints.load_state(tmp_path)["step"] == 0  # the saved state is still the last good one


async def test_the_trainer_does_not_publish_a_folder_with_nan(tmp_path):
    """Also a folder saved before the check existed (the issue's restart published one)."""
    folders = {1: model_folder(tmp_path / "v1", nan=True), 2: model_folder(tmp_path / "v2", nan=False)}
    policy = SimpleNamespace(step=2, vocab_size=len(TOK), device="cpu", folder=folders.__getitem__)
    with open_spool(tmp_path / "spool.sqlite") as spool:
        wiring = fake_wiring()
        t = Trainer(fake_node(), policy, spool, TrainerSections(grpo=CFG), clock=lambda: 0.0, **wiring)
        with pytest.raises(NonFiniteCheckpoint):
            check_finite_folder(folders[1])
        await t.publish(1)
        assert wiring["shards"].held == [] and t.published is None
        assert "NaN or infinity" in t.figures.publish_error and "model.safetensors: w" in t.figures.publish_error
        await t.publish(2)
        assert wiring["shards"].held == [2] and t.published == 2 and t.figures.publish_error == ""


# ---------------------------------------------------------------------------------------------
# (c) An acknowledged batch survives a damaged spool, or the node refuses to start.


def spool_with_acked_batch(path: Path) -> bytes:
    """A spool that acknowledged one batch (through the trainer's intake), closed cleanly."""
    with open_spool(path) as spool:
        t = Trainer(fake_node(), SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu"), spool,
                    TrainerSections(grpo=GRPOConfig(pack_length=64)), clock=lambda: 0.0, **fake_wiring())
        ack = trio.run(t.judge, sign_batch(WORKER, batch()), WORKER.peer_id)
        assert ack.accepted
        return ack.batch_id


def outcome(path: Path, batch_id: bytes) -> str:
    """"kept": the batch is there as acknowledged; "refused": DataDirError. Anything else fails."""
    try:
        with open_spool(path) as spool:
            row = spool.get(batch_id)
            assert row is not None and row.state is BatchState.READY, row
            assert open_batch(spool.envelope(batch_id), RUN).batch_id == batch_id
            return "kept"
    except DataDirError as e:
        assert "spool" in str(e) and "damaged" in str(e)
        return "refused"


PAGE = 4096


def test_acknowledged_batch_survives_flipped_bytes_or_the_spool_is_refused(tmp_path):
    good = tmp_path / "good.sqlite"
    batch_id = spool_with_acked_batch(good)
    raw = good.read_bytes()
    assert len(raw) % PAGE == 0 and not (tmp_path / "good.sqlite-wal").exists()  # checkpointed at close
    seen = {"kept": 0, "refused": 0}
    for page in range(len(raw) // PAGE):
        for at in (PAGE // 2, PAGE - 16):  # the middle of the page and its end, where cells are written
            damaged = bytearray(raw)
            for i in range(page * PAGE + at, page * PAGE + at + 4):
                damaged[i] ^= 0xFF
            path = tmp_path / f"p{page}-{at}.sqlite"
            path.write_bytes(bytes(damaged))
            seen[outcome(path, batch_id)] += 1
    # Both happen: flips in unused space change nothing, flips in the batch's row are caught.
    assert seen["kept"] >= 1 and seen["refused"] >= 1, seen


def test_acknowledged_batch_survives_truncation_or_the_spool_is_refused(tmp_path):
    good = tmp_path / "good.sqlite"
    batch_id = spool_with_acked_batch(good)
    raw = good.read_bytes()
    seen = {}
    for keep in (0, 100, PAGE, len(raw) // 2, len(raw) - PAGE, len(raw) - 1):
        path = tmp_path / f"t{keep}.sqlite"
        path.write_bytes(raw[:keep])
        seen[keep] = outcome(path, batch_id)
    # SQLite would open an empty file as a new, empty spool: refused instead.
    assert seen[0] == seen[100] == seen[PAGE] == seen[len(raw) // 2] == "refused", seen


def test_a_spool_whose_row_was_changed_is_refused(tmp_path):
    """A change SQLite cannot see (a valid page, a different value) is caught against the envelope."""
    import sqlite3

    good = tmp_path / "good.sqlite"
    batch_id = spool_with_acked_batch(good)
    for column, value in (("step", 99), ("samples", 1), ("worker", "someone"), ("batch_id", b"\x00" * 32)):
        path = tmp_path / f"{column}.sqlite"
        shutil.copyfile(good, path)
        db = sqlite3.connect(path)
        with db:
            db.execute(f"UPDATE batches SET {column} = ?", (value,))
        db.close()
        with pytest.raises(DataDirError, match="does not match its envelope|does not hash to its id"):
            with open_spool(path):
                pass


@pytest.mark.slow
def test_the_trainer_refuses_a_damaged_spool_with_one_line(tmp_path):
    """The whole node: a spool with an acknowledged batch and a flipped row stops the trainer with
    DataDirError's one line and exit 2, and the file is left for the operator."""
    data = tmp_path / "data"
    spool = data / "trainer" / "spool.sqlite"
    spool.parent.mkdir(parents=True)
    spool_with_acked_batch(spool)
    raw = bytearray(spool.read_bytes())
    at = raw.find(WORKER.peer_id.encode())  # inside the batch's row
    raw[at : at + 4] = bytes(b ^ 0xFF for b in raw[at : at + 4])
    spool.write_bytes(bytes(raw))
    peer = load_or_create_identity(data)[0].peer_id  # a listed trainer, so it gets as far as its spool
    (tmp_path / "run.toml").write_text(f'[run]\ntrainers = ["{peer}"]\n')
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-m", "node", "--role", "trainer", "--data-dir", str(data),
                          "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "error", "--run", str(tmp_path / "run.toml")],
                         capture_output=True, text=True, timeout=300, env=env, check=False)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "Traceback" not in res.stderr and "spool" in last and "damaged" in last, res.stderr
    assert spool.read_bytes() == bytes(raw)
