"""The validator role: the services it runs on top of the core (see node/roles/core.py)."""

SERVICES: list = []
