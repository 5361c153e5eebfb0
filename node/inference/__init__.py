"""The inference worker: follows checkpoints, generates proven rollout batches, submits them.

* :mod:`node.inference.service` — the trio service (``serve_inference``) around the generator and
  the outbox, built by the factories the role hands in (honest, or node/adversary/'s cheats);
* :mod:`node.inference.generate` — one step: draw, sample, score, prove, sign (blocking, torch);
* :mod:`node.inference.outbox` — the pure state machine of unsent batches (retries, backoff, staleness,
  step headroom);
* :mod:`node.inference.submit` — one delivery over ``/swarm/rollouts/1.0.0``.

What the inference node shares with trainers and validators (the batch and ack messages, the
protocols, the step window, the quota) is node/rollouts/. The inference role's composition (core
services, then this one) is node/roles/inference.py.
"""
