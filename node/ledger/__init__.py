"""The contribution ledger: per-author signed, hash-chained logs replicated to every peer.

* :mod:`node.ledger.entries` — the entry schema, kinds and their bodies, signing and parsing (pure).
* :mod:`node.ledger.chain` — chain rules, equivocation, totals and the state digest (pure).
* :mod:`node.ledger.store` — SQLite persistence in the data dir.
* :mod:`node.ledger.messages` — the anti-entropy sync's wire messages (pure).
* :mod:`node.ledger.service` — the trio service: gossip, anti-entropy, the API other roles call.
* ``swarm-node ledger [verify|export]`` is :mod:`node.app.commands.ledger` (every subcommand lives in node/app/commands/).
"""
