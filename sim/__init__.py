"""A discrete-event simulator that drives the project's own pure protocol code (issue 46).

``events`` is the virtual clock and event heap, ``network`` the simulated internet (per-node
latency, uplink/downlink bandwidth, loss, NAT'd nodes behind relays), ``membership`` runs
node/gossip/membership.py's MemberTable with its SyncPlanner, ConnectionManager, AddressBackoff,
CloseWatch and LocalHealth on that network under churn (bench/sim_membership.py prints the figures),
``shards`` spreads a checkpoint with node/shards' Picker, SuperSeeder and peering choices against
Kumar & Ross's bound (bench/sim_shards.py).
"""
