"""The rooms of the package, read from each module's imports: the SDK imports nothing of the server,
the domain nothing of HTTP, and the routes reach the database only through the domain. app.py,
which composes everything, is the one module that may know every room."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "helix_locks"
SERVER = PACKAGE / "server"
# The HTTP edge: routes, bodies, problem documents, middleware, and the commands that serve them.
EDGE = {
    "api",
    "app",
    "hot",
    "console",
    "schemas",
    "problems",
    "query",
    "edge",
    "openapi",
    "outcome",
    "telemetry",
}
# Configuration and logging, which every room may use.
SHARED = {"settings", "logs"}
COMMANDS = {"commands"}
HTTP = {"fastapi", "starlette", "pydantic", "uvicorn", "httptools"}
ROUTES = {"api", "hot", "console"}


def imports(path: Path) -> set[str]:
    """Every module `path` imports, named in full (helix_locks.server.locks, fastapi.responses)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def server_modules(found: set[str]) -> set[str]:
    """The server's modules among `found`, by their short names."""
    prefix = "helix_locks.server."
    return {name.removeprefix(prefix).split(".")[0] for name in found if name.startswith(prefix)}


def domain() -> list[Path]:
    return sorted(p for p in SERVER.glob("*.py") if p.stem not in EDGE | SHARED | COMMANDS | {"__init__"})


def test_the_rooms_are_where_the_layers_say() -> None:
    """A module added to server/ lands in a room, and the domain is not empty."""
    names = {p.stem for p in domain()}
    assert {"locks", "events", "waiting", "keys", "db", "migrate"} <= names, names
    assert not names & EDGE


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_the_sdk_imports_nothing_of_the_server(path: Path) -> None:
    found = imports(path)
    server = {
        name for name in found if name == "helix_locks.server" or name.startswith("helix_locks.server.")
    }
    # cli.py loads the server's commands for serve, migrate and keys, inside the handler only.
    allowed = {"helix_locks.server", "helix_locks.server.commands"} if path.stem == "cli" else set()
    assert server <= allowed, f"{path.name} imports {sorted(server - allowed)}"
    assert not {name.split(".")[0] for name in found} & HTTP - {"httptools"}, path.name


@pytest.mark.parametrize("path", domain(), ids=lambda p: p.name)
def test_the_domain_imports_nothing_of_http(path: Path) -> None:
    found = imports(path)
    assert not {name.split(".")[0] for name in found} & HTTP, f"{path.name}: {found & HTTP}"
    assert not server_modules(found) & EDGE, f"{path.name} imports {sorted(server_modules(found) & EDGE)}"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_routes_reach_the_database_only_through_the_domain(route: str) -> None:
    found = server_modules(imports(SERVER / f"{route}.py"))
    assert not found & {"db", "migrate", "queries", "listener"}, f"{route}.py imports {sorted(found)}"


TESTS = PACKAGE.parents[1] / "tests"
LAYERS = ("unit", "sql", "api", "system", "fault")


@pytest.mark.parametrize("path", sorted(TESTS.glob("*/test_*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_a_test_file_shares_only_through_support_or_within_its_layer(path: Path) -> None:
    """A layer runs alone: what tests of several layers share is in tests/support.py (or harness/),
    never in a test file of another layer."""
    layer = path.parent.name
    assert layer in LAYERS, f"{path}: not in a layer"
    others = {
        name.split(".")[1]
        for name in imports(path)
        if name.startswith("tests.") and name.split(".")[1] in LAYERS
    }
    assert others <= {layer}, f"{path.relative_to(TESTS)} imports tests of {sorted(others - {layer})}"
