"""The trainer role: the services it runs on top of the core (see node/roles/core.py)."""

from ..trainer.service import serve_trainer

SERVICES: list = [serve_trainer]
