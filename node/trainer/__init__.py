"""The trainer: intake of rollout batches, the validator gate, the GRPO loop, checkpoints.

* :mod:`node.trainer.config` — the ``[trainer]`` table of the run file (no torch, no libp2p).
* :mod:`node.trainer.intake` — pure checks of a received batch (staleness, replay, shape).
* :mod:`node.trainer.spool` — the durable batch spool (SQLite): what was acknowledged survives a crash.
* :mod:`node.trainer.gate` — pure state machine routing batches to validators and collecting verdicts.
* :mod:`node.trainer.policy` — the model, optimizer and training state (torch, no network).
* :mod:`node.trainer.checkpoints` — HF folders per version and atomic training-state files.
* :mod:`node.trainer.figures` — what status and the metrics show of intake, verdicts and steps (pure).
* :mod:`node.trainer.service` — the trio service (``serve_trainer``) wiring them to streams.
* :mod:`node.trainer.fsdp` — several GPUs under ``torchrun`` with FSDP2 (launched by :mod:`node.app.torchrun`;
  rank 0 is the swarm node).
"""
