"""Restart scenarios with real processes: the kill -9 loop, the soak, and DPDK DTS's "vhost/virtio-user
loopback server mode" plan. The benchmarks (benchmarks/kill9.py, soak.py, dts_server_mode.py) print their
tables; the tests run the same functions with fewer rounds.

* ``kill_loop``: `vring vhost` killed -9 ``kills`` times (and relaunched) under `vring driver --reconnect
  --verify` looping ``count`` frames (macfwd); per kill: resume time (relaunch -> first frame received),
  chains the successor took again, duplicates the driver dropped, frames lost (put on the restart after
  which they were never seen again); at the end the whole population is checked. Extra `vring vhost` arguments
  go to every backend (``check_vhost_args`` refuses bad ones before anything runs).
* ``dts_virtio_user_server``: DPDK virtio_user ``server=1`` + `vring vhost --client` killed and relaunched,
  then ``stop`` / ``start tx_first`` on testpmd (as DTS does); traffic resumes.
* ``dts_net_vhost_client``: `vring driver --server` + DPDK net_vhost ``client=1`` killed and relaunched, then
  ``start tx_first`` on the new testpmd; traffic resumes through our driver.

Every process is started in its own session and ended by its pid; sockets live in a temporary directory
removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from rings.errors import ConfigError
from vhost.testing import VhostProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpus():
    """(backend CPU, driver CPU): the first and the last allowed CPU."""
    c = sorted(os.sched_getaffinity(0))
    return c[0], c[-1]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def path_args(packed, in_order, mrg_rxbuf=True):
    return ["--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
            "--mrg-rxbuf" if mrg_rxbuf else "--no-mrg-rxbuf"]


def path_name(packed, in_order):
    return f"{'packed' if packed else 'split'}/{'in-order' if in_order else 'normal'}"


class Driver:
    """`vring driver` as a child process; its restart events (JSON lines on stderr) are collected live."""

    def __init__(self, sock, *args, pin=None):
        argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--json", *map(str, args)]
        if pin is not None:
            argv += ["--pin", str(pin)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                     start_new_session=True)
        self.events, self.other = [], []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.result = None

    def _read(self):
        for line in self.proc.stderr:
            with self._cond:
                if line.startswith('{"event"'):
                    self.events.append(json.loads(line))
                else:
                    self.other.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, name, after=0.0, timeout=10.0):
        """The first event ``name`` stamped after ``after`` (CLOCK_MONOTONIC), or None."""
        def find():
            return next((e for e in self.events if e["event"] == name and e["t"] >= after), None)
        with self._cond:
            self._cond.wait_for(lambda: find() is not None or self.proc.poll() is not None, timeout)
            return find()

    @property
    def pid(self):
        return self.proc.pid

    def stop(self, timeout=60, signal_it=True):
        """SIGINT (the driver drains and prints its counters); returns the JSON result. ``signal_it=False``: a
        driver started with --seconds, which ends by itself (a SIGINT that lands while it is still starting
        would end it before it has a loop to drain)."""
        if signal_it and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out = self.proc.stdout.read()
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self.proc.stdout.close()
        self.proc.stderr.close()
        rc = self.proc.returncode
        # 1: --verify found losses, which are what these runs measure (the report says which)
        if rc not in (0, 1):
            raise RuntimeError(f"vring driver exited {rc}: {''.join(self.other)[-2000:]}")
        self.result = json.loads(out)
        if rc == 1 and not self.result.get("verify", {}).get("failures"):
            raise RuntimeError(f"vring driver exited 1 with no verify failure: {''.join(self.other)[-2000:]}")
        return self.result

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        self.proc.stdout.close()
        self.proc.stderr.close()


def _backend(sock, be_cpu, extra=()):
    return VhostProcess(sock, "--fwd", "macswap", "--stats-interval", "0.2", *map(str, extra), pin=be_cpu)


# what kill_loop sets on every backend itself: --fwd macswap (the driver verifies swapped MACs), the stats lines it
# reads (--json, --stats-interval), --crash-after (--mid-burst's), the CPU; --client and --max-connections would
# leave the relaunched backend nobody to serve
_OWNED = ("socket", "client", "fwd", "json", "stats_interval", "pin", "crash_after", "max_connections")


class _Refusing(argparse.ArgumentParser):
    """`vring vhost`'s own parser, raising where it would print and exit."""

    def error(self, message):
        raise ConfigError(message)

    def exit(self, status=0, message=None):   # --help: printed, then this
        raise ConfigError(message or "not an argument for a run")


def check_vhost_args(args):
    """Refuse (ConfigError) extra `vring vhost` arguments for ``kill_loop`` before anything runs: what its parser
    refuses, what kill_loop sets itself, then what the backend refuses at start (one is started with them on a
    socket of its own and stopped): a bad value would otherwise be a relaunched backend that never comes back."""
    if not args:
        return
    from vring import cmd_vhost
    parser = _Refusing(prog="vring")
    cmd_vhost.register(parser.add_subparsers(dest="command"))
    base = ["vhost", "--socket", "<kill_loop's>"]
    given, default = vars(parser.parse_args(base + list(args))), vars(parser.parse_args(base))
    owned = [f"--{k.replace('_', '-')}" for k in _OWNED if given[k] != default[k]]
    if owned:
        raise ConfigError(f"{', '.join(owned)}: set by the kill loop itself")
    tmp = tempfile.mkdtemp(prefix="vring-kill9-check-")
    be = VhostProcess(os.path.join(tmp, "vh.sock"), *args)
    try:
        be.wait_socket()
    except RuntimeError as e:
        if be.proc.poll() is None:   # not a refusal: it did not start in time
            raise
        lines = be.stderr().strip().splitlines()   # its own message says why (exit 2, one line)
        raise ConfigError(lines[-1] if lines else str(e)) from None
    finally:
        be.__exit__()
        shutil.rmtree(tmp, ignore_errors=True)


def _stats_lines(be):
    return [json.loads(x) for x in be.stdout().splitlines() if x.startswith("{")]


def _wait_connections(be, n, timeout=20.0):
    """Until the backend's stats lines count ``n`` connections (a driver killed before it connected would
    test nothing); False if they do not within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in reversed(be.stdout().splitlines()):   # read while it writes: the last line may be partial
            try:
                if json.loads(line).get("connections", 0) >= n:
                    return True
                break
            except ValueError:
                continue
        time.sleep(0.05)
    return False


def _kill9(be):
    """kill -9 a VhostProcess and collect what it printed (its last stats line)."""
    be.proc.send_signal(signal.SIGKILL)
    be.proc.wait(10)
    lines = _stats_lines(be)
    be._stdout.close()
    be._stderr.close()
    return lines[-1] if lines else None


def _cleanup(drv, be, tmp):
    """End what is still running (the driver killed, the backend stopped) and remove the run's directory."""
    try:
        if drv is not None and drv.proc.poll() is None:
            drv.kill()
        if be.proc.poll() is None:
            _end(be)
    finally:   # the run's directory goes whatever the processes did
        shutil.rmtree(tmp, ignore_errors=True)


def _end(be):
    """Stop a VhostProcess cleanly (SIGINT); its final counters."""
    final = be.stop()
    be._stdout.close()
    be._stderr.close()
    return final


def _resubmitted(st):
    return st["rxq0"].get("rx_resubmitted", 0) + st["txq1"].get("tx_resubmitted", 0) if st else None


_RETAKEN = re.compile(r"vring \d+: (\d+) chains taken by the previous backend")


def _retaken_logged(be):
    """The chains a backend queued to take again, from its log (a --crash-after backend dies before its first
    stats line), or None if it logged no start of its data path."""
    log = be.stderr()
    if "data path started" not in log:
        return None
    return sum(int(x) for x in _RETAKEN.findall(log))


def _dropped(st):
    """The backend's named drop counters."""
    if not st:
        return {}
    rxq, txq, im = st["rxq0"], st["txq1"], st["intermediate"]
    return {"rx_dropped": rxq["rx_dropped"], "rx_too_big": rxq["rx_too_big"], "tx_runt": txq["tx_runt"],
            "tx_oversize": txq["tx_oversize"], "fwd_dropped": im["fwd_dropped"]}


def kill_loop(packed, in_order, kills=20, count=256, run_s=(0.3, 0.8), seed=1, progress=None, driver_args=(),
              mid_burst=False, vhost_args=()):
    """``kills`` kill -9 of the backend under a resilient driver; returns a dict with the per-kill table and
    the end-of-run accounting. ``mid_burst``: every other backend is started with ``--crash-after`` (20-300)
    and dies by itself inside a burst (a random kill mostly finds the backend idle between bursts).
    ``vhost_args``: given to every backend (``check_vhost_args`` first)."""
    rng = random.Random(seed)
    be_cpu, drv_cpu = cpus()
    tmp = tempfile.mkdtemp(prefix="vring-kill9-")
    sock = os.path.join(tmp, "vh.sock")
    rows, backends_dropped = [], {}
    be = _backend(sock, be_cpu, vhost_args)
    drv = None
    try:
        be.wait_socket()
        drv = Driver(sock, "--reconnect", "--verify", "--mode", "macfwd", "--count", count,
                     *path_args(packed, in_order), *driver_args, pin=drv_cpu)
        if drv.wait_event("connected") is None:
            raise RuntimeError(f"driver did not connect: {''.join(drv.other)[-2000:]}")
        crasher = False
        for k in range(kills):
            if crasher:   # dies by itself, mid-burst; a kill -9 if it has not within 10 s
                try:
                    be.proc.wait(10)
                except subprocess.TimeoutExpired:
                    crasher = False
            else:
                time.sleep(rng.uniform(*run_s))
            how = "crash mid-burst" if crasher else "kill -9"
            logged = _retaken_logged(be)
            last = _kill9(be)
            for key, v in _dropped(last).items():
                backends_dropped[key] = backends_dropped.get(key, 0) + v
            if rows:   # the backend just killed was the successor of the previous kill
                rows[-1]["resubmitted"] = _resubmitted(last) if last else logged
            t_launch = time.monotonic()
            crasher = mid_burst and k % 2 == 0 and k + 1 < kills
            be = _backend(sock, be_cpu, (*vhost_args, *(("--crash-after", rng.randint(20, 300)) if crasher else ())))
            ev = drv.wait_event("traffic", after=t_launch, timeout=10)
            row = {"kill": k + 1, "how": how, "resume_s": round(ev["t"] - t_launch, 3) if ev else None,
                   "resubmitted": None}
            rows.append(row)
            if progress:
                progress(row)
            if ev is None:
                break
        res = drv.stop()
        final = _end(be)
        for key, v in _dropped(final).items():
            backends_dropped[key] = backends_dropped.get(key, 0) + v
        if rows:
            rows[-1]["resubmitted"] = _resubmitted(final)
    finally:
        _cleanup(drv, be, tmp)
    recs = res.get("reconnects", [])
    for row, rec in zip(rows, recs):
        row.update(down_s=rec.get("down_s"), lost=rec.get("lost", 0), duplicated=rec.get("duplicates", 0))
    v = res["verify"]
    pop = v["population"]
    driver_dropped = res["tx"]["dropped"]
    accounted = pop["present"] + pop["tx_inflight"] + pop["held"]
    return {
        "path": path_name(packed, in_order), "vhost_args": list(vhost_args), "kills": len(rows), "rows": rows,
        "injected": res["injected"], "present_at_end": pop["present"], "in_flight_at_end": pop["tx_inflight"],
        "held_at_end": pop["held"], "absent_at_end": pop["absent"], "duplicates": v["duplicates"],
        "dropped": {"driver_tx_dropped": driver_dropped, **backends_dropped},
        "lost": max(0, pop["absent"] - driver_dropped - sum(backends_dropped.values())),
        "accounted": accounted, "bad_frames": v["bad"],
        "ring_errors_driver": res["rx"]["errors"] + res["tx"]["errors"],
        "max_resume_s": max((r["resume_s"] for r in rows if r["resume_s"] is not None), default=None),
        "all_resumed": all(r["resume_s"] is not None for r in rows),
    }


def print_kill_table(r, out=sys.stdout):
    extra = f" {' '.join(r['vhost_args'])}" if r.get("vhost_args") else ""
    print(f"\n== {r['path']}: {r['kills']} x kill -9 of vring vhost{extra}, {r['injected']} frames injected "
          f"(macfwd)", file=out)
    print(f"{'kill':>4} {'how':15s} {'resume_s':>9} {'down_s':>7} {'lost':>5} {'duplicated':>10} {'re-taken':>9}",
          file=out)
    for row in r["rows"]:
        print(f"{row['kill']:>4} {row['how']:15s} {row['resume_s'] if row['resume_s'] is not None else 'NEVER':>9} "
              f"{row.get('down_s') or 0:>7.3f} {row.get('lost', 0):>5} {row.get('duplicated', 0):>10} "
              f"{row['resubmitted'] if row['resubmitted'] is not None else '?':>9}", file=out)
    drops = ", ".join(f"{k}={v}" for k, v in r["dropped"].items())
    print(f"end: present {r['present_at_end']}, in flight {r['in_flight_at_end']}, held {r['held_at_end']}, "
          f"absent {r['absent_at_end']} (dropped: {drops}); LOST {r['lost']}; duplicates {r['duplicates']} "
          f"(counted and dropped by the driver); bad frames {r['bad_frames']}; driver ring errors "
          f"{r['ring_errors_driver']}; max resume {r['max_resume_s']} s", file=out)


# ------------------------------------------------------------------------------------------ DTS

def _wait_rx(tp, since, timeout=5.0, port=0):
    """Seconds until testpmd's port ``port`` Rx counter moves past ``since`` (None if it does not)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if tp.stats(port).rx_packets > since:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def dts_virtio_user_server(packed, in_order, mrg_rxbuf, kills=2, settle=0.5):
    """virtio_user server=1 (testpmd, mac fwd) <- `vring vhost --client` killed -9 and relaunched, then
    ``stop`` + ``start tx_first`` on testpmd. Returns per-launch rows (rx packets in ``settle`` s)."""
    from vring import dpdk
    be_cpu, tp_cpu = cpus()
    tmp = tempfile.mkdtemp(prefix="vring-dts-")
    sock = os.path.join(tmp, "fe.sock")
    rows = []
    tp = dpdk.Testpmd.virtio_user(sock, packed=packed, in_order=in_order, mrg_rxbuf=mrg_rxbuf, server=True,
                                  fwd="mac", tx_first=True, fwd_cpu=tp_cpu)
    be = None
    try:
        tp.start(60)
        be = VhostProcess(sock, "--client", "--reconnect", "0.1", "--fwd", "macswap", pin=be_cpu)
        tp.wait_ready(60)
        for k in range(kills + 1):
            if k:
                be.proc.send_signal(signal.SIGKILL)
                be.proc.wait(10)
                be.__exit__()
                t0 = time.monotonic()
                be = VhostProcess(sock, "--client", "--reconnect", "0.1", "--fwd", "macswap", pin=be_cpu)
                tp.wait_link_up(timeout=30, poll=0.05)
                tp.stop_forwarding()
                base = tp.stats(0).rx_packets
                tp.start_forwarding()   # start tx_first
                moved = _wait_rx(tp, base)
                resume = None if moved is None else round(time.monotonic() - t0, 3)
            else:
                resume = 0.0
            a = tp.stats(0)
            time.sleep(settle)
            b = tp.stats(0)
            rows.append({"launch": k, "resume_s": resume, "rx_packets": b.rx_packets - a.rx_packets})
        errors = [ln for ln in tp.error_lines() if "virtio-user port" not in ln]
    finally:
        tp.close()
        if be is not None:
            be.__exit__()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"case": "virtio_user server=1 + vring vhost --client", "packed": packed, "in_order": in_order,
            "mrg_rxbuf": mrg_rxbuf, "rows": rows, "testpmd_errors": errors,
            "resumed": all(r["rx_packets"] > 0 for r in rows)}


def dts_net_vhost_client(packed, in_order, mrg_rxbuf, kills=2, settle=0.5):
    """`vring driver --server` (macfwd, nothing injected) <- DPDK net_vhost client=1 (testpmd, mac fwd,
    ``start tx_first``) killed -9 and relaunched. Returns per-launch rows."""
    from vring import dpdk
    tp_cpu, drv_cpu = cpus()
    tmp = tempfile.mkdtemp(prefix="vring-dts-")
    sock = os.path.join(tmp, "drv.sock")
    rows = []
    drv = Driver(sock, "--server", "--mode", "macfwd", *path_args(packed, in_order, mrg_rxbuf), pin=drv_cpu)
    tp = None
    try:
        for k in range(kills + 1):
            t0 = time.monotonic()
            tp = dpdk.Testpmd.vhost(sock, client=True, fwd="mac", tx_first=True, fwd_cpu=tp_cpu, autostart=False)
            tp.start(60)
            tp.wait_link_up(timeout=30, poll=0.05)   # our driver has set the device up: the burst is not lost
            tp.start_forwarding()                    # start tx_first
            ev = drv.wait_event("traffic" if k else "connected", after=t0, timeout=10)
            moved = _wait_rx(tp, 0)
            resume = round(time.monotonic() - t0, 3) if moved is not None else None
            a = tp.stats(0)
            time.sleep(settle)
            b = tp.stats(0)
            rows.append({"launch": k, "resume_s": resume, "driver_event": bool(ev),
                         "rx_packets": b.rx_packets - a.rx_packets})
            if k < kills:
                tp.kill()
        tp.close()
        res = drv.stop()
    finally:
        if tp is not None:
            tp.close()
        if drv.proc.poll() is None:
            drv.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"case": "vring driver --server + net_vhost client=1", "packed": packed, "in_order": in_order,
            "mrg_rxbuf": mrg_rxbuf, "rows": rows, "connections": res["connections"],
            "driver_errors": res["rx"]["errors"] + res["tx"]["errors"],
            "driver": {"rx": res["rx"], "tx": res["tx"], "reconnects": res["reconnects"]},
            "resumed": all(r["rx_packets"] > 0 for r in rows) and res["connections"] == kills + 1}


# ------------------------------------------------------------------------------------------ soak

def _sample(pid):
    import psutil   # RSS and open fds of another process, portably: psutil rather than parsing /proc by hand
    p = psutil.Process(pid)
    return p.memory_info().rss, p.num_fds()


def _growth(samples):
    """RSS growth after the first sample (warm-up), and the fd counts seen."""
    if not samples:
        return {"samples": 0}
    rss = [s[0] for s in samples]
    fds = sorted({s[1] for s in samples})
    return {"samples": len(samples), "rss_first_mib": round(rss[0] / 2**20, 2), "rss_last_mib": round(rss[-1] / 2**20, 2),
            "rss_max_mib": round(max(rss) / 2**20, 2), "rss_growth_kib": round((rss[-1] - rss[0]) / 1024, 1),
            "fds": fds}


def soak(seconds, packed=True, in_order=True, count=256, period=(0.5, 1.0), seed=1, progress=None):
    """Half the time the backend is the one killed -9 (the driver lives: its RSS/fds are watched), half the
    time the driver is (the backend lives). Returns growth, fds and the counters' balance of both phases."""
    rng = random.Random(seed)
    be_cpu, drv_cpu = cpus()
    tmp = tempfile.mkdtemp(prefix="vring-soak-")
    sock = os.path.join(tmp, "vh.sock")
    out = {"seconds": seconds, "path": path_name(packed, in_order)}
    # phase A: the backend dies, the driver lives
    be = _backend(sock, be_cpu)
    drv = None
    drv_samples, be_samples, kills_a, dropped = [], [], 0, {}
    end = time.monotonic() + seconds / 2
    try:
        be.wait_socket()
        drv = Driver(sock, "--reconnect", "--verify", "--mode", "macfwd", "--count", count,
                     *path_args(packed, in_order), pin=drv_cpu)
        drv.wait_event("connected")
        while time.monotonic() < end:
            time.sleep(rng.uniform(*period))
            be_samples.append(_sample(be.proc.pid))
            last = _kill9(be)
            for key, v in _dropped(last).items():
                dropped[key] = dropped.get(key, 0) + v
            kills_a += 1
            t = time.monotonic()
            be = _backend(sock, be_cpu)
            if drv.wait_event("traffic", after=t, timeout=10) is None:
                raise RuntimeError(f"no traffic after relaunch {kills_a}: {''.join(drv.other)[-2000:]}")
            drv_samples.append(_sample(drv.pid))
            if progress:
                progress("A", kills_a, drv_samples[-1])
        res = drv.stop()
        final = _end(be)
        for key, v in _dropped(final).items():
            dropped[key] = dropped.get(key, 0) + v
    finally:
        if drv is not None and drv.proc.poll() is None:
            drv.kill()
        if be.proc.poll() is None:
            _end(be)
    v = res["verify"]
    pop = v["population"]
    out["backend_killed"] = {
        "kills": kills_a, "driver": _growth(drv_samples), "backend_instances": _growth(be_samples),
        "balance": {"injected": res["injected"], "present": pop["present"], "in_flight": pop["tx_inflight"],
                    "held": pop["held"], "absent": pop["absent"], "duplicates": v["duplicates"],
                    "dropped": {"driver_tx_dropped": res["tx"]["dropped"], **dropped},
                    "ring_errors": res["rx"]["errors"] + res["tx"]["errors"],
                    "balanced": pop["present"] + pop["tx_inflight"] + pop["held"] + res["tx"]["dropped"]
                    + sum(dropped.values()) >= res["injected"] and pop["absent"] <= res["tx"]["dropped"]
                    + sum(dropped.values())}}
    # phase B: the driver dies, the backend lives
    be = _backend(sock, be_cpu)
    be_samples, kills_b = [], 0
    end = time.monotonic() + seconds / 2
    try:
        be.wait_socket()
        while True:
            last = time.monotonic() >= end   # the last one runs 2 s and ends cleanly: the counters settle
            drv = Driver(sock, "--mode", "macfwd", "--count", count, *path_args(packed, in_order),
                         *(("--seconds", 2) if last else ()), pin=drv_cpu)
            if last:
                last_drv = drv.stop(signal_it=False)
                break
            if not _wait_connections(be, kills_b + 1):
                raise RuntimeError(f"driver {kills_b + 1} never connected: {''.join(drv.other)[-2000:]}")
            time.sleep(rng.uniform(*period))
            if drv.proc.poll() is not None:
                raise RuntimeError(f"driver exited: {''.join(drv.other)[-2000:]}")
            drv.kill()
            kills_b += 1
            time.sleep(0.2)   # the backend notices, folds the connection's counters in, waits for the next
            be_samples.append(_sample(be.proc.pid))
            if progress:
                progress("B", kills_b, be_samples[-1])
        time.sleep(0.3)
        final = _end(be)
    finally:
        _cleanup(drv, be, tmp)
    rxq, txq, im = final["rxq0"], final["txq1"], final["intermediate"]
    delivered = rxq["rx_packets"] + rxq["rx_dropped"] + rxq["rx_too_big"] + im["fwd_dropped"]
    out["driver_killed"] = {
        "kills": kills_b, "backend": _growth(be_samples),
        "balance": {"connections": final["connections"], "tx_packets": txq["tx_packets"], "rx_packets": rxq["rx_packets"],
                    "rx_dropped": rxq["rx_dropped"], "rx_too_big": rxq["rx_too_big"], "fwd_dropped": im["fwd_dropped"],
                    "ring_errors": final["ring_errors"], "refused": final["refused"],
                    "last_driver_rx_errors": last_drv["rx"]["errors"],
                    "balanced": txq["tx_packets"] == delivered}}
    return out
