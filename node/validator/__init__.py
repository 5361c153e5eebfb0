"""The validator: which validator checks which batch, the verification pipeline, verdict policy.

* :mod:`node.validator.assign` — rendezvous hashing of batch ids onto the live validators (pure;
  the trainer imports it to route batches).
* :mod:`node.validator.pipeline` — the checks of one batch against one checkpoint (pure given a model).
* :mod:`node.validator.policy` — penalties and bans from verdicts (pure, time as an argument).
* :mod:`node.validator.service` — the trio service that wires them to streams, shards and the ledger.
"""
