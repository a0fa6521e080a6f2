"""The console's SSE decoder (console/sse.js), run by Node on the cases every client shares
(clients/contract.json, "sse") and on a few of its own: the page parses the stream as the WHATWG
standard has it, as the Python and Node clients do."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.processes import ROOT

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="needs Node 20 (node)")
DRIVER = Path(__file__).with_name("sse_cases.mjs")
CONTRACT = ROOT / "clients" / "contract.json"


def decoded(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case's chunks fed, in order, to one EventStreamDecoder of sse.js: its events, by name."""
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(DRIVER)], input=json.dumps(cases), capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stderr == "", done.stderr
    return {result["name"]: result for result in json.loads(done.stdout)}


@needs_node
def test_the_consoles_decoder_passes_every_shared_sse_case() -> None:
    """Each case's chunks, fed in order: the events dispatched ({id, event, data, retry} each), and
    the retry and last event id once every chunk is read, as clients/contract.json has them."""
    cases = json.loads(CONTRACT.read_text())["sse"]
    assert cases, "clients/contract.json has no sse case"
    results = decoded(cases)
    failed = []
    for case in cases:
        want = {key: case[key] for key in ("events", "retry", "last_event_id")}
        result = results[case["name"]]
        got = {
            "events": [
                {field: event[field] for field in ("id", "event", "data", "retry")}
                for event in result["events"]
            ],
            "retry": result["retry"],
            "last_event_id": result["last_event_id"],
        }
        if got != want:
            failed.append((case["name"], got, want))
    assert failed == [], failed


@needs_node
def test_the_consoles_decoder_ignores_one_bom_and_takes_retry() -> None:
    cases = [
        # A leading byte order mark is no part of the first field's name; a second one is.
        {"name": "bom", "chunks": ["\ufeffdata: a\n\n\ufeffdata: b\n\n"]},
        {"name": "bom alone first", "chunks": ["\ufeff", "data: a\n\n"]},
        # retry: of ASCII digits sets the reconnection time; anything else leaves it.
        {"name": "retry", "chunks": ["retry: 2500\n\ndata: a\n\nretry: 1x\nretry\n\n"]},
        # A CR at a chunk's end ends its line at once; a LF opening the next chunk ends none.
        {"name": "split crlf", "chunks": ["id: 1\r", "\ndata: a\r", "\r", "\ndata: b\n\n"]},
        # An id counts once its event is dispatched; a cut event is not dispatched.
        {"name": "cut", "chunks": ["id: 1\ndata: a\n\nid: 2\ndata: b"]},
    ]
    results = decoded(cases)
    assert [e["data"] for e in results["bom"]["events"]] == ["a"]  # the second "data" is another field
    assert [e["data"] for e in results["bom alone first"]["events"]] == ["a"]
    assert results["retry"]["retry"] == 2500 and results["retry"]["events"][0]["retry"] == 2500
    assert [(e["id"], e["data"]) for e in results["split crlf"]["events"]] == [("1", "a"), ("1", "b")]
    assert results["cut"]["last_event_id"] == "1" and [e["data"] for e in results["cut"]["events"]] == ["a"]
