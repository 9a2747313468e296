"""The two-process loopback benchmark behind ``vring bench``.

One *measurement* = one ``Point`` (pair, path, packet size, mode, offered rate, study variant, repeat): start the
device process (ours: ``vring vhost --fwd macswap``; DPDK: ``dpdk-testpmd`` with ``net_vhost``,
``--forward-mode=macswap``) pinned to one CPU, then the driver process (ours: ``vring driver --mode macfwd --count
N --latency``, or ``--mode rate --rate PPS``; DPDK: ``dpdk-testpmd`` with ``virtio_user``, ``--forward-mode=mac``,
``start tx_first K``) pinned to another, on a vhost-user socket in a fresh temporary directory.

CPUs: by default the two least busy CPUs this process may use (from /proc/stat over a short look), device on the
least busy; both sides on one CPU only when one is allowed, with a warning. ``--cpus DEVICE,DRIVER`` overrides.

Modes: ``poll`` (both sides busy-poll, as testpmd does) or ``notify`` (ours: ``vring vhost --idle sleep``, ``vring
driver --wait``: poll while busy, then enable notifications, re-check, block on the eventfd). With ``idle_first``
(vring bench sets it when notify is among the modes) our driver first stays idle for that many seconds with its
queues up, and the CPU both processes use over that interval is the idle cost, polled or notified.

Closed loop (default): N packets are injected and loop. Open loop (``rates``): our driver offers PPS frames/s,
each stamped with the time it was due; latency is measured against that stamp (a late sender counts).

The rate is always read at the device: packets it dequeued from the driver's Tx queue (ours: ``txq1.tx_packets``
from the ``--stats-interval`` JSON lines, stamped by the backend itself; DPDK: ``RX-packets`` of the net_vhost
port from ``show port stats 0``). One sample per interval; the samples of the first ``warmup`` seconds after the
first packet are dropped; the median, min and max of the rest are reported. Our driver starts its latency
histogram over after the same warm-up. CPU time (/proc/PID/task/*/schedstat, all threads) of both processes is
read at every sample; the measured window's share is reported, and how busy the two pinned CPUs were with other
work meanwhile (/proc/stat minus ours: the noise a figure carries).

At the end the driver is stopped first (ours: SIGINT, it drains and prints its counters; DPDK: ``stop``), then the
device, and the loss check is made from both sides' final counters::

    in flight = (driver Tx - device dequeued) + (device enqueued - driver Rx) + held by the driver (ours: drained)
    lost      = driver Tx drops + device drops (no Rx buffer, too big, forward drops, runts, oversize)
    ok        = injected == in flight + lost          (open loop: injected = offered, and driver Rx is terminal)

Every process is started with ``Popen`` in its own session and stopped through that object (SIGINT / testpmd
``quit``, then SIGKILL); the temporary directory (socket, logs) is removed, on Ctrl-C too. (The driver's guest
memory is an anonymous memfd: nothing of it outlives the processes.)

Points are measured side by side (pairs, modes and variants of one path and repeat one after the other, their
order reversed every other repeat), so that ratios of figures from the same repeat share the same noise.
"""
from __future__ import annotations

import glob
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from rings.interrupts import held_back
from virtio.net import TX_HDR   # vring driver --tx-hdr
from virtio.pool import HEADROOM   # vring driver --headroom

PATHS = {  # name -> (packed, in_order)
    "split-normal": (False, False),
    "split-in-order": (False, True),
    "packed-normal": (True, False),
    "packed-in-order": (True, True),
}
PAIRS = ("ours/ours", "dpdk/dpdk", "ours/dpdk", "dpdk/ours")   # driver/device
MODES = ("poll", "notify")
MIN_PKT, MAX_PKT, MAX_PKT_DPDK = 60, 9000, 1518
MAX_RATE = 100e6
MAX_SECONDS = 86400.0   # --seconds, --warmup: a day per point at most
PCTS = ("p50", "p99", "p99.9")
IDLE_MARK = "vring driver: idle for"   # what our driver prints when its idle interval starts
NOISY = 0.10                           # other work on the pinned CPUs above this share: the point is flagged
REGIME_GAP = 1.4                       # two clusters of rate samples this far apart are two machine speeds
REGIME_MIN = 3                         # samples each of the two regimes needs for a split
REGIME_APART = 2.0                     # ... and their centres this many times their spreads (sd, summed) apart


class BenchError(RuntimeError):
    """A measurement could not be made (a process died, no traffic, ...). The message says which and why."""


# --------------------------------------------------------------------------------------------- parsing

def _parse_list(text, one, what):
    """A comma-separated list: each token through ``one`` (which returns a list of values or raises ValueError
    with the message), duplicates dropped, order kept; at least one value."""
    out = []
    for tok in (t.strip().lower() for t in str(text).split(",")):
        if tok:
            out += [v for v in one(tok) if v not in out]
    if not out:
        raise ValueError(f"no {what} given")
    return out


def _one_path(tok):
    tok = tok.replace("_", "-").replace("inorder", "in-order")
    if tok == "all":
        return list(PATHS)
    if tok in ("split", "packed"):
        return [f"{tok}-normal", f"{tok}-in-order"]
    if tok in ("normal", "in-order"):
        return [f"split-{tok}", f"packed-{tok}"]
    if tok in PATHS:
        return [tok]
    raise ValueError(f"unknown path {tok!r}: use {', '.join(PATHS)} (or split, packed, normal, in-order, all)")


def parse_paths(text):
    """'split-normal,packed-in-order' -> ordered unique list. Also: 'all', 'split', 'packed' (both variants),
    'normal', 'in-order' (both formats), 'inorder' for 'in-order'."""
    return _parse_list(text, _one_path, "path")


def _one_pair(tok):
    tok = {"ours": "ours/ours", "dpdk": "dpdk/dpdk"}.get(tok, tok)
    if tok not in PAIRS:
        raise ValueError(f"unknown pair {tok!r}: DRIVER/DEVICE with each ours or dpdk ({', '.join(PAIRS)})")
    return [tok]


def parse_pairs(text):
    return _parse_list(text, _one_pair, "pair")


def _one_size(tok):
    try:
        n = int(tok, 0)
    except ValueError:
        raise ValueError(f"packet size {tok!r} is not an integer") from None
    if not MIN_PKT <= n <= MAX_PKT:
        raise ValueError(f"packet size {n} out of range {MIN_PKT}..{MAX_PKT} (frame bytes without FCS)")
    return [n]


def parse_sizes(text):
    return _parse_list(text, _one_size, "packet size")


def _one_rate(tok):
    mult = {"k": 1e3, "m": 1e6}.get(tok[-1], 1)
    try:
        r = float(tok[:-1] if mult != 1 else tok) * mult
    except ValueError:
        raise ValueError(f"rate {tok!r} is not a number of frames per second (e.g. 10k, 1M, 250000)") from None
    if not 1 <= r <= MAX_RATE:
        raise ValueError(f"rate {r:g} out of range 1..{MAX_RATE:g} frames per second")
    return [r]


def parse_rates(text):
    """'10k,1M,2.5e6' -> [10000.0, 1000000.0, 2500000.0] (frames per second, in the order given)."""
    return _parse_list(text, _one_rate, "rate")


def _one_mode(tok):
    if tok not in MODES:
        raise ValueError(f"unknown mode {tok!r}: poll (both sides busy-poll) or notify (both sleep when idle)")
    return [tok]


def parse_modes(text):
    return _parse_list(text, _one_mode, "mode")


# --------------------------------------------------------------------------------------------- config

@dataclass
class BenchConfig:
    pairs: list = field(default_factory=lambda: ["ours/ours"])
    paths: list = field(default_factory=lambda: list(PATHS))
    pkt_sizes: list = field(default_factory=lambda: [64])
    burst: int = 32
    ring_size: int = 256
    inject: int = 256
    retries: int = 0               # our device only
    txq_flush: str = "rx-batch"    # our device only
    mrg_rxbuf: bool = True
    tx_hdr: str = "headroom"       # our driver: where its Tx virtio-net header goes (vring driver --tx-hdr)
    headroom: int = HEADROOM       # our driver: its buffers' headroom (vring driver --headroom)
    seconds: float = 10.0          # measured seconds per point (after the warm-up)
    warmup: float = 2.0
    interval: float = 0.5
    repeat: int = 1
    device_cpu: int = 0
    driver_cpu: int = 1
    cpu_choice: dict = field(default_factory=dict)   # how the CPUs were chosen (for the output)
    modes: list = field(default_factory=lambda: ["poll"])
    rates: list = field(default_factory=list)        # offered frames/s (open loop); empty: closed loop
    idle_first: float = 0.0        # our driver, closed loop: idle seconds before traffic (idle CPU cost)
    idle_polls: int = 256          # notify mode, our device: empty polls before it sleeps
    study: str | None = None       # vring bench --study NAME (vring/studies.py)
    startup_timeout: float = 30.0
    keep: bool = False             # keep the per-measurement temporary directories (logs)

    def validate(self):
        """Raise ValueError with a message for anything out of range (the CLI turns it into exit code 2)."""
        if not 1 <= self.burst <= 512:
            raise ValueError(f"--burst must be 1..512, not {self.burst}")
        if self.ring_size < 8 or self.ring_size > 32768 or self.ring_size & (self.ring_size - 1):
            raise ValueError(f"--ring-size must be a power of two in 8..32768, not {self.ring_size}")
        if not 1 <= self.inject <= 65536:
            raise ValueError(f"--inject must be 1..65536, not {self.inject}")
        # every float: finite and in range (nan fails every comparison, so each test is written as "in range")
        if not (math.isfinite(self.seconds) and 0 < self.seconds <= MAX_SECONDS):
            raise ValueError(f"--seconds must be a number > 0 and <= {MAX_SECONDS:g}, not {self.seconds}")
        if not (math.isfinite(self.warmup) and 0 <= self.warmup <= MAX_SECONDS):
            raise ValueError(f"--warmup must be a number 0..{MAX_SECONDS:g}, not {self.warmup}")
        if not (math.isfinite(self.interval) and 0.05 <= self.interval <= self.seconds):
            raise ValueError(f"--interval must be 0.05..--seconds ({self.seconds}), not {self.interval}")
        if not 1 <= self.repeat <= 1000:
            raise ValueError(f"--repeat must be 1..1000, not {self.repeat}")
        if not (math.isfinite(self.idle_first) and 0 <= self.idle_first <= 600):
            raise ValueError(f"--idle must be 0..600 seconds, not {self.idle_first}")
        for r in self.rates:
            if not (math.isfinite(r) and 1 <= r <= MAX_RATE):
                raise ValueError(f"rate {r:g} out of range 1..{MAX_RATE:g} frames per second")
        if not (math.isfinite(self.startup_timeout) and 0 < self.startup_timeout <= 3600):
            raise ValueError(f"startup_timeout must be 0..3600 seconds, not {self.startup_timeout}")
        if self.tx_hdr not in TX_HDR:
            raise ValueError(f"--tx-hdr must be one of {', '.join(TX_HDR)}, not {self.tx_hdr!r}")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}")
        from vhost.datapath import Options   # the backend's own validation of --retries / --txq-flush
        from rings.errors import ConfigError, FrameDoesNotFit
        try:
            Options(burst=self.burst, retries=self.retries, txq_flush=self.txq_flush, idle_polls=self.idle_polls)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if any(p != "ours/ours" for p in self.pairs):
            big = [s for s in self.pkt_sizes if s > MAX_PKT_DPDK]
            if big:
                raise ValueError(f"packet sizes {big} > {MAX_PKT_DPDK}: the DPDK pairs run with testpmd's "
                                 f"default 2 KiB mbufs")
        if any(p.startswith("ours/") for p in self.pairs):
            from virtio.app import DriverConfig   # what our driver refuses at start, refused here before anything runs

            def refusal(size, headroom):
                try:
                    # as each point starts it: paced (nothing injected), or a loop of --inject frames
                    run = dict(mode="rate", rate=self.rates[0]) if self.rates else dict(mode="macfwd",
                                                                                          count=self.inject)
                    DriverConfig("", ring_size=self.ring_size, pkt_size=size, mrg_rxbuf=self.mrg_rxbuf,
                                 tx_hdr=self.tx_hdr, headroom=headroom, **run).check()
                except ConfigError as e:
                    return e
                return None

            for size in self.pkt_sizes:
                e = refusal(size, self.headroom)
                if e is None:
                    continue
                # the driver's advice may be a buffer size, which bench does not have: a smaller headroom leaves more
                # of its buffers to the frame, and fits only get easier as it shrinks (bisect for the largest)
                knobs = ["--mrg-rxbuf"] if isinstance(e, FrameDoesNotFit) and e.mrg_rxbuf_helps else []
                lo, hi = 12, self.headroom - 1
                if hi >= lo and refusal(size, lo) is None:
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if refusal(size, mid) is None else (lo, mid - 1)
                    knobs.append(f"--headroom {lo} or less")
                why = str(e) + (f" (vring bench gives our driver {DriverConfig.buf_size}-byte buffers; what it has "
                                f"instead: {', '.join(knobs)})" if knobs else "")
                raise ValueError(f"our driver, --pkt-size {size}: {why}")
        if self.rates:
            dpdk_drivers = [p for p in self.pairs if p.startswith("dpdk/")]
            if dpdk_drivers:
                raise ValueError(f"--rate paces our driver; {', '.join(dpdk_drivers)} has DPDK's (testpmd cannot "
                                 f"pace its Tx and stamps no payload): use pairs ours/ours or ours/dpdk")
        cpus = _allowed_cpus()
        for name, c in (("device", self.device_cpu), ("driver", self.driver_cpu)):
            if c not in cpus:
                raise ValueError(f"{name} CPU {c} is not one this process may use ({cpus})")
        if self.study:
            from vring import studies
            studies.get(self.study)   # ValueError for an unknown name

    def points(self):
        """Measurement order: repeat, path, size, rate, then modes and pairs side by side (so they see the same
        noise), their order reversed every other repeat (so that drift over a repeat favours no pair)."""
        if self.study:
            from vring import studies
            yield from studies.get(self.study).points(self)
            return
        for rep in range(self.repeat):
            for path in self.paths:
                for size in self.pkt_sizes:
                    for rate in self.rates or [None]:
                        side = [(mode, pair) for mode in self.modes for pair in self.pairs]
                        for mode, pair in (side if rep % 2 == 0 else side[::-1]):
                            yield Point(rep, path, size, pair, mode, rate)


@dataclass(frozen=True)
class Point:
    """One measurement. ``group``/``variant``: a study's row (vring/studies.py); ``driver_args``/``device_args``:
    extra command-line arguments of our processes for that variant."""
    rep: int
    path: str
    size: int
    pair: str
    mode: str = "poll"
    rate: float | None = None
    group: str | None = None
    variant: str | None = None
    driver_args: tuple = ()
    device_args: tuple = ()

    def key(self):
        return (self.group, self.variant, self.path, self.size, self.rate, self.mode, self.pair)


def _allowed_cpus():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cpu_times():
    """{cpu: (busy, total)} jiffies from /proc/stat (busy: everything but idle and iowait)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *vals = line.split()
                    v = [int(x) for x in vals[:8]]
                    total = sum(v)
                    out[int(name[3:])] = (total - v[3] - v[4], total)
    except OSError:
        pass
    return out


def cpu_busy(interval=0.3):
    """Per-CPU busy share over ``interval`` seconds (from /proc/stat); {} where it cannot be read."""
    a = _cpu_times()
    time.sleep(interval)
    b = _cpu_times()
    return {c: round((b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]), 3) for c in a if c in b}


def default_cpus(busy=None):
    """(device CPU, driver CPU, how): two distinct CPUs this process may use, the least busy ones (device on the
    least busy); the same one only when there is one."""
    cpus = _allowed_cpus()
    busy = cpu_busy() if busy is None else busy
    order = sorted(cpus, key=lambda c: (busy.get(c, 0.0), c))
    dev, drv = order[0], order[1 % len(order)]
    how = {"chosen": "default: the two least busy allowed CPUs" if len(order) > 1 else "the one allowed CPU",
           "busy_before": {c: busy.get(c) for c in cpus}}
    return dev, drv, how


def pinning_note(cfg):
    """The line the output starts with: which CPU each side runs on, and a warning when both share one."""
    how = cfg.cpu_choice.get("chosen", "--cpus")
    line = f"pinned: device on CPU {cfg.device_cpu}, driver on CPU {cfg.driver_cpu} ({how})"
    if any(p.startswith("ours/") for p in cfg.pairs):
        if cfg.tx_hdr != "headroom":
            line += f"; our driver's Tx header: --tx-hdr {cfg.tx_hdr}"
        if cfg.headroom != HEADROOM:
            line += f"; our driver's headroom: --headroom {cfg.headroom}"
    if cfg.device_cpu == cfg.driver_cpu:
        line += ("\nWARNING: both sides share CPU %d: the figures measure time sharing on one CPU, not the rings "
                 "(give two CPUs with --cpus, or run where two are allowed)" % cfg.device_cpu)
    return line


def proc_cpu_seconds(pid):
    """CPU seconds process ``pid`` has used, all its threads (schedstat: ns; else stat: clock ticks), or None."""
    total, seen = 0, False
    for path in glob.glob(f"/proc/{int(pid)}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
                seen = True
        except (OSError, ValueError, IndexError):
            pass
    if seen:
        return total / 1e9
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------------------------- machine

def machine_description():
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu_model": cpu_model or platform.processor() or None, "cpus": os.cpu_count(),
            "allowed_cpus": _allowed_cpus(), "kernel": platform.release(), "os": platform.platform(),
            "python": platform.python_version(), "python_implementation": platform.python_implementation(),
            "dpdk": dpdk_version(), "hostname": platform.node(), "loadavg": load}


def dpdk_version():
    """DPDK version string ('22.11.11', from pkg-config or the package that owns dpdk-testpmd), or None."""
    from vring import dpdk
    tp = dpdk.find_testpmd()
    if tp is None:
        return None
    for argv in (["pkg-config", "--modversion", "libdpdk"],
                 ["dpkg-query", "-W", "-f", "${Version}", "dpdk"]):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    return "unknown"


# --------------------------------------------------------------------------------------------- processes

class _Proc:
    """A child process in its own session, stdout/stderr to files in the measurement's directory."""

    def __init__(self, name, argv, workdir):
        self.name, self.argv = name, argv
        self.out_path = os.path.join(workdir, f"{name}.out")
        self.err_path = os.path.join(workdir, f"{name}.err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True, close_fds=True)
        self._off = 0
        self._partial = b""

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def new_lines(self):
        """Complete stdout lines written since the last call."""
        try:
            with open(self.out_path, "rb") as f:
                f.seek(self._off)
                data = f.read()
        except OSError:
            return []
        self._off += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [ln.decode("utf-8", "replace") for ln in lines]

    def stdout(self):
        with open(self.out_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stderr_tail(self, n=20):
        try:
            with open(self.err_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, sig=signal.SIGINT, timeout=15.0):
        """Send ``sig`` (if running), wait; SIGKILL after ``timeout``. Returns the exit status."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _vring_cmd(*args):
    return [sys.executable, "-m", "vring.cli", *map(str, args)]


# --------------------------------------------------------------------------------------------- one measurement

class Measurement:
    """One Point. ``run()`` returns the record; every resource is released in ``close()``, which ``run()`` always
    calls."""

    def __init__(self, cfg: BenchConfig, point: Point, progress=None):
        self.cfg, self.point = cfg, point
        self.pair, self.path, self.size, self.rep = point.pair, point.path, point.size, point.rep
        self.driver_kind, self.device_kind = point.pair.split("/")
        self.packed, self.in_order = PATHS[point.path]
        self.notify = point.mode == "notify"
        self.progress = progress or (lambda **kw: None)
        self.workdir = self.sock = None
        self.procs: list[_Proc] = []
        self.testpmds = []
        self.samples: list[tuple[float, int]] = []   # (time, packets dequeued by the device)
        self.cpu: list[tuple] = []                  # (bench time, device CPU s, driver CPU s, /proc/stat times)
        self.idle = None                            # the idle interval's CPU samples, or why there is none
        self.t_traffic = None                       # bench time of the first sample with traffic
        self.notes: list[str] = []
        self.injected = 0

    @property
    def idle_first(self):
        """Seconds our driver stays idle before traffic (our driver, closed loop; vring bench sets it when notify
        is among the modes, so that polled points show what polling an idle queue costs beside them)."""
        if self.driver_kind == "ours" and self.point.rate is None:
            return self.cfg.idle_first
        return 0.0

    # -- start

    def _start_device(self):
        cfg = self.cfg
        if self.device_kind == "ours":
            argv = _vring_cmd("vhost", "--socket", self.sock, "--json", "--stats-interval", cfg.interval,
                              "--pin", cfg.device_cpu, "--max-connections", 1, "--fwd", "macswap",
                              "--burst", cfg.burst, "--retries", cfg.retries, "--txq-flush", cfg.txq_flush,
                              "--pkt-size", max(2048, self.size + 64))
            if self.notify:
                argv += ["--idle", "sleep", "--idle-polls", str(cfg.idle_polls)]
            argv += [str(a) for a in self.point.device_args]
            self.device = _Proc("device", argv, self.workdir)
            self.procs.append(self.device)
            deadline = time.monotonic() + cfg.startup_timeout
            while not os.path.exists(self.sock):
                if not self.device.alive():
                    raise BenchError(f"vring vhost exited ({self.device.proc.returncode}) before listening:\n"
                                     f"{self.device.stderr_tail()}")
                if time.monotonic() > deadline:
                    raise BenchError(f"vring vhost: no socket after {cfg.startup_timeout:.0f} s")
                time.sleep(0.02)
        else:
            from vring import dpdk
            if self.notify:
                self.notes.append("device: testpmd's net_vhost always polls (no notification mode)")
            tp = dpdk.Testpmd.vhost(self.sock, burst=cfg.burst, fwd="macswap",
                                    lcores=(cfg.driver_cpu, cfg.device_cpu),
                                    log_path=os.path.join(self.workdir, "device-testpmd.log"))
            self.testpmds.append(tp)
            self.device = tp
            tp.start(cfg.startup_timeout)   # autostart: forwarding, waiting for a frontend

    def _start_driver(self):
        cfg, rate = self.cfg, self.point.rate
        if self.driver_kind == "ours":
            watchdog = cfg.warmup + cfg.seconds + cfg.startup_timeout + 30 + self.idle_first
            argv = _vring_cmd("driver", "--socket", self.sock, "--json", "--pin", cfg.driver_cpu,
                              "--packed" if self.packed else "--split",
                              "--in-order" if self.in_order else "--no-in-order",
                              "--mrg-rxbuf" if cfg.mrg_rxbuf else "--no-mrg-rxbuf", "--tx-hdr", cfg.tx_hdr,
                              "--headroom", cfg.headroom,
                              "--burst", cfg.burst, "--ring-size", cfg.ring_size, "--pkt-size", self.size,
                              "--seconds", watchdog, "--timeout", 10, "--latency-warmup", cfg.warmup)
            if rate is None:
                argv += ["--mode", "macfwd", "--count", str(cfg.inject), "--latency"]
                self.injected = cfg.inject
            else:
                argv += ["--mode", "rate", "--rate", repr(float(rate))]
            if self.notify:
                argv += ["--wait"]
            if self.idle_first:
                argv += ["--idle-first", str(self.idle_first)]
            argv += [str(a) for a in self.point.driver_args]
            self.driver = _Proc("driver", argv, self.workdir)
            self.procs.append(self.driver)
        else:
            from vring import dpdk
            if self.notify:
                self.notes.append("driver: testpmd's virtio_user always polls (no notification mode)")
            tp = dpdk.Testpmd.virtio_user(self.sock, packed=self.packed, in_order=self.in_order,
                                          mrg_rxbuf=cfg.mrg_rxbuf, queue_size=cfg.ring_size, burst=cfg.burst,
                                          fwd="mac", tx_first=True, autostart=False,
                                          lcores=(cfg.device_cpu, cfg.driver_cpu),
                                          extra=[f"--txpkts={self.size}"],
                                          log_path=os.path.join(self.workdir, "driver-testpmd.log"))
            self.testpmds.append(tp)
            self.driver = tp
            tp.start(cfg.startup_timeout)
            bursts = max(1, math.ceil(cfg.inject / cfg.burst))
            self.injected = bursts * cfg.burst
            if self.injected != cfg.inject:
                self.notes.append(f"testpmd injects whole bursts: {bursts} x {cfg.burst} = {self.injected}")
            out = tp.command(f"start tx_first {bursts}" if bursts > 1 else "start tx_first")
            if "forwarding" not in out and "already started" not in out:
                raise BenchError(f"virtio_user testpmd did not start forwarding: {out.strip()[-300:]}")

    # -- sampling

    def _pids(self):
        return [p.pid if p is not None else None for p in (self.device, getattr(self, "driver", None))]

    def _sample_cpu(self):
        """CPU seconds of both processes and the per-CPU /proc/stat times, now."""
        dev, drv = (None if pid is None else proc_cpu_seconds(pid) for pid in self._pids())
        self.cpu.append((time.monotonic(), dev, drv, _cpu_times()))

    def _poll_device(self):
        """New (time, dequeued packets) samples from the device; raises if a process died."""
        if self.device_kind == "ours":
            if not self.device.alive():
                raise BenchError(f"vring vhost exited ({self.device.proc.returncode}):\n{self.device.stderr_tail()}")
            for line in self.device.new_lines():
                if not line.startswith("{"):
                    continue
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if not d.get("final"):
                    self.samples.append((float(d["time"]), int(d["txq1"]["tx_packets"])))
        else:
            st = self.device.stats(0)
            self.samples.append((st.time, st.rx_packets))
        if self.driver_kind == "ours" and not self.driver.alive():
            raise BenchError(f"vring driver exited ({self.driver.proc.returncode}) during the run:\n"
                             f"{self.driver.stderr_tail()}")
        if self.driver_kind == "dpdk" and not self.driver.running:
            raise BenchError(f"virtio_user testpmd exited ({self.driver.returncode})")
        self._sample_cpu()

    def _first_traffic(self):
        """Index of the last sample before traffic (the measurement's time origin), or None."""
        for i, (_, n) in enumerate(self.samples):
            if n > 0:
                return max(i - 1, 0)
        return None

    def _window(self):
        """Rates (pps) of the intervals after the warm-up, and whether the window is complete."""
        i0 = self._first_traffic()
        if i0 is None:
            return [], False
        t0 = self.samples[i0][0]
        start, end = t0 + self.cfg.warmup, t0 + self.cfg.warmup + self.cfg.seconds
        rates = []
        for (ta, na), (tb, nb) in zip(self.samples, self.samples[1:]):
            if ta >= start - 1e-3 and tb <= end + self.cfg.interval * 0.5 and tb > ta:
                rates.append((nb - na) / (tb - ta))
        done = self.samples[-1][0] >= end
        return rates, done

    def _idle_step(self):
        """Notify mode: the CPU both processes use while our driver's queues are up and idle (after its mark on
        stderr, 0.2 s settling time on either side). Returns True while that interval is running."""
        if not self.idle_first or self.idle is not None and "end" in self.idle:
            return False
        now = time.monotonic()
        if self.idle is None:
            if IDLE_MARK in self.driver.stderr_tail(50):
                self.idle = {"mark": now}
            return True
        if "start" not in self.idle and now >= self.idle["mark"] + 0.2:
            self._sample_cpu()
            self.idle["start"] = self.cpu[-1]
        elif "start" in self.idle and now >= self.idle["mark"] + self.idle_first - 0.2:
            self._sample_cpu()
            self.idle["end"] = self.cpu[-1]
            return False
        return True

    def _sample_loop(self):
        cfg = self.cfg
        t_start = time.monotonic()
        next_tick = t_start
        while True:
            if self.device_kind == "dpdk":
                next_tick += cfg.interval
                delay = next_tick - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            else:
                time.sleep(min(0.1, cfg.interval / 2))
            self._poll_device()
            idling = self._idle_step()
            rates, done = self._window()
            i0 = self._first_traffic()
            if i0 is None:
                if time.monotonic() - t_start > cfg.startup_timeout + (self.idle_first if idling else 0):
                    raise BenchError(f"no packets reached the device after {cfg.startup_timeout:.0f} s")
                self.progress(phase="idle" if idling and self.idle else "starting")
                continue
            if self.t_traffic is None:
                self.t_traffic = time.monotonic()
            el = self.samples[-1][0] - self.samples[i0][0]
            cur = None
            if len(self.samples) >= 2:
                (ta, na), (tb, nb) = self.samples[-2], self.samples[-1]
                cur = (nb - na) / (tb - ta) if tb > ta else None
            self.progress(phase="warm-up" if el < cfg.warmup else "measuring", elapsed=el,
                          total=cfg.warmup + cfg.seconds, pps=cur,
                          median=statistics.median(rates) if rates else None)
            if done:
                return rates

    # -- stop and collect

    def _stop(self):
        """Stop the driver first, then the device; returns (driver counters, device counters)."""
        drv = dev = None
        if self.driver_kind == "ours":
            self.driver.stop(signal.SIGINT, timeout=30)
            rc = self.driver.proc.returncode
            try:
                drv = json.loads(self.driver.stdout())
            except ValueError:
                raise BenchError(f"vring driver exited ({rc}) without its JSON counters:\n"
                                 f"{self.driver.stderr_tail()}") from None
        else:
            fwd = self.driver.stop_forwarding()
            time.sleep(0.3)   # let the device deliver what it still holds
            ports = self.driver.stats_all()
            drv = {"ports": {p: s.as_dict() for p, s in ports.items()},
                   "fwd": {p: s.as_dict() for p, s in fwd.items()}}
        if self.device_kind == "ours":
            if self.driver_kind == "ours":   # --max-connections 1: it exits once our driver has gone
                if self.device.wait(5.0) is None:
                    self.device.stop(signal.SIGINT)
            else:
                self.device.stop(signal.SIGINT)
            finals = [json.loads(x) for x in self.device.stdout().splitlines() if x.startswith("{")]
            finals = [x for x in finals if x.get("final")]
            if not finals:
                raise BenchError(f"vring vhost printed no final counters:\n{self.device.stderr_tail()}")
            dev = finals[-1]
        else:
            final = self.device.close()
            dev = final.as_dict()
        if self.driver_kind == "dpdk":
            self.driver.close()
        return drv, dev

    def close(self):
        """Stop whatever still runs (SIGKILL if it does not stop), remove sockets, shm and the directory.
        SIGINT/SIGTERM/SIGHUP are held back meanwhile (a second Ctrl-C must not leave half of it undone)."""
        with held_back():
            self._close()

    def _close(self):
        for p in self.procs:
            if p.alive():
                p.stop(signal.SIGINT, timeout=5.0)
        for tp in self.testpmds:
            try:
                tp.close(timeout=5.0)
            except Exception:
                tp.kill()
        if self.workdir is None:
            return
        if self.cfg.keep:
            self.notes.append(f"kept {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self):
        self.device = self.driver = None
        try:
            self.workdir = tempfile.mkdtemp(prefix="vring-bench-")
            self.sock = os.path.join(self.workdir, "vhost.sock")
            self._start_device()
            self._start_driver()
            rates = self._sample_loop()
            drv, dev = self._stop()
            return self._record(rates, drv, dev)
        finally:
            self.close()

    # -- the record

    def _cpu_window(self, a, b):
        """CPU use between two CPU samples: each process's share of one CPU, and the other work on the two
        pinned CPUs (their busy share minus ours)."""
        (ta, dva, dra, sa), (tb, dvb, drb, sb) = a, b
        span = tb - ta
        if span <= 0:
            return None
        share = (lambda x, y: None if x is None or y is None else round((y - x) / span, 4))
        out = {"seconds": round(span, 3), "device": share(dva, dvb), "driver": share(dra, drb)}
        cpus = sorted({self.cfg.device_cpu, self.cfg.driver_cpu})
        if all(c in sa and c in sb for c in cpus):
            busy = sum((sb[c][0] - sa[c][0]) / max(1, sb[c][1] - sa[c][1]) for c in cpus)
            ours = sum(x for x in (out["device"], out["driver"]) if x is not None)
            out["other_on_pinned"] = round(max(0.0, busy - ours) / len(cpus), 4)
        return out

    def _cpu_record(self):
        cpu = {"method": "CPU seconds per second of the window (1.0 = one CPU), all threads, from "
                         "/proc/PID/task/*/schedstat; other_on_pinned: the pinned CPUs' busy share from /proc/stat "
                         "minus ours, averaged over them"}
        if self.t_traffic is not None:
            t0 = self.t_traffic + self.cfg.warmup
            win = [c for c in self.cpu if c[0] >= t0]
            if len(win) >= 2:
                cpu["measured"] = self._cpu_window(win[0], win[-1])
        if self.idle_first:
            if self.idle and "end" in self.idle:
                cpu["idle"] = self._cpu_window(self.idle["start"], self.idle["end"])
            else:
                cpu["idle"] = None
                cpu["idle_reason"] = "the driver's idle interval was not seen"
        return cpu

    def _record(self, rates, drv, dev):
        p = self.point
        rec = {"pair": self.pair, "driver": self.driver_kind, "device": self.device_kind, "path": self.path,
               "packed": self.packed, "in_order": self.in_order, "pkt_size": self.size, "repeat": self.rep,
               "mode": p.mode, "offered_pps": p.rate, "group": p.group, "variant": p.variant,
               "driver_args": list(map(str, p.driver_args)), "device_args": list(map(str, p.device_args))}
        rec["rate"] = {
            "pps_median": round(statistics.median(rates)) if rates else None,
            "pps_min": round(min(rates)) if rates else None,
            "pps_max": round(max(rates)) if rates else None,
            "samples_pps": [round(r) for r in rates],
            "measured_at": "device (packets dequeued from the driver's Tx queue)",
        }
        d, v = _driver_side(self.driver_kind, drv), _device_side(self.device_kind, dev)
        moved = d["tx_packets"] or v["dequeued"] or 0
        rec["latency"] = _latency(self.driver_kind, drv, p.rate)
        rec["notifications"] = _notifications(d, v, moved)
        rec["retries"] = v["retries"]
        rec["drops"] = {"total": d["drops"] + v["drops"], "driver": d["drop_parts"], "device": v["drop_parts"]}
        rec["delivered"] = {"device_dequeued": v["dequeued"], "device_enqueued": v["enqueued"],
                            "share": round(v["enqueued"] / v["dequeued"], 6) if v["dequeued"] else None}
        in_flight = {"driver_tx_not_dequeued": d["tx_packets"] - v["dequeued"],
                     "device_pending": v["pending"],
                     "enqueued_not_received": v["enqueued"] - d["rx_packets"],
                     "held_by_driver": d["held"]}
        injected = self.injected
        if p.rate is not None:   # open loop: every frame offered either came back, is in flight or was dropped
            injected = d["offered"]
            in_flight["received_by_driver"] = d["rx_packets"]
            in_flight["held_by_driver"] = 0
        fl, lost = sum(in_flight.values()), d["drops"] + v["drops"]
        rec["loss_check"] = {"injected": injected, "in_flight": fl, "lost": lost,
                             "unaccounted": injected - fl - lost,
                             "ok": injected == fl + lost and all(x >= 0 for x in in_flight.values()),
                             "in_flight_parts": in_flight}
        rec["cpu"] = self._cpu_record()
        rec["features"] = drv.get("feature_names") if self.driver_kind == "ours" else None
        rec["counters"] = {"driver": _trim_driver(drv) if self.driver_kind == "ours" else drv, "device": dev}
        rec["notes"] = list(self.notes)
        return rec


def _driver_side(kind, drv):
    if kind == "ours":
        tx, rx = drv["tx"], drv["rx"]
        parts = {"tx_dropped": tx["dropped"], "rx_errors": rx["errors"]}
        offered = (drv.get("rate") or {}).get("offered", tx["packets"] + tx["dropped"])
        return {"tx_packets": tx["packets"], "rx_packets": rx["packets"], "held": drv.get("drained", 0),
                "drops": sum(parts.values()), "drop_parts": parts, "offered": offered,
                "kicks": tx["kicks"] + rx["kicks"], "kick_parts": {"tx": tx["kicks"], "rx": rx["kicks"]},
                "calls_seen": sum(int(x) for x in drv.get("calls", {}).values()) + rx.get("wakeups", 0),
                "tx_cleanups": tx.get("cleanups"), "tx_reclaimed_bufs": tx.get("reclaimed_bufs"),
                "tx_reclaimed_descs": tx.get("reclaimed_descs")}
    port, fwd = drv["ports"].get(0) or {}, drv["fwd"].get(0) or {}
    parts = {"tx_dropped": fwd.get("tx_dropped", 0), "rx_dropped": fwd.get("rx_dropped", 0)}
    return {"tx_packets": port.get("tx_packets", 0), "rx_packets": port.get("rx_packets", 0), "held": 0,
            "drops": sum(parts.values()), "drop_parts": parts, "kicks": None, "kick_parts": None,
            "calls_seen": None, "offered": port.get("tx_packets", 0)}


def _device_side(kind, dev):
    if kind == "ours":
        rxq, txq, im = dev["rxq0"], dev["txq1"], dev["intermediate"]
        parts = {"rx_dropped": rxq["rx_dropped"], "rx_too_big": rxq["rx_too_big"],
                 "fwd_dropped": im["fwd_dropped"], "tx_runt": txq["tx_runt"], "tx_oversize": txq["tx_oversize"]}
        return {"dequeued": txq["tx_packets"], "enqueued": rxq["rx_packets"], "pending": 0,
                "drops": sum(parts.values()), "drop_parts": parts,
                "calls": rxq["rx_calls"] + txq["tx_calls"],
                "call_parts": {"rx": rxq["rx_calls"], "tx": txq["tx_calls"]},
                "kicks_received": txq.get("tx_kicks"), "sleeps": im.get("sleeps"),
                "retries": {"retries": rxq["rx_retries"], "attempts": rxq["rx_attempts"],
                            "max_per_burst": None}}
    port, fwd = dev["ports"].get(0) or {}, dev["fwd"].get(0) or {}
    parts = {"tx_dropped": fwd.get("tx_dropped", 0), "rx_dropped": fwd.get("rx_dropped", 0)}
    return {"dequeued": port.get("rx_packets", 0), "enqueued": port.get("tx_packets", 0), "pending": 0,
            "drops": sum(parts.values()), "drop_parts": parts, "calls": None, "call_parts": None,
            "kicks_received": None, "sleeps": None,
            "retries": {"retries": None, "attempts": None,
                        "reason": "testpmd's macswap engine does not retry (and counts no retries)"}}


def _latency(kind, drv, rate=None):
    out = {p + "_us": None for p in PCTS}
    if kind != "ours":
        out["reason"] = "DPDK's driver (testpmd virtio_user) writes no timestamps into the payload"
        return out
    lat = drv.get("latency")
    if not lat or not lat.get("count"):
        out["reason"] = "our driver reported no latency samples"
        return out
    for p in PCTS:
        v = lat.get(f"{p}_ns")
        out[p + "_us"] = None if v is None else round(v / 1000, 3)
    after = lat.get("after_warmup_s")
    out.update(count=lat["count"], bad=lat.get("bad", 0), min_us=round(lat["min_ns"] / 1000, 3),
               avg_us=round(lat["avg_ns"] / 1000, 3), max_us=round(lat["max_ns"] / 1000, 3),
               method=("round trip driver Tx -> driver Rx; "
                       + ("open loop: each frame stamped with the time it was due (a late sender counts); "
                          if rate is not None else "CLOCK_MONOTONIC stamped in the payload at each send; ")
                       + (f"histogram started over {after:g} s after the loop started (warm-up); " if after
                          else "whole run incl. warm-up; ")
                       + "percentiles are histogram bucket lower bounds (within 19%)"))
    return out


def _notifications(d, v, moved):
    per = (lambda x: None if x is None or not moved else float(f"{x / moved:.4g}"))
    kicks, calls = d["kicks"], v["calls"]
    calls_src = "device counters"
    if calls is None and d["calls_seen"] is not None:
        calls, calls_src = d["calls_seen"], "driver's call eventfds"
    if kicks is None and v.get("kicks_received") is not None:
        kicks = v["kicks_received"]
    out = {"kicks": kicks, "kicks_per_packet": per(kicks), "kick_parts": d["kick_parts"],
           "calls": calls, "calls_per_packet": per(calls), "calls_source": calls_src if calls is not None else None,
           "device_sleeps": v.get("sleeps"), "packets": moved}
    reasons = []
    if kicks is None:
        reasons.append("kicks: testpmd's virtio_user counts none")
    if calls is None:
        reasons.append("calls: testpmd's net_vhost counts none, and testpmd's driver reports none")
    if reasons:
        out["reason"] = "; ".join(reasons)
    return out


def _trim_driver(drv):
    return {k: v for k, v in drv.items() if k != "config"}


# --------------------------------------------------------------------------------------------- the run

def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rkey(r):
    """A record's point key (as Point.key()), tolerant of records made before modes, rates and studies."""
    return (r.get("group"), r.get("variant"), r["path"], r["pkt_size"], r.get("offered_pps"), r.get("mode", "poll"),
            r["pair"])


def _cpu_med(runs, part, who):
    return _med([((r.get("cpu") or {}).get(part) or {}).get(who) for r in runs])


def speed_regimes(samples):
    """The rate that splits the samples of one point (one pair) into a slow and a fast regime, or None when they
    do not show two. Some machines (a shared VM: seen here, two speeds about 2x apart, switching every few
    seconds) run whole seconds at one speed or the other, whatever runs on them; a median over runs that caught
    different regimes compares the machine, not the pairs. Two-means on the log of the rates; two regimes when the
    two centres are at least REGIME_GAP apart, each holds REGIME_MIN samples and the centres are REGIME_APART times
    the clusters' spreads apart (a wide unimodal spread splits into halves REGIME_GAP apart too, about 1.3 spreads).
    A pair whose samples all fell in one regime cannot say which one: it gets no split."""
    xs = sorted(math.log(x) for x in samples if x and x > 0)
    if len(xs) < 2 * REGIME_MIN or xs[-1] - xs[0] < math.log(REGIME_GAP):
        return None
    lo, hi = xs[0], xs[-1]
    for _ in range(100):
        t = (lo + hi) / 2
        a, b = [x for x in xs if x < t], [x for x in xs if x >= t]
        new = (sum(a) / len(a), sum(b) / len(b))
        if new == (lo, hi):
            break
        lo, hi = new
    t = (lo + hi) / 2
    a, b = [x for x in xs if x < t], [x for x in xs if x >= t]
    if hi - lo < math.log(REGIME_GAP) or min(len(a), len(b)) < REGIME_MIN:
        return None
    if hi - lo < REGIME_APART * (statistics.pstdev(a) + statistics.pstdev(b)):
        return None
    return math.exp(t)


def by_regime(samples, threshold):
    """Samples and median in the slow (< threshold) and fast regime (speed_regimes)."""
    samples = [x for x in samples if x and x > 0]   # as speed_regimes: a second that moved nothing is no speed
    out = {}
    for name, mine in (("slow", [x for x in samples if x < threshold]),
                       ("fast", [x for x in samples if x >= threshold])):
        out[name] = {"samples": len(mine), "median": round(statistics.median(mine)) if mine else None}
    return out


def aggregate(cfg: BenchConfig, records, placement_ns=None):
    """Per point (study group and variant, path, size, offered rate, mode, pair): the medians over repeats, and
    the ratio to dpdk/dpdk at the same point (median of the per-repeat ratios: same repeat, same noise). With
    ``placement_ns`` (placement_threshold of the probes), the repeats are also split by the placement their
    probe saw (by_placement)."""
    keys = []
    for r in records:
        if _rkey(r) not in keys:
            keys.append(_rkey(r))
    points = []
    for key in keys:
        group, variant, path, size, rate, mode, pair = key
        runs = [r for r in records if _rkey(r) == key]
        meds = [r["rate"]["pps_median"] for r in runs]
        samples = [s for r in runs for s in r["rate"]["samples_pps"]]
        lat = {p + "_us": _med([r["latency"][p + "_us"] for r in runs]) for p in PCTS}
        if all(v is None for v in lat.values()):
            lat["reason"] = runs[0]["latency"].get("reason")
        else:
            lat["p50_us_per_repeat"] = [r["latency"]["p50_us"] for r in runs]
        nt = {k: _med([r["notifications"].get(k) for r in runs])
              for k in ("kicks_per_packet", "calls_per_packet")}
        if runs[0]["notifications"].get("reason"):
            nt["reason"] = runs[0]["notifications"]["reason"]
        retr = [r["retries"]["retries"] for r in runs]
        cpu = {f"{part}_{who}": _cpu_med(runs, part, who)
               for part in ("measured", "idle") for who in ("device", "driver", "other_on_pinned")}
        delivered = _med([(r.get("delivered") or {}).get("share") for r in runs])
        drv_tx = [(r.get("counters") or {}).get("driver", {}).get("tx", {}) for r in runs]
        points.append({
            "group": group, "variant": variant, "path": path, "pkt_size": size, "offered_pps": rate, "mode": mode,
            "pair": pair,
            "pps": {"median": round(_med(meds)) if _med(meds) is not None else None,
                    "min": min(samples) if samples else None, "max": max(samples) if samples else None,
                    "per_repeat": meds},
            "latency": lat, "notifications": nt, "cpu": cpu,
            "retries": None if any(x is None for x in retr) else sum(retr),
            "retry_attempts": _med([(r["retries"] or {}).get("attempts") for r in runs]),
            "delivered_share": delivered,
            "delivered_share_per_repeat": [(r.get("delivered") or {}).get("share") for r in runs],
            "tx_cleanups_per_kpkt": _med([1000 * t["cleanups"] / t["packets"] for t in drv_tx
                                          if t.get("packets") and t.get("cleanups") is not None]),
            "tx_descs_per_cleanup": _med([t["reclaimed_descs"] / t["cleanups"] for t in drv_tx
                                          if t.get("cleanups") and t.get("reclaimed_descs") is not None]),
            "tx_descs_per_packet": _med([t["reclaimed_descs"] / t["reclaimed_bufs"] for t in drv_tx
                                         if t.get("reclaimed_bufs") and t.get("reclaimed_descs") is not None]),
            "drops": sum(r["drops"]["total"] for r in runs),
            "loss_check_ok": all(r["loss_check"]["ok"] for r in runs),
            "noisy": any((((r.get("cpu") or {}).get("measured") or {}).get("other_on_pinned") or 0) > NOISY
                         for r in runs),
            "repeats": len(runs),
        })
    by_key = {(p["group"], p["variant"], p["path"], p["pkt_size"], p["offered_pps"], p["mode"], p["pair"]): p
              for p in points}
    for p in points:
        ref = by_key.get((p["group"], p["variant"], p["path"], p["pkt_size"], p["offered_pps"], p["mode"],
                          "dpdk/dpdk"))
        p["vs_dpdk"] = None
        if ref is not None and p["pair"] != "dpdk/dpdk" and ref["pps"]["median"] and p["pps"]["median"]:
            same = [a / b for a, b in zip(p["pps"]["per_repeat"], ref["pps"]["per_repeat"]) if a and b]
            p["vs_dpdk"] = {"ratio": round(p["pps"]["median"] / ref["pps"]["median"], 3),
                            "per_repeat": [round(x, 3) for x in same],
                            "median_of_per_repeat": round(statistics.median(same), 3) if same else None}
    # speed regimes: each point's own samples (pairs run at different rates: pooled, they would split by pair)
    samples = {}
    for r in records:
        samples.setdefault(_rkey(r), []).extend(r["rate"]["samples_pps"])
    for p in points:
        mine = samples[_pkey(p)]
        threshold = speed_regimes(mine)
        p["regimes"] = None if threshold is None else {"threshold_pps": round(threshold),
                                                       **by_regime(mine, threshold)}
    for p in points:
        ref = by_key.get(_pkey(p)[:-1] + ("dpdk/dpdk",))
        if p["regimes"] and p["vs_dpdk"] is not None and ref is not None and ref["regimes"]:
            p["vs_dpdk"]["by_regime"] = {name: round(p["regimes"][name]["median"] / ref["regimes"][name]["median"], 3)
                                         for name in ("slow", "fast")}
    if placement_ns is not None:
        for p in points:
            p["placements"] = by_placement([r for r in records if _rkey(r) == _pkey(p)], placement_ns)
        for p in points:
            ref = by_key.get(_pkey(p)[:-1] + ("dpdk/dpdk",))
            if p["vs_dpdk"] is not None and ref is not None:
                p["vs_dpdk"]["by_placement"] = {
                    name: round(p["placements"][name]["median"] / ref["placements"][name]["median"], 3)
                    for name in ("near", "far")
                    if p["placements"][name]["median"] and ref["placements"][name]["median"]}
    return points


def by_placement(runs, threshold_ns):
    """The repeats of one point by where the host had put the two CPUs before each (line_ns_before: near below
    threshold_ns, far at or above, none when not probed): {"near": {"repeats", "median"}, "far": ...}, the median
    of those repeats' medians. Within a placement two pairs compare; across placements they compare the machine."""
    out = {"near": [], "far": []}
    for r in runs:
        ns, pps = r.get("line_ns_before"), r["rate"]["pps_median"]
        if ns is not None and pps:
            out["near" if ns < threshold_ns else "far"].append(pps)
    return {name: {"repeats": len(m), "median": round(statistics.median(m)) if m else None} for name, m in out.items()}


def _pkey(p):
    """A point's key, as _rkey of its records."""
    return (p["group"], p["variant"], p["path"], p["pkt_size"], p["offered_pps"], p["mode"], p["pair"])


def placement_threshold(probes):
    """The line-transfer time (ns, rings.affinity.line_transfer_ns) that splits near placements of the two CPUs
    from far ones, or None when the probes show one placement only: their 10th and 90th percentiles at least 2x
    apart (this VM: ~35-50 ns against ~200-240 ns), split at the geometric mean of the two."""
    probes = [x for x in probes if x is not None]
    if len(probes) < 4:
        return None
    q = statistics.quantiles(probes, n=10, method="inclusive")
    lo, hi = q[0], q[-1]
    if hi < 2 * lo:
        return None
    # with fewer than ~11 probes the inclusive percentiles lean on the extremes: one disturbed probe made a
    # "placement"; each side needs 2 probes (and 10 %) of its own
    t, k = math.sqrt(lo * hi), max(2, len(probes) // 10)
    near = sum(x < t for x in probes)
    return t if near >= k and len(probes) - near >= k else None


def probe_placement(cfg):
    """How long one cache line takes from the device's CPU to the driver's, in ns, measured while neither side
    runs; None when both sides share one CPU or the probe could not run (never fatal: it only labels)."""
    if cfg.device_cpu == cfg.driver_cpu:
        return None
    from rings.affinity import line_transfer_ns
    from rings.errors import VringError
    try:
        return round(line_transfer_ns(cfg.device_cpu, cfg.driver_cpu), 1)
    except VringError:
        return None


def run_bench(cfg: BenchConfig, progress=None, on_record=None):
    """Every measurement in ``cfg.points()`` order; returns the JSON-able result. ``progress(**kw)`` is called
    often with the state of the current measurement; ``on_record(rec)`` after each one."""
    started = time.time()
    machine = machine_description()
    records, errors = [], []
    interrupted = False
    todo = list(cfg.points())
    probes = []   # where the host had put the two CPUs before each measurement (probe_placement)
    for k, point in enumerate(todo):
        def prog(**kw):
            if progress:
                progress(index=k, count=len(todo), point=point, **kw)
        line_ns = probe_placement(cfg)
        probes.append(line_ns)
        try:
            rec = Measurement(cfg, point, prog).run()
            rec["line_ns_before"] = line_ns
        except KeyboardInterrupt:   # Ctrl-C / SIGTERM: that measurement is cleaned up; report what is done
            interrupted = True
            break
        except Exception as e:      # one failed point (a process died, testpmd refused, ...) is reported, not fatal
            rec = None
            why = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
            errors.append({"pair": point.pair, "path": point.path, "pkt_size": point.size, "repeat": point.rep,
                           "mode": point.mode, "offered_pps": point.rate, "group": point.group,
                           "variant": point.variant, "error": why})
            if progress:
                progress(index=k, count=len(todo), point=point, phase="failed", error=why)
        if rec is not None:
            records.append(rec)
            if on_record:
                on_record(rec)
    try:
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    placement_ns = placement_threshold(probes)
    result = {"tool": "vring bench", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "duration_s": round(time.time() - started, 1), "machine": machine, "config": asdict(cfg),
              "pinning": pinning_note(cfg),
              "method": {"rate": "packets the device dequeued per second, one sample per interval, samples of the "
                                 "warm-up dropped; median/min/max over the rest (point: median of the per-repeat "
                                 "medians, min/max over all samples)",
                         "our_driver": "vring driver --mode macfwd --latency (or --mode rate), pinned to driver_cpu",
                         "our_device": "vring vhost --fwd macswap, pinned to device_cpu",
                         "dpdk_driver": "dpdk-testpmd virtio_user, --forward-mode=mac, start tx_first K (K bursts)",
                         "dpdk_device": "dpdk-testpmd net_vhost, --forward-mode=macswap",
                         "notify": "ours: vring vhost --idle sleep, vring driver --wait (testpmd always polls)",
                         "cpu": "CPU seconds per second (1.0 = one CPU) over the measured window and over the "
                                "idle interval; other_on_pinned flags noise",
                         "loss_check": "injected == in flight (driver Tx not dequeued + device pending + enqueued "
                                       "not received + held by the driver) + lost (all drop counters)"},
              "placement": {"probes_ns": probes, "threshold_ns": placement_ns},
              "interrupted": interrupted, "points": aggregate(cfg, records, placement_ns), "runs": records,
              "errors": errors}
    if cfg.study:
        from vring import studies
        result["study"] = studies.get(cfg.study).summary(cfg, result["points"])
    return result


# --------------------------------------------------------------------------------------------- output

def _fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def _small(x):
    if x is None:
        return "-"
    return "0" if x == 0 else format(x, ".4f") if x >= 1e-3 else format(x, ".1e")


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def _rate_label(r):
    if r is None:
        return "closed"
    return f"{r / 1e6:g}M" if r >= 1e6 else f"{r / 1e3:g}k" if r >= 1e3 else f"{r:g}"


def format_table(result):
    """The table at the end (a study's own table with --study). "vs dpdk": our rate / DPDK's pair at the same point,
    as the median of the ratios of runs made side by side (same repeat); Mpps: median of the per-repeat medians,
    min-max over all samples; CPU: share of one CPU over the measured window (idle: over the idle interval)."""
    if result.get("study"):
        from vring import studies
        return studies.format_study(result)
    pts = result["points"]
    rates = any(p.get("offered_pps") is not None for p in pts)
    idle = any((p.get("cpu") or {}).get("idle_device") is not None for p in pts)
    head = (f"{'path':16s} {'size':>5s} {'driver/device':13s} {'mode':6s} "
            + (f"{'offered':>8s} " if rates else "")
            + f"{'Mpps':>7s} {'min-max':>13s} {'vs dpdk':>7s} {'p50 us':>8s} {'p99 us':>8s} {'p99.9 us':>9s} "
              f"{'kick/pkt':>9s} {'call/pkt':>9s} {'cpu dev':>7s} {'cpu drv':>7s} "
            + (f"{'idle dev':>8s} {'idle drv':>8s} " if idle else "")
            + f"{'retries':>7s} {'drops':>6s} {'loss':>5s}")
    lines = [result.get("pinning") or "", head, "-" * len(head)]
    prev = None
    for p in pts:
        grp = (p["path"], p["pkt_size"], p.get("offered_pps"))
        if prev is not None and grp != prev:
            lines.append("")
        prev = grp
        pps, cpu = p["pps"], p.get("cpu") or {}
        mpps = None if pps["median"] is None else pps["median"] / 1e6
        rng = "-" if pps["min"] is None else f"{pps['min'] / 1e6:.2f}-{pps['max'] / 1e6:.2f}"
        lat, nt = p["latency"], p["notifications"]
        vs = None
        if p["vs_dpdk"]:   # side by side: the median of the per-repeat ratios (each pair of runs saw the same noise)
            vs = p["vs_dpdk"]["median_of_per_repeat"] or p["vs_dpdk"]["ratio"]
        lines.append(
            f"{p['path']:16s} {p['pkt_size']:>5d} {p['pair']:13s} {p.get('mode', 'poll'):6s} "
            + (f"{_rate_label(p.get('offered_pps')):>8s} " if rates else "")
            + f"{_fmt(mpps, '7.3f'):>7s} {rng:>13s} "
              f"{_fmt(vs, '7.3f'):>7s} {_fmt(lat['p50_us'], '8.1f'):>8s} {_fmt(lat['p99_us'], '8.1f'):>8s} "
              f"{_fmt(lat['p99.9_us'], '9.1f'):>9s} {_small(nt['kicks_per_packet']):>9s} "
              f"{_small(nt['calls_per_packet']):>9s} {_pct(cpu.get('measured_device')):>7s} "
              f"{_pct(cpu.get('measured_driver')):>7s} "
            + (f"{_pct(cpu.get('idle_device')):>8s} {_pct(cpu.get('idle_driver')):>8s} " if idle else "")
            + f"{_fmt(p['retries'], 'd'):>7s} {p['drops']:>6d} "
              f"{'ok' if p['loss_check_ok'] else 'FAIL':>5s}" + ("  noisy" if p.get("noisy") else ""))
    lines += _regime_lines(pts, rates)
    lines += _placement_table_lines(pts, rates)
    lines += _footer(result)
    return "\n".join(lines)


def _split_lines(pts, rates, field, vs_key, names, count, title, split_at=False):
    """A table of the points split two ways (p[field][name] for each of names: ``count`` and median), with the
    ratio to dpdk/dpdk within the same part (p["vs_dpdk"][vs_key]); the threshold first with ``split_at``."""
    pts = [p for p in pts if p.get(field)]
    if not pts:
        return []
    head = (f"{'path':16s} {'size':>5s} {'driver/device':13s} {'mode':6s} " + (f"{'offered':>8s} " if rates else "")
            + (f"{'split at':>8s} " if split_at else "")
            + " | ".join([""] + [f"{name + ' n':>6s} {'Mpps':>7s} {'vs dpdk':>7s}" for name in names]).lstrip())
    lines = ["", title, head, "-" * len(head)]
    for p in pts:
        g, by = p[field], (p["vs_dpdk"] or {}).get(vs_key) or {}
        cells = [f"{g[name][count]:>6d} {_fmt(g[name]['median'] and g[name]['median'] / 1e6, '7.3f'):>7s} "
                 f"{_fmt(by.get(name), '7.3f'):>7s}" for name in names]
        lines.append(f"{p['path']:16s} {p['pkt_size']:>5d} {p['pair']:13s} {p.get('mode', 'poll'):6s} "
                     + (f"{_rate_label(p.get('offered_pps')):>8s} " if rates else "")
                     + (f"{g['threshold_pps'] / 1e6:>8.2f} " if split_at else "")
                     + " | ".join([""] + cells).lstrip())
    return lines


def _regime_lines(pts, rates):
    """Points whose samples fell into two speed regimes (speed_regimes): each pair's rate within each, and its
    ratio to dpdk/dpdk's in the same regime."""
    return _split_lines(pts, rates, "regimes", "by_regime", ("slow", "fast"), "samples",
                        "two speed regimes: the samples of these points fell into two clusters (the machine ran at "
                        "two speeds); Mpps (median) within each, and vs dpdk where dpdk/dpdk's samples split too",
                        split_at=True)


def _placement_table_lines(pts, rates):
    """When the probes saw two placements (by_placement): each point's rate among the repeats measured near and
    among those measured far, and its ratio to dpdk/dpdk's in the same placement."""
    return _split_lines(pts, rates, "placements", "by_placement", ("near", "far"), "repeats",
                        "by placement: the repeats measured with the two CPUs near, and far (placement line below); "
                        "Mpps (median) within each, and vs dpdk within the same placement")


def _placement_lines(result):
    """Where the host had put the two CPUs: one cache line's trip between them before each measurement. On a shared
    VM it switches between near and far every few seconds, and a pair that moves more lines per packet loses more
    when far: rates measured in different placements compare the machine, not the pairs."""
    pl = result.get("placement") or {}
    probes = [x for x in pl.get("probes_ns") or [] if x is not None]
    if not probes:
        return []
    cfg = result.get("config") or {}
    where = f"CPU {cfg.get('device_cpu')} -> CPU {cfg.get('driver_cpu')}"
    t = pl.get("threshold_ns")
    line = (f"placement: one cache line {where} took {min(probes):.0f}-{max(probes):.0f} ns (median "
            f"{statistics.median(probes):.0f}) before the {len(probes)} measurements")
    if t is not None:
        far = sum(x >= t for x in probes)
        line += (f"; the host moved the CPUs: near (< {t:.0f} ns) before {len(probes) - far}, far before {far} "
                 f"(runs[].line_ns_before; \"by placement\" above compares within each)")
    return [line]


def _footer(result):
    pts = result["points"]
    lines = []
    if any(p["vs_dpdk"] for p in pts):
        lines.append("vs dpdk: rate / dpdk/dpdk's at the same point, median of the side-by-side (same repeat) ratios")
    lines.append("cpu: CPU seconds per second of each process over the measured window (100% = one CPU busy)"
                 + ("; idle: the same over our driver's idle interval (queues up, no traffic)"
                    if any((p.get("cpu") or {}).get("idle_device") is not None for p in pts) else ""))
    if any(p.get("noisy") for p in pts):
        lines.append(f"noisy: other work used more than {NOISY:.0%} of the pinned CPUs during the window")
    lines += _placement_lines(result)
    for e in result.get("errors", []):
        first = e["error"].splitlines()[0] if e["error"] else ""
        what = " ".join(str(x) for x in (e.get("group"), e.get("variant")) if x)
        lines.append(f"FAILED {what + ' ' if what else ''}{e['path']} {e['pkt_size']} {e['pair']} "
                     f"{e.get('mode', 'poll')} repeat {e['repeat'] + 1}: {first}")
    return lines


def plot(result, out):
    """Closed loop: rates per path (bars per pair and mode, min-max whiskers) and latency percentiles of our
    driver's pairs. Open loop (--rate): latency percentiles against offered load, polled and notified. A study:
    its own chart (vring/studies.py)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.get("study"):
        from vring import studies
        fig = studies.plot_study(result, plt)
    elif any(p.get("offered_pps") is not None for p in result["points"]):
        fig = _plot_load(result, plt)
    else:
        fig = _plot_rates(result, plt)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _series(pts):
    """(pair, mode) labels in the order the points came."""
    out = []
    for p in pts:
        s = (p["pair"], p.get("mode", "poll"))
        if s not in out:
            out.append(s)
    return out


def _plot_rates(result, plt):
    pts = result["points"]
    cfg = result["config"]
    series = _series(pts)
    groups = []
    for p in pts:
        if (p["path"], p["pkt_size"]) not in groups:
            groups.append((p["path"], p["pkt_size"]))
    sizes = {s for _, s in groups}
    labels = [f"{p}\n{s} B" if len(sizes) > 1 else p for p, s in groups]
    by = {(p["path"], p["pkt_size"], p["pair"], p.get("mode", "poll")): p for p in pts}
    name = (lambda s: s[0] if len({m for _, m in series}) == 1 else f"{s[0]} {s[1]}")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 2.2 * len(groups)), 9))
    w = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for g, (path, size) in enumerate(groups):
            p = by.get((path, size, *s))
            if p is None or p["pps"]["median"] is None:
                continue
            m = p["pps"]["median"] / 1e6
            xs.append(g + (i - (len(series) - 1) / 2) * w)
            ys.append(m)
            lo.append(m - p["pps"]["min"] / 1e6)
            hi.append(p["pps"]["max"] / 1e6 - m)
        ax1.bar(xs, ys, w, yerr=[lo, hi], capsize=3, label=name(s))
    ax1.set_xticks(range(len(groups)), labels)
    ax1.set_ylabel("Mpps (median; whiskers: min-max)")
    ax1.set_title(f"vring bench: loopback rate, burst {cfg['burst']}, ring {cfg['ring_size']}, "
                  f"{cfg['inject']} packets in flight")
    ax1.legend(title="driver/device")
    lat_series = [s for s in series if s[0].startswith("ours/")]
    k = 0
    w2 = 0.8 / max(1, len(lat_series) * len(PCTS))
    for s in lat_series:
        for pc in PCTS:
            xs, ys = [], []
            for g, (path, size) in enumerate(groups):
                p = by.get((path, size, *s))
                if p is None or p["latency"][pc + "_us"] is None:
                    continue
                xs.append(g + (k - (len(lat_series) * len(PCTS) - 1) / 2) * w2)
                ys.append(p["latency"][pc + "_us"])
            ax2.bar(xs, ys, w2, label=f"{name(s)} {pc}", color=f"C{series.index(s)}",
                    alpha=(1.0, 0.7, 0.45)[PCTS.index(pc)], hatch=("", "//", "xx")[PCTS.index(pc)],
                    edgecolor="black", linewidth=0.5)
            k += 1
    ax2.set_xticks(range(len(groups)), labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("round-trip latency, us (log)")
    ax2.set_title("latency percentiles (our driver's payload timestamps, after the warm-up)")
    if lat_series:
        ax2.legend(fontsize="small", ncol=len(lat_series))
    else:
        ax2.text(0.5, 0.5, "no pair with our driver: no latency", ha="center", transform=ax2.transAxes)
    return fig


def _plot_load(result, plt):
    """Latency (p50, p99, p99.9) against offered load, one panel per path, a line per (pair, mode)."""
    pts = [p for p in result["points"] if p.get("offered_pps") is not None]
    paths = []
    for p in pts:
        if (p["path"], p["pkt_size"]) not in paths:
            paths.append((p["path"], p["pkt_size"]))
    series = _series(pts)
    fig, axes = plt.subplots(len(paths), 1, figsize=(9, 4.2 * len(paths)), squeeze=False)
    for ax, (path, size) in zip(axes[:, 0], paths):
        for i, s in enumerate(series):
            mine = sorted((p for p in pts if (p["path"], p["pkt_size"], p["pair"], p.get("mode", "poll"))
                           == (path, size, *s)), key=lambda p: p["offered_pps"])
            for pc, style in zip(PCTS, ("-o", "--s", ":^")):
                xy = [(p["offered_pps"], p["latency"][pc + "_us"]) for p in mine
                      if p["latency"][pc + "_us"] is not None]
                if xy:
                    ax.plot(*zip(*xy), style, color=f"C{i}", label=f"{s[0]} {s[1]} {pc}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered load, frames/s (open loop)")
        ax.set_ylabel("round-trip latency, us")
        ax.set_title(f"{path}, {size} B: latency against offered load (after the warm-up)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    return fig
