"""What the Python SDK costs, for comparison with bench/cycles.mjs: CPU time and peak memory of
this process for CYCLES (default 1,000) acquire/renew/release cycles, one after another, against
HELIX_LOCKS_URL (HELIX_LOCKS_API_KEY). Run in the project's .venv: python bench/cycles.py [CYCLES].
Prints one JSON line; CPU time and peak RSS are the whole process's, start-up included."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time

from helix_locks import LockClient


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    organization_id = os.environ.get("BENCH_ORG", "acme")
    job_type = f"bench-python-{os.getpid()}"
    started = time.monotonic()
    with LockClient() as client:
        for _ in range(cycles):
            grant = client.acquire(organization_id, job_type, ttl=30)
            client.renew(grant.id, grant.token, ttl=30)
            client.release(grant.id, grant.token)
    wall = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    said = {
        "client": f"python {platform.python_version()}",
        "cycles": cycles,
        "wall_seconds": round(wall, 2),
        "cycles_per_second": round(cycles / wall),
        "cpu_seconds": round(cpu, 2),
        "cpu_ms_per_cycle": round(cpu * 1000 / cycles, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
    }
    print(json.dumps(said))


if __name__ == "__main__":
    main()
