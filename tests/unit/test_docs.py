"""The documentation agrees with the code and links only inside the repository (file checks only)."""

from __future__ import annotations

import ast
import builtins
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.responses import JSONResponse

# The service's code: the declared problem kinds, the domain errors, and the app's OpenAPI
# document; the package's source is read from where it lives.
from helix_locks.server import openapi, problems
from helix_locks.server.errors import LockError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(problems.__file__).resolve().parent
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "api.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
URN = "urn:helix-locks:problem:"
# Starlette raises these for a path no route has and a method a path lacks; app.py answers each
# as the problem http-<status>, and adds Allow (the path's methods) to a 405.
HTTP_PROBLEMS: dict[str, tuple[int, dict[str, str | None]]] = {
    "http-404": (404, {}),
    "http-405": (405, {"allow": None}),
}
# Headers whose presence the problem table must state exactly: named if and only if sent.
CHECKED_HEADERS = ("Retry-After", "WWW-Authenticate", "Allow")
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


@dataclass
class Problem:
    """A problem type as the code answers it. A header's value is None when it varies."""

    status: int
    headers: dict[str, str | None]


def _answered(response: JSONResponse) -> tuple[str, Problem]:
    body = json.loads(bytes(response.body))
    kind: str = body["type"]
    assert kind.startswith(URN), body
    headers: dict[str, str | None] = {
        name: value
        for name, value in response.headers.items()
        if name not in ("content-type", "content-length")
    }
    return kind.removeprefix(URN), Problem(response.status_code, headers)


def _problem_calls() -> Iterator[tuple[str, Problem]]:
    """Every problem(status, "kind", …) call in the package's source, with its constant status and
    headers; an f-string kind (http-<status>) stands for the HTTP problems."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and len(node.args) >= 2):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            status, kind = node.args[0], node.args[1]
            if name != "problem":
                continue
            if isinstance(kind, ast.JoinedStr):
                prefix = kind.values[0]
                assert isinstance(prefix, ast.Constant) and prefix.value == "http-", (
                    f"{path.name}:{node.lineno}: a problem kind unknown here; add it to HTTP_PROBLEMS"
                )
                for http_kind, (http_status, http_headers) in HTTP_PROBLEMS.items():
                    yield http_kind, Problem(http_status, dict(http_headers))
            elif isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                assert isinstance(status, ast.Constant) and isinstance(status.value, int), ast.dump(node)
                yield kind.value, Problem(status.value, {})


def declared_problems() -> dict[str, Problem]:
    """The problem types the code can answer: each declared kind as its example answers (a header
    whose value comes from the error counts as varying), and every problem built by hand."""
    declared: dict[str, Problem] = {}
    for kind in problems.KINDS.values():
        name, found = _answered(kind.answer(kind.example))
        assert name == kind.name, f"{kind.name} answers {name}"
        if callable(kind.headers):
            found.headers = dict.fromkeys(found.headers)
        declared[name] = found
    for name, found in _problem_calls():
        declared.setdefault(name, found)
    return declared


def _subclasses(error: type[LockError]) -> set[type[LockError]]:
    found = set(error.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


def test_every_domain_error_answers_as_one_declared_kind() -> None:
    """Each LockError subclass answers as its own kind or its nearest ancestor's; no kind is
    declared twice; each is in the API's document and in docs/api.md."""
    for error in _subclasses(LockError):
        problems.kind_of(error)  # LookupError if it has none
    assert set(problems.KINDS) <= _subclasses(LockError)
    names = Counter(kind.name for kind in problems.KINDS.values())
    assert [name for name, count in names.items() if count > 1] == []
    document = openapi.document()
    documented = problem_table(API_PAGE.read_text())
    for name in names:
        assert f'"{URN}{name}"' in document, f"{name} is in no route's responses"
        assert name in documented, f"{name} is not in docs/api.md"


def _without_code(text: str) -> Iterator[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    fence = ""
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if match and (not fence or match.group(1).startswith(fence)):
            fence = "" if fence else match.group(1)[0] * 3
            continue
        if not fence:
            yield line


def _code_blocks(text: str, language: str) -> Iterator[str]:
    block: list[str] | None = None
    fence = ""
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if match and not fence:
            fence = match.group(1)[0] * 3
            block = [] if match.group(2).strip() == language else None
        elif match and match.group(1).startswith(fence):
            if block is not None:
                yield "\n".join(block)
            fence, block = "", None
        elif block is not None:
            block.append(line)


def problem_table(text: str) -> dict[str, list[str]]:
    """The rows of api.md's "Problem types" table, by kind: `kind` | status | headers | when."""
    rows: dict[str, list[str]] = {}
    in_section = False
    for line in _without_code(text):
        if line.startswith("## "):
            in_section = line.strip() == "## Problem types"
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if in_section and line.startswith("|") and (match := re.fullmatch(r"`([a-z0-9-]+)`", cells[0])):
            assert match.group(1) not in rows, f"{match.group(1)} has two rows"
            rows[match.group(1)] = cells
    return rows


def test_the_problem_types_in_the_api_page_are_those_the_code_answers() -> None:
    declared = declared_problems()
    documented = problem_table(API_PAGE.read_text())
    assert sorted(documented) == sorted(declared), (
        f"only in the code: {sorted(set(declared) - set(documented))}; "
        f"only in docs/api.md: {sorted(set(documented) - set(declared))}"
    )
    for kind, problem in declared.items():
        _, status, headers, *_ = documented[kind]
        assert status == str(problem.status), f"{kind}: docs/api.md says {status}, the code {problem.status}"
        sent = {name.lower(): value for name, value in problem.headers.items()}
        for name in CHECKED_HEADERS:
            named = re.search(rf"\b{re.escape(name)}\b", headers, re.IGNORECASE) is not None
            assert named == (name.lower() in sent), f"{kind}: {name} in docs/api.md: {named}; sent: {sent}"
            value = sent.get(name.lower())
            if value is not None:
                assert f"{name}: {value}".lower() in headers.lower(), (
                    f"{kind}: the code sends {name}: {value}"
                )


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: Counter[str] = Counter()
    for line in _without_code(page.read_text()):
        if match := re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line):
            slug = _slug(match.group(1))
            found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)  # a repeated heading gets -1, -2…
            seen[slug] += 1
    return found


def links(page: Path) -> Iterator[str]:
    """The targets of the page's Markdown links and images, outside code."""
    for line in _without_code(page.read_text()):
        prose = re.sub(r"(`+).*?\1", "", line)  # inline code spans
        yield from re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
        yield from re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", prose)
        yield from re.findall(r"<([a-z][a-z0-9+.-]*:[^>\s]*)>", prose, re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_stay_in_the_repository_and_find_their_target(page: Path) -> None:
    for target in links(page):
        assert not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE), f"a link out: {target}"
        assert not target.startswith(("/", "\\")), f"an absolute path: {target}"
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"a link outside the repository: {target}"
        assert resolved.exists(), f"no such file: {target}"
        if anchor:
            assert resolved.suffix == ".md", f"an anchor into a file that is not Markdown: {target}"
            assert anchor in anchors(resolved), f"no such heading: {target}"


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def _unbound_names(source: str) -> list[str]:
    """Names a snippet reads but neither defines, imports nor gets from builtins."""
    tree = ast.parse(source)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    read = {
        node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    return sorted(read - bound)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_python_examples_define_what_they_use_and_import_the_sdk(page: Path) -> None:
    for source in _code_blocks(page.read_text(), "python"):
        assert not _unbound_names(source), f"{page.name}: undefined {_unbound_names(source)} in\n{source}"
        imported = {
            node.module
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not any(module.split(".")[0] == "service" for module in imported), (
            f"{page.name}: workers import the SDK as helix_locks, not from the server's package"
        )
