"""Deliberate cheats, for demos and for testing validators end to end (``[worker] cheat``).

Each cheat wraps an honest piece and departs from it in one place, so the honest path carries no
cheat branches: :func:`node.adversary.generator.make_generator` (the rollout generator of
node/inference/generate.py) and :func:`node.adversary.outbox.make_outbox` (the outbox of
node/inference/outbox.py). The names are ``node.rollouts.config.CHEATS``; the validator and the
trainers must reject every one of them.
"""
