"""Run DPDK's ``dpdk-testpmd`` as a managed subprocess (the peer for interop tests and the DPDK baseline).

Two roles, mirroring ``shared/tools/dpdk-loopback.sh``:

* ``Testpmd.vhost(sock)``: the device side, ``--vdev net_vhost0,iface=SOCK,queues=N[,client=1]``;
* ``Testpmd.virtio_user(sock)``: the driver side, ``--single-file-segments --vdev virtio_user0,path=SOCK,...``.

Both run with ``--no-huge --no-pci -m 512 --file-prefix=<unique>`` and one forwarding core.

How it is driven.  testpmd runs interactively (``-i``).  Commands go in through a pipe on stdin; stdout and
stderr go to a pseudo-terminal, because testpmd writes command output with stdio, which is fully buffered on
a pipe (``show port stats`` would only appear at exit) and line buffered on a terminal.  A reader thread
drains the terminal into an in-memory log (and optionally a file) all the time, so testpmd never blocks on a
full terminal, and counts the ``testpmd> `` prompts: the output of the k-th command is the text between the
k-th and the (k+1)-th prompt.  Counters come from ``show port stats <port>`` (``PortStats``) and
``show fwd stats all`` / ``stop`` (``FwdStats``), parsed as ``Name: <int>`` pairs.

Cleanup.  Every testpmd gets its own session (process group).  ``close()`` sends ``stop`` and ``quit``, falls
back to SIGTERM then SIGKILL on the group, then removes what the run leaves on disk: the runtime directory
``/var/run/dpdk/<file-prefix>`` (testpmd never removes it) and the vhost-user socket if this process was the
side that created it.  A ``weakref.finalize`` (run at interpreter exit at the latest) does the same for an
object that was never closed.  Neither runs when this process is killed -9: its testpmd then quits (EOF on its
stdin) and leaves its runtime directory, which the next ``launch()`` removes (``sweep_stale_runtime_dirs``).

Core pinning.  ``lcores=(main_cpu, fwd_cpu)``: the EAL main lcore (idle in interactive mode: it blocks
reading stdin) and the forwarding lcore (busy-polls at 100%).  On a 2-CPU box the defaults put the vhost
forwarder on CPU 0 and the virtio forwarder on CPU 1, as the reference script does; a caller that runs its own
side in Python picks ``fwd_cpu`` for testpmd and pins itself to ``free_cpus(tp)``.

Only the Python standard library is used.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import pty
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Iterable, Sequence

__all__ = [
    "APT_HINT",
    "FinalStats",
    "FwdStats",
    "PortStats",
    "Testpmd",
    "TestpmdError",
    "find_testpmd",
    "free_cpus",
    "measure_dpdk_pair",
    "skip_reason",
    "sweep_stale_runtime_dirs",
]

APT_HINT = "apt-get install -y dpdk-dev"
PROMPT = b"testpmd> "
# Another thread of testpmd (vhost-user messages: "VHOST_CONFIG: ...", port events: "\nPort 0: ... event") prints
# whole lines while the main thread prints the prompt a few bytes at a time: "t" + a log line + "estpmd> ". The
# prompt is found with such lines between any two of its bytes (a missed prompt put every later command one
# prompt behind: "no prompt after 10s").
_ASYNC_LINE = rb"(?:[A-Z][A-Z0-9_]*: [^\n]*\n|\n*Port \d+: [^\n]*\n)"
PROMPT_RE = re.compile((rb"(?:" + _ASYNC_LINE + rb")*").join(re.escape(bytes([c])) for c in PROMPT))
FWD_MODES = ("mac", "io", "rxonly", "txonly", "macswap", "csum", "flowgen", "icmpecho", "5tuple", "noisy")

# Log lines that look like errors but are expected with these vdevs.
BENIGN_ERRORS = (
    "Error during enabling promiscuous mode",  # virtio_user has no promiscuous control
    "Error during enabling allmulticast mode",
    "-FAILED: 0",  # net_vhost's dump of the device status bits
    "error handling mode: none",  # `show port info`
)
_ERROR_RE = re.compile(r"(?i)\b(error|fail(ed|s|ure)?|cannot|invalid|panic|nack)\b")


# --------------------------------------------------------------------------------------------- discovery

def find_testpmd() -> str | None:
    """Path of dpdk-testpmd, or None.  ``$VRING_TESTPMD`` overrides the PATH lookup."""
    env = os.environ.get("VRING_TESTPMD")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    for name in ("dpdk-testpmd", "testpmd"):
        path = shutil.which(name)
        if path:
            return path
    return None


def skip_reason() -> str:
    """Why DPDK interop cannot run here; '' when it can (so ``skipif(bool(r), reason=r)`` works)."""
    if find_testpmd() is None:
        return f"dpdk-testpmd not found; {APT_HINT}"
    if not hasattr(os, "sched_getaffinity"):
        return "dpdk-testpmd needs Linux"
    return ""


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def free_cpus(*testpmds: "Testpmd") -> set[int]:
    """CPUs this process may use that none of ``testpmds`` forwards on (pin your own busy loop there)."""
    busy = {tp.fwd_cpu for tp in testpmds}
    cpus = set(_allowed_cpus()) - busy
    return cpus or set(_allowed_cpus())


# --------------------------------------------------------------------------------------------- counters

def _snake(name: str) -> str:
    return name.strip().lower().replace("-", "_")


_PAIR_RE = re.compile(r"([A-Za-z][A-Za-z0-9_-]*(?:-[A-Za-z0-9_]+)*):\s+(-?\d+)")


def _pairs(text: str) -> dict[str, int]:
    return {_snake(k): int(v) for k, v in _PAIR_RE.findall(text)}


@dataclasses.dataclass(frozen=True)
class PortStats:
    """One ``show port stats`` block.  Counters are cumulative since port start (or ``clear port stats``);
    the ``*_pps``/``*_bps`` rates are testpmd's, over the interval since the previous ``show`` of that port."""

    port: int
    rx_packets: int = 0
    rx_missed: int = 0
    rx_bytes: int = 0
    rx_errors: int = 0
    rx_nombuf: int = 0
    tx_packets: int = 0
    tx_errors: int = 0
    tx_bytes: int = 0
    rx_pps: int = 0
    rx_bps: int = 0
    tx_pps: int = 0
    tx_bps: int = 0
    time: float = 0.0  # time.monotonic() when the command returned
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_pairs(cls, port: int, pairs: dict[str, int], when: float) -> "PortStats":
        names = {f.name for f in dataclasses.fields(cls)} - {"port", "time", "raw"}
        return cls(port=port, time=when, raw=dict(pairs), **{k: v for k, v in pairs.items() if k in names})

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d


@dataclasses.dataclass(frozen=True)
class FwdStats:
    """One per-port block of ``show fwd stats all`` or ``stop``: counters since forwarding (re)started.
    ``rx_dropped`` is the port's missed count, ``tx_dropped`` what the forwarder could not transmit."""

    port: int
    rx_packets: int = 0
    rx_dropped: int = 0
    rx_total: int = 0
    tx_packets: int = 0
    tx_dropped: int = 0
    tx_total: int = 0
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_pairs(cls, port: int, pairs: dict[str, int]) -> "FwdStats":
        names = {f.name for f in dataclasses.fields(cls)} - {"port", "raw"}
        return cls(port=port, raw=dict(pairs), **{k: v for k, v in pairs.items() if k in names})

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d


@dataclasses.dataclass
class FinalStats:
    """What ``close()`` collected: last port counters, forward counters of the last run, exit status."""

    ports: dict[int, PortStats]
    fwd: dict[int, FwdStats]
    returncode: int | None
    clean: bool  # exited by itself after ``quit``, status 0, no signal needed

    def as_dict(self) -> dict:
        return {
            "ports": {p: s.as_dict() for p, s in self.ports.items()},
            "fwd": {p: s.as_dict() for p, s in self.fwd.items()},
            "returncode": self.returncode,
            "clean": self.clean,
        }


_PORT_BLOCK_RE = re.compile(r"NIC statistics for port (\d+)\s*#+\n(.*?)\n\s*#{20,}", re.S)
_FWD_BLOCK_RE = re.compile(r"Forward statistics for port (\d+)\s*-+\n(.*?)\n\s*-{20,}", re.S)


def parse_port_stats(text: str, when: float = 0.0) -> dict[int, PortStats]:
    return {int(p): PortStats.from_pairs(int(p), _pairs(body), when) for p, body in _PORT_BLOCK_RE.findall(text)}


def parse_fwd_stats(text: str) -> dict[int, FwdStats]:
    return {int(p): FwdStats.from_pairs(int(p), _pairs(body)) for p, body in _FWD_BLOCK_RE.findall(text)}


# --------------------------------------------------------------------------------------------- process

class TestpmdError(RuntimeError):
    """testpmd did not start, died, or did not answer in time.  The message ends with the log's tail."""

    __test__ = False  # not a pytest test class


_prefix_counter = itertools.count()


def _unique_prefix() -> str:
    return f"vr{os.getpid()}x{next(_prefix_counter)}{secrets.token_hex(2)}"


def _runtime_base() -> str:
    if os.geteuid() == 0:
        return "/var/run/dpdk"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", "dpdk")


_OUR_PREFIX = re.compile(r"vr(\d+)x\d+[0-9a-f]{4}", re.ASCII)
_PID_MAX_LIMIT = 1 << 22   # no pid reaches it (linux/threads.h, 64-bit): a larger one is no name of ours


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        pass
    return True


def _runtime_dir_in_use(path: str) -> bool:
    """A running EAL primary holds a write lock on its ``config`` file (a byte range of it) for its whole life."""
    try:   # EAL's config is a regular file: nothing else is opened (a symlink to a device, a FIFO)
        fd = os.open(os.path.join(path, "config"),
                     os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True   # cannot tell (a symlink among them): leave it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)   # also drops the lock just taken
    return False


def sweep_stale_runtime_dirs(base: str | None = None) -> list[str]:
    """Remove the runtime directories our earlier runs left behind when they were killed -9 (close() and the
    finalizer cannot run then, and testpmd never removes its own): ours by name (``_unique_prefix``), the
    process that made the name gone, and no testpmd holding the directory's ``config`` lock (a regular file:
    anything else there, a symlink included, is not EAL's). Anything else under ``base`` (symlinks named like
    ours too) is left alone. Returns the paths removed."""
    base = base or _runtime_base()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _OUR_PREFIX.fullmatch(name)
        path = os.path.join(base, name)
        if not m or not 0 < int(m.group(1)) < _PID_MAX_LIMIT or _pid_alive(int(m.group(1))):
            continue
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):   # a file, or a symlink (to somewhere not ours)
                continue
        except OSError:
            continue
        if _runtime_dir_in_use(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _cpu_args(main_cpu: int, fwd_cpu: int) -> list[str]:
    if main_cpu != fwd_cpu:
        return ["-l", f"{main_cpu},{fwd_cpu}", "--main-lcore", str(main_cpu)]
    # one CPU: two lcores mapped onto it
    return ["--lcores", f"0@{main_cpu},1@{fwd_cpu}", "--main-lcore", "0"]


class _Child:
    """The OS resources of one testpmd run; reaped by ``Testpmd.close()`` or by a finalizer."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.master_fd: int | None = None
        self.reader: threading.Thread | None = None
        self.remove_socket: str | None = None  # socket we (the testpmd we started) own
        self.runtime_dir: str | None = None
        self.log_file = None

    def signal_group(self, sig: int) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # own session: pgid == pid
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.send_signal(sig)

    def terminate(self, grace: float = 5.0) -> None:
        proc = self.proc
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            self.signal_group(sig)
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        # anything else left in the group (testpmd does not fork, but be thorough)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> None:
        proc = self.proc
        if proc is not None and proc.stdin is not None:
            try:  # EOF on stdin ends testpmd's command loop: it quits once it reaches its prompt
                proc.stdin.close()
            except OSError:
                pass
        self.terminate()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(5.0)
        if self.master_fd is not None:
            try:
                os.close(self.master_fd)
            except OSError:
                pass
            self.master_fd = None
        if self.log_file is not None:
            try:
                self.log_file.close()
            except OSError:
                pass
            self.log_file = None
        if self.remove_socket and _is_socket(self.remove_socket):
            try:
                os.unlink(self.remove_socket)
            except OSError:
                pass
        rd = self.runtime_dir
        if rd and os.path.isdir(rd):
            shutil.rmtree(rd, ignore_errors=True)


class Testpmd:
    """One dpdk-testpmd process in interactive mode.  Build it with ``Testpmd.vhost()`` or
    ``Testpmd.virtio_user()``, then ``with tp:`` (or ``start()`` ... ``close()``).

    ``start()`` returns once testpmd shows its prompt (ports configured and started) and, for the side
    that creates the socket, once the socket exists; with ``autostart`` it then starts forwarding.
    Exception: ``virtio_user(server=True)`` blocks in ``accept()`` until a vhost client connects, so its
    ``start()`` returns as soon as the socket exists; call ``wait_ready()`` after starting the client.
    """

    __test__ = False

    def __init__(
        self,
        role: str,
        socket_path: str,
        vdev: str,
        *,
        creates_socket: bool,
        prompt_needs_peer: bool,
        lcores: tuple[int, int],
        burst: int = 32,
        fwd: str = "mac",
        queues: int = 1,
        mbufs: int = 16384,
        mem_mb: int = 512,
        tx_first: bool = False,
        autostart: bool = True,
        eal_extra: Sequence[str] = (),
        extra: Sequence[str] = (),
        file_prefix: str | None = None,
        log_path: str | None = None,
        testpmd: str | None = None,
    ) -> None:
        if fwd not in FWD_MODES:
            raise ValueError(f"unknown forward mode {fwd!r}; one of {FWD_MODES}")
        self.role = role
        self.socket_path = os.fspath(socket_path)
        self.vdev = vdev
        self.creates_socket = creates_socket
        self.prompt_needs_peer = prompt_needs_peer
        self.main_cpu, self.fwd_cpu = int(lcores[0]), int(lcores[1])
        self.burst = burst
        self.fwd = fwd
        self.queues = queues
        self.tx_first = tx_first
        self.autostart = autostart
        self.file_prefix = file_prefix or _unique_prefix()
        self.log_path = log_path
        self.testpmd = testpmd or find_testpmd()
        eal = [
            *_cpu_args(self.main_cpu, self.fwd_cpu),
            "--no-huge", "--no-pci", "-m", str(mem_mb), f"--file-prefix={self.file_prefix}",
            *eal_extra,
            "--vdev", vdev,
        ]
        app = ["-i", f"--forward-mode={fwd}", "--nb-cores=1", f"--burst={burst}", f"--total-num-mbufs={mbufs}"]
        if queues > 1:
            app += [f"--rxq={queues}", f"--txq={queues}"]
        app += list(extra)
        self.argv = [self.testpmd or "dpdk-testpmd", *eal, "--", *app]

        self._child = _Child()
        self._finalizer = weakref.finalize(self, self._child.reap)
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._prompt_starts: list[int] = []
        self._prompt_ends: list[int] = []
        self._scan = 0
        self._eof = False
        self._consumed = 0  # prompts accounted for by wait_ready()/command()
        self._cmd_lock = threading.Lock()
        self._ready = False
        self._forwarding = False
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from launch to first prompt
        self.final: FinalStats | None = None
        self._runtime_dir_seen = False

    # ------------------------------------------------------------------ constructors

    @classmethod
    def vhost(
        cls,
        socket_path: str,
        client: bool = False,
        queues: int = 1,
        lcores: tuple[int, int] | None = None,
        burst: int = 32,
        fwd: str = "mac",
        extra: Sequence[str] = (),
        *,
        fwd_cpu: int | None = None,
        devargs: dict | None = None,
        **kw,
    ) -> "Testpmd":
        """testpmd with ``net_vhost0`` (the vhost-user backend).  Server by default: it creates the socket
        and waits for a frontend; ``client=True`` connects to a frontend's socket (retrying every second).
        ``devargs`` adds vdev options (``tso``, ``linear-buffer``, ...).  Other keywords: see ``__init__``."""
        vdev = f"net_vhost0,iface={socket_path},queues={queues}"
        if client:
            vdev += ",client=1"
        vdev += "".join(f",{k}={_devval(v)}" for k, v in (devargs or {}).items())
        return cls(
            "vhost", socket_path, vdev, creates_socket=not client, prompt_needs_peer=False,
            lcores=_lcores(lcores, fwd_cpu, default=(1, 0)), burst=burst, fwd=fwd, queues=queues, extra=extra,
            **kw,
        )

    @classmethod
    def virtio_user(
        cls,
        socket_path: str,
        packed: bool = False,
        in_order: bool = True,
        mrg_rxbuf: bool = True,
        queue_size: int = 256,
        server: bool = False,
        tx_first: bool = True,
        queues: int = 1,
        lcores: tuple[int, int] | None = None,
        burst: int = 32,
        fwd: str = "mac",
        extra: Sequence[str] = (),
        *,
        fwd_cpu: int | None = None,
        devargs: dict | None = None,
        **kw,
    ) -> "Testpmd":
        """testpmd with ``virtio_user0`` (the virtio-net driver over vhost-user).  Client by default;
        ``server=True`` creates the socket and blocks until a backend connects.  ``tx_first``: the
        autostart (or ``start_forwarding()``) is ``start tx_first``, which primes the loop with one burst."""
        vdev = (
            f"virtio_user0,path={socket_path},queues={queues},in_order={int(bool(in_order))},"
            f"packed_vq={int(bool(packed))},mrg_rxbuf={int(bool(mrg_rxbuf))},queue_size={queue_size}"
        )
        if server:
            vdev += ",server=1"
        vdev += "".join(f",{k}={_devval(v)}" for k, v in (devargs or {}).items())
        eal_extra = ["--single-file-segments", *kw.pop("eal_extra", ())]
        tp = cls(
            "virtio_user", socket_path, vdev, creates_socket=server, prompt_needs_peer=server,
            lcores=_lcores(lcores, fwd_cpu, default=(0, 1)), burst=burst, fwd=fwd, queues=queues,
            tx_first=tx_first, eal_extra=eal_extra, extra=extra, **kw,
        )
        tp.packed, tp.in_order, tp.mrg_rxbuf, tp.queue_size, tp.server = packed, in_order, mrg_rxbuf, queue_size, server
        return tp

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child.proc else None

    @property
    def returncode(self) -> int | None:
        return self._child.proc.poll() if self._child.proc else None

    @property
    def running(self) -> bool:
        return self._child.proc is not None and self._child.proc.poll() is None

    @property
    def runtime_dir(self) -> str:
        return self._child.runtime_dir or os.path.join(_runtime_base(), self.file_prefix)

    @property
    def forwarding(self) -> bool:
        return self._forwarding

    def launch(self) -> "Testpmd":
        """Spawn testpmd and the log reader; does not wait."""
        if self._child.proc is not None:
            raise TestpmdError("already launched")
        if self.testpmd is None:
            raise TestpmdError(skip_reason())
        if self.creates_socket and _is_socket(self.socket_path):
            os.unlink(self.socket_path)  # stale socket of an earlier run: bind() would fail
        try:
            sweep_stale_runtime_dirs()
        except Exception:  # noqa: BLE001 - the leftovers of earlier runs never stop this one
            pass
        self._child.runtime_dir = os.path.join(_runtime_base(), self.file_prefix)
        if self.creates_socket:
            self._child.remove_socket = self.socket_path
        if self.log_path:
            self._child.log_file = open(self.log_path, "wb")
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=slave, stderr=slave,
                start_new_session=True, close_fds=True,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self._child.proc = proc
        self._child.master_fd = master
        self.started_at = time.monotonic()
        t = threading.Thread(target=self._read_loop, args=(master,), name=f"testpmd-{proc.pid}", daemon=True)
        self._child.reader = t
        t.start()
        return self

    def start(self, timeout: float = 60.0) -> "Testpmd":
        """Launch and wait until usable (see the class docstring); closes everything on failure."""
        try:
            if self._child.proc is None:
                self.launch()
            if self.prompt_needs_peer:  # virtio_user server: probe blocks in accept() until a backend connects
                self.wait_socket(timeout)
            else:
                self.wait_ready(timeout, autostart=False)
                if self.creates_socket:  # net_vhost creates its socket during probe, before the prompt
                    self.wait_socket(5.0)
                if self.autostart:
                    self.start_forwarding()
        except BaseException:
            self.close(timeout=5.0)
            raise
        return self

    def wait_socket(self, timeout: float = 30.0) -> None:
        """Wait until ``socket_path`` is a Unix socket (or raise if testpmd dies first)."""
        deadline = time.monotonic() + timeout
        while not _is_socket(self.socket_path):
            if not self.running:
                raise self._error(f"exited (status {self.returncode}) before creating {self.socket_path}")
            if time.monotonic() > deadline:
                raise self._error(f"no socket {self.socket_path} after {timeout:.0f}s")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 60.0, autostart: bool | None = None) -> None:
        """Wait for the first prompt (EAL init done, port probed, configured and started); then start
        forwarding if ``autostart`` (default: the constructor's).  Raises if the vdev failed to probe:
        testpmd then still shows a prompt, with no port."""
        if self._ready:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._prompt_ends or self._eof, timeout)
            if not self._prompt_ends:
                why = f"exited (status {self.returncode})" if self._eof else f"no prompt after {timeout:.0f}s"
                raise self._error(why)
            self._consumed = 1
            self._ready = True
            self.ready_after = time.monotonic() - (self.started_at or time.monotonic())
            head = bytes(self._buf[: self._prompt_ends[0]])
        for bad in (b"No probed ethernet devices", b"probe failed", b"Fail to start port", b"Fail to configure port"):
            if bad in head:
                raise self._error(f"{self.vdev.split(',')[0]} did not come up ({bad.decode()!r})")
        if self.autostart if autostart is None else autostart:
            self.start_forwarding()

    def close(self, timeout: float = 15.0) -> FinalStats:
        """Stop forwarding, read the final counters, ``quit``; kill if needed; remove socket and runtime dir.
        Idempotent: later calls return the same ``FinalStats``."""
        if self.final is not None:
            return self.final
        ports: dict[int, PortStats] = {}
        fwd: dict[int, FwdStats] = {}
        clean = False
        proc = self._child.proc
        try:
            if proc is not None and self.running and self._ready:
                try:
                    if self._forwarding:
                        fwd = self.stop_forwarding(timeout=timeout)
                    ports = self.stats_all(timeout=timeout)
                    self._send("quit")
                    proc.wait(timeout)
                    clean = proc.returncode == 0
                except (TestpmdError, subprocess.TimeoutExpired, OSError):
                    clean = False
        finally:
            self._child.reap()
            self._finalizer.detach()
        self.final = FinalStats(ports=ports, fwd=fwd, returncode=self.returncode, clean=clean)
        return self.final

    def kill(self) -> None:
        """SIGKILL the process group and clean up, without asking testpmd."""
        self._child.signal_group(signal.SIGKILL)
        if self._child.proc is not None:
            self._child.proc.wait(10)
        self.close(timeout=1.0)

    def __enter__(self) -> "Testpmd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited({self.returncode})" if self._child.proc else "new"
        return f"<Testpmd {self.role} {self.socket_path} pid={self.pid} {state}>"

    # ------------------------------------------------------------------ commands

    def command(self, cmd: str, timeout: float = 10.0) -> str:
        """Send one interactive command; return its output (text between the echo and the next prompt)."""
        if "\n" in cmd:
            raise ValueError("one command at a time")
        if not self._ready:
            raise TestpmdError(f"{self!r}: not ready (call start()/wait_ready())")
        with self._cmd_lock:
            idx = self._consumed
            self._send(cmd)
            self._consumed += 1
            with self._cond:
                self._cond.wait_for(lambda: len(self._prompt_ends) > idx or self._eof, timeout)
                if len(self._prompt_ends) <= idx:
                    raise self._error(f"{cmd!r}: " + ("testpmd exited" if self._eof else f"no prompt after {timeout}s"))
                raw = bytes(self._buf[self._prompt_ends[idx - 1]: self._prompt_starts[idx]])
        text = raw.decode("utf-8", "replace").replace("\r", "")
        first, _, rest = text.partition("\n")  # drop the echoed command line
        return rest if first.strip() == cmd.strip() else text

    def start_forwarding(self, tx_first: bool | None = None, timeout: float = 10.0) -> str:
        """``start`` (or ``start tx_first``; default: the constructor's ``tx_first``)."""
        tx_first = self.tx_first if tx_first is None else tx_first
        out = self.command("start tx_first" if tx_first else "start", timeout)
        if "forwarding" not in out and "Packet forwarding already started" not in out:
            raise self._error(f"start failed: {out.strip()[-300:]}")
        self._forwarding = True
        return out

    def stop_forwarding(self, timeout: float = 10.0) -> dict[int, FwdStats]:
        """``stop``; returns the forward counters of the run that just ended (empty if none was running)."""
        out = self.command("stop", timeout)
        self._forwarding = False
        return parse_fwd_stats(out)

    def stats_all(self, timeout: float = 10.0) -> dict[int, PortStats]:
        out = self.command("show port stats all", timeout)
        return parse_port_stats(out, time.monotonic())

    def stats(self, port: int = 0, timeout: float = 10.0) -> PortStats:
        """Counters of one port (``show port stats <port>``), read now."""
        out = self.command(f"show port stats {port}", timeout)
        parsed = parse_port_stats(out, time.monotonic())
        if port not in parsed:
            raise self._error(f"no stats for port {port} in: {out.strip()[-300:]}")
        return parsed[port]

    def sample_rx(self, count: int, period: float = 1.0, port: int = 0, alive=None) -> tuple[list, list]:
        """``count`` Rx-rate samples of a port, one every ``period`` s (stopping early once ``alive()`` is
        false): testpmd's own Rx-pps, and RX-packets deltas over our monotonic clock."""
        t0 = time.monotonic()
        prev = self.stats(port)  # baseline: also resets testpmd's "since last show" window
        tp_pps: list[int] = []
        own_pps: list[float] = []
        for k in range(1, count + 1):
            delay = t0 + k * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if alive is not None and not alive():
                break
            cur = self.stats(port)
            tp_pps.append(cur.rx_pps)
            own_pps.append((cur.rx_packets - prev.rx_packets) / (cur.time - prev.time))
            prev = cur
        return tp_pps, own_pps

    def fwd_stats(self, timeout: float = 10.0) -> dict[int, FwdStats]:
        """Forward counters since forwarding started (``show fwd stats all``), without stopping."""
        return parse_fwd_stats(self.command("show fwd stats all", timeout))

    def clear_stats(self, timeout: float = 10.0) -> None:
        self.command("clear port stats all", timeout)

    def link_up(self, port: int = 0, timeout: float = 10.0) -> bool:
        m = re.search(r"Link status:\s*(\w+)", self.command(f"show port info {port}", timeout))
        return bool(m and m.group(1).lower() == "up")

    def wait_link_up(self, port: int = 0, timeout: float = 30.0, poll: float = 0.1) -> float:
        """Wait until the port's link is up (net_vhost: the frontend finished its setup).  Returns seconds."""
        t0 = time.monotonic()
        while not self.link_up(port):
            if time.monotonic() - t0 > timeout:
                raise self._error(f"port {port} link still down after {timeout:.0f}s")
            time.sleep(poll)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ log

    @property
    def log(self) -> str:
        """Everything testpmd printed so far (stdout and stderr interleaved, '\\r' removed)."""
        with self._cond:
            raw = bytes(self._buf)
        return raw.decode("utf-8", "replace").replace("\r", "")

    def log_offset(self) -> int:
        with self._cond:
            return len(self._buf)

    def wait_for_log(self, pattern: str, timeout: float = 30.0, since: int = 0) -> re.Match:
        """Wait until regex ``pattern`` matches the log (from byte offset ``since``)."""
        rx = re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        with self._cond:
            found: list[re.Match] = []

            def check() -> bool:
                m = rx.search(self._buf, since)
                if m:
                    found.append(m)
                return bool(m) or self._eof

            self._cond.wait_for(check, timeout)
            if not found:
                raise self._error(f"log never matched {pattern!r}" + (" (testpmd exited)" if self._eof else ""))
            return found[0]

    def error_lines(self, ignore: Iterable[str] = BENIGN_ERRORS) -> list[str]:
        """Log lines that look like errors, minus the known-benign ones."""
        ign = tuple(ignore)
        return [ln for ln in self.log.splitlines() if _ERROR_RE.search(ln) and not any(s in ln for s in ign)]

    # ------------------------------------------------------------------ internals

    def _send(self, cmd: str) -> None:
        proc = self._child.proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            raise self._error(f"cannot send {cmd!r}: not running")
        try:
            proc.stdin.write(cmd.encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise self._error(f"cannot send {cmd!r}: {e}") from e

    def _feed(self, chunk: bytes) -> None:
        """New output: the prompts in it (PROMPT_RE; from the end of the last one: a prompt may be in pieces)."""
        self._buf += chunk
        while True:
            m = PROMPT_RE.search(self._buf, self._scan)
            if m is None:
                break
            self._prompt_starts.append(m.start())
            self._prompt_ends.append(m.end())
            self._scan = m.end()

    def _read_loop(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every slave fd closed (testpmd exited), or master closed by reap()
                chunk = b""
            with self._cond:
                if not chunk:
                    self._eof = True
                    self._cond.notify_all()
                    return
                self._feed(chunk)
                if not self._runtime_dir_seen:  # EAL says where it keeps its files; trust it over our guess
                    m = re.search(rb"Multi-process socket (\S+)/mp_socket", self._buf)
                    if m:
                        self._runtime_dir_seen = True
                        found = m.group(1).decode()
                        if os.path.basename(found) == self.file_prefix:
                            self._child.runtime_dir = found
                self._cond.notify_all()
            lf = self._child.log_file
            if lf is not None:
                try:
                    lf.write(chunk)
                    lf.flush()
                except (OSError, ValueError):
                    pass

    def _error(self, what: str) -> TestpmdError:
        tail = "\n".join(self.log.splitlines()[-25:])
        return TestpmdError(f"{self.role} testpmd (pid {self.pid}): {what}\n--- log tail ---\n{tail}")


def _devval(v) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def _lcores(lcores: tuple[int, int] | None, fwd_cpu: int | None, default: tuple[int, int]) -> tuple[int, int]:
    """(main_cpu, fwd_cpu).  ``fwd_cpu`` alone: the main lcore goes on another allowed CPU if there is one.
    Neither: ``default`` indexes the allowed CPUs, so the two roles forward on different CPUs when there are two."""
    if lcores is not None:
        if fwd_cpu is not None and fwd_cpu != lcores[1]:
            raise ValueError("lcores and fwd_cpu disagree")
        return int(lcores[0]), int(lcores[1])
    cpus = _allowed_cpus()
    if fwd_cpu is None:  # defaults are positions in the allowed-CPU list: CPUs 0 and 1 on a plain 2-CPU box
        return cpus[default[0] % len(cpus)], cpus[default[1] % len(cpus)]
    others = [c for c in cpus if c != fwd_cpu]
    return (others[0] if others else fwd_cpu), fwd_cpu


# --------------------------------------------------------------------------------------------- baseline

def _script_median(values: Sequence[float]) -> float:
    """The median as dpdk-loopback.sh takes it: sorted, element ceil(n/2) (the lower middle for even n)."""
    s = sorted(values)
    return s[(len(s) + 1) // 2 - 1]


def measure_dpdk_pair(
    packed: bool = True,
    in_order: bool = True,
    seconds: float = 12.0,
    burst: int = 32,
    *,
    period: float = 2.0,
    warmup: int = 2,
    fwd: str = "mac",
    queue_size: int = 256,
    mrg_rxbuf: bool = True,
    socket_dir: str | None = None,
    timeout: float = 60.0,
) -> dict:
    """dpdk-loopback.sh in Python: net_vhost testpmd (forwarding on CPU 0) <-> virtio_user testpmd
    (forwarding on CPU 1), both ``--forward-mode=mac``, 64-byte packets primed by ``start tx_first``.

    Every ``period`` seconds for ``seconds`` the virtio side's port counters are read; the first ``warmup``
    samples are dropped and the median is taken the way the script does.  ``samples`` are testpmd's own
    Rx-pps (what the script greps); ``own_samples`` are RX-packets deltas over our monotonic clock.
    """
    tmpdir = tempfile.mkdtemp(prefix="vring-dpdk-", dir=socket_dir)
    sock = os.path.join(tmpdir, "vhost.sock")
    result: dict = {
        "packed": bool(packed), "in_order": bool(in_order), "burst": burst, "seconds": seconds,
        "period": period, "warmup": warmup, "fwd": fwd,
    }
    vhost = Testpmd.vhost(sock, burst=burst, fwd=fwd)
    virtio = Testpmd.virtio_user(
        sock, packed=packed, in_order=in_order, mrg_rxbuf=mrg_rxbuf, queue_size=queue_size,
        burst=burst, fwd=fwd, tx_first=True, autostart=False,
    )
    try:
        vhost.start(timeout)
        virtio.start(timeout)
        result["startup_s"] = {"vhost": round(vhost.ready_after or 0, 3), "virtio": round(virtio.ready_after or 0, 3)}
        result["link_up_s"] = round(vhost.wait_link_up(timeout=timeout), 3)
        virtio.start_forwarding()
        tp_pps, own_pps = virtio.sample_rx(max(1, round(seconds / period)), period)
        kept = tp_pps[warmup:] or tp_pps
        own_kept = own_pps[warmup:] or own_pps
        result.update(
            all_samples=tp_pps,
            samples=kept,
            median_rx_pps=_script_median(kept),
            own_samples=[round(x) for x in own_kept],
            own_median_rx_pps=round(_script_median(own_kept)),
        )
    finally:
        vfinal = virtio.close()
        hfinal = vhost.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    result["virtio"] = vfinal.as_dict()
    result["vhost"] = hfinal.as_dict()
    result["errors"] = {"virtio": virtio.error_lines(), "vhost": vhost.error_lines()}
    return result


if __name__ == "__main__":  # python3 -m vring.dpdk [PACKED IN_ORDER SECONDS BURST]
    import json
    import sys

    if skip_reason():
        sys.exit(skip_reason())
    a = sys.argv[1:]
    r = measure_dpdk_pair(
        packed=bool(int(a[0])) if len(a) > 0 else True,
        in_order=bool(int(a[1])) if len(a) > 1 else True,
        seconds=float(a[2]) if len(a) > 2 else 12.0,
        burst=int(a[3]) if len(a) > 3 else 32,
    )
    print(json.dumps(r, indent=1))
