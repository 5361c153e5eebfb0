"""Being reachable: whether peers can dial this node, and the relays that carry their connections
when they cannot.

* relay.py: Circuit Relay v2, the HOP service (the ``relay`` role) and the client every other role
  runs (reservations on the relays it is handed, relayed dials);
* dialback.py: the ``/swarm/dialback/1.0.0`` service that answers "can you dial me?" and, off the
  relay role, asks it of others and reserves relay slots when the answer is no;
* reachability.py: the pure votes and verdict of those answers, time as an argument.

These are node services (they take the node's context, register status, are started by the roles'
composition, node/roles/core.py); node/net/ below them is the transport they use.
"""
