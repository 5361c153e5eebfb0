"""The inference worker: follows checkpoints, generates proven rollout batches, submits them.

* :mod:`node.inference.service` — the trio service (``serve_inference``) around the generator
  (node/inference/generate.py) and the outbox (node/inference/outbox.py).

The inference role's composition (core services, then this one) is node/roles/inference.py.
"""
