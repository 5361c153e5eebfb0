"""The validators the trainer hands batches to, and why that set changes. Pure (no I/O).

The gate assigns batches among the run's validators that the trainer's membership holds alive
(:meth:`node.trainer.service.Trainer.live_validators`). A validator missing from that set gets no
batch, whatever it is doing: in issue 45's 20-minute soak one restarted validator was ready after
7.4 s and got nothing for ~33 s, and no log line said whether the trainer held it dead. So each
change of the set is logged at INFO with its reason: the member state that took a validator out
(suspected, dead, left, no record) or ``record seen`` for one that came in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Membership's member states (node/gossip/membership.py MemberState values) as a removal's reason.
REMOVED_BECAUSE = {"suspect": "suspected", "dead": "dead", "left": "left", None: "no record",
                   "alive": "alive but not listed"}


class Roster:
    """The last set of validators the gate was given, and the changes from one set to the next."""

    def __init__(self) -> None:
        self.live: frozenset[str] = frozenset()
        self.changes = 0  # additions and removals so far (status)

    def update(self, live: Iterable[str], state_of: Callable[[str], str | None]) -> list[str]:
        """Take the current set; one line per validator that came in or went out, with the reason
        (``state_of(peer)``: its membership state's value, None when membership holds no record)."""
        now = frozenset(live)
        lines = [f"validator {v[-8:]} added (record seen)" for v in sorted(now - self.live)]
        lines += [f"validator {v[-8:]} removed ({REMOVED_BECAUSE.get(state_of(v), state_of(v))})"
                  for v in sorted(self.live - now)]
        self.live = now
        self.changes += len(lines)
        return lines


def member_state(membership, peer: str) -> str | None:
    """A peer's state in ``membership``'s member table ("alive", "suspect", "dead", "left"; None
    when it holds no record, or when a stand-in membership keeps no table)."""
    table = getattr(membership, "table", None)
    state = table.state_of(peer) if table is not None else None
    return None if state is None else state.value
