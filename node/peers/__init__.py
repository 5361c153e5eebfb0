"""Peer penalties: the pure score table (table.py) and its trio edge (service.py)."""

from .service import Peers, serve_peers
from .table import Action, ActionKind, FaultRule, PeerTable

__all__ = ["Action", "ActionKind", "FaultRule", "PeerTable", "Peers", "serve_peers"]
