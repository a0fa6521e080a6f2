"""What each layer of Helix costs per request over HTTP: the same service with one layer switched
off at a time, beside everything on and the bare app (issue 19).

    python -m bench.layers                                      # 3 rounds of 2 s warm-up + 8 s per variant
    python -m bench.layers --rounds 1 --warmup 1 --duration 2   # smoke run

(from the repository root). Every variant is `helix-locks serve --workers 2` as deployed: an API
key required, a JSON log line per request, Prometheus metrics and request ids, except for the one
layer switched off. It is switched off here, in the bench, not by a setting of the service:
`python -m bench.layers serve ARGS` runs `helix-locks serve ARGS` with uvicorn told to build the app
with app_without() below, which builds Helix's app and then removes a middleware or monkeypatches
one function in the worker process (HELIX_BENCH_LAYER names the layer). The bare app
(bench/bare.py) is the floor. A profiler's share is not a cost: each figure here is the service
with that layer gone.

wrk drives the acquire+release cycles of bench/run.py's cross-check (bench/wrk/cycles.lua) at 32
connections, a thread each, each on a key of its own. The variants take turns in each round, each
in a server of its own started for that turn; the median of the rounds is reported, with the ratio
of cycles/s to everything on, and the CPU time of the service's worker processes per cycle (user +
system, from /proc/<pid>/stat over the measured window). The database is a throwaway one, as for
bench/run.py, seeded the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from subprocess import Popen
from typing import Any, LiteralString

from fastapi import FastAPI, Response
from psycopg.rows import DictRow
from pydantic import BaseModel

from bench import interrupted, load_average, log, said_and_stopped
from bench.database import bench_database, seed
from bench.servers import bare_process, service_process, worker_pids
from bench.wrk import WrkResult, run_wrk
from helix_locks.server import api, keys, telemetry
from helix_locks.server.app import BodyLimit, create_app
from helix_locks.server.db import Database
from helix_locks.server.hot import HotRoutes
from helix_locks.server.keys import Caller, KeyRing
from helix_locks.server.migrate import migrate
from helix_locks.server.schemas import GrantBody

LAYER = "HELIX_BENCH_LAYER"
ORGANIZATION = "bench"  # the API key's, and the requests' (bench/wrk/cycles.lua)


def _without_middleware(kind: object) -> Callable[[FastAPI], None]:
    def off(app: FastAPI) -> None:
        app.user_middleware = [middleware for middleware in app.user_middleware if middleware.cls != kind]

    return off


def _without_log_line(app: FastAPI) -> None:
    # Observe still calls logger.log, which returns at its level check.
    telemetry.logger.setLevel(logging.WARNING)


def _without_metrics(app: FastAPI) -> None:
    def nothing(self: telemetry.Metrics, *args: Any) -> None:
        pass

    telemetry.Metrics.answered = nothing  # type: ignore[method-assign,assignment]


def _without_request_id(app: FastAPI) -> None:
    # No X-Request-Id read, none drawn at random: one fixed id (still sent, and still logged).
    telemetry.request_id = lambda scope: "bench"


def _without_key_check(app: FastAPI) -> None:
    # The key is still sent; every request is the organization's key, unchecked.
    caller = Caller("bench", ORGANIZATION)

    async def fixed(self: KeyRing, authorization: str | None) -> Caller:
        return caller

    KeyRing.authenticate = fixed  # type: ignore[method-assign]


async def without_deadline(db: Database, query: LiteralString, params: Mapping[str, Any]) -> list[DictRow]:
    """Database.fetch_all with the statement in the caller's own task: no Task, no timer."""
    return await db._fetch_all(query, params)


def _without_deadline(app: FastAPI) -> None:
    Database.fetch_all = without_deadline  # type: ignore[method-assign,assignment]


def _without_serialization(app: FastAPI) -> None:
    # A grant's answer is bytes made once (from the first grant), with only the id and token that
    # the client reads written in per request; the GrantBody is still built. Other answers as before.
    serialized = api.json_body
    tail: list[bytes] = []

    def prebuilt(
        body: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> Response:
        if not isinstance(body, GrantBody):
            return serialized(body, status_code, headers)
        if not tail:
            fields = json.loads(body.model_dump_json())
            del fields["id"], fields["token"]
            tail.append(json.dumps(fields, separators=(",", ":")).encode().removeprefix(b"{"))
        content = b'{"id":%d,"token":"%s",' % (body.id, body.token.encode()) + tail[0]
        return Response(content, status_code, headers, media_type="application/json")

    api.json_body = prebuilt


# The variants, in the order they take turns: the layer's name (HELIX_BENCH_LAYER), what it means,
# and how it is switched off. "" is everything on; "bare" is the bare app.
VARIANTS: dict[str, tuple[str, Callable[[FastAPI], None]]] = {
    "": ("everything on (API key required, as deployed)", lambda app: None),
    "observe": (
        "without the Observe middleware (request id, log line, metrics)",
        _without_middleware(telemetry.Observe),
    ),
    "log": ("without the log line only", _without_log_line),
    "metrics": ("without the Prometheus observations only", _without_metrics),
    "request-id": ("without the request id only", _without_request_id),
    "body-limit": ("without the BodyLimit middleware", _without_middleware(BodyLimit)),
    "key-check": ("without the key check (a fixed caller)", _without_key_check),
    "deadline": ("without the deadline's Task and timer per statement", _without_deadline),
    "hot-routes": ("without the hot routes' thin path (FastAPI's routing)", _without_middleware(HotRoutes)),
    "edge": ("without the HTTP bounds of edge.py (uvicorn's own httptools protocol)", lambda app: None),
    "serialization": ("without model_dump_json (prebuilt bytes)", _without_serialization),
    "bare": ("the bare app (bench/bare.py): the floor", lambda app: None),
}


def app_without() -> FastAPI:
    """Helix's app with the layer HELIX_BENCH_LAYER names switched off: uvicorn's app factory in
    each worker process of `python -m bench.layers serve`."""
    app = create_app()
    VARIANTS[os.environ.get(LAYER, "")][1](app)
    return app


def serve(argv: list[str]) -> int:
    """`helix-locks serve ARGV`, everything as it is, but the app built by app_without."""
    import uvicorn

    from helix_locks import cli

    run = uvicorn.run

    def run_without(app: Any, **kwargs: Any) -> None:
        if os.environ.get(LAYER) == "edge":
            kwargs["http"] = "httptools"  # uvicorn's own protocol, without edge.py's bounds
        run("bench.layers:app_without", **kwargs)

    uvicorn.run = run_without
    return cli.main(["serve", *argv])


@contextmanager
def variant_server(layer: str, url: str, workers: int, workdir: Path) -> Iterator[tuple[str, Popen[bytes]]]:
    log_path = workdir / f"service-{layer or 'all'}.log"
    if layer == "bare":
        with bare_process(url, workers, log_path) as served:
            yield served
        return
    launcher = [sys.executable, "-m", "bench.layers"]
    with service_process(url, workers, log_path, {LAYER: layer}, launcher) as served:
        yield served


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.layers",
        description="What each layer of Helix costs per request: wrk's cycles/s and the service's CPU per"
        " cycle with one layer switched off at a time, beside everything on and the bare app.",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant (default: 3)")
    parser.add_argument("--duration", type=int, default=8, help="seconds measured per turn (default: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per turn (default: 2)")
    parser.add_argument("--clients", type=int, default=32, help="wrk's connections (default: 32)")
    parser.add_argument("--workers", type=int, default=2, help="service worker processes (default: 2)")
    parser.add_argument("--history", type=int, default=200_000, help="ended locks seeded (default: 200000)")
    parser.add_argument("--live", type=int, default=10_000, help="live locks seeded (default: 10000)")
    parser.add_argument(
        "--only", help="the variants to run, comma-separated, of: " + ", ".join(v or "all" for v in VARIANTS)
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.duration, args.clients, args.workers) < 1 or args.warmup < 0:
        parser.error("--rounds, --duration, --clients and --workers must be at least 1, --warmup at least 0")
    wanted = args.only.split(",") if args.only else [v or "all" for v in VARIANTS]
    args.variants = ["" if name == "all" else name for name in wanted]
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    return args


def report(args: argparse.Namespace, setup: list[str], results: dict[str, list[WrkResult]]) -> str:
    base = results.get("")
    base_rate = statistics.median(r.cycles_per_second for r in base) if base else float("nan")
    base_cpu = statistics.median(r.cpu_ms_per_cycle for r in base) if base else float("nan")
    header = (
        f"{'variant':<66} | {'cycles/s':>8} | {'/ all on':>8} | {'CPU ms/cycle':>12} | {'saved ms':>8}"
        f" | {'p50 ms':>6} | {'p99 ms':>6}"
    )
    lines = [
        f"The cost of each layer: wrk -t{args.clients} -c{args.clients}, acquire+release cycles;"
        f" {args.rounds} round(s) of {args.warmup} s warm-up + {args.duration} s per variant,"
        " variants in turn, each in a fresh server; medians of the rounds",
        *(f"  {line}" for line in setup),
        "",
        header,
        "-" * len(header),
    ]
    for layer, runs in results.items():
        rate = statistics.median(r.cycles_per_second for r in runs)
        cpu = statistics.median(r.cpu_ms_per_cycle for r in runs)
        p50, p99 = (statistics.median(getattr(r, name) for r in runs) for name in ("p50_ms", "p99_ms"))
        lines.append(
            f"{VARIANTS[layer][0]:<66} | {rate:>8,.0f} | {rate / base_rate:>8.2f} | {cpu:>12.3f}"
            f" | {base_cpu - cpu:>8.3f} | {p50:>6.2f} | {p99:>6.2f}"
        )
    lines += [
        "",
        "cycles/s / CPU ms per cycle of every round, in order:",
        *(
            f"  {layer or 'all':>13}: "
            + ", ".join(f"{r.cycles_per_second:,.0f} / {r.cpu_ms_per_cycle:.3f}" for r in runs)
            for layer, runs in results.items()
        ),
        "",
        "failed cycles: "
        + ", ".join(f"{layer or 'all'} {sum(r.failures for r in runs)}" for layer, runs in results.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        log("error: wrk is not installed (apt-get install wrk)")
        return 1
    signal.signal(signal.SIGTERM, interrupted)
    setup = [load_average()]
    results: dict[str, list[WrkResult]] = {layer: [] for layer in args.variants}
    with said_and_stopped(), ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="helix-bench-layers-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        url, where = cleanup.enter_context(bench_database(workdir))
        setup.append(f"database: {where}")
        log(setup[-1])
        migrate(url)
        setup.append(f"seeded: {seed(url, args.history, args.live)}")
        log(setup[-1])
        key = keys.create(url, ORGANIZATION)
        setup.append(f"helix: helix-locks serve --workers {args.workers}, an organization API key sent")
        for round_ in range(args.rounds):
            for layer in args.variants:
                log(f"round {round_ + 1}/{args.rounds}: {VARIANTS[layer][0]} ...")
                with variant_server(layer, url, args.workers, workdir) as (base_url, process):
                    side = f"{layer or 'all'}-{round_}"
                    sent_key = None if layer == "bare" else key
                    results[layer].append(
                        run_wrk(
                            base_url,
                            side,
                            sent_key,
                            args.clients,
                            args.warmup,
                            args.duration,
                            worker_pids(process.pid),
                        )
                    )
    print(report(args, setup, results))
    return 0 if sum(r.failures for runs in results.values() for r in runs) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
