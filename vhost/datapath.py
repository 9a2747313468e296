"""The forwarding data path of one virtio-net queue pair, in C (``vhost._net``, csrc/vhost_net.h).

Python calls ``run()`` once per time slice; C runs the poll iterations: dequeue a burst from the driver's Tx
queue (vring 1) into the intermediate queue, forward (macswap / io / rxonly), and flush the intermediate queue
into the driver's Rx queue (vring 0) at the threshold, after each poll iteration (``rx-batch``), after a
timer, or when the Tx queue runs dry (``threshold``), with retries only after progress. The variant is fixed
when the object is built; nothing is allocated per packet or per burst.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from rings._virtq import ffi as rings_ffi
from rings.errors import ConfigError, GuestMemoryFault, UsageError
from rings.layout import (VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, has, odd_line_stride)
from rings.shm import MemoryTable

from ._net import ffi, lib

log = logging.getLogger("vhost")

FWD_MODES = {"macswap": 0, "io": 1, "rxonly": 2}
USED_BATCH = ("per-burst", "per-buffer")
IDLE_MODES = ("poll", "sleep")
MAX_RETRIES = 8
MAX_FRAME = 65535   # the longest frame forwarded (without GSO, a driver sends at most 1514): longer ones are dropped
STATS_FIELDS = tuple(name for name, _ in ffi.typeof("struct vh_stats").fields)

#: Per-queue counters (vring 0 = the driver's Rx queue, vring 1 = its Tx queue) and the intermediate queue's.
RXQ_FIELDS = ("rx_packets", "rx_bytes", "rx_buffers", "rx_dropped", "rx_too_big", "rx_runt_bufs",
              "rx_retries", "rx_attempts", "rx_calls", "rx_resubmitted")
TXQ_FIELDS = ("tx_packets", "tx_bytes", "tx_runt", "tx_oversize", "tx_bursts", "tx_calls", "tx_kicks",
              "tx_resubmitted")
INTERMEDIATE_FIELDS = ("flush_threshold", "flush_rx_batch", "flush_timer", "flush_idle", "fwd_dropped",
                       "iterations", "busy_iterations", "busy_ns", "sleeps")


@dataclass(frozen=True)
class Options:
    """What ``vring vhost`` configures (validated here, once)."""

    burst: int = 32
    retries: int = 0
    used_batch: str = "per-burst"     # 'per-burst' | 'per-buffer'
    in_order_batch: bool = False
    txq_threshold: int = 32
    txq_flush: str = "rx-batch"       # 'rx-batch' | 'timer:US' | 'threshold'
    fwd: str = "macswap"              # 'macswap' | 'io' | 'rxonly'
    pkt_size: int = 2048              # bytes a frame takes in the intermediate queue (longer ones take more)
    timing: bool = False              # count busy_ns: the time of iterations that moved packets
    pcap: object = field(default=None, compare=False, repr=False)  # rings.pcap.PcapWriter: capture per burst
    idle: str = "poll"                # 'poll' | 'sleep' (block on the kick eventfd after idle_polls empty polls)
    idle_polls: int = 256
    crash_after: int = 0              # fault injection: exit abruptly after N enqueues that delivered packets

    def __post_init__(self):
        if not 1 <= self.burst <= 1024:
            raise ConfigError(f"burst must be 1..1024, not {self.burst}")
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ConfigError(f"retries must be 0..{MAX_RETRIES}, not {self.retries}")
        if self.used_batch not in USED_BATCH:
            raise ConfigError(f"used batch must be one of {USED_BATCH}, not {self.used_batch!r}")
        if not 1 <= self.txq_threshold <= 4096:
            raise ConfigError(f"txq threshold must be 1..4096, not {self.txq_threshold}")
        if self.fwd not in FWD_MODES:
            raise ConfigError(f"forwarding mode must be one of {tuple(FWD_MODES)}, not {self.fwd!r}")
        if not 0 <= self.crash_after < 2**32:
            raise ConfigError(f"crash-after must be 0..2^32-1, not {self.crash_after}")
        if not 64 <= self.pkt_size <= 65536:
            raise ConfigError(f"packet buffer size must be 64..65536, not {self.pkt_size}")
        if self.idle not in IDLE_MODES:
            raise ConfigError(f"idle mode must be one of {IDLE_MODES}, not {self.idle!r}")
        if not 1 <= self.idle_polls <= 1 << 30:
            raise ConfigError(f"idle polls must be 1..{1 << 30}, not {self.idle_polls}")
        self.flush_mode()

    def flush_mode(self):
        """(C mode, timer in ns) for ``txq_flush`` ('none' runs as rx-batch, with no staging copy: ``direct``)."""
        f = self.txq_flush
        if f in ("rx-batch", "none"):
            return 0, 0
        if f == "threshold":
            return 2, 0
        if f.startswith("timer:"):
            try:
                us = int(f[6:])
            except ValueError:
                us = -1
            if not 0 <= us <= 10_000_000:
                raise ConfigError(f"txq flush timer must be timer:US with US in 0..10000000, not {f!r}")
            return 1, us * 1000
        raise ConfigError(f"txq flush must be none, rx-batch, timer:US or threshold, not {f!r}")

    @property
    def direct(self):
        """--txq-flush none: no intermediate queue; one-segment frames go from the Tx buffer straight into Rx."""
        return self.txq_flush == "none"


def hdr_len(features):
    """NET-02/NET-03: 12 bytes with MRG_RXBUF, VERSION_1 or RING_PACKED, else the legacy 10."""
    return 12 if (has(features, VIRTIO_NET_F_MRG_RXBUF) or has(features, VIRTIO_F_VERSION_1)
                  or has(features, VIRTIO_F_RING_PACKED)) else 10


def install_fault_handler():
    """Once per process: SIGBUS in the guarded C entry points (guest_fault.h) becomes an error."""
    if lib.gf_install() != 0:
        raise OSError(ffi.errno, "cannot install the SIGBUS handler of the data path")


FRONTEND_MEMORY = ("the frontend's memory", "it truncated a region's file after SET_MEM_TABLE")


def _memory_fault(where, whose=FRONTEND_MEMORY):
    return GuestMemoryFault(f"{whose[0]} shrank under {where} (SIGBUS caught): {whose[1]}", side="device")


class GuardedMemoryTable(MemoryTable):
    """Someone else's memory as our Python sees it (the frontend's in `vring vhost`, a peer's region in `vring dump
    --shm`). Outside the C data path nothing catches SIGBUS, so a read here is a copy made by a guarded C memcpy:
    a region its owner truncated (POSIX shm cannot be sealed) raises GuestMemoryFault at a queue start or in a
    dump instead of killing the process, even when the truncation races the read. Writes are guarded copies too.
    There are no views: Python going through one would not be guarded. ``whose``: (what the memory is, how it
    shrank) for the error; ``fault``: the first such error, whichever thread met it (the server drops the
    frontend on it even when no data path runs)."""

    def __init__(self, regions=(), whose=FRONTEND_MEMORY):
        install_fault_handler()
        self.whose = whose
        self.fault: GuestMemoryFault | None = None
        super().__init__(regions)

    def _copy(self, gpa, length, data=None):
        """One guarded memcpy: ``data`` into guest range [gpa, gpa+length), or (``data`` None) that range out into
        a new bytearray, allocated once the range is known to be in the table. GuestMemoryFault (also kept as
        ``fault``) if the region's pages are gone."""
        r, off = self.lookup(gpa, length)
        into_guest = data is not None
        guest = ffi.cast("uint8_t *", ffi.from_buffer(r.buf, require_writable=into_guest)) + off
        ours = data if into_guest else bytearray(length)
        src, dst = (ffi.from_buffer(ours), guest) if into_guest else (guest, ffi.from_buffer(ours))
        if lib.vh_copy_guarded(dst, src, length) != 0:
            e = _memory_fault(f"guest range {gpa:#x}+{length:#x}", self.whose)
            if self.fault is None:
                self.fault = e
            raise e
        return ours

    def read(self, gpa, length):
        return bytes(self._copy(gpa, length))

    def write(self, gpa, data):
        data = bytes(data)
        self._copy(gpa, len(data), data)

    def view(self, gpa, length):
        raise UsageError(f"{self.whose[0]} is read and written with GuardedMemoryTable.read / write (guarded "
                         f"copies), never viewed from Python")


def enable_kicks_guarded(q, on, index):
    """``q.enable_kicks(on)`` (the event suppression area is the frontend's memory), guarded as the data path."""
    if lib.vh_enable_kicks_guarded(_cast_dev(q), int(bool(on))) != 0:
        raise _memory_fault(f"vring {index}'s event suppression area at its start")


def _cast_dev(q):
    return ffi.cast("struct vq_device *", int(rings_ffi.cast("uintptr_t", q.c)))


def _ptr(ctype, arr):
    return ffi.cast(ctype, ffi.from_buffer(arr))


class _ChainsBuf:
    """A ``struct vq_chains`` of this module with host pointers (``seg_host``) filled by the poll."""

    def __init__(self, cap_chains, cap_segs):
        self.arrays = {
            "id": np.zeros(cap_chains, np.uint16), "ndesc": np.zeros(cap_chains, np.uint16),
            "nseg": np.zeros(cap_chains, np.uint16), "seg_start": np.zeros(cap_chains, np.uint32),
            "rlen": np.zeros(cap_chains, np.uint32), "wlen": np.zeros(cap_chains, np.uint32),
            "seg_addr": np.zeros(cap_segs, np.uint64), "seg_len": np.zeros(cap_segs, np.uint32),
            "seg_write": np.zeros(cap_segs, np.uint8), "seg_host": np.zeros(cap_segs, np.uint64),
        }
        c = self.c = ffi.new("struct vq_chains *")
        c.cap_chains, c.cap_segs = cap_chains, cap_segs
        fields = dict(ffi.typeof("struct vq_chains").fields)
        for name, arr in self.arrays.items():
            setattr(c, name, ffi.cast(fields[name].type, ffi.from_buffer(arr)))


class Datapath:
    """The C loop over one Rx (vring 0) and one Tx (vring 1) DeviceQueue; either may be None (not served)."""

    def __init__(self, rxq, txq, features, options: Options, rx_callfd=-1, tx_callfd=-1, tracking=(None, None)):
        """``tracking``: the ``vhost.inflight.QueueTracking`` of each queue (INFLIGHT_SHMFD) or None."""
        install_fault_handler()
        self.options = options
        self.rxq, self.txq = rxq, txq
        self.tracking = list(tracking)
        self.features = features
        n = self.n = ffi.new("struct vh_net *")
        sizes = [q.size for q in (rxq, txq) if q is not None] or [1]
        if rxq is not None:
            self._rxc = _ChainsBuf(rxq.size, 2 * rxq.size + 64)
            n.rxq = _cast_dev(rxq)
            n.rxc = self._rxc.c
        if txq is not None:
            self._txc = _ChainsBuf(min(options.burst, txq.size), 2 * txq.size + 64)
            n.txq = _cast_dev(txq)
            n.txc = self._txc.c
        n.rx_callfd, n.tx_callfd = rx_callfd, tx_callfd
        n.rx_inf = self.tracking[0].c if rxq is not None and self.tracking[0] is not None else ffi.NULL
        n.tx_inf = self.tracking[1].c if txq is not None and self.tracking[1] is not None else ffi.NULL
        n.hdr_len = hdr_len(features)
        n.mrg_rxbuf = has(features, VIRTIO_NET_F_MRG_RXBUF)
        n.burst = options.burst
        n.retries = options.retries
        n.per_buffer = options.used_batch == "per-buffer"
        n.fwd = FWD_MODES[options.fwd]
        n.threshold = options.txq_threshold
        n.flush_mode, n.timer_ns = options.flush_mode()
        n.timing = options.timing
        n.crash_after = options.crash_after
        cap = options.txq_threshold + options.burst
        n.pkt_size, n.pkt_max, n.pkt_cap = odd_line_stride(options.pkt_size), MAX_FRAME, cap   # slots: no set aliasing
        self._pkt_data = np.zeros(cap * n.pkt_size, np.uint8)
        # frames longer than a slot: room for cap of the longest, mapped lazily (np.zeros), so only what such frames
        # touch is ever resident
        self._pkt_long = np.zeros(cap * (-(-n.pkt_max // 64) * 64), np.uint8)
        self._pkt_len = np.zeros(cap, np.uint32)
        self._pkt_src = ffi.new("const uint8_t *[]", cap)
        n.pkt_data = _ptr("uint8_t *", self._pkt_data)
        n.pkt_long, n.long_size = _ptr("uint8_t *", self._pkt_long), self._pkt_long.nbytes
        n.pkt_len = _ptr("uint32_t *", self._pkt_len)
        n.pkt_src = self._pkt_src
        n.direct = options.direct and options.pcap is None   # see _run_captured
        n.capture = options.pcap is not None
        n.idle_polls = options.idle_polls if options.idle == "sleep" else 0
        scratch = max(max(sizes), options.burst)
        self._ids = np.zeros(scratch, np.uint32)
        self._lens = np.zeros(scratch, np.uint32)
        n.ids = _ptr("uint32_t *", self._ids)
        n.lens = _ptr("uint32_t *", self._lens)
        self._reported = 0
        self.errors = {}   # vring index -> RingError

    # -- running ---------------------------------------------------------------------------------

    def run(self, budget_us=500, max_iters=1 << 20):
        """Poll for about ``budget_us`` microseconds. Returns the RingErrors that broke a queue in this slice
        (as ``{vring index: error}``; the queue is then left alone, the other keeps running)."""
        pcap = self.options.pcap
        if pcap is not None and not pcap.full:
            broken = self._run_captured(budget_us)
        else:
            self.n.capture = 0   # the capture is over (or none): rxonly frames are dropped at the dequeue again
            passed = self._frames_passed() if pcap is not None else 0
            broken = lib.vh_run(self.n, max_iters, budget_us * 1000)
            if pcap is not None:   # what a capture that is over would have taken: counted, not captured
                pcap.left_out += self._frames_passed() - passed
        if self.n.guest_fault:
            raise self._fault()
        if broken != self._reported:
            return self._collect(broken)
        return {}

    def _run_captured(self, budget_us):
        """--pcap: one dequeue burst at a time from Python, its frames written, then flushed into the Rx queue
        (so while capturing the intermediate queue drains after every burst). Each frame is written as the
        driver sent it (with macswap, the swap is undone on the copy) and, unless the Rx queue had no room for
        it, as the driver receives it."""
        n, w = self.n, self.options.pcap
        swap, rxonly = self.options.fwd == "macswap", self.options.fwd == "rxonly"   # rxonly: nothing received
        end = time.monotonic() + budget_us / 1e6
        while not n.broken and not w.full:
            first = int(n.npkts)
            got = lib.vh_dequeue_guarded(n)
            if n.guest_fault:
                break
            # every frame is in the backend's own copy (pkt_data or pkt_long; no direct path while capturing: Python
            # never reads guest memory, which a frontend may truncate under it), its MACs already swapped
            out = [bytes(ffi.buffer(n.pkt_src[i], int(self._pkt_len[i]))) for i in range(first, int(n.npkts))]
            now, dropped = time.time_ns(), int(n.st.rx_dropped)
            for f in out:
                w.write(f[6:12] + f[:6] + f[12:] if swap and len(f) >= 12 else f, now)
            lib.vh_txq_flush_guarded(n)
            if n.guest_fault:
                break
            # the Rx queue drops the tail; a frame no one Rx buffer holds (NET-27, rx_too_big) has its length zeroed
            received = [] if rxonly else out[:len(out) - (int(n.st.rx_dropped) - dropped)]
            for i, f in enumerate(received, first):
                if self._pkt_len[i]:
                    w.write(f, now)
            if got <= 0 or time.monotonic() >= end:
                break
        return n.broken

    def _frames_passed(self):
        """Frames a capture takes: each one the driver sent, and each one it received (``_run_captured``)."""
        return int(self.n.st.tx_packets) + int(self.n.st.rx_packets)

    def _fault(self):
        """The C data path caught SIGBUS: the frontend's memory shrank under a ring. Both queues are taken out of
        the loop (what the interrupted burst did is half done: nothing of theirs is touched again)."""
        self.n.rxq = self.n.txq = ffi.NULL
        self.n.npkts = self.n.long_fill = 0
        return _memory_fault("the rings (in the data path)")

    def step(self):
        """One poll iteration (tests)."""
        return self.run(budget_us=0, max_iters=1)

    def _collect(self, broken):
        new = {}
        for bit, idx, q in ((1, 0, self.rxq), (2, 1, self.txq)):
            if broken & bit and not self._reported & bit:
                self.errors[idx] = new[idx] = q.mark_broken()
        self._reported = broken
        return new

    @property
    def pending(self):
        """Packets waiting in the intermediate queue."""
        return int(self.n.npkts)

    def discard(self):
        """Drop what waits in the intermediate queue (counted as rx_dropped)."""
        return int(lib.vh_discard(self.n))

    @property
    def idle(self):
        """True when no queue is left to poll."""
        return self.n.txq == ffi.NULL

    @property
    def sleeping(self):
        """--idle sleep: the last ``run()`` enabled kicks, found the Tx queue still empty and stopped; block on
        vring 1's kick eventfd (then call ``kicked()``) before the next ``run()``."""
        return bool(self.n.sleep)

    def kicked(self, count):
        """Kicks read from vring 1's eventfd (its counter: writes since the last read)."""
        self.n.st.tx_kicks += count

    # -- counters --------------------------------------------------------------------------------

    def stats(self):
        st = self.n.st
        out = {name: int(getattr(st, name)) for name in STATS_FIELDS}
        for side, t in zip(("rx", "tx"), self.tracking):   # chains taken again for a killed predecessor
            out[f"{side}_resubmitted"] = int(t.c.resubmitted) if t is not None else 0
        return out

    def set_hook(self, hook, ctx=ffi.NULL):
        """Tests: ``hook`` is a C function pointer (``lib.vh_test_hook``) called after each enqueue attempt."""
        self.n.hook = hook
        self.n.hook_ctx = ctx


def split_stats(st):
    """The flat counter dict as per-queue groups: ``{'rxq0': ..., 'txq1': ..., 'intermediate': ...}``."""
    return {
        "rxq0": {k: st.get(k, 0) for k in RXQ_FIELDS},
        "txq1": {k: st.get(k, 0) for k in TXQ_FIELDS},
        "intermediate": {k: st.get(k, 0) for k in INTERMEDIATE_FIELDS},
    }


def add_stats(total, st):
    for k, v in st.items():
        total[k] = total.get(k, 0) + v
    return total
