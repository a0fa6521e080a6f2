"""A throwaway highly available PostgreSQL cluster for failover tests: one etcd and two Patroni nodes.

Needs, on the machine that runs it (Debian 12)::

    apt-get install -y patroni etcd-server etcd-client postgresql-15

and root, because every server runs as the ``postgres`` OS user.  Everything listens on 127.0.0.1 on
ports picked at run time, and lives in ``workdir``::

    workdir/etcd/                    etcd's data           workdir/etcd.log      etcd's output
    workdir/pg0/data/                node pg0's PGDATA     workdir/pg0/patroni.log   Patroni's output
    workdir/pg0/log/postgresql.log   PostgreSQL's log      workdir/pg0/patroni.json  Patroni's config

``workdir`` and every folder above it must be reachable by the ``postgres`` user (pytest's ``tmp_path``
is not: ``/tmp/pytest-of-root`` is 0700), so use e.g. ``Path(tempfile.mkdtemp())``.

Usage::

    with patroni_cluster(Path(tempfile.mkdtemp())) as cluster:
        with psycopg.connect(cluster.url) as conn: ...
        old = cluster.kill_leader()          # SIGKILL Patroni *and* PostgreSQL of the leader
        cluster.wait_failover(old)           # the replica takes over once the lease expires (ttl 5 s)
        cluster.restart(old)                 # rejoins as a replica (crash recovery + pg_rewind)
        cluster.wait_healthy()
        cluster.switchover()

Every process the fixture starts carries ``HELIX_PATRONI_FIXTURE=<run id>:<node>`` in its environment,
which PostgreSQL's postmaster and backends inherit although Patroni detaches the postmaster from itself.
Killing and teardown find processes by that marker, so they end exactly what this fixture started and
nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psycopg

SCOPE = "helix-test"
OS_USER = "postgres"
MARKER = "HELIX_PATRONI_FIXTURE"
PATRONI_BIN = "/usr/bin/patroni"
ETCD_BIN = "/usr/bin/etcd"

# Dynamic (DCS) settings: small timings so that a failover takes seconds, not half a minute.
TTL = 5
LOOP_WAIT = 1
RETRY_TIMEOUT = 2

# Unix socket paths are limited to 107 bytes; a longer workdir gets its sockets in a short temp folder.
_MAX_SOCKET_DIR = 80

# Never send requests for 127.0.0.1 through an http_proxy from the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ClusterError(RuntimeError):
    """The cluster did not reach or keep the state a method promised."""


def find_pg_bin_dir() -> Path:
    """PostgreSQL's server binaries: $PG_BIN_DIR, else the newest /usr/lib/postgresql/N/bin."""
    env = os.environ.get("PG_BIN_DIR")
    if env:
        return Path(env)
    candidates = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/postgres")]
    if not candidates:
        raise ClusterError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin; set PG_BIN_DIR")
    return max(candidates, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 right now (all bound at once, so they are distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [cast(int, s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def marked_pids(prefix: str) -> set[int]:
    """Live processes whose environment has ``HELIX_PATRONI_FIXTURE=<prefix>...`` (zombies have none)."""
    needle = f"{MARKER}={prefix}".encode()
    found: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(var.startswith(needle) for var in environ.split(b"\0")):
            found.add(int(entry.name))
    return found


def _pid_alive(pid: int) -> bool:
    """Running (not a zombie, which is dead but not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _HTTP.open(request, timeout=timeout) as response:
            return cast(int, response.status), cast(bytes, response.read()).decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {path})"
    return f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


@dataclass
class Node:
    name: str
    pg_port: int
    api_port: int
    dir: Path
    socket_dir: Path
    marker: str
    proc: subprocess.Popen[bytes] | None = None
    killed: set[int] = field(default_factory=set)

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def config_path(self) -> Path:
        return self.dir / "patroni.json"

    @property
    def log_path(self) -> Path:
        return self.dir / "patroni.log"

    @property
    def pg_log_path(self) -> Path:
        return self.dir / "log" / "postgresql.log"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def conninfo(self) -> str:
        """This node only, whatever its role."""
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres"

    def patroni_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """Handle on a running cluster; made by :func:`patroni_cluster`."""

    def __init__(self, workdir: Path, run_id: str, bin_dir: Path, replication: Replication) -> None:
        self.workdir = workdir
        self.replication = replication
        self.run_id = run_id
        self.bin_dir = bin_dir
        etcd_client, etcd_peer, *node_ports = free_ports(6)
        self.etcd_port = etcd_client
        self.etcd_peer_port = etcd_peer
        self.etcd_proc: subprocess.Popen[bytes] | None = None
        self._temp_socket_dirs: list[Path] = []
        self.nodes: list[Node] = []
        for i in range(2):
            name = f"pg{i}"
            node_dir = workdir / name
            socket_dir = node_dir
            if len(str(node_dir)) > _MAX_SOCKET_DIR:
                socket_dir = Path(tempfile.mkdtemp(prefix=f"hxpg-{name}-"))
                self._temp_socket_dirs.append(socket_dir)
            self.nodes.append(
                Node(name, node_ports[2 * i], node_ports[2 * i + 1], node_dir, socket_dir, f"{run_id}:{name}")
            )
        pw = pwd.getpwnam(OS_USER)
        self._uid, self._gid, self._home = pw.pw_uid, pw.pw_gid, pw.pw_dir

    # ----- what a test uses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Multi-host libpq URL that always lands on the writable primary (when there is one)."""
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``GET /cluster`` members (name, role, state, host, port, timeline, lag...)."""
        errors = []
        for n in self.nodes:
            if not n.patroni_running():
                continue
            try:
                status, body = _http("GET", f"{n.api_url}/cluster", timeout=2.0)
            except OSError as exc:
                errors.append(f"{n.name}: {exc}")
                continue
            if status == 200:
                return cast(list[dict[str, Any]], json.loads(body)["members"])
            errors.append(f"{n.name}: HTTP {status}")
        raise ClusterError(f"no Patroni REST API answered /cluster: {errors}")

    def leader(self) -> str:
        """Name of the member holding the leader key in etcd (a killed leader keeps it for up to ttl)."""
        for m in self.members():
            if m["role"] == "leader":
                return cast(str, m["name"])
        raise ClusterError("the cluster has no leader right now")

    def replica(self) -> str:
        """Name of a non-leader member, the synchronous standby if there is one."""
        others = [m for m in self.members() if m["role"] != "leader"]
        others.sort(key=lambda m: m["role"] != "sync_standby")
        if not others:
            raise ClusterError("the cluster has no replica right now")
        return cast(str, others[0]["name"])

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait for a running leader and a streaming standby, synchronous unless the cluster's
        replication is not (checked in Patroni and PG)."""
        deadline = time.monotonic() + timeout
        problem = "not checked yet"
        while time.monotonic() < deadline:
            try:
                problem = self._health_problem() or ""
            except (ClusterError, OSError, psycopg.Error) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if not problem:
                return
            time.sleep(0.2)
        raise ClusterError(f"cluster not healthy after {timeout:.0f} s: {problem}\n{self.log_tails()}")

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's Patroni, then its postmaster and every backend: a crashed machine."""
        node = self.node(name)
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()
        # Patroni is dead first so nothing restarts PostgreSQL; the postmaster may still fork, so sweep
        # until no process of this node is left running.
        deadline = time.monotonic() + 10
        while pids := {p for p in marked_pids(node.marker) if _pid_alive(p)}:
            node.killed |= pids
            _signal_all(pids, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise ClusterError(f"processes of {name} survive SIGKILL: {sorted(pids)}")
            time.sleep(0.02)

    def walreceiver(self, name: str) -> int:
        """The pid of the node's WAL receiver, the process that takes the leader's WAL: the child
        of the node's postmaster that says so in its process title."""
        postmaster = (self.node(name).data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        with os.scandir("/proc") as entries:
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry.name}/stat").read_bytes()
                    parent = stat[stat.rindex(b")") + 2 :].split()[1].decode()
                    title = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                    if parent == postmaster and b"walreceiver" in title:
                        return int(entry.name)
        raise ClusterError(f"{name} has no WAL receiver running")

    def kill_leader(self) -> str:
        """SIGKILL the leader's Patroni and PostgreSQL (no watchdog here); return its name."""
        name = self.leader()
        self.kill_node(name)
        return name

    def wait_failover(self, old_leader: str, timeout: float = 30.0) -> str:
        """Wait until a member other than ``old_leader`` leads and accepts writes; return its name.

        After :meth:`kill_leader` the dead node keeps the leader key until its lease expires (ttl, 5 s);
        only then does the replica promote.
        """
        deadline = time.monotonic() + timeout
        seen: object = None
        while time.monotonic() < deadline:
            with contextlib.suppress(ClusterError, OSError):
                members = self.members()
                seen = [(m["name"], m["role"], m["state"]) for m in members]
                for m in members:
                    if m["role"] == "leader" and m["state"] == "running" and m["name"] != old_leader:
                        self._wait_writable(m["name"], deadline)
                        return cast(str, m["name"])
            time.sleep(0.1)
        raise ClusterError(f"no failover from {old_leader} in {timeout:.0f} s: {seen}\n{self.log_tails()}")

    def restart(self, name: str, timeout: float = 30.0) -> None:
        """Start a killed node's Patroni again; it rejoins as a replica (pg_rewind or re-clone).

        Call it after :meth:`wait_failover`: a node restarted while it still holds the leader key
        takes its old role back ("promoted self to leader because I had the session lock").
        """
        node = self.node(name)
        if node.patroni_running():
            raise ClusterError(f"Patroni of {name} is still running")
        holder = None
        with contextlib.suppress(ClusterError):
            holder = self.leader()
        if holder == name:
            raise ClusterError(f"{name} still holds the leader key; call wait_failover() first")
        # The killed postmaster stays a zombie until init reaps it (a second or two here); Patroni would
        # take a zombie with the pid and start time of postmaster.pid for a live postmaster.
        deadline = time.monotonic() + timeout
        while any(os.path.exists(f"/proc/{p}") for p in node.killed) or marked_pids(node.marker):
            if time.monotonic() > deadline:
                raise ClusterError(f"old processes of {name} not gone after {timeout:.0f} s")
            time.sleep(0.05)
        node.killed.clear()
        self._start_patroni(node)

    def switchover(self, candidate: str | None = None, timeout: float = 60.0) -> str:
        """Planned switchover via ``POST /switchover`` on the leader; return the new, writable leader."""
        leader = self.leader()
        candidate = candidate or self.replica()
        node = self.node(leader)
        status, body = _http(
            "POST", f"{node.api_url}/switchover", {"leader": leader, "candidate": candidate}, timeout=timeout
        )
        if status != 200:
            raise ClusterError(f"switchover {leader} -> {candidate} failed: HTTP {status} {body}")
        new = self.leader()  # Patroni answers 200 once the new leader holds the key...
        self._wait_writable(new, time.monotonic() + timeout)  # ...which it may not have promoted yet
        return new

    def log_tails(self, lines: int = 15) -> str:
        paths = [self.workdir / "etcd.log"]
        for n in self.nodes:
            paths += [n.log_path, n.pg_log_path]
        return "\n".join(_tail(p, lines) for p in paths)

    # ----- start and stop -----------------------------------------------------------------------------

    def _popen(self, argv: list[str], log: Path, marker: str, cwd: Path) -> subprocess.Popen[bytes]:
        env = {
            "PATH": f"{self.bin_dir}:/usr/bin:/bin",
            "HOME": self._home,
            "USER": OS_USER,
            "LOGNAME": OS_USER,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            MARKER: marker,
        }
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                user=self._uid,
                group=self._gid,
                extra_groups=[],
                start_new_session=True,
            )

    def _check_reachable(self) -> None:
        ok = subprocess.run(
            ["/usr/bin/test", "-w", str(self.workdir), "-a", "-x", str(self.workdir)],
            user=self._uid,
            group=self._gid,
            extra_groups=[],
            check=False,
        )
        if ok.returncode != 0:
            blocked = [str(p) for p in reversed(self.workdir.parents) if not os.stat(p).st_mode & 0o001]
            raise ClusterError(
                f"user {OS_USER} cannot use {self.workdir} (folders without o+x on the way: {blocked}); "
                "use e.g. Path(tempfile.mkdtemp()) rather than pytest's tmp_path"
            )

    def _patroni_config(self, node: Node) -> dict[str, Any]:
        hba = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host all all ::1/128 trust",
            "host replication all 127.0.0.1/32 trust",
            "host replication all ::1/128 trust",
        ]
        api = f"127.0.0.1:{node.api_port}"
        return {
            "scope": SCOPE,
            "namespace": "/service/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": api, "connect_address": api},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": self.replication.maximum_lag_on_failover,
                    "synchronous_mode": self.replication.synchronous,
                    "synchronous_mode_strict": self.replication.strict,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        # Patroni itself sets wal_log_hints=on, which pg_rewind needs (checksums are on too).
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "data-checksums", "no-sync"],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data_dir),
                "bin_dir": str(self.bin_dir),
                "pgpass": str(node.dir / "pgpass"),
                # Trust auth: the passwords are only written to pgpass, never checked.
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "rewinder", "password": "rewinder"},
                },
                "pg_hba": hba,
                "use_unix_socket": False,
                # If pg_rewind cannot bring a killed leader back, re-clone it instead of leaving it down.
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
                "parameters": {
                    "unix_socket_directories": str(node.socket_dir),
                    "logging_collector": "on",
                    "log_directory": str(node.dir / "log"),
                    "log_filename": "postgresql.log",
                    "log_line_prefix": "%m [%p] %q%u@%d ",
                    "shared_buffers": "32MB",
                    # Only processes are killed, never the machine: the page cache keeps every write.
                    "fsync": "off",
                },
            },
            "watchdog": {"mode": "off"},
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def _start(self, timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if any(self.workdir.iterdir()):
            raise ClusterError(f"{self.workdir} is not empty")
        os.chown(self.workdir, self._uid, self._gid)
        self._check_reachable()
        for node in self.nodes:
            (node.dir / "log").mkdir(parents=True)
            for d in (node.dir, node.dir / "log", node.socket_dir):
                os.chown(d, self._uid, self._gid)
            node.config_path.write_text(json.dumps(self._patroni_config(node), indent=2))
        self._start_etcd(timeout)
        for node in self.nodes:
            self._start_patroni(node)
        self.wait_healthy(timeout)

    def _start_etcd(self, timeout: float) -> None:
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        argv = [
            ETCD_BIN,
            "--name=etcd0",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=etcd0={peer}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self.run_id}",
            "--logger=zap",
        ]
        self.etcd_proc = self._popen(argv, self.workdir / "etcd.log", f"{self.run_id}:etcd", self.workdir)
        deadline = time.monotonic() + timeout
        while True:
            if self.etcd_proc.poll() is not None:
                raise ClusterError(f"etcd exited with {self.etcd_proc.returncode}\n{self.log_tails()}")
            with contextlib.suppress(OSError):
                status, body = _http("GET", f"{client}/health", timeout=1.0)
                if status == 200 and json.loads(body).get("health") == "true":
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"etcd not healthy after {timeout:.0f} s\n{self.log_tails()}")
            time.sleep(0.1)

    def _start_patroni(self, node: Node) -> None:
        node.proc = self._popen([PATRONI_BIN, str(node.config_path)], node.log_path, node.marker, node.dir)

    def _wait_writable(self, name: str, deadline: float) -> None:
        """Patroni shows the new leader as running before its asynchronous promote has finished."""
        node = self.node(name)
        while True:
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(node.conninfo, autocommit=True, connect_timeout=2) as conn,
            ):
                if not cast(tuple[bool], conn.execute("SELECT pg_is_in_recovery()").fetchone())[0]:
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"leader {name} did not leave recovery in time\n{self.log_tails()}")
            time.sleep(0.05)

    def _health_problem(self) -> str | None:
        members = self.members()
        leaders = [m for m in members if m["role"] == "leader" and m["state"] == "running"]
        role, sync_state = ("sync_standby", "sync") if self.replication.synchronous else ("replica", "async")
        syncs = [m for m in members if m["role"] == role and m["state"] in ("running", "streaming")]
        if len(leaders) != 1 or not syncs:
            have = [(m["name"], m["role"], m["state"]) for m in members]
            return f"want a running leader and {role}, have {have}"
        leader, sync = self.node(leaders[0]["name"]), syncs[0]["name"]
        with psycopg.connect(leader.conninfo, autocommit=True, connect_timeout=2) as conn:
            if cast(tuple[bool], conn.execute("SELECT pg_is_in_recovery()").fetchone())[0]:
                return f"leader {leader.name} is still in recovery"
            query = "SELECT application_name, state, sync_state FROM pg_stat_replication"
            rows = conn.execute(query).fetchall()
        if (sync, "streaming", sync_state) not in rows:
            return f"{sync} is not a streaming {sync_state} standby of {leader.name}: {rows}"
        return None

    def close(self) -> None:
        """Stop everything this cluster started: SIGTERM, then SIGKILL; raise if anything survives."""
        running = [n.proc for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)  # Patroni stops its PostgreSQL and releases the leader key
        for proc in running:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = {p for p in marked_pids(self.run_id) if _pid_alive(p)}
            if self.etcd_proc is not None and self.etcd_proc.poll() is None:
                pids.add(self.etcd_proc.pid)
            _signal_all(pids, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                if self.etcd_proc is not None:
                    self.etcd_proc.poll()  # reap our own child
                pids = {p for p in pids | marked_pids(self.run_id) if _pid_alive(p)}
                time.sleep(0.05)
        if self.etcd_proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.etcd_proc.wait(timeout=5)
        for d in self._temp_socket_dirs:
            shutil.rmtree(d, ignore_errors=True)
        left = {p for p in marked_pids(self.run_id) if _pid_alive(p)}
        if left:
            raise ClusterError(f"processes of cluster {self.run_id} survive teardown: {sorted(left)}")

    def leftover_pids(self) -> set[int]:
        """Processes of this cluster still running (empty after a clean teardown)."""
        return {p for p in marked_pids(self.run_id) if _pid_alive(p)}


@dataclass(frozen=True)
class Replication:
    """Patroni's replication settings: synchronous_mode (and _strict), and how far behind (in
    bytes of WAL) a replica may be and still be promoted."""

    synchronous: bool = True
    strict: bool = False
    maximum_lag_on_failover: int = 1048576


@contextlib.contextmanager
def patroni_cluster(
    workdir: Path, startup_timeout: float = 90.0, replication: Replication = Replication()
) -> Iterator[Cluster]:
    """Start etcd and two Patroni/PostgreSQL nodes in an empty ``workdir``; stop them all on exit."""
    cluster = Cluster(workdir.resolve(), uuid.uuid4().hex[:12], find_pg_bin_dir(), replication)
    try:
        cluster._start(startup_timeout)
        yield cluster
    finally:
        cluster.close()
