"""The ``replay`` cheat: an outbox that queues every accepted batch again, so trainers see it twice.

Kept apart from the generators (node/adversary/generator.py) because the role builds its outbox
before torch is loaded.
"""

from __future__ import annotations

from dataclasses import replace

from ..inference.outbox import BatchState, Outbox, Outcome


class ReplayingOutbox(Outbox):
    def on_ack(self, batch_id, trainer, ack, now) -> Outcome:
        item = self._in_flight(batch_id)
        outcome = super().on_ack(batch_id, trainer, ack, now)
        if outcome.state is BatchState.ACCEPTED:
            self.offer(replace(item, state=BatchState.QUEUED, tried=[]))  # send it again
        return outcome


def make_outbox(cheat: str, capacity: int, **kwargs) -> Outbox:
    """An :class:`Outbox` (same arguments) that cheats the way ``cheat`` says."""
    return (ReplayingOutbox if cheat == "replay" else Outbox)(capacity, **kwargs)
