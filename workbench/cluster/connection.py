"""Getting a Dask client to train on: the embedded default, a GPU box, or an existing cluster.

`connect()` is the one place that decides. With a scheduler address it connects there, failing within
`timeout_s` with a clear message. Otherwise it starts a `dask_cuda.LocalCUDACluster` when dask-cuda
imports and NVML reports at least one GPU (one worker per GPU, each seeing it as cuda:0; more workers
than GPUs share them round robin, `SharedGpuCluster`, and are told that NCCL then gives way to gloo),
else a `distributed.LocalCluster` of single-threaded worker processes configured for training.

TLS: `connect(security=True)` starts a local cluster with throwaway self-signed certificates;
`connect("tls://host:8786", security=security_from_files(ca, cert, key))` reaches a TLS scheduler.
Only Dask's own connections are encrypted: torch.distributed's (gloo, NCCL) between workers are not.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import multiprocessing
import os
import socket
import ssl
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import dask
import psutil
from dask.system import CPU_COUNT
from distributed import Client, LocalCluster, Security
from distributed.comm import get_address_host_port
from distributed.deploy.spec import SpecCluster
from distributed.system import MEMORY_LIMIT

from workbench.cluster.restarts import keep_restarting_nannies
from workbench.errors import ClusterError, ConfigError
from workbench.worker.host import HOUSEKEEPING_MS

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Worker and scheduler settings for clusters the workbench starts itself.
TRAINING_CONFIG: dict[str, Any] = {
    # A rank task whose worker died must fail, not be silently re-run elsewhere as a duplicate rank.
    "distributed.scheduler.allowed-failures": 0,
    # Let user code start DataLoader worker processes inside a task.
    "distributed.worker.daemon": False,
    # Worker housekeeping competes with training on small machines (design.md section 5).
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": f"{HOUSEKEEPING_MS['monitor']}ms",
    "distributed.admin.system-monitor.gil.enabled": False,
    # Every Dask process wakes its event loop every 20 ms only to warn when the loop was blocked, and
    # checks memory every 100 ms; each wake-up contends for the GIL with the training thread. The same
    # intervals as a training task sets on any worker (worker/host.py).
    "distributed.admin.tick.interval": f"{HOUSEKEEPING_MS['tick']}ms",
    "distributed.worker.memory.monitor-interval": f"{HOUSEKEEPING_MS['memory_monitor']}ms",
    # Dask sets MALLOC_TRIM_THRESHOLD_=65536 in workers to return memory to the OS eagerly. Setting it
    # disables glibc's adaptive mmap threshold, so every large gradient buffer is mmap'd and page-faulted
    # afresh each step: about 25% slower training steps, measured. Training workers keep glibc's default.
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    # Late subscribers backfill metrics from the scheduler's per-topic event log.
    "distributed.admin.low-level-log-length": 10_000,
}
KINDS = ("auto", "cpu", "cuda")
# How many local worker threads a machine holds: a few per core still train (waiting on each other in
# turn), hundreds only thrash; and each worker process with torch loaded takes about this much memory.
THREADS_PER_CORE = 4
WORKER_MEMORY_BYTES = 400 * 2**20


def count_gpus() -> int:
    """GPUs NVML can see here; 0 where NVML or its library is missing (never raises)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def dask_cuda_available() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except Exception:  # ImportError, or cuda-bindings missing beneath it
        return False
    return True


def choose_kind(kind: str, workers: int | None) -> str:
    """'cuda' or 'cpu' for a local cluster, from the request and what this machine has."""
    if kind not in KINDS:
        raise ConfigError("kind", kind, f"one of {list(KINDS)}")
    if kind == "cpu":
        return "cpu"
    gpus = count_gpus() if dask_cuda_available() else 0
    if kind == "cuda" and gpus == 0:
        raise ConfigError("kind", kind, "'cuda' only where dask-cuda is installed and a GPU is visible",
                          "Install the 'cuda' extra on a GPU machine, or use kind='cpu'")
    return "cuda" if gpus else "cpu"


def gpu_placement(workers: int, gpus: int) -> list[str]:
    """Each local worker's CUDA_VISIBLE_DEVICES over `gpus` GPUs, round robin: worker i's own GPU is
    i mod gpus, listed first so that it is that worker's cuda:0 (as dask-cuda lists them)."""
    return [",".join(str((i + k) % gpus) for k in range(gpus)) for i in range(workers)]


def placement_message(workers: int, gpus: int) -> str | None:
    """What a user is told when more workers than GPUs are asked for; None when each has a GPU of its own."""
    if workers <= gpus:
        return None
    per_gpu = -(-workers // gpus)
    return (f"{workers} workers on {gpus} GPU{'s' if gpus > 1 else ''}: up to {per_gpu} workers share a GPU "
            f"(round robin). NCCL refuses two ranks on one GPU, so runs on these workers exchange through gloo "
            f"(CUDA tensors over TCP) or use a parameter-server strategy (async, ssp, easgd); for NCCL start "
            f"at most {gpus} worker{'s' if gpus > 1 else ''}")


class SharedGpuCluster(LocalCluster):
    """A local cluster of more workers than GPUs: each worker process sees every GPU, its own first
    (dask-cuda's LocalCUDACluster names workers after their GPU and starts at most one per GPU)."""

    def __init__(self, gpus: int, n_workers: int, **options: Any) -> None:
        self._gpus = gpus
        # LocalCluster builds its first workers without `new_worker_spec`: start none, then scale, as
        # dask-cuda does, so that every worker gets its placement.
        super().__init__(n_workers=0, **options)
        self.scale(n_workers)
        self.sync(self._correct_state)

    def new_worker_spec(self) -> dict[Any, Any]:
        ((name, spec),) = super().new_worker_spec().items()
        index = name if isinstance(name, int) else len(self.worker_spec)
        options = dict(spec.get("options", {}))
        options["env"] = {**options.get("env", {}), "CUDA_VISIBLE_DEVICES": gpu_placement(index + 1, self._gpus)[index]}
        return {name: {**spec, "options": options}}


def check_local_capacity(workers: int, threads_per_worker: int, cores: int, memory_bytes: int) -> None:
    """Refuse more local workers than this machine can hold (`ConfigError` naming `workers`)."""
    by_cores = max(1, cores * THREADS_PER_CORE // threads_per_worker)
    by_memory = max(1, memory_bytes // WORKER_MEMORY_BYTES)
    if workers > min(by_cores, by_memory):
        raise ConfigError("workers", workers,
                          f"at most {min(by_cores, by_memory)} local workers on this machine ({cores} cores, "
                          f"{memory_bytes / 2**30:.1f} GiB of memory: up to {THREADS_PER_CORE} worker threads a core "
                          f"and about {WORKER_MEMORY_BYTES // 2**20} MiB a worker)",
                          "For more workers connect to a cluster of several machines (scheduler=...); to start them "
                          "here anyway pass oversubscribe=True (--oversubscribe)")


def check_main_guard(stack: list[Any] | None = None, main: Any = None) -> None:
    """Refuse to start local worker processes from the top level of a script without a main guard.

    Dask starts its workers with the 'spawn' method, which imports the script again in every new process:
    an unguarded `connect()` there starts a cluster inside each worker, and Dask reports only
    'Nanny failed to start' under screens of tracebacks. Judged from the line of the script's top-level
    code that led here: unindented and not itself an `if __name__ == ...` line means unguarded.
    """
    main = main if main is not None else sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None):
        return  # an interactive session or a notebook: nothing is imported again
    spec_name = getattr(getattr(main, "__spec__", None), "name", "") or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return  # `python -m package`: multiprocessing does not import a package's __main__ again
    if multiprocessing.parent_process() is not None and main.__name__ == "__mp_main__":
        raise ClusterError(MAIN_GUARD_MESSAGE.format(script=main.__file__))  # the re-import itself
    for frame_info in stack if stack is not None else inspect.stack(context=1)[1:]:
        frame = frame_info.frame
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            line = linecache.getline(frame.f_code.co_filename, frame_info.lineno)
            if line and not line[0].isspace() and not line.lstrip().startswith("if __name__"):
                raise ClusterError(MAIN_GUARD_MESSAGE.format(script=frame.f_code.co_filename)
                                   + f" (line {frame_info.lineno}: {line.strip()})")
            return


MAIN_GUARD_MESSAGE = (
    "a local cluster cannot start from the top level of {script}: Dask starts each worker process by importing "
    "the script again, which would start another cluster in every worker. Put the code that starts the "
    "cluster under a main guard:\n\n    if __name__ == \"__main__\":\n        client = workbench.connect(workers=2)"
    "\n        ...")


def check_local_start(workers: int | None, kind: str = "auto", threads_per_worker: int = 1,
                      oversubscribe: bool = False) -> str:
    """What `connect` refuses before it starts a cluster here (see its arguments); returns the kind it
    would start. The CLI asks first, so that the machine's capacity is said before the run's own checks."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError("workers", workers, "an integer >= 1")
    if isinstance(threads_per_worker, bool) or not isinstance(threads_per_worker, int) or threads_per_worker < 1:
        raise ConfigError("threads_per_worker", threads_per_worker, "an integer >= 1")
    chosen = choose_kind(kind, workers)
    if not isinstance(oversubscribe, bool):
        raise ConfigError("oversubscribe", oversubscribe, "True or False")
    if chosen == "cpu" and not oversubscribe:
        check_local_capacity(workers or 2, threads_per_worker, CPU_COUNT, MEMORY_LIMIT)
    return chosen


def connect(
    scheduler: str | None = None,
    workers: int | None = None,
    kind: str = "auto",
    threads_per_worker: int = 1,
    dashboard_address: str | None = "127.0.0.1:8787",
    security: Any = None,
    timeout_s: float = 10.0,
    oversubscribe: bool = False,
    **cluster_options: Any,
) -> Client:
    """A Dask client for training.

    scheduler: address of an existing scheduler (`tcp://host:8786`, `tls://...`); None starts one here.
    workers: worker processes to start (default: one per GPU, else 2; more than the GPUs share them).
    kind: 'auto', 'cpu' or 'cuda' for a cluster started here.
    security: a `distributed.Security` (see `security_from_files`), passed through untouched; for a
    cluster started here also True: TLS with temporary self-signed certificates (needs `cryptography`).
    oversubscribe: start more local workers than this machine holds (refused otherwise, see
    `check_local_capacity`).
    A cluster started here is closed with the client: use `shutdown(client)` or `client_session(...)`.
    Whatever interrupts starting it (Ctrl-C, an error), no worker process is left behind.
    """
    if security is False:
        security = None
    if security is not None and security is not True and not isinstance(security, Security):
        raise ConfigError("security", security, "None, True (a temporary TLS setup here) or a distributed.Security",
                          "Build one with workbench.security_from_files(ca_file, cert, key)")
    if scheduler is not None:
        return _connect_existing(scheduler, security, timeout_s)
    chosen = check_local_start(workers, kind, threads_per_worker, oversubscribe)
    check_main_guard()
    if security is True:
        security = _temporary_security()  # made here, so a missing `cryptography` is a ConfigError
    with dask.config.set(TRAINING_CONFIG), _no_process_left_if_interrupted():
        gpus = count_gpus() if chosen == "cuda" else 0
        if chosen == "cuda" and (workers or gpus) <= gpus:
            from dask_cuda import LocalCUDACluster

            local = _started_where_a_signal_reaches(lambda: LocalCUDACluster(
                n_workers=workers, threads_per_worker=threads_per_worker, dashboard_address=dashboard_address,
                security=security, device_memory_limit=0, **cluster_options,
            ))
        elif chosen == "cuda":
            message = placement_message(workers, gpus)
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
            local = _started_where_a_signal_reaches(lambda: SharedGpuCluster(
                gpus, n_workers=workers, threads_per_worker=threads_per_worker, processes=True,
                dashboard_address=dashboard_address, security=security, **cluster_options,
            ))
        else:
            local = _started_where_a_signal_reaches(lambda: LocalCluster(
                n_workers=workers or 2, threads_per_worker=threads_per_worker, processes=True,
                dashboard_address=dashboard_address, security=security, **cluster_options,
            ))
        keep_restarting_nannies(local)  # a worker killed twice within 15 s comes back (cluster/restarts.py)
        client = Client(local, security=local.security if security is not None else None)
    client._workbench_owns_cluster = True  # type: ignore[attr-defined]
    return client


def _started_where_a_signal_reaches(start: Callable[[], T]) -> T:
    """`start()` on a thread of its own while the main thread waits in short slices. Python runs a signal's
    handler in the main thread, when that thread next runs: Dask's `sync` waits in 10 s slices, and a
    Ctrl-C or SIGTERM the kernel delivered to another thread of the process (any may take it) waited for
    the slice's end, while the start-up went on (an interrupted start-up of 6 workers ended 16 s after
    the signal, measured; 1-5 s when the main thread took it)."""
    if threading.current_thread() is not threading.main_thread():
        return start()
    done, outcome = threading.Event(), {}

    def run() -> None:
        try:
            outcome["value"] = start()
        except BaseException as error:  # handed to the main thread, which raises it
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="workbench-cluster-start", daemon=True).start()
    while not done.wait(SIGNAL_CHECK_S):
        pass
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


SIGNAL_CHECK_S = 0.1  # how often the main thread wakes to run a signal's handler while a cluster starts


@contextlib.contextmanager
def _no_process_left_if_interrupted() -> Iterator[None]:
    """Kill the processes started inside the block (and theirs) if it does not complete: a cluster whose
    start-up is interrupted leaves its worker processes running otherwise (hundreds, once, measured)."""
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    clusters_before = set(SpecCluster._instances)
    try:
        yield
    except BaseException:
        # A cluster whose start-up was cut short is not left to Dask's exit hook (`close_clusters`): it
        # waited 10 s on a start that never ends before the interrupted command could exit (measured).
        # Its processes are killed below; the object holds nothing else.
        for cluster in set(SpecCluster._instances) - clusters_before:
            SpecCluster._instances.discard(cluster)
        # Again while new ones appear: the cluster's event-loop thread may still be spawning workers.
        for _ in range(20):
            started = [child for child in me.children(recursive=True) if child.pid not in before]
            if not started:
                break
            for child in started:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            psutil.wait_procs(started, timeout=5)
        raise


def shutdown(client: Client) -> None:
    """Close `client`, and the cluster with it when `connect()` started that cluster."""
    owned = getattr(client, "_workbench_owns_cluster", False)
    local = client.cluster if owned else None
    client.close()
    if local is not None:
        try:
            local.close()
        except KeyError as error:
            # dask/distributed#5407: a worker's "remove" reaches the cluster's status watcher after the
            # scheduler forgot it (a killed worker restarted by its nanny, seen in CI at teardown). It
            # is raised from the last step of `close`, after the workers and the scheduler were closed.
            logger.debug("a worker removed twice while the cluster closed (%s): closed anyway", error)


@contextlib.contextmanager
def client_session(**options: Any) -> Iterator[Client]:
    """`with workbench.client_session(workers=2) as client:` — `connect(**options)` closed on exit."""
    client = connect(**options)
    try:
        yield client
    finally:
        shutdown(client)


def security_from_files(ca_file: str | os.PathLike | None, cert: str | os.PathLike | None,
                        key: str | os.PathLike | None = None,
                        names: tuple[str, str, str] = ("ca_file", "cert", "key")) -> Security | None:
    """A client's `distributed.Security` for a TLS scheduler, from PEM files; None when no file is given.

    ca_file: the cluster's CA certificate; cert: this client's certificate; key: its private key (may be
    left out when appended to `cert`), as `dask scheduler`/`dask worker --tls-ca-file/--tls-cert/--tls-key`
    take them. Every file must exist, be readable and hold PEM; otherwise `ConfigError` names the
    parameter (`names`: how the caller calls them, e.g. the command's flags).
    """
    ca_name, cert_name, key_name = names
    if not (ca_file or cert or key):
        return None
    for name, path in ((ca_name, ca_file), (cert_name, cert), (key_name, key)):
        if path:
            _check_readable(name, os.fspath(path))
    if not ca_file:
        raise ConfigError(ca_name, ca_file, f"the cluster's CA certificate (PEM) together with {cert_name}")
    if not cert:
        raise ConfigError(cert_name, cert, f"this client's certificate (PEM) together with {ca_name}",
                          "Dask's TLS authenticates both sides: the scheduler checks the client's certificate")
    try:
        ssl.create_default_context(cafile=os.fspath(ca_file))
    except (ssl.SSLError, ValueError) as error:
        raise ConfigError(ca_name, os.fspath(ca_file), "a PEM CA certificate file", f"{error}") from None
    try:
        ssl.create_default_context().load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
    except (ssl.SSLError, ValueError) as error:
        hint = f"{error}" if key else f"{error}; give the private key with {key_name} or append it to the file"
        raise ConfigError(cert_name, os.fspath(cert), "a PEM certificate" + (f" matching {key_name}" if key else
                          " followed by its private key"), hint) from None
    return Security(tls_ca_file=os.fspath(ca_file), tls_client_cert=os.fspath(cert),
                    tls_client_key=os.fspath(key) if key else None, require_encryption=True)


def _check_readable(name: str, path: str) -> None:
    if not os.path.exists(path):
        raise ConfigError(name, path, "an existing PEM file", "No such file")
    if not os.path.isfile(path):
        raise ConfigError(name, path, "a PEM file", "It is not a regular file")
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ConfigError(name, path, "a readable PEM file", f"{type(error).__name__}: {error.strerror}") from None


def _temporary_security() -> Security:
    try:
        return Security.temporary()
    except ImportError:
        raise ConfigError("security", True, "True only where the 'cryptography' package is installed",
                          "pip install cryptography (it makes the temporary certificates), or pass a "
                          "distributed.Security with certificate files") from None


# A port that refuses every connection this long has no scheduler behind it (one starting listens within a
# second or two): said then, not after the whole `timeout_s` that a scheduler which does not answer gets.
REFUSED_S = 3.0


def _refused_throughout(address: str, within_s: float) -> bool:
    """Whether every TCP connection to `address` was refused for `within_s` seconds. Anything else (it
    connects, no answer, no route, an address that is not host:port) is for Dask's own connect to judge."""
    try:
        host, port = get_address_host_port(address)
    except (ValueError, TypeError):
        return False
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, within_s))):
                return False
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
        except OSError:
            return False


def _connect_existing(address: str, security: Any, timeout_s: float) -> Client:
    check_connection(address, security, timeout_s)
    refused_s = min(REFUSED_S, timeout_s)
    if _refused_throughout(address, refused_s):
        raise ClusterError(
            f"could not reach the Dask scheduler at {address}: the connection was refused for {refused_s:g} s "
            "(nothing listens on that port). Check that 'dask scheduler' runs there and the address and port "
            "are right.")
    try:
        return Client(address, security=security, timeout=f"{timeout_s}s")
    except (OSError, TimeoutError, ValueError) as error:
        text = f"{error}"
        hint = ("Check that the CA file is the cluster's and the certificate and key are ones it signed"
                if "TLS" in text or "SSL" in text else
                "Check that 'dask scheduler' runs there and the address and port are right")
        raise ClusterError(
            f"could not reach the Dask scheduler at {address} within {timeout_s:g} s ({type(error).__name__}: "
            f"{text}). {hint}."
        ) from None


def check_connection(address: str, security: Any, timeout_s: float = 10.0) -> None:
    """Refuse, before anything connects, an address, timeout or security that cannot reach a scheduler
    (a command checks this before it changes anything of its process, as `workbench dashboard` does)."""
    if not isinstance(address, str) or "://" not in address and ":" not in address:
        raise ConfigError("scheduler", address, "an address such as 'tcp://127.0.0.1:8786' or 'tls://host:8786'")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError("timeout_s", timeout_s, "a number of seconds > 0")
    if security is True:
        raise ConfigError("security", True, "a distributed.Security holding the cluster's certificates",
                          "security=True makes throwaway certificates, good only for a cluster started here; "
                          "use workbench.security_from_files(ca_file, cert, key)")
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    effective = security if security is not None else Security()  # None: Dask's configuration decides
    if scheme == "tls" and not (effective.tls_ca_file and effective.tls_client_cert):
        raise ConfigError("security", security, "TLS certificates for a tls:// scheduler",
                          "Pass security=workbench.security_from_files(ca_file, cert, key); on the "
                          "command line --tls-ca-file, --tls-cert and --tls-key")
    if scheme == "tcp" and effective.require_encryption:
        raise ConfigError("scheduler", address, "a tls:// address when TLS is required",
                          "A scheduler started with certificates listens on tls://host:port")
