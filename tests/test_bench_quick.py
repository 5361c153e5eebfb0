"""Every benchmark has a ``--quick`` form and ``make bench-quick`` fails when one of them does.

CI runs ``make bench-quick`` (.ci/run): every script in bench/ with ``--quick``. A benchmark is a
bench/*.py that runs as a script (``if __name__ == "__main__":``, the Makefile's own selection);
the other files there are helpers the benchmarks import. Each benchmark's real argument parser is
asked for ``--help`` in this process (one torch import for all of them, not one per script).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MAIN = re.compile(r'^if __name__ == "__main__":', re.M)  # the Makefile's `grep -l` pattern


def benchmarks() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if MAIN.search(p.read_text()))


def test_every_file_in_bench_is_a_benchmark_or_a_helper_a_benchmark_imports():
    helpers = sorted(set(BENCH.glob("*.py")) - set(benchmarks()))
    sources = "\n".join(p.read_text() for p in benchmarks())
    # A script without the guard would run as a benchmark yet be left out of `make bench-quick`.
    unused = [p.name for p in helpers if not re.search(rf"^\s*from {p.stem} import ", sources, re.M)]
    assert not unused, f"bench/{unused[0]} neither runs as a benchmark (if __name__ == \"__main__\":) nor is imported by one"
    assert BENCH / "ledger.py" in benchmarks()  # the pattern still finds the guard (the Makefile greps the same line)


def help_text(path: Path, monkeypatch) -> str:
    """``path``'s ``--help`` output, from its own parser (its main() run with ``--help``)."""
    monkeypatch.syspath_prepend(str(BENCH))  # restores sys.path, which the scripts extend on import
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    before = set(sys.modules)
    term = signal.getsignal(signal.SIGTERM)  # shards.py and membership.py install their own first
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    out = io.StringIO()
    try:
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            module.main()
    finally:
        signal.signal(signal.SIGTERM, term)
        for name in set(sys.modules) - before:  # bench/ helpers imported by their bare names
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(BENCH)):
                del sys.modules[name]
    assert exit_.value.code in (0, None), out.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("path", benchmarks(), ids=lambda p: p.name)
def test_every_benchmark_has_a_quick_flag(path, monkeypatch):
    text = help_text(path, monkeypatch)
    assert re.search(r"^\s+--quick\b", text, re.M), f"bench/{path.name} --help lists no --quick flag:\n{text}"


def test_bench_quick_runs_every_benchmark_and_fails_naming_the_broken_ones(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text('import sys\nif __name__ == "__main__":\n    sys.exit("benchmark broke")\n')
    hangs = tmp_path / "hangs.py"
    hangs.write_text('import threading\nif __name__ == "__main__":\n    threading.Event().wait()  # hangs until killed\n')
    fine = tmp_path / "fine.py"
    fine.write_text('import sys\nif __name__ == "__main__":\n    print("ran with", sys.argv[1:])\n')
    # -o: take the venv as built (its recipe is not what this tests)
    run = subprocess.run(["make", "-s", "-o", ".venv/.installed", "bench-quick", "BENCH_TIMEOUT=2",
                          f"BENCHES={broken} {hangs} {fine}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "ran with ['--quick']" in run.stdout  # the ones after a failure still run
    assert f"benchmarks failed: {broken} {hangs}" in run.stderr, run.stderr
