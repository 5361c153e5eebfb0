"""Ledger cuts at run time: who cuts, how a cut travels in pages, and when a replica adopts one.

How this works
--------------
node/ledger/cut.py says what a cut is; this module holds the rules the service (node/ledger/service.py)
applies to cuts at run time. Pure: no I/O, no clock.

* **Who cuts**: the run's *cutter*, its first trainer in sorted order (:func:`cutter_of`), every
  ``[ledger] cut_every`` entries its replica took in, from its replica as it stands. One cutter per run
  means honest trainers never sign two different cuts with one number; the other trainers, validators
  and workers only relay the cut they are based on. (Should the cutter be gone, no cuts are made and
  replicas keep their history; nothing else stops.)
* **How a cut travels**: a peer's sync hello names the cut it is based on (number, hash of the signed
  bytes). A caller seeing a newer number than its own asks for that cut page by page
  (:class:`CutPages`: pages of :data:`~node.ledger.messages.CUT_PAGE_BYTES`, every page but the last
  full, one page count throughout, at most :data:`~node.ledger.cut.MAX_CUT_BYTES` in all), checks the
  assembled bytes against the hello's hash (a mismatch is the sending peer's garbage) and opens them
  (:func:`~node.ledger.cut.open_cut`: a trainer's signature, this run, newer than ours; a cut that does
  not open is garbage too: the peer announced and sent it). Nothing of a hello is remembered: a peer
  that names a cut it cannot serve costs one request per session with it, and the next real cut is
  taken from anyone who has it.
* **When a replica adopts one** (:func:`refusal`): a cut must not reach below what the replica already
  adopted (every author the replica has a base for appears in it at or above that base: otherwise the
  entries between would be needed and are pruned). Where the replica holds the cut's head of an
  author, the hashes must agree. Then:

  - the cut follows ours directly (number + 1, ``prev`` our cut's hash) and the replica holds every
    author's entries up to the cut's heads: it replays its own history to the heads and compares
    (:func:`~node.ledger.cut.replay_to`, :func:`~node.ledger.cut.cut_problem`); a disagreement refuses
    the cut and keeps the history: the signed cut and those entries are a fraud proof for the run's
    operator (the service logs it as one);
  - otherwise (the replica is empty, or behind on some author, or missed cuts between): it has nothing
    to check the totals against and adopts on the trainer's signature, as it trusts the trainer's
    manifests. A behind replica does not sync first: peers based on the cut hold nothing below it.

  Adopting is :func:`~node.ledger.cut.rebase` plus the store's one-transaction prune
  (node/ledger/store.py ``adopt_cut``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .. import hashes
from ..wire import RemoteProtocolError
from .chain import History, Ledger
from .cut import MAX_CUT_BYTES, OpenedCut, cut_problem, replay_to
from .messages import CUT_PAGE_BYTES, CutPage

def cutter_of(trainers: Iterable[str]) -> str | None:
    """The trainer that cuts the run's ledger (module docstring), None for a run without trainers."""
    return min(trainers, default=None)


def page_count(size: int) -> int:
    return max(1, -(-size // CUT_PAGE_BYTES))


def page_of(raw: bytes, index: int) -> bytes:
    """Page ``index`` of a signed cut (b"" past its end)."""
    return raw[index * CUT_PAGE_BYTES:(index + 1) * CUT_PAGE_BYTES]


class CutPages:
    """The pages of one announced cut as they arrive: RemoteProtocolError on the first one that cannot
    be part of it (the sending peer's fault)."""

    def __init__(self, number: int, cut_hash: bytes, max_bytes: int = MAX_CUT_BYTES) -> None:
        self.number = number
        self.hash = cut_hash
        self.max_pages = page_count(max_bytes)
        self.count = 0  # pages announced by the first page
        self._pages: list[bytes] = []

    @property
    def next_index(self) -> int:
        return len(self._pages)

    @property
    def done(self) -> bool:
        return bool(self.count) and len(self._pages) == self.count

    def add(self, page: CutPage) -> None:
        if page.number != self.number:
            raise RemoteProtocolError("cut-page-number", f"{page.number} != {self.number}")
        if page.index != self.next_index:
            raise RemoteProtocolError("cut-page-index", f"{page.index} != {self.next_index}")
        if not 1 <= page.count <= self.max_pages:
            raise RemoteProtocolError("cut-too-large", f"{page.count} pages of {CUT_PAGE_BYTES} B")
        if self.count and page.count != self.count:
            raise RemoteProtocolError("cut-page-count", f"{page.count} != {self.count}")
        last = page.index == page.count - 1
        if not page.data or (not last and len(page.data) != CUT_PAGE_BYTES):
            raise RemoteProtocolError("cut-page-size", f"page {page.index}: {len(page.data)} B")
        self.count = page.count
        self._pages.append(page.data)

    def raw(self) -> bytes:
        """The assembled cut, once every page came and their bytes hash to the announced hash."""
        raw = b"".join(self._pages)
        if not self.done or hashes.digest(raw) != self.hash:
            raise RemoteProtocolError("cut-hash", f"cut {self.number}: the pages do not hash to the hello's hash")
        return raw


def refusal(ledger: Ledger, opened: OpenedCut, bases: dict[str, int], history: History,
            base_replica: Callable[[], Ledger]) -> str | None:
    """Why ``ledger`` (based on the cut whose heads are ``bases``, with ``history``) must not adopt
    ``opened``, or None to adopt it (module docstring). ``base_replica`` makes an empty replica based
    on ``ledger``'s own cut, what a cut following it directly is replayed from."""
    cut = opened.cut
    heads = {log.author: log for log in cut.logs}
    for author, base in bases.items():
        if base and (author not in heads or heads[author].seq < base):
            return "below-our-cut"
    holds_all = True
    for log in cut.logs:
        if ledger.head_of(log.author) < log.seq:
            holds_all = False
        elif log.seq and ledger.hash_at(log.author, log.seq) != log.hash:
            return "other-heads"  # we hold another entry at the cut's head: a wrong cut, or a fork's other branch
    if not holds_all or cut.number != ledger.cut_number + 1 or cut.prev != ledger.cut_hash:
        return None  # nothing to check the totals against: the trainer's signature
    replayed = replay_to(cut, base_replica(), history)
    if isinstance(replayed, str):
        return replayed
    return cut_problem(cut, replayed)
