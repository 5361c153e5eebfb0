"""The validator: the verification pipeline and verdict policy (which validator checks which batch
is :mod:`node.rollouts.assign`, shared with the trainer that routes the batches).

* :mod:`node.validator.pipeline` — the checks of one batch against one checkpoint (pure given a model).
* :mod:`node.validator.policy` — penalties and bans from verdicts (pure, time as an argument).
* :mod:`node.validator.service` — the trio service that wires them to streams, shards and the ledger.
"""
