"""The driver process: connect to a vhost-user backend, bring up one queue pair, move packets, stop cleanly.

Used by ``vring driver`` (vring/cmd_driver.py), the interop tests and the benchmark. Modes:

* ``txonly``: generate frames (C fills them from a template) and send them, a burst at a time;
* ``rxonly``: receive and free;
* ``macfwd``: receive, swap MAC addresses, send back (one C call per burst). ``count`` frames are injected
  first, like testpmd's ``start tx_first``;
* ``rate``: open loop, ``rate`` frames per second generated and sent on schedule (each stamped with the time it
  was due), the frames that come back measured and freed (``vring bench --rate``).

With ``wait`` the driver polls while busy and, after ``spin`` empty polls, enables used-buffer notifications,
re-checks the ring and blocks on the Rx call eventfd (RxQueue.wait).

The loop runs Python once per burst. At the end Tx is drained (cleanup until nothing is in flight), Rx is
drained for ``drain`` seconds (packets counted and freed), the vrings are stopped (SET_VRING_ENABLE 0,
GET_VRING_BASE), and the counters are returned as a dict.

Restarts (virtio/session.py): with ``reconnect`` (client) or ``server`` a backend that goes away is replaced:
the driver keeps its rings and buffers, consumes what the old backend published, brings the next backend up
at its own ring positions and goes on. Each step is an event (a JSON line on stderr: ``backend_gone``,
``connected``, ``resumed``, ``traffic`` = the first packet received after a resume).
"""
import json
import socket
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from rings import interrupts
from rings import vhost_user as vu
from rings.affinity import pin_all_threads
from rings.errors import ConfigError, PeerGone, ProtocolTimeout, VringError
from rings.interrupts import SignalWakeup
from rings.layout import feature_names
from rings.pcap import PcapWriter

from . import packets
from ._net import ffi, lib
from .frontend import want_features
from rings.ctl import ControlServer

from .ledger import SEQ_BAD, SEQ_MASK, Ledger, count_seqs, population
from .net import (PUBLISH_EVERY, NetQueues, check_injected, check_rx_frame, check_tx_frame, check_tx_hdr,
                  frame_segments, indirect_table_len)
from .pool import HEADROOM
from .session import Session


#: The longest the C loops poll an empty Rx ring before Python looks at its stop flag and the clock again (a stop is
#: seen within about this much, whatever --spin)
POLL_SLICE_NS = 1_000_000


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
    buf_size: int = 2048      # pool buffer size (headroom included); small buffers make Rx merge
    headroom: int = HEADROOM  # pool buffers' headroom: the Tx header goes into its last bytes, the Rx header lands there
    ctl: str | None = None    # control socket for `vring dump --ctl` (queues "rx" and "tx")
    pcap: str | None = None   # write the frames sent and received (Python once per burst while capturing)
    pcap_count: int = 10000   # at most this many frames (0: no limit)
    rate: float = 0.0         # rate mode: frames per second offered
    latency_warmup: float = 0.0   # start the latency histogram over this many seconds after the loop starts
    idle_first: float = 0.0   # stay idle (queues up, nothing sent) this long before injecting (idle CPU cost)
    tx_hdr: str = "headroom"  # Tx variants (virtio.net.TX_HDR, HDR_INIT, DOORBELL), fixed per queue
    hdr_init: str = "burst"
    doorbell: str = "burst"
    tx_publish: int = PUBLISH_EVERY   # macfwd, no more than a burst out: N packets a step (0: whole bursts)
    rx_burst: int = 0         # rate mode: at most this many frames received per step (0: burst)
    reconnect: bool = False   # a backend that goes away is looked for again (bounded by seconds)
    server: bool = False      # listen on socket; the backend connects (and reconnects)
    inflight: bool | None = None  # negotiate INFLIGHT_SHMFD when offered; None: only with reconnect or server

    def features(self):
        """The virtio features asked for; negotiation gives exactly these (each one is required) or fails."""
        return want_features(VERSION_1=self.version_1, RING_PACKED=self.packed, IN_ORDER=self.in_order,
                             MRG_RXBUF=self.mrg_rxbuf, EVENT_IDX=self.event_idx, INDIRECT_DESC=self.indirect)

    def check(self):
        """Refuse, before connecting, a run whose frames the queues could never carry (ConfigError, saying why);
        returns warnings (spec SHOULDs the configuration does not meet, and frames DPDK's net_vhost never delivers)."""
        if self.pcap and self.mode == "rate":
            raise ConfigError("--pcap cannot capture --mode rate: its paced loop sends and receives in C, frames "
                              "never seen from Python; capture on the backend's side (vring vhost --pcap)")
        frame, features = max(self.pkt_size, packets.MIN_SIZE), self.features()
        check_tx_hdr(self.tx_hdr, features, indirect_table_len(self.ring_size))
        geometry = dict(buf_size=self.buf_size, headroom=self.headroom)
        # the --pkt-size frames this driver builds: sent (txonly, rate) or injected and forwarded (macfwd --count);
        # a macfwd without --count forwards what it receives, whatever its size
        builds = self.mode in ("txonly", "rate") or (self.mode == "macfwd" and self.count > 0)
        tx_slots = 1
        if builds:
            _, tx_slots = check_tx_frame(frame, features, self.ring_size, **geometry, hdr=self.tx_hdr,
                                         force_slow=self.force_slow)
        # frames received that are known to be --pkt-size: our own coming back, or the ones --verify expects
        receives = (builds and self.mode != "txonly") or (self.mode == "rxonly" and self.verify)
        warnings = check_rx_frame(frame if receives else None, features, **geometry, ring_size=self.ring_size)
        if self.mode == "macfwd" and self.count:
            restarts = (self.reconnect or self.server) and self.inflight is not False   # a successor takes again
            warnings += check_injected(self.count, frame, features, self.ring_size, **geometry, tx_slots=tx_slots,
                                       restarts=restarts)
        return warnings


def _eventfd_count(fd):
    """Calls the device made that nobody waited for (the eventfd's counter; reading resets it)."""
    if fd is None:
        return 0
    return vu.eventfd_take(fd)


#: after a stop signal has cut the drain, a backend's answers to the stop get this long each (a healthy one takes
#: microseconds; a frozen one would hold the exit for --timeout per message)
CUT_STOP_ANSWER_S = 0.5


class _StopCut(BaseException):
    """A stop signal cut the stop exchange short (raised by ``_Stop`` inside the wait for the backend's reply)."""


class _Stop:
    """The SIGINT/SIGTERM handler: the first asks the loop to end (within 100 ms: the signal also wakes the
    --wait sleep through a wakeup pipe); once the loop has ended, the next one (``cut``) cuts the drain and the
    stop exchange short. While the rings are being set up (``setup``) it raises KeyboardInterrupt at once, and
    during the stop exchange (``exchanging``) a cutting one raises _StopCut: a backend that does not answer would
    otherwise hold the signal until the message's timeout (PEP 475 resumes the wait after a handler that
    returns)."""

    def __init__(self):
        self.flag = False
        self.count = 0
        self.when = None
        self.signum = None
        self.setup = True
        self.cut_at = None   # set when the loop ends: the count from which a signal cuts what follows
        self.exchanging = False

    def __call__(self, signum=None, _frame=None):
        self.count += 1
        self.seen(signum)
        if self.setup:
            raise KeyboardInterrupt
        if self.exchanging and self.cut:
            raise _StopCut

    def loop_ended(self):
        """The signal that ended the loop (its handler may run only now) does not cut; the next one does. After a
        loop that ended by itself (--seconds, --count), the first one does."""
        self.cut_at = 2 if self.flag else self.count + 1

    @property
    def cut(self):
        return self.cut_at is not None and self.count >= self.cut_at

    def seen(self, signum):
        """The first stop signal, from its handler or from the wakeup pipe (whichever comes first)."""
        if not self.flag:
            self.flag, self.when, self.signum = True, time.monotonic(), signum


def run(cfg: DriverConfig, on_ready=None, after_signals=None):
    """Run the driver; returns the counters dict. ``on_ready()`` is called once the device is started. A typed error
    (VringError) that ends the run after that carries the counters so far, the error among them, as ``e.report``.
    The stop signals' handlers are put back once everything is closed; ``after_signals``, if given, is installed
    instead (the CLI: SIG_IGN, so that a late second signal cannot cut its report short or change its exit status)."""
    if cfg.pin is not None:
        pin_all_threads(cfg.pin)
    if cfg.mode not in ("txonly", "rxonly", "macfwd", "rate"):
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if cfg.mode == "rate" and not cfg.rate > 0:
        raise ValueError("rate mode needs a rate > 0 (frames per second)")
    warnings = cfg.check()
    for w in warnings:
        print(f"vring driver: warning: {w}", file=sys.stderr, flush=True)
    want = cfg.features()
    events = _event_printer() if cfg.reconnect or cfg.server else None
    sess = Session(cfg.socket, want, server=cfg.server, reconnect=cfg.reconnect, timeout=cfg.timeout,
                   inflight=(cfg.reconnect or cfg.server) if cfg.inflight is None else cfg.inflight, events=events)
    fe = sess.fe
    nq = ctl = pcap = None
    stop = _Stop()
    old, wakeup = {}, None
    result = {"config": asdict(cfg), "warnings": warnings}
    try:   # (installed inside it: a signal that comes meanwhile raises where the finally puts them back)
        wakeup = SignalWakeup()
        interrupts.install(stop, into=old)
        sess.open()
        up_until = time.monotonic() + cfg.seconds if cfg.seconds > 0 else float("inf")
        features = sess.establish(up_until, lambda: stop.flag)
        segs = frame_segments(max(cfg.pkt_size, packets.MIN_SIZE), cfg.buf_size, cfg.headroom)
        nbufs = cfg.nbufs or max(4096, 4 * cfg.ring_size + 8 * cfg.burst + cfg.count * segs)
        nq = NetQueues(features, size=cfg.ring_size, nbufs=nbufs, burst=cfg.burst, buf_size=cfg.buf_size,
                       headroom=cfg.headroom,
                       callfds=fe.callfds, force_slow=cfg.force_slow, hdr=cfg.tx_hdr,
                       hdr_init=cfg.hdr_init, doorbell=cfg.doorbell, publish_every=cfg.tx_publish)
        if cfg.ctl:
            ctl = ControlServer(cfg.ctl).register("rx", nq.rx.vq).register("tx", nq.tx.vq).start()
        sess.bring_up(nq, up_until, lambda: stop.flag)
        nq.set_kickfds(fe.kickfds)   # created by the first start (SET_VRING_KICK), kept across reconnects;
        nq.rx.fill()                 # no kick before DRIVER_OK (NOTIF-08)
        result.update(features=features, feature_names=feature_names(features), hdr_size=nq.hdr_size,
                      protocol_features=fe.protocol)
        if on_ready:
            on_ready()
        if cfg.pcap:
            pcap = PcapWriter(cfg.pcap, cfg.pcap_count or None)
        stop.setup = False   # from here a signal ends the run with its report
        loop = _Loop(cfg, nq, stop, sess, pcap, wakeup)
        t0 = error = None
        try:
            if cfg.idle_first > 0:
                loop.idle(cfg.idle_first)
            t0 = time.monotonic()
            loop.run()
            stop.loop_ended()
            result["stop"] = loop.stop_info()
            loop.drain()
            # Tx buffers the backend never completed: their memory still belongs to the device
            result["tx_unfinished"] = int(nq.tx.inflight)
            result["vring_bases"] = _stop_vrings(sess, stop, warnings)
            for w in vring_base_warnings(result["vring_bases"], cfg.packed, cfg.ring_size):
                print(f"vring driver: warning: {w}", file=sys.stderr, flush=True)
                warnings.append(w)
        except VringError as e:   # e.g. a frozen backend that never answers the stop: still a report, the error in it
            error = e
            result.setdefault("stop", {"reason": "error"})
            if "tx_unfinished" not in result:
                result["tx_unfinished"] = _tx_unfinished(nq.tx)
            result["error"] = {"type": type(e).__name__, "message": str(e)}
        elapsed = loop.t_end - t0 if t0 is not None and loop.t_end is not None else 0.0
        result["elapsed_s"] = round(elapsed, 6)
        result["connections"] = sess.connections
        result["reconnects"] = loop.reconnects
        result["calls"] = {i: _eventfd_count(fd) for i, fd in enumerate(fe.callfds)}
        result.update(loop.summary(elapsed))
        result.update(nq.counters())
        if pcap is not None:
            pcap.close()   # first: a write error may show only when the last frames reach the file
            result["pcap"] = pcap.stats()
        if error is not None:
            error.report = result
            raise error
        return result
    finally:
        stop.setup = False   # a signal during the clean-up is counted, and does not cut it short
        try:
            try:
                if fe.started and fe.conn is not None and not fe.conn.broken:
                    fe.stop()
            except Exception:
                pass
            sess.close()
            if ctl is not None:
                ctl.close()
            if pcap is not None:
                pcap.close()
            if nq is not None:
                nq.close()
        finally:   # last: a second signal used to kill the process half-way through the clean-up
            interrupts.restore(old, after_signals)
            if wakeup is not None:
                wakeup.close()


def verify_failures(v, at_end=True):
    """What a --verify report says went wrong, one line each (empty: every frame checked came back whole, each
    sequence number sent came back during the run and, with ``at_end`` (a drain), once more at the end, with no
    extra copy)."""
    out = []
    if v["bad"]:
        out.append(f"{v['bad']} frame(s) bad: MACs not swapped, length, payload or sequence number wrong")
    missing = v.get("missing", 0)
    if missing:
        out.append(f"{missing} frame(s) sent never came back intact")
    alone = v.get("duplicates_without_restart", 0)
    if alone:
        out.append(f"{alone} duplicate(s) with no backend restart to explain them: the backend sent a frame twice")
    pop = v.get("population")
    if pop is not None and at_end:
        late = pop["absent"] - missing
        if late > 0:
            out.append(f"{late} frame(s) came back during the run but not at the end " + (
                       "(in flight in a backend that was gone at the end)" if v.get("backend_gone") else
                       "(lost late, or held by the backend longer than --drain)"))
        if pop["extra"]:
            out.append(f"{pop['extra']} extra {'copy' if pop['extra'] == 1 else 'copies'} at the end: a frame came "
                       f"back more than once")
    return out


def vring_base_warnings(bases, packed, size):
    """What is wrong with the vring bases a backend returned at the stop (GET_VRING_BASE): each must be a position
    of the ring. Split: a 16-bit index. Packed: bits 0-14 a slot < size and bit 15 its wrap counter, as DPDK
    returns it; newer QEMU puts the used index and wrap in bits 16-31 the same way. Reported, not fatal: the
    driver resumes from its own positions."""
    out = []
    for i, base in sorted(bases.items()):
        if packed:
            bad = base > 0xFFFFFFFF or (base & 0x7FFF) >= size or (base >> 16 & 0x7FFF) >= size
        else:
            bad = base > 0xFFFF
        if bad:
            kind, rule = ("packed", "bits 0-14 and 16-30 each a slot < size") if packed else ("split", "a 16-bit index")
            out.append(f"GET_VRING_BASE of vring {i} returned {base:#x}: no position of a {kind} ring of {size} "
                       f"({rule})")
    return out


def _tx_unfinished(tx):
    """Tx buffers the backend never completed, when the run ended on an error (no drain): what its used ring
    already returned is reclaimed first (our memory, readable after the backend died), since the driver reclaims
    lazily. A broken Tx ring returns nothing more."""
    try:
        tx.cleanup(0)
    except VringError:
        pass
    return int(tx.inflight)


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


def _stop_vrings(sess, stop, warnings):
    """SET_VRING_ENABLE 0 + GET_VRING_BASE at the end; {} when no backend is there. A resilient run whose backend
    goes away just then ends normally (the next one would have been waited for). A stop signal ends the wait for
    a backend that does not answer: one during it, or one that came before it, after which a backend gets
    CUT_STOP_ANSWER_S for each answer. The vring bases are then {}, and a warning says why."""
    if sess.fe.conn is None:
        return {}
    try:
        try:
            stop.exchanging = True
            try:
                return sess.fe.stop(timeout=CUT_STOP_ANSWER_S if stop.cut else None)
            finally:
                stop.exchanging = False
        except ProtocolTimeout:
            if not stop.cut:
                raise
        except _StopCut:
            pass
    except PeerGone as e:
        if not sess.reconnect:
            raise
        sess.lost(str(e))
        return {}
    if sess.fe.conn is not None:
        sess.fe.conn.mark_broken("a stop signal cut the stop exchange short")   # a reply may be half read
    w = ("the backend did not answer SET_VRING_ENABLE/GET_VRING_BASE before a stop signal cut the wait short: "
         "the vring bases are unknown")
    print(f"vring driver: warning: {w}", file=sys.stderr, flush=True)
    warnings.append(w)
    return {}


def _event_printer():
    """Restart events as JSON lines on stderr, stamped with CLOCK_MONOTONIC (comparable across processes)."""
    def emit(name, **fields):
        print(json.dumps({"event": name, "t": round(time.monotonic(), 6), **fields}), file=sys.stderr, flush=True)
    return emit


class _Loop:
    def __init__(self, cfg, nq, stop, session=None, pcap=None, wakeup=None):
        self.cfg, self.nq, self.stop = cfg, nq, stop
        self.session = session         # its socket is watched for the backend going away
        self.pcap = pcap               # rings.pcap.PcapWriter: the loops run a burst at a time from Python
        self.wakeup = wakeup           # signals wake the --wait sleeps at once (a wakeup pipe)
        self.noisy_sock = None         # a socket that sent unexpected bytes: no longer a wakeup source
        self.pace = None               # rate mode: the C pacer's state, once the paced loop starts
        self.next_watch = 0.0
        self.deadline = float("inf")
        self.backendless = False       # --reconnect: the backend was lost and none came back in time
        self.t_end = None
        self.reconnects = []           # one record per backend replaced
        self.await_traffic = None      # (time resumed, rx packets then) until the first packet after a resume
        self.holding = bool(session is not None and session.reconnect)
        self.backlog = []              # (idx, lens) that did not fit in the Tx ring (resilient runs)
        self.ledger = None             # resilient macfwd --verify: laps, duplicates, the population at the end
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
        self.lat_reset_at = None
        if (cfg.latency and cfg.mode == "macfwd") or cfg.mode == "rate":
            self.lat = ffi.new("struct vn_lat *")
            self.lat.ts_off = packets.TS_OFF
            nq.rx.c.lat = self.lat
        nq.rx.c.own_frame = cfg.mode == "macfwd"   # it writes the MACs and stamp (and the Tx header: same line)
        self.pace = None
        self.bad = 0
        self.seen = None               # macfwd --count --verify: arrivals per sequence number over the run
        self.sent_seq = None           # ... which sequence numbers went out (a failed injection leaves gaps)
        self.final = None              # ... arrivals per sequence number while draining (the ledger keeps its own)
        self.injected = 0
        self.held_end = 0
        self.drained = 0
        self.drain_cut = False         # a second signal cut the drain short: what was in flight is not judged
        self.drain_gone = False        # the drain ended because no backend was left to give anything back
        self.tx_fail = 0

    # -- pieces

    def _gen(self, n):
        """Allocate and fill n frames into self.idx; returns how many."""
        nq = self.nq
        k = lib.vn_gen(nq.pool.c, self.p_idx, n, self.p_tmpl, self.plen, self.seq, packets.SEQ_OFF,
                       int(self.cfg.stamp or self.cfg.latency), packets.TS_OFF)
        self.seq += k
        return k

    def _cap(self, idx):
        """--pcap: the frames of these buffers as they are now (received, or about to be sent)."""
        if self.pcap is None:
            return
        if self.pcap.full:   # counted, not captured
            self.pcap.left_out += len(idx)
            return
        t = time.time_ns()
        for b in idx:
            self.pcap.write(self.nq.pool.data(b), t)

    def _send_all(self, k, deadline):
        """Send self.idx[:k] completely (cleanup as needed) or until deadline; frees the rest. A packet the queue
        refused (a Tx error: it will never fit) ends the attempt at once."""
        self._cap(self.idx[:k])
        tx, sent = self.nq.tx, 0
        while sent < k:
            errors = tx.c.errors
            sent += tx.burst(self.idx[sent:k], self.lens[sent:k])
            if sent < k:
                if time.monotonic() > deadline or self.stop.flag or tx.c.errors != errors:
                    self.nq.pool.free(self.idx[sent:k])
                    self.tx_fail += k - sent
                    break
                tx.cleanup(0)
        return sent

    def _check(self, n):
        if not self.cfg.verify or n == 0:
            return
        c = self.cfg
        bad = lib.vn_check(self.nq.pool.c, self.p_idx, self.p_lens, n, self.p_tmpl, self.plen,
                           int(c.mode != "rxonly"), packets.SEQ_OFF, packets.TS_OFF, self.p_seqs)
        if self.seen is None:
            self.bad += bad
            return
        # a bad frame (SEQ_BAD) counts once and is not seen; nor is an intact one with a sequence number never sent,
        # or, with no ledger writing laps, a high half that is not vn_gen's 0
        s = self.seqs[:n]
        ok = (s & SEQ_MASK) < len(self.seen)
        if self.ledger is None:
            ok &= (s >> 32) == 0
        self.bad += int((~ok).sum())
        s[~ok] = SEQ_BAD   # not counted at the end either (_drain_rx)
        np.add.at(self.seen, (s[ok] & SEQ_MASK).astype(np.int64), 1)

    # -- loops

    def idle(self, seconds):
        """Queues up, nothing sent yet: the macfwd receive loop runs on an empty ring for ``seconds`` (busy polling,
        or with --wait blocked on the call eventfd): what an idle queue costs. stderr says when it starts."""
        print(f"vring driver: idle for {seconds:g} s before sending", file=sys.stderr, flush=True)
        end = time.monotonic() + seconds
        # a backend lost now is waited for as long as the run after the idle could last
        self._resilient(self._run_macfwd, end, end + self.cfg.seconds if self.cfg.seconds > 0 else float("inf"))

    def _lat_warmup(self, t):
        """Start the latency histogram over once the warm-up is behind (called from _done)."""
        if self.lat_reset_at is not None and t >= self.lat_reset_at:
            lib.vn_lat_reset(self.lat)
            self.lat_reset_at = None

    def run(self):
        try:
            self._run()
        finally:
            self.t_end = time.monotonic()

    def stop_info(self):
        """Why the loop ended and how long after the stop was due (a signal, or --seconds) it did."""
        if self.stop.flag and self.stop.when <= self.t_end:   # (one after the loop ended did not end it)
            return {"reason": "signal", "signal": self.stop.signum,
                    "latency_s": round(self.t_end - self.stop.when, 6)}
        if self.backendless and self.t_end < self.deadline:   # the time ran out in --idle-first
            return {"reason": "no backend", "latency_s": 0.0}
        if self.t_end >= self.deadline:
            return {"reason": "seconds", "latency_s": round(self.t_end - self.deadline, 6)}
        return {"reason": "count" if self.cfg.count else "done", "latency_s": 0.0}

    @property
    def wake(self):
        """What ends a --wait sleep besides a call: a signal (the wakeup pipe), the backend's socket becoming
        readable (it left). The session's socket changes when the backend is replaced."""
        sock = self.session.sock if self.session is not None else None
        return [x for x in (self.wakeup.rfd if self.wakeup else None, sock)
                if x is not None and x is not self.noisy_sock]

    def _idle(self, deadline, timeout=0.1):
        """--wait with nothing received: sleep on the Rx call eventfd, the signal wakeup pipe and the
        vhost-user socket, never past the deadline; then look at once whether to stop."""
        self.nq.rx.wait(max(0.0, min(timeout, deadline - time.monotonic())), wake=self.wake)
        return self._done(deadline, watch=True)

    def _run(self):
        cfg = self.cfg
        deadline = self.deadline = time.monotonic() + cfg.seconds if cfg.seconds > 0 else float("inf")
        if self.lat is not None and cfg.latency_warmup > 0:
            self.lat_reset_at = time.monotonic() + cfg.latency_warmup
        if cfg.mode == "macfwd" and cfg.count:
            if cfg.verify:
                self.seen = np.zeros(cfg.count, np.int64)
                self.sent_seq = np.zeros(cfg.count, bool)
                if self.holding:
                    self.ledger = Ledger(cfg.count)
                elif cfg.drain > 0:   # --drain 0: nothing is waited for at the end, nothing counted
                    self.final = np.zeros(cfg.count, np.int64)
            left = cfg.count
            while left and not (self.stop.flag or self.backendless) and time.monotonic() < deadline:
                k = self._gen(min(cfg.burst, left))
                if k == 0:
                    break
                sent = self._send_all(k, min(deadline, time.monotonic() + cfg.timeout))
                if self.sent_seq is not None:
                    self.sent_seq[self.seq - k:self.seq - k + sent] = True
                self.injected += sent
                left -= k
        if self.stop.flag or self.backendless:   # a signal, or no backend, ended --idle-first (txonly would
            return                              # send a burst before its first look)
        self._resilient(getattr(self, "_run_" + cfg.mode), deadline, deadline)

    # -- restarts

    def _resilient(self, step, until, wait_until):
        """``step(until)``. With --reconnect a backend lost meanwhile is replaced (waited for until ``wait_until``
        or a stop signal) and the step resumed; when none came, ``backendless`` is set and the step is over."""
        while True:
            try:
                step(until)
                return
            except PeerGone as e:
                if self.session is None or not self.session.reconnect:
                    raise
                try:
                    self._resume_after(str(e), wait_until)
                except PeerGone:   # time is up (or stop asked) with no backend: the run ends here
                    if not (self.stop.flag or time.monotonic() >= wait_until):
                        raise
                    self.session.events("ended_without_backend")
                    self.backendless = True
                    return

    def _resume_after(self, why, deadline):
        """The backend went away: the session brings the next one up at our ring positions; then forward
        what was received meanwhile."""
        rec = {"gone_t": round(time.monotonic(), 6)}
        self.reconnects.append(rec)
        held = self.session.replace_backend(self.nq, why, deadline, lambda: self.stop.flag, self.cfg.burst, rec)
        self.await_traffic = (time.monotonic(), self.nq.rx.c.packets)
        for idx, lens in held:
            self._forward_held(idx, lens)

    def _forward_held(self, idx, lens):
        """Packets received while the backend was away: what the mode does with a received burst."""
        n = len(idx)
        self.idx[:n], self.lens[:n] = idx, lens
        if self.cfg.mode == "macfwd":
            self._forward(n)
        else:
            self._check(n)
            lib.vn_pool_free(self.nq.pool.c, self.p_idx, n)

    def _forward(self, n):
        """macfwd of the burst in self.idx[:n] (the Python path): check, drop the copies a restart made, swap
        MACs, send; what does not fit in the Tx ring is held (resilient runs) or dropped (tx dropped)."""
        self._check(n)
        if self.ledger is not None:
            n = self.ledger.dedupe(self.nq.pool, self.idx, self.lens, self.seqs, n,
                                   restart=self.reconnects[-1] if self.reconnects else None)
        self._cap(self.idx[:n])
        if self.lat is not None:
            lib.vn_lat_update(self.lat, self.nq.pool.c, self.p_idx, n)
        lib.vn_macswap(self.nq.pool.c, self.p_idx, n)
        self.nq.rx.fill()   # repost before the send, as vn_fwd_burst does: the backend may need them for these frames
        sent = self.nq.tx.burst(self.idx[:n], self.lens[:n]) if n and self._send_backlog() else 0
        self._cap(self.idx[:sent])  # in flight: unchanged until they come back
        if sent < n:
            if self.holding:
                self.backlog.append((self.idx[sent:n].copy(), self.lens[sent:n].copy()))
            else:
                self.nq.pool.free(self.idx[sent:n])
                self.nq.tx.c.dropped += n - sent

    def _send_backlog(self):
        """Send held packets first, in order; True when none is left."""
        while self.backlog:
            idx, lens = self.backlog[0]
            sent = self.nq.tx.burst(idx, lens)
            if sent < len(idx):
                self.backlog[0] = (idx[sent:], lens[sent:])
                return False
            self.backlog.pop(0)
        return True

    def _run_macfwd(self, deadline):
        rx, tx, b = self.nq.rx.c, self.nq.tx.c, self.cfg.burst
        p_idx, p_lens = self.p_idx, self.p_lens
        if self.cfg.wait and not self.cfg.verify and self.pcap is None:
            return self._run_macfwd_wait(deadline)
        if self.cfg.verify or self.cfg.wait or self.pcap is not None:
            it = 0
            while True:
                it += 1
                if not it & 63 and self._done(deadline):
                    break
                n = lib.vn_rx_burst(rx, p_idx, p_lens, b)
                if n < 0:
                    self.nq.rx.vq._fail()
                if n == 0:
                    if self.backlog:
                        self._send_backlog()
                    elif self.cfg.wait and self._idle(deadline):
                        break
                    continue
                self._forward(n)
            return
        spin, loop, done = self.cfg.spin, lib.vn_fwd_loop, self._done
        while not done(deadline):
            if loop(rx, tx, p_idx, p_lens, b, spin, 64, ffi.NULL, POLL_SLICE_NS) < 0:
                self._raise()

    def _run_macfwd_wait(self, deadline):
        """--wait: the C loop polls while busy (up to ``spin`` empty polls); then calls are enabled, the ring
        re-checked and the call eventfd waited on (RxQueue.wait, woken early by a signal or the backend
        leaving)."""
        rx, tx, b, spin = self.nq.rx.c, self.nq.tx.c, self.cfg.burst, self.cfg.spin
        p_idx, p_lens, loop, idle = self.p_idx, self.p_lens, lib.vn_fwd_loop, ffi.new("int32_t *")
        while not self._done(deadline):
            if loop(rx, tx, p_idx, p_lens, b, spin, 64, idle, POLL_SLICE_NS) < 0:
                self._raise()
            if idle[0] and self._idle(deadline):
                break

    def _run_rate(self, deadline):
        """Open loop at cfg.rate frames/s (vn_pace_loop); with --wait, block between sends on the Rx call
        eventfd until the next frame is due."""
        cfg, nq = self.cfg, self.nq
        pc = self.pace = ffi.new("struct vn_pace *")
        pc.ns_per_pkt = 1e9 / cfg.rate
        pc.t0 = lib.vn_now_ns()
        rx_idx = np.zeros(nq.size + cfg.burst, np.uint32)
        rx_len = np.zeros(nq.size + cfg.burst, np.uint32)
        p_rx_idx = ffi.cast("uint32_t *", ffi.from_buffer(rx_idx))
        p_rx_len = ffi.cast("uint32_t *", ffi.from_buffer(rx_len))
        spin = max(1, cfg.spin) if cfg.wait else 0
        args = (nq.rx.c, nq.tx.c, pc, self.p_idx, self.p_lens, p_rx_idx, p_rx_len, self.p_tmpl, self.plen,
                packets.SEQ_OFF, packets.TS_OFF, cfg.burst, cfg.rx_burst or cfg.burst, spin, 256)
        while not self._done(deadline):
            if lib.vn_pace_loop(*args) < 0:
                self._raise()
            if pc.idle:
                left = (pc.next_ns - lib.vn_now_ns()) / 1e9
                if left > 20e-6 and self._idle(deadline, left):
                    break
        self.seq = pc.offered

    def _done(self, deadline, watch=False):
        """Stop asked, time up, or (checked every 0.1 s, or now with ``watch``) the backend closed the
        vhost-user socket."""
        if self.stop.flag:
            return True
        t = time.monotonic()
        self._lat_warmup(t)
        if t >= deadline:
            return True
        if self.await_traffic is not None and self.nq.rx.c.packets > self.await_traffic[1]:
            self.session.events("traffic", after_s=round(t - self.await_traffic[0], 6))
            self.reconnects[-1]["traffic_s"] = round(t - self.await_traffic[0], 6)
            self.await_traffic = None
        if watch or t >= self.next_watch:
            self.next_watch = t + 0.1
            if self.pcap is not None and self.pcap.pending:   # a live reader of a --pcap FIFO gets frames soon
                self.pcap.flush()
            if self.wakeup is not None:
                # a stop signal whose byte is here may not have had its Python handler run yet: taking the byte
                # without acting on it would leave the next --wait sleep to its full timeout
                for signum in self.wakeup.stops():
                    self.stop.seen(signum)
                if self.stop.flag:
                    return True
            if self._peer_gone():
                raise PeerGone("the backend closed the vhost-user connection while the driver was running")
        return False

    def _peer_gone(self):
        """The backend closed the vhost-user socket (EOF); False while there is no socket to look at."""
        sock = self.session.sock if self.session is not None else None
        if sock is None:
            return False
        if not interrupts.readable([sock], 0):
            return False
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if data:   # unexpected bytes: stop waking on them (no busy loop)
            self.noisy_sock = sock
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
        pcap = self.pcap
        while t.packets < limit:
            n = b if limit - t.packets >= b else int(limit - t.packets)
            sent = gen(t, p_idx, n, p_tmpl, plen, self.seq, seq_off, stamp, ts_off, p_lens)
            self.seq += sent
            if pcap is not None:  # in flight now: nothing writes them before they come back
                self._cap(self.idx[:sent])
            if t.q.error:
                tx.vq._fail()
            it += 1
            if not it & 255 and self._done(deadline):
                break

    def _run_rxonly(self, deadline):
        cfg, rx = self.cfg, self.nq.rx
        limit = cfg.count or float("inf")
        it = 0
        if cfg.verify or cfg.wait or self.pcap is not None:
            while rx.c.packets < limit:
                n = lib.vn_rx_burst(rx.c, self.p_idx, self.p_lens, cfg.burst)
                if n < 0:
                    rx.vq._fail()
                if n:
                    self._check(n)
                    self._cap(self.idx[:n])
                    lib.vn_pool_free(self.nq.pool.c, self.p_idx, n)
                elif cfg.wait and self._idle(deadline):
                    break
                it += 1
                if not it & 255 and self._done(deadline):
                    break
            return
        drop, r, p_idx, p_lens, b, spin = lib.vn_rx_drop, rx.c, self.p_idx, self.p_lens, cfg.burst, cfg.spin
        while r.packets < limit:
            n = drop(r, p_idx, p_lens, b, spin, POLL_SLICE_NS)
            if n < 0:
                rx.vq._fail()
            it += 1
            if (n == 0 or not it & 255) and self._done(deadline):   # idle: look at once (the spin took its time)
                break

    def drain(self):
        """Tx: reclaim until nothing is in flight; Rx: receive (and free) whatever comes for cfg.drain s.
        Cut short by a second signal, or when the backend has left (nothing more will come)."""
        nq, cfg = self.nq, self.cfg
        tx = nq.tx
        tx.flush()
        tx.cleanup(0)   # what was completed already (the used ring is ours), even if no backend is left to wait on
        end = time.monotonic() + max(cfg.drain, 0.05) + 1.0
        while (tx.inflight or self.backlog) and time.monotonic() < end and not self._drain_stop():
            self._send_backlog()
            tx.cleanup(0)
            self._drain_rx()
        self.held_end = sum(len(i) for i, _ in self.backlog)   # never sent: the backend did not come back
        for idx, _ in self.backlog:
            nq.pool.free(idx)
        self.backlog = []
        end = time.monotonic() + cfg.drain
        while time.monotonic() < end and not self._drain_stop():
            if not self._drain_rx():
                time.sleep(0.001)

    def _drain_stop(self):
        if self.stop.cut:
            self.drain_cut = True
            return True
        if self.session is not None and self.session.sock is None:
            self.drain_gone = True   # the backend was lost and none came back (--reconnect): nothing more will come
            return True
        t = time.monotonic()
        if t < self.next_watch:
            return False
        self.next_watch = t + 0.05
        self.drain_gone = self._peer_gone()
        return self.drain_gone

    def _drain_rx(self):
        n = lib.vn_rx_burst(self.nq.rx.c, self.p_idx, self.p_lens, self.cfg.burst)
        if n < 0:
            self.nq.rx.vq._fail()
        if n:
            self._check(n)
            self._cap(self.idx[:n])
            if self.ledger is not None:   # what came back at the end (copies counted, not kept)
                n = self.ledger.dedupe(self.nq.pool, self.idx, self.lens, self.seqs, n, advance=False,
                                       restart=self.reconnects[-1] if self.reconnects else None)
                self.ledger.count_final(self.seqs, n)
            elif self.final is not None:
                count_seqs(self.final, self.seqs[:n])
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
            out["latency"]["after_warmup_s"] = self.cfg.latency_warmup if self.lat_reset_at is None else None
        if self.cfg.mode == "rate":
            pc = self.pace   # None: the run ended before its first paced step (a signal during --idle-first)
            out["rate"] = {"offered_pps": self.cfg.rate, "offered": int(pc.offered) if pc else 0,
                           "sent": int(nq.tx.c.packets), "tx_dropped": int(nq.tx.c.dropped),
                           "pool_empty_steps": int(pc.nobuf) if pc else 0}
        if self.cfg.verify:
            out["verify"] = {"bad": self.bad}
            v = out["verify"]
            if self.seen is not None:
                sent = self.sent_seq
                v.update(missing=int((sent & (self.seen == 0)).sum()), max_seen=int(self.seen.max(initial=0)),
                         min_seen=int(self.seen[sent].min()) if sent.any() else 0)
            if self.ledger is not None:
                v.update(self.ledger.summary(self.reconnects, int(nq.tx.inflight), self.held_end, self.sent_seq))
            elif self.final is not None:
                v["population"] = population(self.final, self.sent_seq)[0]
            if self.drain_cut:
                v["drain_cut"] = True
            if self.drain_gone:
                v["backend_gone"] = True
            v["failures"] = verify_failures(v, self.cfg.drain > 0 and not self.drain_cut)
            v["ok"] = not v["failures"]
        return out
