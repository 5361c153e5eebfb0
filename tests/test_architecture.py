"""The import rules that keep the layout honest (docs/design.md "Source layout", DESIGN.md "Layout and wiring").

Arrows run down: app -> roles -> services -> pure logic -> wire. Every module under node/ is parsed
with ``ast`` (imports inside functions included, since a lazy import is still a dependency) and
the rules below are checked on the result; nothing is imported, so the test is fast and needs no
ML stack. Imports under ``if TYPE_CHECKING:`` never run and are left out: they name a type for
readers and checkers; the rules that type-only imports break as well read them too (``type_only``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

NODE = Path(__file__).resolve().parents[1] / "node"

# Protocol logic with no I/O: messages and the time go in, decisions come out (STYLE.md 1-2).
# Neither they nor anything they import (transitively, inside node/) may reach an event loop, the
# network or a database. rl/spec.py imports rl/sandbox.py, which runs verifier code in a
# subprocess with limits: a blocking call the spec makes on purpose, not an I/O service.
PURE = [
    "node.wire",
    "node.refusals",
    "node.hashes",
    "node.net.multiaddrs",
    "node.counters",
    "node.net.budget",
    "node.reach.reachability",
    "node.peers.table",
    "node.gossip.membership",
    "node.gossip.records",
    "node.gossip.connections",
    "node.shards.picker",
    "node.shards.peering",
    "node.shards.manifest",
    "node.shards.delta",
    "node.shards.protocol",
    "node.shards.superseed",
    "node.shards.throttle",
    "node.shards.catchup",
    "node.shards.finite",
    "node.ledger.chain",
    "node.ledger.entries",
    "node.ledger.messages",
    "node.proofs.toploc",
    "node.proofs.checks",
    "node.proofs.margins",
    "node.proofs.reasons",
    "node.proofs.capture",
    "node.rl.spec",
    "node.rl.grpo",
    "node.rollouts.assign",
    "node.rollouts.schema",
    "node.inference.outbox",
    "node.net.failure",
    "node.trainer.gate",
    "node.trainer.intake",
    "node.trainer.evaluation",
    "node.trainer.figures",
    "node.validator.policy",
    "node.ledger.summary",
    "node.summary",
    "node.steptime",
]
# What pure code may not import: third-party I/O, and node's own I/O layers.
IO_LIBRARIES = ("trio", "libp2p", "sqlite3", "socket")
IO_MODULES = ("node.net.host", "node.net.reqres", "node.net.patches", "node.reach.relay", "node.reach.dialback",
              "node.context", "node.status", "node.roles", "node.app")
IO_SUFFIXES = (".service", ".sync", ".store")  # the trio services and the SQLite/piece stores

# Layers below the roles and the program: they never import them.
LOWER = ("gossip", "shards", "proofs", "ledger", "peers", "net", "reach", "rl", "engines", "rollouts", "adversary",
         "trainer", "validator", "inference")
# Components that talk only through each other's typed APIs (``api.py`` Protocols) or pure modules.
COMPONENTS = ("gossip", "shards", "ledger", "proofs", "reach")
# The top: the program (``python -m node`` is node/__main__.py), the app and the role compositions.
TOP = ("__main__", "app", "roles")
# Top-level package edges that form a cycle and cannot be fixed yet: (importer, imported, why).
CYCLE_ALLOWED: list[tuple[str, str, str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(NODE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(NODE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for child in n.body:
                skip.update(id(d) for d in ast.walk(child))
    return skip


def imports_of(module: str, *, type_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``module`` that runs (and, with ``type_only``,
    those under ``if TYPE_CHECKING:`` too), relative ones resolved; ``from pkg import name`` counts
    as importing ``pkg.name`` when that is a module."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = set() if type_only else _type_checking_nodes(tree)
    out = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")[: len(package.split(".")) - n.level + 1]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module
            for a in n.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, n.lineno))
    return out


IMPORTS = {m: imports_of(m) for m in MODULES}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _top(module: str) -> str:
    """The top-level package (or module) of node that ``module`` belongs to."""
    return module.split(".")[1] if module.count(".") else module


def _is_io(name: str) -> bool:
    return (name.split(".")[0] in IO_LIBRARIES or any(_within(name, m) for m in IO_MODULES)
            or (name.startswith("node.") and name.endswith(IO_SUFFIXES)))


def _io_paths(module: str) -> list[str]:
    """Import chains from ``module`` to an I/O import, through node's own modules."""
    found, seen, stack = [], set(), [(module, [module])]
    while stack:
        m, chain = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        for name, line in IMPORTS[m]:
            if _is_io(name):
                found.append(" -> ".join(chain) + f" -> {name} (line {line})")
            elif name in MODULES:
                stack.append((name, chain + [name]))
    return found


def test_the_rules_see_the_whole_package():
    assert len(MODULES) > 100 and "node.app.cli" in MODULES
    assert all(m in MODULES for m in PURE), [m for m in PURE if m not in MODULES]
    # Lazy imports count: the CLI imports the role composition inside a function.
    assert "node.roles.core" in {name for name, _ in IMPORTS["node.app.cli"]}


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_reach_no_io(module):
    assert _io_paths(module) == []


def test_lower_layers_never_import_roles_or_app():
    """Services, pure logic and the shared top-level modules never reach up to the roles or the app."""
    bad = [f"{m}:{line} imports {name}" for m in MODULES if _top(m) not in TOP
           for name, line in IMPORTS[m] if _within(name, "node.roles") or _within(name, "node.app")]
    assert bad == []
    # Every package is either one of the lower layers or the top: a new one must be placed.
    packages = {_top(m) for m in MODULES if m.count(".") > 1}
    assert packages <= set(LOWER) | set(TOP), packages - set(LOWER) - set(TOP)


def test_roles_never_import_the_app():
    bad = [f"{m}:{line} imports {name}" for m in MODULES if _within(m, "node.roles")
           for name, line in IMPORTS[m] if _within(name, "node.app")]
    assert bad == []


def _api_of(package: str, name: str) -> bool:
    """What one component may import from another: its typed API, its config, a pure module, or
    its package when that ``__init__`` imports no service."""
    if name == f"node.{package}":
        return not any(_is_io(n) for n, _ in IMPORTS[name])
    return name in (f"node.{package}.api", f"node.{package}.config") or name in PURE


def test_components_meet_only_through_apis_and_pure_modules():
    bad = [f"{m}:{line} imports {name}" for m in MODULES if _top(m) in COMPONENTS
           for name, line in IMPORTS[m]
           if name.startswith("node.") and _top(name) in COMPONENTS and _top(name) != _top(m)
           and not _api_of(_top(name), name)]
    assert bad == []


def package_graph() -> dict[str, dict[str, list[str]]]:
    """Top-level package -> imported top-level package -> the imports that make the edge."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for m in MODULES:
        if m == "node":
            continue
        for name, line in IMPORTS[m]:
            if name.startswith("node.") and _top(name) != _top(m):
                graph[_top(m)][_top(name)].append(f"{m}:{line} -> {name}")
    for src, dst, _why in CYCLE_ALLOWED:
        graph[src].pop(dst, None)
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, {})):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_top_level_packages_form_no_cycle():
    graph = package_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between node's packages:\n  " + "\n  ".join(edges))


def patch_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports of the py-libp2p patches (node/net/patches/) from outside node/net/: the rest of the
    node uses the host's API and the byte counts (node/counters.py), never a patch."""
    return [f"{m}:{line} imports {name}" for m in sorted(imports) if not _within(m, "node.net")
            for name, line in imports[m] if _within(name, "node.net.patches")]


def test_nothing_outside_net_imports_the_patches():
    assert patch_imports(IMPORTS) == []
    assert "node.net.patches" in {name for name, _ in IMPORTS["node.net.host"]}  # net/ itself may


def plant(tmp_path, monkeypatch, module: str, code: str, *, type_only: bool = False):
    """``module``'s imports, read through the same parser from a copy of it with ``code`` appended,
    and the copy's line count."""
    planted = tmp_path / MODULES[module].name
    planted.write_text(MODULES[module].read_text() + code)
    monkeypatch.setitem(MODULES, module, planted)
    return {module: imports_of(module, type_only=type_only)}, len(planted.read_text().splitlines())


def adversary_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports of node/adversary/ (the deliberate cheats of ``[worker] cheat``) from below the top:
    components build the honest pieces and take cheating ones only as factories a role hands in
    (node/roles/inference.py), so no honest path can reach a cheat."""
    return [f"{m}:{line} imports {name}" for m in sorted(imports)
            if _top(m) not in TOP and not _within(m, "node.adversary")
            for name, line in imports[m] if _within(name, "node.adversary")]


# The role services reach the running components through what they are handed: the component's
# api.py (its Protocol and the errors it raises), its config.py, and the shared contracts named here
# (the ledger's entry bodies, which LedgerAPI.append takes; the finite check every published
# checkpoint folder passes, node/shards/finite.py). Never a component's service, nor one of its pure
# internals such as the gossip record's bounds: issue 44 found the trainer importing LedgerError from
# the ledger's service and MAX_VERSIONS from gossip/records.py. Subcommands are app code
# (node/app/commands/), so no component module is exempt.
ROLE_SERVICES = ("trainer", "validator", "inference")
SERVICE_COMPONENTS = ("gossip", "shards", "ledger")
CONTRACTS = ("node.ledger.entries", "node.shards.finite")


def component_internals(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports by the role services of a component's modules other than its api, config and contracts."""
    return [f"{m}:{line} imports {name}" for m in sorted(imports)
            if _top(m) in ROLE_SERVICES
            for name, line in imports[m] if name.startswith("node.") and _top(name) in SERVICE_COMPONENTS
            and name not in (f"node.{_top(name)}.api", f"node.{_top(name)}.config") + CONTRACTS]


def test_role_services_use_only_the_components_apis():
    """Type-only imports included."""
    assert component_internals({m: imports_of(m, type_only=True) for m in MODULES}) == []
    assert "node.ledger.api" in {name for name, _ in IMPORTS["node.trainer.service"]}  # what they may


def test_components_never_import_the_adversary():
    """Type-only imports included: a cheat's type has no business in a component either."""
    assert adversary_imports({m: imports_of(m, type_only=True) for m in MODULES}) == []
    assert "node.adversary.outbox" in {name for name, _ in IMPORTS["node.roles.inference"]}  # roles do


def context_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports of the node's context (node/context.py) under node/net/: net/ is the transport every
    service dials and streams through, and takes a host, a stream, budgets, never the running node.
    The services that did (the relay, the dial-back) are node/reach/ (issue 44 item 8)."""
    return [f"{m}:{line} imports {name}" for m in sorted(imports) if _within(m, "node.net")
            for name, line in imports[m] if _within(name, "node.context")]


def test_nothing_in_net_takes_the_node_context():
    """Type-only imports included: net/relay.py took the context for a type, net/ sitting below it."""
    assert context_imports({m: imports_of(m, type_only=True) for m in MODULES}) == []
    assert "node.context" in {name for name, _ in IMPORTS["node.reach.relay"]}  # the services above it do


# The base modules every layer imports: the wire, identity, hashes, atomic files, config, logging,
# metrics and the byte counts it exports (counters.py, which the net patches add to). They import
# each other, the refusal table (node/refusals.py, what the wire's acks carry; it imports nothing)
# and from net/ only the pure multiaddr check config.py validates addresses with; never a
# component (config.py reaches the component tables through its string registry).
BASE = ("node.wire", "node.identity", "node.hashes", "node.atomic", "node.config", "node.log", "node.metrics",
        "node.counters")
BASE_MAY_IMPORT = BASE + ("node.refusals", "node.net.multiaddrs")
# Imports that break the rule today, each (importer, imported, why); the test fails once one is gone,
# so the entry goes with it.
BASE_ALLOWED: list[tuple[str, str, str]] = []


def base_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports by the base modules of node's modules other than those they may import."""
    allowed = {(m, name) for m, name, _why in BASE_ALLOWED}
    return [f"{m}:{line} imports {name}" for m in sorted(imports) if m in BASE
            for name, line in imports[m] if _within(name, "node") and name not in BASE_MAY_IMPORT
            and (m, name) not in allowed]


def test_base_modules_import_no_component():
    """Type-only imports included."""
    assert all(m in MODULES for m in BASE_MAY_IMPORT), [m for m in BASE_MAY_IMPORT if m not in MODULES]
    imports = {m: imports_of(m, type_only=True) for m in BASE}
    assert base_imports(imports) == []
    assert [(m, name) for m, name, _ in BASE_ALLOWED if name not in {n for n, _ in imports[m]}] == []  # still needed
    assert "node.net.multiaddrs" in {name for name, _ in IMPORTS["node.config"]}  # what they may


@pytest.mark.parametrize("rule,module,planted,caught", [
    # a patch from shards/client.py, in both spellings
    (patch_imports, "node.shards.client", ("from ..net.patches.speed import QuickLock", "from ..net import patches"),
     ("node.net.patches.speed", "node.net.patches")),
    # a cheat from inference/service.py, a module and the package
    (adversary_imports, "node.inference.service", ("from ..adversary.generator import make_generator",
                                                   "from .. import adversary"),
     ("node.adversary.generator", "node.adversary")),
    # issue 44's two imports by trainer/service.py: the ledger's error from its service, a gossip bound
    (component_internals, "node.trainer.service", ("from ..ledger.service import LedgerError",
                                                   "from ..gossip.records import MAX_VERSIONS"),
     ("node.ledger.service", "node.gossip.records")),
    # the node's context in net/, as a module and from the package
    (context_imports, "node.net.reqres", ("from ..context import NodeContext", "from .. import context"),
     ("node.context", "node.context")),
    # config.py importing a component's table instead of naming it in its registry, and the host
    (base_imports, "node.config", ("from .shards.config import ShardsConfig", "from .net.host import SwarmHost"),
     ("node.shards.config", "node.net.host")),
])
def test_the_import_rules_find_planted_imports(tmp_path, monkeypatch, rule, module, planted, caught):
    """Planted as lazy imports in a copy of ``module``, each is caught on its own line."""
    imports, lines = plant(tmp_path, monkeypatch, module, "\n\ndef lazy():\n" + "".join(f"    {p}\n" for p in planted))
    first = lines - len(planted) + 1
    assert rule(imports) == [f"{module}:{first + i} imports {name}" for i, name in enumerate(caught)]


def test_the_context_rule_finds_the_old_relay_layout(tmp_path, monkeypatch):
    """net/relay.py as it was: the context imported for a type only, under ``if TYPE_CHECKING:``."""
    imports, lines = plant(tmp_path, monkeypatch, "node.net.host", "\n\nif TYPE_CHECKING:  # the services take the "
                           "node's context\n    from ..context import NodeContext\n", type_only=True)
    assert context_imports(imports) == [f"node.net.host:{lines} imports node.context"]


# The shards sessions (rust-libp2p's handlers: the download, the serving session, the delta part)
# see the service (the behaviour) only through node/shards/session_api.py, and report to it there:
# none of them imports service.py, not even for a type, so the package has no import circle.
SHARDS_SESSIONS = ("node.shards.client", "node.shards.server", "node.shards.deltasync", "node.shards.session_api")


def service_imports(imports: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports of node/shards/service.py by the shards session modules."""
    return [f"{m}:{line} imports {name}" for m in sorted(imports) if m in SHARDS_SESSIONS
            for name, line in imports[m] if _within(name, "node.shards.service")]


def test_shards_sessions_never_import_the_service():
    assert all(m in MODULES for m in SHARDS_SESSIONS), [m for m in SHARDS_SESSIONS if m not in MODULES]
    assert service_imports({m: imports_of(m, type_only=True) for m in SHARDS_SESSIONS}) == []
    assert "node.shards.server" in {name for name, _ in IMPORTS["node.shards.service"]}  # the other way is the rule


def test_the_session_rule_finds_a_planted_import(tmp_path, monkeypatch):
    """Planted in a copy of shards/server.py, a type-only import and a lazy one are both caught."""
    imports, lines = plant(tmp_path, monkeypatch, "node.shards.server", "\n\nif TYPE_CHECKING:\n"
                           "    from .service import ShardsService\n\n\ndef lazy():\n    from . import service\n",
                           type_only=True)
    assert service_imports(imports) == [
        f"node.shards.server:{lines - 4} imports node.shards.service",
        f"node.shards.server:{lines} imports node.shards.service"]


def test_the_shards_package_has_no_import_circle():
    """Between the modules of node/shards/, type-only imports included."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for m in MODULES:
        if _within(m, "node.shards"):
            for name, line in imports_of(m, type_only=True):
                if _within(name, "node.shards") and name != m:
                    graph[m][name] = [f"{m}:{line}"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ["x"]}, "b": {}}) is None


def test_the_pure_rule_finds_a_planted_import(tmp_path, monkeypatch):
    """Planted in a copy of gossip/connections.py (the membership service's connection bookkeeping,
    issue 44 item 4): a lazy trio import, and one that reaches I/O through the service, are caught."""
    module = "node.gossip.connections"
    imports, lines = plant(tmp_path, monkeypatch, module, "\n\ndef lazy():\n    import trio\n"
                           "    from .service import Membership\n")
    monkeypatch.setitem(IMPORTS, module, imports[module])
    assert sorted(_io_paths(module)) == [f"{module} -> node.gossip.service (line {lines})",
                                         f"{module} -> trio (line {lines - 1})"]


# A service whose tasks share state is a class with a named method per task and handler (STYLE.md 4
# and 10): serve_membership was one 341-line function of 21 closures over a mutable ``svc`` (issue
# 44). A serve_* function may still wrap a handler or two.
MAX_SERVE_CLOSURES = 2


def closure_heavy_services(modules: dict[str, Path]) -> list[str]:
    """serve_* functions in ``modules`` that nest more than ``MAX_SERVE_CLOSURES`` functions."""
    out = []
    for m, path in sorted(modules.items()):
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("serve"):
                nested = [d for d in ast.walk(n) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d is not n]
                if len(nested) > MAX_SERVE_CLOSURES:
                    out.append(f"{m}:{n.lineno} {n.name} nests {len(nested)} functions")
    return out


def test_services_keep_their_state_in_a_class():
    assert closure_heavy_services(MODULES) == []


def test_the_service_rule_finds_a_planted_closure_heap(tmp_path, monkeypatch):
    """Planted in a copy of gossip/service.py: a serve_* function of three closures."""
    _, lines = plant(tmp_path, monkeypatch, "node.gossip.service", "\n\nasync def serve_heap():\n"
                     "    def a():\n        pass\n\n    async def b():\n        pass\n\n    def c():\n        pass\n")
    assert closure_heavy_services({"node.gossip.service": MODULES["node.gossip.service"]}) == [
        f"node.gossip.service:{lines - 8} serve_heap nests 3 functions"]


# Every ``swarm-node`` subcommand lives in node/app/commands/, registered in its COMMANDS: issue 44
# item 8 found them in two homes (four components' cli.py and app/*_cli.py), loaded by module names.
def subcommands_elsewhere(modules: dict[str, Path]) -> list[str]:
    """``add_parser`` calls outside node/app/commands/ (the top-level parser in app/cli.py adds none)."""
    return [f"{m}:{n.lineno}" for m, path in sorted(modules.items()) if not _within(m, "node.app.commands")
            for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_parser"]


def test_subcommands_live_in_app_commands():
    assert subcommands_elsewhere(MODULES) == []


def test_the_subcommand_rule_finds_a_planted_one(tmp_path, monkeypatch):
    """Planted in a copy of ledger/store.py: a subcommand beside the component again."""
    _, lines = plant(tmp_path, monkeypatch, "node.ledger.store", "\n\ndef add_commands(sub):\n    sub.add_parser('x')\n")
    assert subcommands_elsewhere({"node.ledger.store": MODULES["node.ledger.store"]}) == [f"node.ledger.store:{lines}"]
