"""The shape of every py-libp2p patch in this package: a change made once per process."""

from __future__ import annotations


class Patch:
    """A change to py-libp2p's classes or modules, made once per process (all its hosts share them)."""

    @classmethod
    def install(cls) -> None:
        if not cls.__dict__.get("_installed", False):
            cls._patch()
            cls._installed = True

    @classmethod
    def _patch(cls) -> None:
        raise NotImplementedError
