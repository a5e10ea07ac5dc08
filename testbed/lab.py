"""An emulated rack on one Linux machine: N hosts as network namespaces on a bridge, each with its own
address, an optional link rate and CPU share (both changeable while a run trains), a Dask scheduler and
workers started inside them, and a client that talks to them from a namespace of its own.

What training across machines needs to be tested and measured here, on one VM: separate interfaces and
addresses (gloo picking the wrong one is the classic multi-host failure), slow links (`tbf` on both ends
of each host's link, so each host has a full-duplex NIC of that rate) and slower hosts (a cgroup v1
`cpu.cfs_quota_us`). Only addresses inside the lab's own namespaces are used; the machine's own
namespace gets no address and no route. Everything is torn down on `close()`, at interpreter exit, and
(for a lab whose process was killed) by the next lab's start. Needs root, `ip` and `tc`; `available()`
says why not otherwise.

    with Lab(hosts=3) as lab:            # host 0: scheduler and client; hosts 1, 2: one worker each
        lab.start_cluster()
        client = lab.connect()           # a workbench client inside host 0
        lab.set_rate("100mbit")          # every host's link; lab.set_rate(None) lifts it
        lab.set_cpu(2, 0.5)              # host 2 gets half a core
        lab.set_link(2, up=False)        # host 2's cable pulled; up=True plugs it back in
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.comm.collectives import SOCKET_IFNAME_VARIABLES as HOST_LOCAL_VARIABLES

NAME_PREFIX = "wbl"  # every lab's namespaces and cgroups start with this, then the owning process id
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CPU_PERIOD_US = 100_000
CLONE_NEWNET = 0x40000000
SCHEDULER_PORT = 8786
RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
START_TIMEOUT_S = 60.0
# Dask sets TCP_USER_TIMEOUT on its connections to `distributed.comm.timeouts.tcp` (30 s by default). On
# a link whose shaper drops packets (`tbf` at 100 Mbit/s under parameter-server transfers), this machine's
# kernel (6.18) ended healthy connections with ETIMEDOUT at once: a worker's scheduler connection with a
# 220 ms RTO and no backoff half a second before (ss), dozens of (partly spurious) retransmits behind it
# over the previous 40 s. The worker then stops ("scheduler connection broken"): 6 of 36 cells at 100
# Mbit/s on a 2026-11-25 grid. A longer timeout keeps the kernel from ending them; Dask's own heartbeats
# still find a dead worker. The one setting the lab's processes get beyond a user's defaults.
LAB_DASK_ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "3600s"}


class LabError(RuntimeError):
    """The lab could not be built (or torn down) on this machine."""


def available() -> str | None:
    """None when labs can be built here, else the reason they cannot (for a test's skip)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is missing"
    probe = f"{NAME_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def rate_bytes_per_s(rate: str) -> float:
    """'100mbit' -> 12.5e6 (tc's units: k, m, g bits per second)."""
    match = RATE.match(rate) if isinstance(rate, str) else None
    if match is None:
        raise ValueError(f"rate={rate!r} is not allowed: expected a number and kbit, mbit or gbit, e.g. '100mbit'")
    return float(match.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)] / 8


def burst_bytes(bytes_per_s: float) -> int:
    """The depth of a shaped link's token bucket: 10 ms of traffic (at least 32 KiB, above one jumbo segment
    of veth's offloads). What it lets through at once after an idle shortens every message by as much
    (`simulate.predict`'s `link_burst`)."""
    return max(32 * 1024, int(bytes_per_s / 100))


class Lab:
    """N emulated hosts; host i has address `subnet.(10 + i)` on interface eth0 of namespace `hosts[i]`."""

    def __init__(self, hosts: int = 3, subnet: str = "10.77.0") -> None:
        if not isinstance(hosts, int) or not 2 <= hosts <= 200:
            raise ValueError(f"hosts={hosts!r} is not allowed: expected an integer from 2 to 200")
        self.size, self.subnet = hosts, subnet
        self.prefix = f"{NAME_PREFIX}{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.hosts = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.addresses = [f"{subnet}.{10 + i}" for i in range(hosts)]
        self.processes: list[tuple[int, subprocess.Popen]] = []  # (host, process)
        self.logs = Path(tempfile.mkdtemp(prefix="workbench-lab-"))
        self.scheduler_address: str | None = None
        self._clients: list[Any] = []
        self._built = False

    # --- building and tearing down ------------------------------------------------------------------------

    def start(self) -> Lab:
        reason = available()
        if reason:
            raise LabError(f"cannot build the lab: {reason}")
        remove_leftovers()
        atexit.register(self.close)
        self._built = True
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                _ip("netns", "add", host)
                near, far = f"{self.prefix}a{index}", f"{self.prefix}b{index}"
                _ip("link", "add", near, "type", "veth", "peer", "name", far)
                _ip("link", "set", near, "netns", host)
                _ip("link", "set", far, "netns", self.switch)
                _ip("-n", host, "link", "set", near, "name", "eth0")
                _ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", host, "link", "set", "eth0", "up")
                _ip("-n", host, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "set", far, "master", "br0", "up")
                cgroup = self.cgroup(index)
                cgroup.mkdir(exist_ok=True)
                (cgroup / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process of the lab and delete its namespaces, links and cgroups (idempotent)."""
        if not self._built:
            return
        self._built = False
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        self._clients.clear()
        for _, process in self.processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=10)
        self.processes.clear()
        _remove_namespaces([*self.hosts, self.switch], [self.cgroup(i) for i in range(self.size)])
        atexit.unregister(self.close)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- conditions -----------------------------------------------------------------------------------------

    def set_rate(self, rate: str | None, host: int | None = None) -> None:
        """Limit host `host`'s link (every host's when None) to `rate` ('100mbit', '1gbit'), both ways;
        None lifts the limit. Takes effect at once, also while a run trains."""
        if rate is not None:
            # Queued packets beyond 50 ms are dropped, as a real switch's buffer would.
            burst = burst_bytes(rate_bytes_per_s(rate))
        for index in self._indices(host):
            for namespace, device in ((self.hosts[index], "eth0"), (self.switch, f"{self.prefix}b{index}")):
                if rate is None:
                    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                                   capture_output=True)  # none set is fine
                else:
                    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                          "rate", rate, "burst", str(burst), "latency", "50ms"])

    def set_link(self, host: int, up: bool) -> None:
        """Cut host `host` off the switch (`up=False`: its port on the bridge goes down, as a pulled cable;
        the host keeps its address and routes) or plug it back in (`up=True`). Connections are not reset:
        they stall until the link is back or their own timeouts end them."""
        self._indices(host)
        _ip("-n", self.switch, "link", "set", f"{self.prefix}b{host}", "up" if up else "down")

    def set_cpu(self, host: int, share: float | None, period_ms: float = CPU_PERIOD_US / 1000) -> None:
        """Give every process of host `host` at most `share` of one core (None: no limit), at once.

        `period_ms`: the span the share is granted over. A host at half a core runs its whole period's
        quota, then waits out the rest: at the default 100 ms that is 50 ms on, 50 ms off, which a worker
        of millisecond steps sees as bursts (and its peers as waits at every exchange), not as a machine
        of half the speed; 10 ms comes closer to one (measured: three hosts at half a core read speed
        spreads of 0.3-0.9 under a synchronous strategy at 100 ms, 0.8-1.0 at 10 ms)."""
        if share is not None and not 0.01 <= share <= 64:
            raise ValueError(f"share={share!r} is not allowed: expected cores from 0.01 to 64, or None")
        if not 1 <= period_ms <= 1000:
            raise ValueError(f"period_ms={period_ms!r} is not allowed: expected 1 to 1000 (ms)")
        period = int(period_ms * 1000)
        quota = -1 if share is None else int(share * period)
        if 0 <= quota < 1000:  # the kernel's least quota
            raise ValueError(f"share={share!r} over period_ms={period_ms!r} is not allowed: "
                             f"at least 1 ms of CPU a period (share x period_ms >= 1)")
        cgroup = self.cgroup(host)
        # The period first: the quota is a share of it (a quota above its period, several cores, is allowed).
        (cgroup / "cpu.cfs_period_us").write_text(str(period))
        (cgroup / "cpu.cfs_quota_us").write_text(str(quota))

    def cgroup(self, host: int) -> Path:
        return CGROUP_CPU / self.hosts[host]

    def _indices(self, host: int | None) -> list[int]:
        if host is None:
            return list(range(self.size))
        if not isinstance(host, int) or not 0 <= host < self.size:
            raise ValueError(f"host={host!r} is not allowed: expected 0 to {self.size - 1}")
        return [host]

    # --- processes ------------------------------------------------------------------------------------------

    def spawn(self, host: int, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` inside host `host` (its namespace and CPU cgroup), logging to `logs/<name>.log`."""
        self._indices(host)
        log = open(self.logs / f"{name}.log", "ab")
        # The shell joins the host's cgroup before exec'ing, so every process it starts (a nanny's worker
        # too) is inside it from its first instruction.
        command = ["sh", "-c", f'echo $$ > {self.cgroup(host) / "cgroup.procs"} && exec "$@"', "lab",
                   "ip", "netns", "exec", self.hosts[host], *argv]
        # An emulated host is another machine: the interface this one's processes were told to use (a
        # GLOO_SOCKET_IFNAME set here) names nothing there, so it does not travel; `env` can set it.
        inherited = {k: v for k, v in os.environ.items() if k not in HOST_LOCAL_VARIABLES}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**inherited, **LAB_DASK_ENV, **(env or {})})
        log.close()
        self.processes.append((host, process))
        return process

    def start_cluster(self, workers_per_host: int = 1, nthreads: int = 1, scheduler_host: int = 0,
                      worker_hosts: list[int] | None = None, env: dict[str, str] | None = None) -> str:
        """A `dask scheduler` on `scheduler_host` and `dask worker`s on `worker_hosts` (default: every other
        host), started as a user would, with no settings of the workbench's own but a longer TCP timeout
        (`LAB_DASK_ENV`). Returns the scheduler's address."""
        scheduler_ip = self.addresses[scheduler_host]
        self.scheduler_address = f"tcp://{scheduler_ip}:{SCHEDULER_PORT}"
        self.spawn(scheduler_host, [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", scheduler_ip,
                                    "--port", str(SCHEDULER_PORT), "--no-dashboard"], "scheduler", env)
        hosts = worker_hosts if worker_hosts is not None else [i for i in range(self.size) if i != scheduler_host]
        for host in hosts:
            self.start_worker(host, workers_per_host, nthreads, env)
        return self.scheduler_address

    def start_worker(self, host: int, workers: int = 1, nthreads: int = 1,
                     env: dict[str, str] | None = None) -> subprocess.Popen:
        if self.scheduler_address is None:
            raise LabError("start the scheduler first (start_cluster)")
        return self.spawn(host, [sys.executable, "-m", "distributed.cli.dask_worker", self.scheduler_address,
                                 "--host", self.addresses[host], "--nworkers", str(workers), "--nthreads",
                                 str(nthreads), "--no-dashboard", "--memory-limit", "0"],
                          f"worker-{host}-{len(self.processes)}", env)

    def restore_workers(self, client: Any, hosts: list[int], timeout_s: float = START_TIMEOUT_S) -> list[int]:
        """A fresh `dask worker` on every host in `hosts` whose worker the scheduler does not know now, its
        old one killed first so no host ever has two; waits until they have joined and returns the hosts
        restored (a worker whose scheduler connection broke ends, and one its nanny restarts after a run's
        stop on a slow link sometimes never rejoins).

        Who is present is asked of the scheduler (`launcher.present_workers`), not read from
        `client.scheduler_info()`: that returns the client's cached identity, which the client's own refresh
        every 2 s (asking for 0 workers) can empty between the fetch and the read. Trusting it, a benchmark
        once took every host's worker for gone and started three more beside the live ones, on the 2 cores,
        in the middle of a measured cell (the shard's host worker at 3,888 samples/s, 5,852 in the same
        point's middle window); the next cells failed on 6 of 3 workers (grid 2026-11-26-crowding-b)."""
        from workbench.run.launcher import present_workers

        for host in hosts:
            self._indices(host)
        present = {address.split("//")[-1].rsplit(":", 1)[0] for address in present_workers(client)}
        restored = [host for host in hosts if self.addresses[host] not in present]
        for host in restored:
            for entry in [e for e in self.processes if e[0] == host and _is_worker(e[1])]:
                _signal_group(entry[1], signal.SIGKILL)  # the nanny and its worker: one process group
                entry[1].wait(timeout=10)
                self.processes.remove(entry)
            self.start_worker(host)
        if restored:
            client.wait_for_workers(len(present) + len(restored), timeout=timeout_s)
        return restored

    def connect(self, host: int = 0, workers: int | None = None, timeout_s: float = START_TIMEOUT_S, **options: Any):
        """A workbench client inside host `host`, connected to the lab's scheduler; waits for `workers`."""
        import workbench

        if self.scheduler_address is None:
            raise LabError("start the cluster first (start_cluster)")
        deadline = time.monotonic() + timeout_s
        with self.inside(host):
            # The client's IO thread is started here, so it (and every connection it makes) lives in
            # the host's namespace; the calling thread goes back to its own afterwards.
            while True:
                try:
                    client = workbench.connect(scheduler=self.scheduler_address, **options)
                    break
                except Exception:
                    if time.monotonic() >= deadline:
                        raise LabError(f"the lab's scheduler did not answer within {timeout_s:g} s; its log: "
                                       f"{self.tail('scheduler')}") from None
                    time.sleep(0.5)  # the scheduler process is still starting
        self._clients.append(client)
        if workers:
            try:
                client.wait_for_workers(workers, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as error:
                raise LabError(f"{workers} workers did not join within {timeout_s:g} s ({error}); logs in "
                               f"{self.logs}") from None
        return client

    @contextlib.contextmanager
    def inside(self, host: int) -> Iterator[None]:
        """Run the calling thread (and threads it starts meanwhile) in host `host`'s network namespace.
        A network namespace belongs to a thread, not to the process: other threads are not moved."""
        self._indices(host)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.hosts[host]}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise LabError(f"setns into {self.hosts[host]} failed: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                libc.setns(own, CLONE_NEWNET)
        finally:
            os.close(own)
            os.close(target)

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def remove_leftovers() -> list[str]:
    """Delete the namespaces and cgroups of labs whose process is gone (killed before it could clean up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale: dict[int, list[str]] = {}
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.match(rf"^{NAME_PREFIX}(\d+)(sw|h\d+)$", name)
        if match and not _alive(int(match.group(1))):
            stale.setdefault(int(match.group(1)), []).append(name)
    removed = []
    for pid, names in stale.items():
        cgroups = [CGROUP_CPU / name for name in names if not name.endswith("sw")]
        _remove_namespaces(names, cgroups)
        removed += names
    return removed


def _remove_namespaces(namespaces: list[str], cgroups: list[Path]) -> None:
    for namespace in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for namespace in namespaces:
        # Deleting a namespace removes its interfaces, and a veth's peer with it.
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
    for cgroup in cgroups:
        for _ in range(50):  # a killed process leaves its cgroup a moment after it is reaped
            try:
                cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _is_worker(process: subprocess.Popen) -> bool:
    return "distributed.cli.dask_worker" in process.args


def _signal_group(process: subprocess.Popen, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)


def _ip(*arguments: str) -> None:
    _run(["ip", *arguments])


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"{' '.join(command)} failed: {done.stderr.strip()}")

