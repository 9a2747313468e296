"""The driver process: connect to a vhost-user backend, bring up one queue pair, move packets, stop cleanly.

Used by ``vring driver`` (vring/cmd_driver.py), the interop tests and the benchmark. Modes:

* ``txonly``: generate frames (C fills them from a template) and send them, a burst at a time;
* ``rxonly``: receive and free;
* ``macfwd``: receive, swap MAC addresses, send back (one C call per burst). ``count`` frames are injected
  first, like testpmd's ``start tx_first``.

The loop runs Python once per burst. At the end Tx is drained (cleanup until nothing is in flight), Rx is
drained for ``drain`` seconds (packets counted and freed), the vrings are stopped (SET_VRING_ENABLE 0,
GET_VRING_BASE), and the counters are returned as a dict.
"""
import os
import select
import signal
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np

from rings.errors import PeerGone
from rings.layout import feature_names

from . import packets
from ._net import ffi, lib
from .frontend import VhostUserFrontend, want_features
from rings.ctl import ControlServer

from .net import NetQueues


@dataclass
class DriverConfig:
    socket: str
    packed: bool = False
    in_order: bool = True
    mrg_rxbuf: bool = True
    version_1: bool = True
    event_idx: bool = False
    indirect: bool = True
    ring_size: int = 256
    burst: int = 32
    mode: str = "macfwd"
    count: int = 0            # txonly/rxonly: stop after this many packets; macfwd: inject this many first
    seconds: float = 0.0      # 0: no time limit (txonly/rxonly with count) / until SIGINT/SIGTERM
    pkt_size: int = 64
    dst_mac: str = packets.DEFAULT_DST
    src_mac: str = packets.DEFAULT_SRC
    verify: bool = False      # check every received frame against the template (MACs swapped, payload intact)
    stamp: bool = False       # write a CLOCK_MONOTONIC timestamp into injected/generated frames
    latency: bool = False     # macfwd: round-trip latency of every frame (implies stamp; re-stamped per lap)
    wait: bool = False        # block on the Rx call eventfd when idle instead of busy polling
    force_slow: bool = False  # Tx slow path for every packet (header descriptor / indirect)
    drain: float = 0.3
    spin: int = 64            # macfwd: empty polls done in C before returning to Python
    timeout: float = 5.0
    pin: int | None = None
    nbufs: int = 0
    buf_size: int = 2048      # pool buffer size (headroom 128 included); small buffers make Rx merge
    ctl: str | None = None    # control socket for `vring dump --ctl` (queues "rx" and "tx")


def pin_all_threads(cpu):
    """Pin every thread of this process (numpy's BLAS threads too, created at import) to one CPU."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, OSError):
            pass


def _eventfd_count(fd):
    """Calls the device made that nobody waited for (the eventfd's counter; reading resets it)."""
    if fd is None:
        return 0
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


class _Stop:
    """The SIGINT/SIGTERM handler: the first asks the loop to end (within 100 ms: the signal also wakes the
    --wait sleep through a wakeup pipe), a second one cuts the drain short."""

    def __init__(self):
        self.flag = False
        self.count = 0
        self.when = None
        self.signum = None

    def __call__(self, signum=None, _frame=None):
        self.count += 1
        if not self.flag:
            self.flag, self.when, self.signum = True, time.monotonic(), signum


class _SignalWakeup:
    """A pipe the C-level signal handler writes to (signal.set_wakeup_fd): a select on its read end returns as
    soon as a signal arrives, where PEP 475 would resume the sleep after the Python handler ran."""

    def __init__(self):
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.old = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)

    def drain(self):
        try:
            while os.read(self.rfd, 64):
                pass
        except BlockingIOError:
            pass

    def close(self):
        signal.set_wakeup_fd(self.old)
        os.close(self.rfd)
        os.close(self.wfd)


def run(cfg: DriverConfig, on_ready=None):
    """Run the driver; returns the counters dict. ``on_ready()`` is called once the device is started."""
    if cfg.pin is not None:
        pin_all_threads(cfg.pin)
    if cfg.mode not in ("txonly", "rxonly", "macfwd"):
        raise ValueError(f"unknown mode {cfg.mode!r}")
    want = want_features(VERSION_1=cfg.version_1, RING_PACKED=cfg.packed, IN_ORDER=cfg.in_order,
                         MRG_RXBUF=cfg.mrg_rxbuf, EVENT_IDX=cfg.event_idx, INDIRECT_DESC=cfg.indirect)
    fe = VhostUserFrontend(cfg.socket, timeout=cfg.timeout)
    nq = ctl = None
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = _SignalWakeup()
    result = {"config": asdict(cfg)}
    try:
        fe.connect()
        features = fe.negotiate(want)
        segs = -(-max(cfg.pkt_size, packets.MIN_SIZE) // (cfg.buf_size - 128))
        nbufs = cfg.nbufs or max(4096, 4 * cfg.ring_size + 8 * cfg.burst + cfg.count * segs)
        nq = NetQueues(features, size=cfg.ring_size, nbufs=nbufs, burst=cfg.burst, buf_size=cfg.buf_size,
                       kickfds=fe.kickfds, callfds=fe.callfds, force_slow=cfg.force_slow)
        nq.rx.fill()
        if cfg.ctl:
            ctl = ControlServer(cfg.ctl).register("rx", nq.rx.vq).register("tx", nq.tx.vq).start()
        fe.start(nq.mem, nq.layouts())
        result.update(features=features, feature_names=feature_names(features), hdr_size=nq.hdr_size,
                      protocol_features=fe.protocol)
        if on_ready:
            on_ready()
        loop = _Loop(cfg, nq, stop, fe.conn.sock, wakeup)
        t0 = time.monotonic()
        loop.run()
        elapsed = time.monotonic() - t0
        result["stop"] = loop.stop_info()
        loop.drain()
        # Tx buffers the backend never completed: their memory still belongs to the device
        result["tx_unfinished"] = int(nq.tx.inflight)
        result["elapsed_s"] = round(elapsed, 6)
        result["vring_bases"] = fe.stop()
        result["calls"] = {i: _eventfd_count(fd) for i, fd in enumerate(fe.callfds)}
        result.update(loop.summary(elapsed))
        result.update(nq.counters())
        return result
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        wakeup.close()
        try:
            if fe.started and fe.conn is not None and not fe.conn.broken:
                fe.stop()
        except Exception:
            pass
        fe.close()
        if ctl is not None:
            ctl.close()
        if nq is not None:
            nq.close()


def _bucket_value(b):
    """The lower bound in ns of quarter-octave bucket b (vn_lat_bucket)."""
    lg, frac = divmod(b, 4)
    return (1 << lg) + (frac << lg >> 2)


def latency_summary(lat):
    n = lat.count
    if n == 0:
        return {"count": 0, "bad": lat.bad}
    hist = list(lat.hist)
    out = {"count": n, "bad": lat.bad, "min_ns": lat.min, "avg_ns": round(lat.sum / n), "max_ns": lat.max}
    for q in (50, 90, 99, 99.9):
        want, acc = n * q / 100, 0
        for b, c in enumerate(hist):
            acc += c
            if acc >= want:
                out[f"p{q:g}_ns"] = _bucket_value(b)   # bucket lower bound (within 19%)
                break
    return out


class _Loop:
    def __init__(self, cfg, nq, stop, ctl=None, wakeup=None):
        self.cfg, self.nq, self.stop = cfg, nq, stop
        self.ctl = ctl                 # the vhost-user socket: watched for the backend going away
        self.wakeup = wakeup
        # --wait sleeps wake up for a call, a signal, or the backend's socket becoming readable (it left)
        self.wake = [x for x in (wakeup.rfd if wakeup else None, ctl) if x is not None]
        self.next_watch = 0.0
        self.deadline = float("inf")
        self.t_end = None
        self.tmpl = packets.template(cfg.pkt_size, cfg.dst_mac, cfg.src_mac)
        self.plen = len(self.tmpl)
        self.p_tmpl = ffi.cast("uint8_t *", ffi.from_buffer(self.tmpl))
        b = cfg.burst
        self.idx = np.zeros(nq.size + b, np.uint32)
        self.lens = np.full(nq.size + b, self.plen, np.uint32)
        self.p_idx = ffi.cast("uint32_t *", ffi.from_buffer(self.idx))
        self.p_lens = ffi.cast("uint32_t *", ffi.from_buffer(self.lens))
        self.seqs = np.zeros(nq.size + b, np.uint64)
        self.p_seqs = ffi.cast("uint64_t *", ffi.from_buffer(self.seqs))
        self.seq = 0
        self.lat = None
        if cfg.latency and cfg.mode == "macfwd":
            self.lat = ffi.new("struct vn_lat *")
            self.lat.ts_off = packets.TS_OFF
            nq.rx.c.lat = self.lat
        self.bad = 0
        self.seen = None
        self.injected = 0
        self.drained = 0
        self.tx_fail = 0

    # -- pieces

    def _gen(self, n):
        """Allocate and fill n frames into self.idx; returns how many."""
        nq = self.nq
        k = lib.vn_gen(nq.pool.c, self.p_idx, n, self.p_tmpl, self.plen, self.seq, packets.SEQ_OFF,
                       int(self.cfg.stamp or self.cfg.latency), packets.TS_OFF)
        self.seq += k
        return k

    def _send_all(self, k, deadline):
        """Send self.idx[:k] completely (cleanup as needed) or until deadline; frees the rest."""
        tx, sent = self.nq.tx, 0
        while sent < k:
            sent += tx.burst(self.idx[sent:k], self.lens[sent:k])
            if sent < k:
                if time.monotonic() > deadline or self.stop.flag:
                    self.nq.pool.free(self.idx[sent:k])
                    self.tx_fail += k - sent
                    break
                tx.cleanup(0)
        return sent

    def _check(self, n):
        if not self.cfg.verify or n == 0:
            return
        c = self.cfg
        self.bad += lib.vn_check(self.nq.pool.c, self.p_idx, self.p_lens, n, self.p_tmpl, self.plen,
                                 int(c.mode != "rxonly"), packets.SEQ_OFF, packets.TS_OFF, self.p_seqs)
        s = self.seqs[:n]
        if self.seen is not None:
            ok = s < len(self.seen)
            self.bad += int((~ok).sum())
            np.add.at(self.seen, s[ok].astype(np.int64), 1)

    # -- loops

    def run(self):
        try:
            self._run()
        finally:
            self.t_end = time.monotonic()

    def stop_info(self):
        """Why the loop ended and how long after the stop was due (a signal, or --seconds) it did."""
        if self.stop.flag:
            return {"reason": "signal", "signal": self.stop.signum,
                    "latency_s": round(self.t_end - self.stop.when, 6)}
        if self.t_end >= self.deadline:
            return {"reason": "seconds", "latency_s": round(self.t_end - self.deadline, 6)}
        return {"reason": "count" if self.cfg.count else "done", "latency_s": 0.0}

    def _idle(self, deadline):
        """--wait with nothing received: sleep on the Rx call eventfd, the signal wakeup pipe and the
        vhost-user socket, never past the deadline; then look at once whether to stop."""
        self.nq.rx.wait(max(0.0, min(0.1, deadline - time.monotonic())), wake=self.wake)
        return self._done(deadline, watch=True)

    def _run(self):
        cfg = self.cfg
        deadline = self.deadline = time.monotonic() + cfg.seconds if cfg.seconds > 0 else float("inf")
        if cfg.mode == "macfwd" and cfg.count:
            if cfg.verify:
                self.seen = np.zeros(cfg.count, np.int64)
            left = cfg.count
            while left and not self.stop.flag:
                k = self._gen(min(cfg.burst, left))
                if k == 0:
                    break
                self.injected += self._send_all(k, time.monotonic() + cfg.timeout)
                left -= k
        getattr(self, "_run_" + cfg.mode)(deadline)

    def _run_macfwd(self, deadline):
        rx, tx, b = self.nq.rx.c, self.nq.tx.c, self.cfg.burst
        p_idx, p_lens = self.p_idx, self.p_lens
        if self.cfg.verify or self.cfg.wait:
            it = 0
            while True:
                it += 1
                if not it & 63 and self._done(deadline):
                    break
                n = lib.vn_rx_burst(rx, p_idx, p_lens, b)
                if n < 0:
                    self.nq.rx.vq._fail()
                if n == 0:
                    if self.cfg.wait and self._idle(deadline):
                        break
                    continue
                self._check(n)
                if self.lat is not None:
                    lib.vn_lat_update(self.lat, self.nq.pool.c, p_idx, n)
                lib.vn_macswap(self.nq.pool.c, p_idx, n)
                sent = self.nq.tx.burst(self.idx[:n], self.lens[:n])
                if sent < n:
                    self.nq.pool.free(self.idx[sent:n])
                    tx.dropped += n - sent
            return
        spin, loop, done = self.cfg.spin, lib.vn_fwd_loop, self._done
        while not done(deadline):
            if loop(rx, tx, p_idx, p_lens, b, spin, 64) < 0:
                self._raise()

    def _done(self, deadline, watch=False):
        """Stop asked, time up, or (checked every 0.1 s, or now with ``watch``) the backend closed the
        vhost-user socket."""
        if self.stop.flag:
            return True
        t = time.monotonic()
        if t >= deadline:
            return True
        if self.ctl is not None and (watch or t >= self.next_watch):
            self.next_watch = t + 0.1
            if self.wakeup is not None:
                self.wakeup.drain()
            if self._peer_gone():
                raise PeerGone("the backend closed the vhost-user connection while the driver was running")
        return False

    def _peer_gone(self):
        r, _, _ = select.select([self.ctl], [], [], 0)
        if not r:
            return False
        try:
            data = self.ctl.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if data and self.ctl in self.wake:   # unexpected bytes: stop waking on them (no busy loop)
            self.wake.remove(self.ctl)
        return data == b""

    def _raise(self):
        if self.nq.rx.c.q.error:
            self.nq.rx.vq._fail()
        self.nq.tx.vq._fail()

    def _run_txonly(self, deadline):
        cfg, tx = self.cfg, self.nq.tx
        limit = cfg.count or float("inf")
        it = 0
        gen, t, p_idx, p_lens, p_tmpl, plen = lib.vn_gen_tx, tx.c, self.p_idx, self.p_lens, self.p_tmpl, self.plen
        seq_off, ts_off, stamp, b = packets.SEQ_OFF, packets.TS_OFF, int(cfg.stamp), cfg.burst
        while t.packets < limit:
            n = b if limit - t.packets >= b else int(limit - t.packets)
            self.seq += gen(t, p_idx, n, p_tmpl, plen, self.seq, seq_off, stamp, ts_off, p_lens)
            if t.q.error:
                tx.vq._fail()
            it += 1
            if not it & 255 and self._done(deadline):
                break

    def _run_rxonly(self, deadline):
        cfg, rx = self.cfg, self.nq.rx
        limit = cfg.count or float("inf")
        it = 0
        if cfg.verify or cfg.wait:
            while rx.c.packets < limit:
                n = lib.vn_rx_burst(rx.c, self.p_idx, self.p_lens, cfg.burst)
                if n < 0:
                    rx.vq._fail()
                if n:
                    self._check(n)
                    lib.vn_pool_free(self.nq.pool.c, self.p_idx, n)
                elif cfg.wait and self._idle(deadline):
                    break
                it += 1
                if not it & 255 and self._done(deadline):
                    break
            return
        drop, r, p_idx, p_lens, b, spin = lib.vn_rx_drop, rx.c, self.p_idx, self.p_lens, cfg.burst, cfg.spin
        while r.packets < limit:
            if drop(r, p_idx, p_lens, b, spin) < 0:
                rx.vq._fail()
            it += 1
            if not it & 255 and self._done(deadline):
                break

    def drain(self):
        """Tx: reclaim until nothing is in flight; Rx: receive (and free) whatever comes for cfg.drain s.
        Cut short by a second signal, or when the backend has left (nothing more will come)."""
        nq, cfg = self.nq, self.cfg
        tx = nq.tx
        tx.flush()
        end = time.monotonic() + max(cfg.drain, 0.05) + 1.0
        while tx.inflight and time.monotonic() < end and not self._drain_stop():
            tx.cleanup(0)
            self._drain_rx()
        end = time.monotonic() + cfg.drain
        while time.monotonic() < end and not self._drain_stop():
            if not self._drain_rx():
                time.sleep(0.001)

    def _drain_stop(self):
        if self.stop.count >= 2:
            return True
        t = time.monotonic()
        if self.ctl is None or t < self.next_watch:
            return False
        self.next_watch = t + 0.05
        return self._peer_gone()

    def _drain_rx(self):
        n = lib.vn_rx_burst(self.nq.rx.c, self.p_idx, self.p_lens, self.cfg.burst)
        if n < 0:
            self.nq.rx.vq._fail()
        if n:
            self._check(n)
            lib.vn_pool_free(self.nq.pool.c, self.p_idx, n)
            self.drained += n
        return n

    def summary(self, elapsed):
        nq = self.nq
        out = {"injected": self.injected, "drained": self.drained, "tx_fail": self.tx_fail,
               "rx_pps": round(nq.rx.c.packets / elapsed) if elapsed > 0 else 0,
               "tx_pps": round(nq.tx.c.packets / elapsed) if elapsed > 0 else 0}
        if self.lat is not None:
            out["latency"] = latency_summary(self.lat)
        if self.cfg.verify:
            out["verify"] = {"bad": self.bad}
            if self.seen is not None:
                out["verify"].update(missing=int((self.seen == 0).sum()), max_seen=int(self.seen.max(initial=0)),
                                     min_seen=int(self.seen.min()) if len(self.seen) else 0)
        return out
