"""The two-process loopback benchmark behind ``vring bench``.

One *measurement* = one (pair, path, packet size, repeat): start the device process (ours: ``vring vhost
--fwd macswap``; DPDK: ``dpdk-testpmd`` with ``net_vhost``, ``--forward-mode=macswap``) pinned to one CPU, then
the driver process (ours: ``vring driver --mode macfwd --count N --latency``; DPDK: ``dpdk-testpmd`` with
``virtio_user``, ``--forward-mode=mac``, ``start tx_first K``) pinned to the other, on a vhost-user socket in a
fresh temporary directory. N packets are injected and loop.

The rate is always read at the device: packets it dequeued from the driver's Tx queue (ours: ``txq1.tx_packets``
from the ``--stats-interval`` JSON lines, stamped by the backend itself; DPDK: ``RX-packets`` of the net_vhost
port from ``show port stats 0``). One sample per interval; the samples of the first ``warmup`` seconds after the
first packet are dropped; the median, min and max of the rest are reported.

At the end the driver is stopped first (ours: SIGINT, it drains and prints its counters; DPDK: ``stop``), then the
device, and the loss check is made from both sides' final counters::

    in flight = (driver Tx - device dequeued) + (device enqueued - driver Rx) + held by the driver (ours: drained)
    lost      = driver Tx drops + device drops (no Rx buffer, too big, forward drops, runts, oversize)
    ok        = injected == in flight + lost

Every process is started with ``Popen`` in its own session and stopped through that object (SIGINT / testpmd
``quit``, then SIGKILL); the temporary directory (socket, logs) is removed, and the driver's shared-memory
segments (``/dev/shm/vring-drv-<pid>-*``) are removed if the driver died before unlinking them; on Ctrl-C too.
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

PATHS = {  # name -> (packed, in_order)
    "split-normal": (False, False),
    "split-in-order": (False, True),
    "packed-normal": (True, False),
    "packed-in-order": (True, True),
}
PAIRS = ("ours/ours", "dpdk/dpdk", "ours/dpdk", "dpdk/ours")   # driver/device
MIN_PKT, MAX_PKT, MAX_PKT_DPDK = 60, 9000, 1518
PCTS = ("p50", "p99", "p99.9")


class BenchError(RuntimeError):
    """A measurement could not be made (a process died, no traffic, ...). The message says which and why."""


# --------------------------------------------------------------------------------------------- parsing

def parse_paths(text):
    """'split-normal,packed-in-order' -> ordered unique list. Also: 'all', 'split', 'packed' (both variants),
    'normal', 'in-order' (both formats), 'inorder' for 'in-order'."""
    out = []
    for tok in (t.strip().lower().replace("_", "-").replace("inorder", "in-order") for t in text.split(",")):
        if not tok:
            continue
        if tok == "all":
            names = list(PATHS)
        elif tok in ("split", "packed"):
            names = [f"{tok}-normal", f"{tok}-in-order"]
        elif tok in ("normal", "in-order"):
            names = [f"split-{tok}", f"packed-{tok}"]
        elif tok in PATHS:
            names = [tok]
        else:
            raise ValueError(f"unknown path {tok!r}: use {', '.join(PATHS)} (or split, packed, normal, in-order, all)")
        out += [n for n in names if n not in out]
    if not out:
        raise ValueError("no path given")
    return out


def parse_pairs(text):
    out = []
    alias = {"ours": "ours/ours", "dpdk": "dpdk/dpdk"}
    for tok in (t.strip().lower() for t in text.split(",")):
        if not tok:
            continue
        tok = alias.get(tok, tok)
        if tok not in PAIRS:
            raise ValueError(f"unknown pair {tok!r}: DRIVER/DEVICE with each ours or dpdk ({', '.join(PAIRS)})")
        if tok not in out:
            out.append(tok)
    if not out:
        raise ValueError("no pair given")
    return out


def parse_sizes(text):
    out = []
    for tok in (t.strip() for t in str(text).split(",")):
        if not tok:
            continue
        try:
            n = int(tok, 0)
        except ValueError:
            raise ValueError(f"packet size {tok!r} is not an integer") from None
        if not MIN_PKT <= n <= MAX_PKT:
            raise ValueError(f"packet size {n} out of range {MIN_PKT}..{MAX_PKT} (frame bytes without FCS)")
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("no packet size given")
    return out


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
    seconds: float = 10.0          # measured seconds per point (after the warm-up)
    warmup: float = 2.0
    interval: float = 0.5
    repeat: int = 1
    device_cpu: int = 0
    driver_cpu: int = 1
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
        if not self.seconds > 0:
            raise ValueError(f"--seconds must be > 0, not {self.seconds}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, not {self.warmup}")
        if not 0.05 <= self.interval <= self.seconds:
            raise ValueError(f"--interval must be 0.05..--seconds ({self.seconds}), not {self.interval}")
        if not 1 <= self.repeat <= 1000:
            raise ValueError(f"--repeat must be 1..1000, not {self.repeat}")
        from vhost.datapath import Options   # the backend's own validation of --retries / --txq-flush
        from rings.errors import ConfigError
        try:
            Options(burst=self.burst, retries=self.retries, txq_flush=self.txq_flush)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if any(p != "ours/ours" for p in self.pairs):
            big = [s for s in self.pkt_sizes if s > MAX_PKT_DPDK]
            if big:
                raise ValueError(f"packet sizes {big} > {MAX_PKT_DPDK}: the DPDK pairs run with testpmd's "
                                 f"default 2 KiB mbufs")
        cpus = _allowed_cpus()
        for name, c in (("device", self.device_cpu), ("driver", self.driver_cpu)):
            if c not in cpus:
                raise ValueError(f"{name} CPU {c} is not one this process may use ({cpus})")

    def points(self):
        """Measurement order: repeat, path, size, pair (pairs side by side, so they see the same noise)."""
        for rep in range(self.repeat):
            for path in self.paths:
                for size in self.pkt_sizes:
                    for pair in self.pairs:
                        yield rep, path, size, pair


def _allowed_cpus():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def default_cpus():
    """(device CPU, driver CPU): the first two CPUs this process may use (the same one if there is one)."""
    cpus = _allowed_cpus()
    return cpus[0], cpus[1 % len(cpus)]


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


def _remove_driver_shm(pid):
    """Shared-memory segments our driver process ``pid`` created (rings.shm names them /vring-drv-PID-*).
    Only called once that process has exited: normally it unlinked them itself and there is nothing to do."""
    removed = []
    for path in glob.glob(f"/dev/shm/vring-drv-{int(pid)}-*"):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def _block_signals():
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, ValueError, OSError):
        return None


def _vring_cmd(*args):
    return [sys.executable, "-m", "vring.cli", *map(str, args)]


# --------------------------------------------------------------------------------------------- one measurement

class Measurement:
    """One (pair, path, size, repeat). ``run()`` returns the record; every resource is released in ``close()``,
    which ``run()`` always calls."""

    def __init__(self, cfg: BenchConfig, pair, path, size, rep, progress=None):
        self.cfg, self.pair, self.path, self.size, self.rep = cfg, pair, path, size, rep
        self.driver_kind, self.device_kind = pair.split("/")
        self.packed, self.in_order = PATHS[path]
        self.progress = progress or (lambda **kw: None)
        self.workdir = self.sock = None
        self.procs: list[_Proc] = []
        self.testpmds = []
        self.driver_pids = []
        self.samples: list[tuple[float, int]] = []   # (time, packets dequeued by the device)
        self.notes: list[str] = []

    # -- start

    def _start_device(self):
        cfg = self.cfg
        if self.device_kind == "ours":
            argv = _vring_cmd("vhost", "--socket", self.sock, "--json", "--stats-interval", cfg.interval,
                              "--pin", cfg.device_cpu, "--max-connections", 1, "--fwd", "macswap",
                              "--burst", cfg.burst, "--retries", cfg.retries, "--txq-flush", cfg.txq_flush,
                              "--pkt-size", max(2048, self.size + 64))
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
            tp = dpdk.Testpmd.vhost(self.sock, burst=cfg.burst, fwd="macswap",
                                    lcores=(cfg.driver_cpu, cfg.device_cpu),
                                    log_path=os.path.join(self.workdir, "device-testpmd.log"))
            self.testpmds.append(tp)
            self.device = tp
            tp.start(cfg.startup_timeout)   # autostart: forwarding, waiting for a frontend

    def _start_driver(self):
        cfg = self.cfg
        if self.driver_kind == "ours":
            watchdog = cfg.warmup + cfg.seconds + cfg.startup_timeout + 30
            argv = _vring_cmd("driver", "--socket", self.sock, "--json", "--pin", cfg.driver_cpu,
                              "--mode", "macfwd", "--count", cfg.inject, "--latency",
                              "--packed" if self.packed else "--split",
                              "--in-order" if self.in_order else "--no-in-order",
                              "--mrg-rxbuf" if cfg.mrg_rxbuf else "--no-mrg-rxbuf",
                              "--burst", cfg.burst, "--ring-size", cfg.ring_size, "--pkt-size", self.size,
                              "--seconds", watchdog, "--timeout", 10)
            self.driver = _Proc("driver", argv, self.workdir)
            self.procs.append(self.driver)
            self.driver_pids.append(self.driver.pid)
            self.injected = cfg.inject
        else:
            from vring import dpdk
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
            rates, done = self._window()
            i0 = self._first_traffic()
            if i0 is None:
                if time.monotonic() - t_start > cfg.startup_timeout:
                    raise BenchError(f"no packets reached the device after {cfg.startup_timeout:.0f} s")
                self.progress(phase="starting")
                continue
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
        SIGINT/SIGTERM are held back meanwhile (a second Ctrl-C must not leave half of it undone)."""
        blocked = _block_signals()
        try:
            self._close()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _close(self):
        for p in self.procs:
            if p.alive():
                p.stop(signal.SIGINT, timeout=5.0)
        for tp in self.testpmds:
            try:
                tp.close(timeout=5.0)
            except Exception:
                tp.kill()
        for pid in self.driver_pids:
            removed = _remove_driver_shm(pid)
            if removed:
                self.notes.append(f"removed shared memory left by the driver: {', '.join(removed)}")
        if self.workdir is None:
            return
        if self.cfg.keep:
            self.notes.append(f"kept {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self):
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

    def _record(self, rates, drv, dev):
        rec = {"pair": self.pair, "driver": self.driver_kind, "device": self.device_kind, "path": self.path,
               "packed": self.packed, "in_order": self.in_order, "pkt_size": self.size, "repeat": self.rep}
        rec["rate"] = {
            "pps_median": round(statistics.median(rates)) if rates else None,
            "pps_min": round(min(rates)) if rates else None,
            "pps_max": round(max(rates)) if rates else None,
            "samples_pps": [round(r) for r in rates],
            "measured_at": "device (packets dequeued from the driver's Tx queue)",
        }
        d, v = _driver_side(self.driver_kind, drv), _device_side(self.device_kind, dev)
        moved = d["tx_packets"] or v["dequeued"] or 0
        rec["latency"] = _latency(self.driver_kind, drv)
        rec["notifications"] = _notifications(d, v, moved)
        rec["retries"] = v["retries"]
        rec["drops"] = {"total": d["drops"] + v["drops"], "driver": d["drop_parts"], "device": v["drop_parts"]}
        in_flight = {"driver_tx_not_dequeued": d["tx_packets"] - v["dequeued"],
                     "device_pending": v["pending"],
                     "enqueued_not_received": v["enqueued"] - d["rx_packets"],
                     "held_by_driver": d["held"]}
        fl, lost = sum(in_flight.values()), d["drops"] + v["drops"]
        rec["loss_check"] = {"injected": self.injected, "in_flight": fl, "lost": lost,
                             "unaccounted": self.injected - fl - lost,
                             "ok": self.injected == fl + lost and all(x >= 0 for x in in_flight.values()),
                             "in_flight_parts": in_flight}
        rec["features"] = drv.get("feature_names") if self.driver_kind == "ours" else None
        rec["counters"] = {"driver": _trim_driver(drv) if self.driver_kind == "ours" else drv, "device": dev}
        rec["notes"] = list(self.notes)
        return rec


def _driver_side(kind, drv):
    if kind == "ours":
        tx, rx = drv["tx"], drv["rx"]
        parts = {"tx_dropped": tx["dropped"], "rx_errors": rx["errors"]}
        return {"tx_packets": tx["packets"], "rx_packets": rx["packets"], "held": drv.get("drained", 0),
                "drops": sum(parts.values()), "drop_parts": parts,
                "kicks": tx["kicks"] + rx["kicks"], "kick_parts": {"tx": tx["kicks"], "rx": rx["kicks"]},
                "calls_seen": sum(int(x) for x in drv.get("calls", {}).values())}
    port, fwd = drv["ports"].get(0) or {}, drv["fwd"].get(0) or {}
    parts = {"tx_dropped": fwd.get("tx_dropped", 0), "rx_dropped": fwd.get("rx_dropped", 0)}
    return {"tx_packets": port.get("tx_packets", 0), "rx_packets": port.get("rx_packets", 0), "held": 0,
            "drops": sum(parts.values()), "drop_parts": parts, "kicks": None, "kick_parts": None,
            "calls_seen": None}


def _device_side(kind, dev):
    if kind == "ours":
        rxq, txq, im = dev["rxq0"], dev["txq1"], dev["intermediate"]
        parts = {"rx_dropped": rxq["rx_dropped"], "rx_too_big": rxq["rx_too_big"],
                 "fwd_dropped": im["fwd_dropped"], "tx_runt": txq["tx_runt"], "tx_oversize": txq["tx_oversize"]}
        return {"dequeued": txq["tx_packets"], "enqueued": rxq["rx_packets"], "pending": 0,
                "drops": sum(parts.values()), "drop_parts": parts,
                "calls": rxq["rx_calls"] + txq["tx_calls"],
                "call_parts": {"rx": rxq["rx_calls"], "tx": txq["tx_calls"]},
                "retries": {"retries": rxq["rx_retries"], "attempts": rxq["rx_attempts"],
                            "max_per_burst": None}}
    port, fwd = dev["ports"].get(0) or {}, dev["fwd"].get(0) or {}
    parts = {"tx_dropped": fwd.get("tx_dropped", 0), "rx_dropped": fwd.get("rx_dropped", 0)}
    return {"dequeued": port.get("rx_packets", 0), "enqueued": port.get("tx_packets", 0), "pending": 0,
            "drops": sum(parts.values()), "drop_parts": parts, "calls": None, "call_parts": None,
            "retries": {"retries": None, "attempts": None,
                        "reason": "testpmd's macswap engine does not retry (and counts no retries)"}}


def _latency(kind, drv):
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
    out.update(count=lat["count"], bad=lat.get("bad", 0), min_us=round(lat["min_ns"] / 1000, 3),
               avg_us=round(lat["avg_ns"] / 1000, 3), max_us=round(lat["max_ns"] / 1000, 3),
               method="round trip driver Tx -> driver Rx, CLOCK_MONOTONIC stamped in the payload at each send; "
                      "whole run incl. warm-up; percentiles are histogram bucket lower bounds (within 19%)")
    return out


def _notifications(d, v, moved):
    per = (lambda x: None if x is None or not moved else float(f"{x / moved:.4g}"))
    kicks, calls = d["kicks"], v["calls"]
    calls_src = "device counters"
    if calls is None and d["calls_seen"] is not None:
        calls, calls_src = d["calls_seen"], "driver's call eventfds (calls nobody waited for: we poll)"
    out = {"kicks": kicks, "kicks_per_packet": per(kicks), "kick_parts": d["kick_parts"],
           "calls": calls, "calls_per_packet": per(calls), "calls_source": calls_src if calls is not None else None,
           "packets": moved}
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


def aggregate(cfg: BenchConfig, records):
    """Per (path, size, pair): the medians over repeats, and the ratio to dpdk/dpdk at the same point."""
    points = []
    for path in cfg.paths:
        for size in cfg.pkt_sizes:
            for pair in cfg.pairs:
                runs = [r for r in records if (r["path"], r["pkt_size"], r["pair"]) == (path, size, pair)]
                if not runs:
                    continue
                meds = [r["rate"]["pps_median"] for r in runs]
                samples = [s for r in runs for s in r["rate"]["samples_pps"]]
                lat = {p + "_us": _med([r["latency"][p + "_us"] for r in runs]) for p in PCTS}
                if all(v is None for v in lat.values()):
                    lat["reason"] = runs[0]["latency"].get("reason")
                nt = {k: _med([r["notifications"][k] for r in runs]) for k in ("kicks_per_packet", "calls_per_packet")}
                if runs[0]["notifications"].get("reason"):
                    nt["reason"] = runs[0]["notifications"]["reason"]
                retr = [r["retries"]["retries"] for r in runs]
                points.append({
                    "path": path, "pkt_size": size, "pair": pair,
                    "pps": {"median": round(_med(meds)) if _med(meds) is not None else None,
                            "min": min(samples) if samples else None, "max": max(samples) if samples else None,
                            "per_repeat": meds},
                    "latency": lat, "notifications": nt,
                    "retries": None if any(x is None for x in retr) else sum(retr),
                    "drops": sum(r["drops"]["total"] for r in runs),
                    "loss_check_ok": all(r["loss_check"]["ok"] for r in runs),
                    "repeats": len(runs),
                })
    by_key = {(p["path"], p["pkt_size"], p["pair"]): p for p in points}
    for p in points:
        ref = by_key.get((p["path"], p["pkt_size"], "dpdk/dpdk"))
        p["vs_dpdk"] = None
        if ref is not None and p["pair"] != "dpdk/dpdk" and ref["pps"]["median"] and p["pps"]["median"]:
            same = [a / b for a, b in zip(p["pps"]["per_repeat"], ref["pps"]["per_repeat"]) if a and b]
            p["vs_dpdk"] = {"ratio": round(p["pps"]["median"] / ref["pps"]["median"], 3),
                            "per_repeat": [round(x, 3) for x in same],
                            "median_of_per_repeat": round(statistics.median(same), 3) if same else None}
    return points


def run_bench(cfg: BenchConfig, progress=None, on_record=None):
    """Every measurement in ``cfg.points()`` order; returns the JSON-able result. ``progress(**kw)`` is called
    often with the state of the current measurement; ``on_record(rec)`` after each one."""
    started = time.time()
    machine = machine_description()
    records, errors = [], []
    interrupted = False
    todo = list(cfg.points())
    for k, (rep, path, size, pair) in enumerate(todo):
        def prog(**kw):
            if progress:
                progress(index=k, count=len(todo), pair=pair, path=path, size=size, rep=rep, **kw)
        try:
            rec = Measurement(cfg, pair, path, size, rep, prog).run()
        except KeyboardInterrupt:   # Ctrl-C / SIGTERM: that measurement is cleaned up; report what is done
            interrupted = True
            break
        except Exception as e:      # one failed point (a process died, testpmd refused, ...) is reported, not fatal
            rec = None
            why = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
            errors.append({"pair": pair, "path": path, "pkt_size": size, "repeat": rep, "error": why})
            if progress:
                progress(index=k, count=len(todo), pair=pair, path=path, size=size, rep=rep, phase="failed",
                         error=why)
        if rec is not None:
            records.append(rec)
            if on_record:
                on_record(rec)
    try:
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return {"tool": "vring bench", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": round(time.time() - started, 1), "machine": machine, "config": asdict(cfg),
            "method": {"rate": "packets the device dequeued per second, one sample per interval, samples of the "
                               "warm-up dropped; median/min/max over the rest (point: median of the per-repeat "
                               "medians, min/max over all samples)",
                       "our_driver": "vring driver --mode macfwd --latency, pinned to driver_cpu",
                       "our_device": "vring vhost --fwd macswap, pinned to device_cpu",
                       "dpdk_driver": "dpdk-testpmd virtio_user, --forward-mode=mac, start tx_first K (K bursts)",
                       "dpdk_device": "dpdk-testpmd net_vhost, --forward-mode=macswap",
                       "loss_check": "injected == in flight (driver Tx not dequeued + device pending + enqueued "
                                     "not received + held by the driver) + lost (all drop counters)"},
            "interrupted": interrupted, "points": aggregate(cfg, records), "runs": records, "errors": errors}


# --------------------------------------------------------------------------------------------- output

def _fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def _small(x):
    if x is None:
        return "-"
    return "0" if x == 0 else format(x, ".4f") if x >= 1e-3 else format(x, ".1e")


def format_table(result):
    """The table at the end. "vs dpdk": our rate / DPDK's pair at the same point, as the median of the ratios of
    runs made side by side (same repeat); Mpps: median of the per-repeat medians, min-max over all samples."""
    pts = result["points"]
    head = (f"{'path':16s} {'size':>5s} {'driver/device':13s} {'Mpps':>7s} {'min-max':>13s} {'vs dpdk':>7s} "
            f"{'p50 us':>8s} {'p99 us':>8s} {'p99.9 us':>9s} {'kick/pkt':>9s} {'call/pkt':>9s} {'retries':>7s} "
            f"{'drops':>6s} {'loss':>5s}")
    lines = [head, "-" * len(head)]
    prev = None
    for p in pts:
        if prev is not None and (p["path"], p["pkt_size"]) != prev:
            lines.append("")
        prev = (p["path"], p["pkt_size"])
        pps = p["pps"]
        mpps = None if pps["median"] is None else pps["median"] / 1e6
        rng = "-" if pps["min"] is None else f"{pps['min'] / 1e6:.2f}-{pps['max'] / 1e6:.2f}"
        lat, nt = p["latency"], p["notifications"]
        vs = None
        if p["vs_dpdk"]:   # side by side: the median of the per-repeat ratios (each pair of runs saw the same noise)
            vs = p["vs_dpdk"]["median_of_per_repeat"] or p["vs_dpdk"]["ratio"]
        lines.append(
            f"{p['path']:16s} {p['pkt_size']:>5d} {p['pair']:13s} {_fmt(mpps, '7.3f'):>7s} {rng:>13s} "
            f"{_fmt(vs, '7.3f'):>7s} {_fmt(lat['p50_us'], '8.1f'):>8s} {_fmt(lat['p99_us'], '8.1f'):>8s} "
            f"{_fmt(lat['p99.9_us'], '9.1f'):>9s} {_small(nt['kicks_per_packet']):>9s} "
            f"{_small(nt['calls_per_packet']):>9s} {_fmt(p['retries'], 'd'):>7s} {p['drops']:>6d} "
            f"{'ok' if p['loss_check_ok'] else 'FAIL':>5s}")
    if any(p["vs_dpdk"] for p in pts):
        lines.append("vs dpdk: rate / dpdk/dpdk's at the same point, median of the side-by-side (same repeat) ratios")
    for e in result.get("errors", []):
        first = e["error"].splitlines()[0] if e["error"] else ""
        lines.append(f"FAILED {e['path']} {e['pkt_size']} {e['pair']} repeat {e['repeat'] + 1}: {first}")
    return "\n".join(lines)


def plot(result, out):
    """Rates per path (bars per pair, min-max whiskers) and latency percentiles of our driver's pairs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    cfg = result["config"]
    pairs = cfg["pairs"]
    groups = [(p, s) for p in cfg["paths"] for s in cfg["pkt_sizes"]]
    labels = [f"{p}\n{s} B" if len(cfg["pkt_sizes"]) > 1 else p for p, s in groups]
    by = {(p["path"], p["pkt_size"], p["pair"]): p for p in pts}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 2.2 * len(groups)), 9))
    w = 0.8 / max(1, len(pairs))
    for i, pair in enumerate(pairs):
        xs, ys, lo, hi = [], [], [], []
        for g, (path, size) in enumerate(groups):
            p = by.get((path, size, pair))
            if p is None or p["pps"]["median"] is None:
                continue
            m = p["pps"]["median"] / 1e6
            xs.append(g + (i - (len(pairs) - 1) / 2) * w)
            ys.append(m)
            lo.append(m - p["pps"]["min"] / 1e6)
            hi.append(p["pps"]["max"] / 1e6 - m)
        ax1.bar(xs, ys, w, yerr=[lo, hi], capsize=3, label=pair)
    ax1.set_xticks(range(len(groups)), labels)
    ax1.set_ylabel("Mpps (median; whiskers: min-max)")
    ax1.set_title(f"vring bench: loopback rate, burst {cfg['burst']}, ring {cfg['ring_size']}, "
                  f"{cfg['inject']} packets in flight")
    ax1.legend(title="driver/device")
    lat_pairs = [p for p in pairs if p.startswith("ours/")]
    k = 0
    w2 = 0.8 / max(1, len(lat_pairs) * len(PCTS))
    for pair in lat_pairs:
        for pc in PCTS:
            xs, ys = [], []
            for g, (path, size) in enumerate(groups):
                p = by.get((path, size, pair))
                if p is None or p["latency"][pc + "_us"] is None:
                    continue
                xs.append(g + (k - (len(lat_pairs) * len(PCTS) - 1) / 2) * w2)
                ys.append(p["latency"][pc + "_us"])
            ax2.bar(xs, ys, w2, label=f"{pair} {pc}", color=f"C{pairs.index(pair)}",
                    alpha=(1.0, 0.7, 0.45)[PCTS.index(pc)], hatch=("", "//", "xx")[PCTS.index(pc)],
                    edgecolor="black", linewidth=0.5)
            k += 1
    ax2.set_xticks(range(len(groups)), labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("round-trip latency, us (log)")
    ax2.set_title("latency percentiles (our driver's payload timestamps)")
    if lat_pairs:
        ax2.legend(fontsize="small", ncol=len(lat_pairs))
    else:
        ax2.text(0.5, 0.5, "no pair with our driver: no latency", ha="center", transform=ax2.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
