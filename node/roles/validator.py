"""The validator role: the services it runs on top of the core (see node/roles/core.py).

A validator checks rollout batches that trainers forward to it, signs verdicts, and records them
and any penalties in the ledger (node/validator/service.py).
"""

from ..validator.service import serve_validator

SERVICES = [serve_validator]
