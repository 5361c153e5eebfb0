"""Networking layers above the libp2p host: the request/response layer (reqres.py)."""
