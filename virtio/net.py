"""The virtio-net data path: guest memory, buffer pool, one Rx and one Tx queue, bursts.

Python runs once per burst; the C of ``csrc/vnet.h`` runs once per packet/descriptor. The ring variant
(split/packed x normal/in-order) is fixed in the ring engine's C state when the queues are built, and the
negotiated header size and mergeable mode in the queue structs, so no per-packet choice is made in Python.

Layout of the one shared-memory region (guest address = ``GPA_BASE`` + offset; gpa == uaddr as virtio_user):
Rx ring, Tx ring, Tx header area (one 16-byte slot per buffer id), Tx indirect tables, then the buffer pool.
"""
import numbers
import os
import time

import numpy as np

from rings import vhost_user as vu
from rings import virtq as _virtq
from rings._virtq import ffi as rings_ffi
from rings.errors import ConfigError, FrameDoesNotFit
from rings.interrupts import readable
from rings.layout import (VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, QueueLayout, align_up, has)
from rings.shm import MemoryTable, ShmRegion

from ._net import ffi, lib
from .pool import HEADROOM, BufferPool, check_geometry, pool_stride

GPA_BASE = 0x100000000     # like virtio_user's --no-huge memory: gpa == uaddr, a fixed base
PAGE = 4096
HDR_SLOT = 16              # VN_HDR_SLOT in csrc/vnet.h
INDIRECT_MAX = 8           # entries of a Tx indirect table; a longer chain goes directly into the ring
RXQ, TXQ = 0, 1            # NET-04: receiveq1 = 0, transmitq1 = 1


def net_hdr_size(features):
    """NET-02/NET-03: 12 bytes with VERSION_1 or MRG_RXBUF (or packed, which implies VERSION_1), else 10."""
    if has(features, VIRTIO_F_VERSION_1) or has(features, VIRTIO_NET_F_MRG_RXBUF) \
            or has(features, VIRTIO_F_RING_PACKED):
        return 12
    return 10


def _p(ctype, arr):
    return ffi.cast(ctype, ffi.from_buffer(arr))


def _recast(cptr, ctype):
    """A rings._virtq pointer as a pointer of this module's ffi (same struct declarations)."""
    return ffi.cast(ctype, int(rings_ffi.cast("uintptr_t", cptr)))


class GuestMemory:
    """One size-sealed memfd holding both rings, the Tx header area, indirect tables and the pool. The backend
    gets its fd writable but can neither shrink it under our mapping (SIGBUS) nor unseal it."""

    def __init__(self, fmt, size, nbufs, buf_size=2048, headroom=HEADROOM, indirect_max=INDIRECT_MAX,
                 gpa_base=GPA_BASE):
        ring = align_up(QueueLayout.bytes_needed(fmt, size), PAGE)
        off = 0
        self.rx_off, off = off, off + ring
        self.tx_off, off = off, off + ring
        self.hdr_off, off = off, align_up(off + size * HDR_SLOT, PAGE)
        self.ind_off, off = off, align_up(off + size * indirect_max * 16, PAGE)
        self.pool_off, off = off, off + nbufs * pool_stride(buf_size)
        self.size = align_up(off, PAGE)
        self.gpa = gpa_base
        self.indirect_max = indirect_max
        # the backend maps the fd we pass: a memfd has no name to leave in /dev/shm, even if we are killed
        self.region = ShmRegion.create_sealed(self.size, name="vring-drv")
        self.table = MemoryTable([(gpa_base, self.size, self.region.buf)])
        self.rx_layout = QueueLayout.contiguous(fmt, size, gpa_base + self.rx_off)
        self.tx_layout = QueueLayout.contiguous(fmt, size, gpa_base + self.tx_off)
        view = memoryview(self.region.buf)
        self.pool = BufferPool(view[self.pool_off:], gpa_base + self.pool_off, nbufs, buf_size, headroom)
        self.hdr_view = np.frombuffer(view[self.hdr_off:self.hdr_off + size * HDR_SLOT], np.uint8)

    def fileno(self):
        return self.region.fileno()

    def close(self):
        self.pool = None
        self.hdr_view = None
        self.region.close()


#: Where the Tx header goes (chosen once per queue): into the packet's headroom, one descriptor (DPDK's
#: "can push" path); a header descriptor chained before the data; one indirect descriptor holding both.
TX_HDR = ("headroom", "chain", "indirect")
#: Per burst: the header template cleared once, copied per packet; per packet: cleared in place for each.
HDR_INIT = ("burst", "packet")
#: Per burst: one publish and at most one kick per burst (xmit_more); per packet: after every packet.
DOORBELL = ("burst", "packet")
#: macfwd with no more than a burst out: packets received, sent and published per step (vnet.h vn_fwd_take), so that
#: the device starts on the first while the driver receives the next; 0 (or the burst size or more): whole bursts.
#: 16, 8 and 4 side by side in front of net_vhost (benchmarks/interleaved.py, packed, one burst in flight): 1.05,
#: 1.07 and 1.04 times DPDK's own driver.
PUBLISH_EVERY = 16
PUBLISH_EVERY_MAX = 64


def _choice(what, value, allowed):
    if value not in allowed:
        raise ConfigError(f"{what} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def frame_segments(frame_len, buf_size, headroom=HEADROOM):
    """Pool buffers a frame the driver builds takes (vn_gen: ``buf_size - headroom`` data bytes in each)."""
    check_geometry(buf_size, headroom)
    return max(1, -(-frame_len // (buf_size - headroom)))


def indirect_table_len(size, indirect_max=INDIRECT_MAX):
    """Entries of the Tx indirect tables on a queue of ``size``: a table holds at most the queue size (SPLIT-D-05;
    the engine refuses larger ones)."""
    return min(indirect_max, size)


def check_tx_hdr(hdr, features, indirect_max):
    """ConfigError when the Tx header placement ``hdr`` cannot be used with these features and tables of
    ``indirect_max`` entries (``indirect_table_len``)."""
    if hdr == "indirect" and not has(features, VIRTIO_F_INDIRECT_DESC):
        raise ConfigError("indirect Tx headers need VIRTIO_F_INDIRECT_DESC negotiated")
    # a table holds 2..queue size entries (SPLIT-D-05): a queue of one entry has none, its chains are direct
    if hdr == "indirect" and indirect_max < 2:
        raise ConfigError(f"indirect Tx headers need indirect tables of at least 2 entries (the header and the "
                          f"frame; at most the queue size), not {indirect_max}")


def tx_descs(frame_len, features, buf_size=2048, headroom=HEADROOM, hdr="headroom", force_slow=False,
             indirect_max=INDIRECT_MAX):
    """What one frame of ``frame_len`` bytes built in pool buffers takes on transmitq, as (chain, slots): the
    descriptors the device walks (an indirect table's entries included) and the ring descriptors it occupies.

    One segment with the header in its headroom: one descriptor. Otherwise (several segments, --tx-hdr chain or
    indirect, the slow path) a header descriptor, then one per segment; with VIRTIO_F_INDIRECT_DESC negotiated and
    the header not chained, a chain of at most ``indirect_max`` fills one indirect table (one ring slot) and a
    longer one goes directly into the ring (vq_drv_needed)."""
    segs = frame_segments(frame_len, buf_size, headroom)
    if segs == 1 and hdr == "headroom" and not force_slow:
        return 1, 1
    chain = 1 + segs
    indirect = has(features, VIRTIO_F_INDIRECT_DESC) and hdr != "chain"
    return chain, 1 if indirect and chain <= indirect_max else chain


def check_tx_frame(frame_len, features, size, buf_size=2048, headroom=HEADROOM, hdr="headroom", force_slow=False,
                   indirect_max=INDIRECT_MAX):
    """FrameDoesNotFit (a ConfigError), with the reason, when such frames can never be sent on a queue of ``size``:
    a chain longer than the queue size is forbidden, an indirect table's entries included (SPLIT-D-05,
    PACKED-D-09/19), and vn_tx_one refuses it (the packet would be retried forever). Returns (chain, slots)
    otherwise."""
    chain, slots = tx_descs(frame_len, features, buf_size, headroom, hdr, force_slow,
                            indirect_table_len(size, indirect_max))
    if chain <= size:
        return chain, slots
    room = buf_size - headroom
    how = " in one indirect table" if slots == 1 else ""
    bufs = f"{chain - 1} buffer{'s' if chain > 2 else ''}"
    if size > 1:       # the frame in at most size - 1 buffers, and its header descriptor
        fit_buf = align_up(-(-frame_len // (size - 1)) + headroom, 64)
    elif hdr == "headroom" and not force_slow:   # one buffer, the header in its headroom: one descriptor
        fit_buf = align_up(frame_len + headroom, 64)
    else:
        fit_buf = None
    raise FrameDoesNotFit(f"a {frame_len}-byte frame takes {chain} descriptors{how} on transmitq ({bufs} of {room} "
                          f"data bytes + 1 for the virtio-net header), more than the queue size {size}: no chain may "
                          f"be longer (SPLIT-D-05/PACKED-D-09, indirect entries included); use a ring size of at least "
                          f"{_ring_size_for(chain, features)}"
                          + (f" or a buffer size of at least {fit_buf}" if fit_buf else ""), fit_buf)


def _ring_size_for(entries, features):
    """The smallest queue size of at least ``entries``: a power of 2 for a split ring (SPLIT-L-06)."""
    return entries if has(features, VIRTIO_F_RING_PACKED) else 1 << (entries - 1).bit_length()


#: NET-24: without MRG_RXBUF, GUEST_TSO4/TSO6/UFO/USO4/USO6 and HASH_REPORT (this driver never negotiates the
#: last ones) Rx buffers SHOULD hold at least 1526 bytes: a 1514-byte frame and its 12-byte header.
NET_24_RX_MIN = 1526

#: DPDK's vhost takes at most ring size - 1 mergeable Rx buffers for one frame, and 256 descriptors (BUF_VECTOR_MAX)
#: across them: it never delivers a frame that needs more (it stays in its queue, then is dropped).
DPDK_RX_DESCS_MAX = 256


def rx_buffer_len(features, buf_size=2048, headroom=HEADROOM):
    """The bytes of one posted Rx buffer: the header lands in the headroom, the frame after it."""
    check_geometry(buf_size, headroom)
    return buf_size - headroom + net_hdr_size(features)


def rx_buffers(frame_len, features, buf_size=2048, headroom=HEADROOM):
    """Mergeable Rx buffers one frame and its header take (NET-30: all but the last full)."""
    return -(-(frame_len + net_hdr_size(features)) // rx_buffer_len(features, buf_size, headroom))


def check_rx_frame(frame_len, features, buf_size=2048, headroom=HEADROOM, ring_size=None):
    """Without MRG_RXBUF the device puts a frame and its header into ONE buffer (NET-27) and drops what does not
    fit; with it, into as many as it needs (NET-30), all of them available at once: FrameDoesNotFit, with the reason,
    when frames of ``frame_len`` bytes (None: sizes unknown) cannot fit one buffer, or an Rx ring of ``ring_size``
    entries. Returns warnings: buffers below NET_24_RX_MIN (a SHOULD; frames that fit still arrive whole), more
    buffers a frame than DPDK's net_vhost takes (DPDK_RX_DESCS_MAX, ring size - 1; other devices fill the ring)."""
    post, hs = rx_buffer_len(features, buf_size, headroom), net_hdr_size(features)
    if has(features, VIRTIO_NET_F_MRG_RXBUF):
        need = rx_buffers(frame_len, features, buf_size, headroom) if frame_len is not None else 0
        if ring_size is not None and need > ring_size:
            fit_buf = align_up(-(-(frame_len + hs) // ring_size) - hs + headroom, 64)
            raise FrameDoesNotFit(f"a {frame_len}-byte frame and its {hs}-byte header take {need} Rx buffers of "
                                  f"{post} bytes (NET-30), more than the Rx ring's {ring_size} entries: the device "
                                  f"could never deliver one; use a ring size of at least "
                                  f"{_ring_size_for(need, features)} or a buffer size of at least {fit_buf}", fit_buf)
        dpdk = min(DPDK_RX_DESCS_MAX, ring_size - 1 if ring_size is not None else DPDK_RX_DESCS_MAX)
        if need > dpdk:
            return [f"a {frame_len}-byte frame and its {hs}-byte header take {need} Rx buffers of {post} bytes "
                    f"(NET-30): DPDK's net_vhost takes at most {dpdk} for one frame (ring size - 1, and "
                    f"{DPDK_RX_DESCS_MAX} descriptors) and would never deliver one; use a larger buffer size"
                    + (" or ring size" if need <= DPDK_RX_DESCS_MAX else "")]
        return []
    if frame_len is not None and frame_len + hs > post:
        fit_buf = align_up(frame_len + headroom, 64)
        raise FrameDoesNotFit(f"a {frame_len}-byte frame and its {hs}-byte header do not fit one {post}-byte Rx "
                              f"buffer, and without VIRTIO_NET_F_MRG_RXBUF the device uses one buffer a frame "
                              f"(NET-27): every frame would be dropped; negotiate MRG_RXBUF or use a buffer size of "
                              f"at least {fit_buf}", fit_buf, mrg_rxbuf_helps=True)
    if post < NET_24_RX_MIN:
        return [f"Rx buffers of {post} bytes without VIRTIO_NET_F_MRG_RXBUF: NET-24 asks for at least "
                f"{NET_24_RX_MIN} (a 1514-byte frame and its header); larger frames will be dropped by the device"]
    return []


def check_injected(count, frame_len, features, size, buf_size=2048, headroom=HEADROOM, tx_slots=1,
                   restarts=False):
    """macfwd --count: the frames injected all come back through the Rx ring at once when the device is quicker
    than the driver, and a device with no Rx buffer for a frame drops it; they all go out again through the Tx ring
    when the driver is the quicker, and the driver drops what finds no room there (after VN_TX_RETRIES reclaims).
    ConfigError when a ring of ``size`` entries cannot hold ``count`` such frames: Rx, with MRG_RXBUF
    ceil((header + frame) / buffer) buffers a frame (NET-30), one without (check_rx_frame); Tx, ``tx_slots`` ring
    descriptors a frame (check_tx_frame: a chained header or more segments than an indirect table holds).
    Returns warnings: with ``restarts`` (inflight tracking across backend restarts) a successor takes again the Tx
    chains its predecessor delivered and did not complete, up to one copy a frame, bounded by the Tx ring; when
    frames and copies together overflow the Rx ring the device drops injected frames."""
    per_frame = 1
    if has(features, VIRTIO_NET_F_MRG_RXBUF):
        per_frame = rx_buffers(frame_len, features, buf_size, headroom)
    rx_holds, tx_holds = size // per_frame, size // tx_slots
    if count > rx_holds:
        how = f"{per_frame} Rx buffers a {frame_len}-byte frame, " if per_frame > 1 else ""
        raise ConfigError(f"{count} frames injected, but the Rx ring holds {rx_holds} ({size} entries, {how}buffer "
                          f"size {buf_size}): the device would drop {count - rx_holds} of them; inject at most "
                          f"{rx_holds}, or use a larger ring" + (" or buffer size" if per_frame > 1 else ""))
    if count > tx_holds:
        raise ConfigError(f"{count} frames injected, but the Tx ring holds {tx_holds} ({size} entries, {tx_slots} "
                          f"descriptors a {frame_len}-byte frame): the driver would drop {count - tx_holds} of them "
                          f"when they are all to go out at once; inject at most {tx_holds}, or use a larger ring")
    at_once = min(2 * count, tx_holds)   # copies take Tx slots too
    if restarts and at_once > rx_holds:
        return [f"{count} frames injected and, after a backend restart, up to {at_once - count} copies of them taken "
                f"again (inflight tracking: chains delivered and not completed) take {at_once} frames' room, but the "
                f"Rx ring holds {rx_holds} ({per_frame} Rx buffers a {frame_len}-byte frame): the device would drop "
                f"{at_once - rx_holds} injected frames on a restart; inject at most {rx_holds // 2} to lose none"]
    return []


class TxQueue:
    """transmitq1 over a rings DriverQueue. ``burst(indices, lengths, more=False)`` -> packets queued.
    ``hdr``, ``hdr_init``, ``doorbell``, ``publish_every``: the Tx variants (TX_HDR, HDR_INIT, DOORBELL,
    PUBLISH_EVERY), fixed here."""

    def __init__(self, mem, features, kickfd=None, force_slow=False, hdr="headroom", hdr_init="burst",
                 doorbell="burst", publish_every=PUBLISH_EVERY):
        self.features = features
        self.hdr_size = net_hdr_size(features)
        _choice("Tx header placement", hdr, TX_HDR)
        _choice("header init", hdr_init, HDR_INIT)
        _choice("doorbell", doorbell, DOORBELL)
        if isinstance(publish_every, bool) or not isinstance(publish_every, numbers.Integral) \
                or not 0 <= publish_every <= PUBLISH_EVERY_MAX:
            raise ConfigError(f"publish_every must be 0..{PUBLISH_EVERY_MAX}, not {publish_every!r}")
        check_tx_hdr(hdr, features, mem.indirect_max)
        # indirect has a fast path of its own (one-segment packets); force_slow keeps every packet on the general one
        t_hdr_indirect = hdr == "indirect" and not force_slow
        force_slow = force_slow or hdr != "headroom"
        ind = (mem.gpa + mem.ind_off, mem.indirect_max) \
            if has(features, VIRTIO_F_INDIRECT_DESC) and hdr != "chain" and mem.indirect_max >= 2 else None
        self.vq = _virtq.DriverQueue(mem.table, mem.tx_layout, features, indirect=ind)
        n = self.vq.size
        # the cleanup variant, fixed here: in-order (one used entry may cover a batch) or normal (by id)
        self.variant = ("packed" if self.vq.layout.packed else "split") + ("_in_order" if self.vq.in_order else "")
        self.pool = mem.pool
        self.kickfd = kickfd
        self._tok = np.zeros(n, np.uint64)
        self._lens = np.zeros(n, np.uint32)
        self._seg_addr = np.zeros(n, np.uint64)
        self._seg_len = np.zeros(n, np.uint32)
        t = self.c = ffi.new("struct vn_txq *")
        t.q = _recast(self.vq.c, "struct vq_driver *")
        t.pool = mem.pool.c
        t.hdr_size = self.hdr_size
        t.max_segs = n
        t.cleanup_thresh = min(n, 64)
        t.hdr_host = ffi.cast("uint8_t *", ffi.from_buffer(mem.hdr_view))
        t.hdr_gpa = mem.gpa + mem.hdr_off
        t.force_slow = int(bool(force_slow))
        t.hdr_indirect = t_hdr_indirect
        t.hdr_per_packet = hdr_init == "packet"
        t.doorbell_per_packet = doorbell == "packet"
        t.publish_every = publish_every = int(publish_every)
        self.hdr, self.hdr_init, self.doorbell, self.publish_every = hdr, hdr_init, doorbell, publish_every
        t.kickfd = -1 if kickfd is None else kickfd
        t.tok, t.lens = _p("uint64_t *", self._tok), _p("uint32_t *", self._lens)
        t.seg_addr, t.seg_len = _p("uint64_t *", self._seg_addr), _p("uint32_t *", self._seg_len)
        self._cache = (None, None, None, None)

    def _ptrs(self, idx, lens):
        ci, pi, cl, pl = self._cache
        if ci is not idx:
            pi = _p("uint32_t *", idx)
        if cl is not lens:
            pl = _p("uint32_t *", lens)
        self._cache = (idx, pi, lens, pl)
        return pi, pl

    def burst(self, indices, lengths, more=False):
        """Queue packets (uint32 buffer indices and lengths); returns how many were queued. Packets not queued
        stay the caller's. One publish per call; one kick at most, only if the device asks and not ``more``."""
        idx = indices if isinstance(indices, np.ndarray) and indices.dtype == np.uint32 \
            else np.ascontiguousarray(indices, np.uint32)
        lens = lengths if isinstance(lengths, np.ndarray) and lengths.dtype == np.uint32 \
            else np.ascontiguousarray(lengths, np.uint32)
        n = min(len(idx), len(lens))
        if n == 0:
            return 0
        self.vq._check()
        pi, pl = self._ptrs(idx, lens)
        sent = lib.vn_tx_burst(self.c, pi, pl, n, int(bool(more)))
        if self.c.q.error:
            self.vq._fail()
        return sent

    def flush(self):
        """Kick now if a ``more=True`` burst left one pending and the device wants it."""
        return bool(lib.vn_tx_flush(self.c))

    @property
    def kicks(self):
        return self.c.kicks

    def cleanup(self, need=0):
        """Reclaim completed buffers until ``need`` descriptors are free (or nothing more is used)."""
        self.vq._check()
        r = lib.vn_tx_cleanup(self.c, need)
        if r < 0:
            self.vq._fail()
        return r

    @property
    def inflight(self):
        return self.vq.inflight

    def counters(self):
        c = self.c
        return {"variant": self.variant, "hdr": self.hdr, "hdr_init": self.hdr_init, "doorbell": self.doorbell,
                "publish_every": self.publish_every,
                "packets": c.packets, "bytes": c.bytes, "kicks": self.kicks, "publishes": c.publishes,
                "fast_path": c.fast,
                "slow_path": c.slow, "ring_full": c.full, "dropped": c.dropped, "cleanups": c.cleanups,
                "reclaimed_bufs": c.reclaimed_bufs, "reclaimed_descs": c.reclaimed_descs, "errors": c.errors,
                "inflight": self.vq.inflight}


class RxQueue:
    """receiveq1 over a rings DriverQueue, kept full of writable pool buffers (refilled in bursts)."""

    def __init__(self, mem, features, burst=32, kickfd=None, callfd=None):
        """``burst``: the largest ``max_pkts`` of ``burst()``, and the refill threshold."""
        self.features = features
        self.hdr_size = net_hdr_size(features)
        self.mrg = has(features, VIRTIO_NET_F_MRG_RXBUF)
        self.vq = _virtq.DriverQueue(mem.table, mem.rx_layout, features)
        n = self.vq.size
        self.pool = mem.pool
        self.kickfd, self.callfd = kickfd, callfd
        self.waits = 0
        self.wakeups = 0
        cap = n + max(burst, 1)
        self._tok = np.zeros(n, np.uint64)
        self._lens = np.zeros(n, np.uint32)
        self._ref_idx = np.zeros(n, np.uint32)
        self._ref_addr = np.zeros(n, np.uint64)
        self._ref_len = np.zeros(n, np.uint32)
        self._ref_tok = np.zeros(n, np.uint64)
        self.out_idx = np.zeros(cap, np.uint32)
        self.out_len = np.zeros(cap, np.uint32)
        self._p_out_idx = _p("uint32_t *", self.out_idx)
        self._p_out_len = _p("uint32_t *", self.out_len)
        r = self.c = ffi.new("struct vn_rxq *")
        r.q = _recast(self.vq.c, "struct vq_driver *")
        r.pool = mem.pool.c
        r.hdr_size = self.hdr_size
        r.mrg = int(self.mrg)
        r.post_len = rx_buffer_len(features, mem.pool.buf_size, mem.pool.headroom)
        r.refill_thresh = max(1, min(burst, n))
        r.kickfd = -1 if kickfd is None else kickfd
        r.tok, r.lens = _p("uint64_t *", self._tok), _p("uint32_t *", self._lens)
        r.ref_idx, r.ref_addr = _p("uint32_t *", self._ref_idx), _p("uint64_t *", self._ref_addr)
        r.ref_len, r.ref_tok = _p("uint32_t *", self._ref_len), _p("uint64_t *", self._ref_tok)
        if r.post_len < self.hdr_size:   # NET-25
            raise ConfigError("Rx buffers must hold at least the virtio-net header")

    def fill(self):
        """Post buffers until the ring is full (at start)."""
        return lib.vn_rx_refill(self.c, 1)

    @property
    def kicks(self):
        return self.c.kicks

    def burst(self, max_pkts=32):
        """Received packets as (indices, lengths) views (valid until the next call); the header is stripped,
        a mergeable packet comes back as one packet whose buffers chain through ``pool.next``. The caller owns
        the packets (free them with ``pool.free`` or send them)."""
        self.vq._check()
        # an in-order used entry may complete a whole batch: leave room for a ring's worth beyond max_pkts
        max_pkts = max(0, min(int(max_pkts), len(self.out_idx) - self.vq.size))
        n = lib.vn_rx_burst(self.c, self._p_out_idx, self._p_out_len, max_pkts)
        if n < 0:
            self.vq._fail()
        return self.out_idx[:n], self.out_len[:n]

    def pending(self):
        return bool(lib.vn_rx_pending(self.c))

    def wait(self, timeout, wake=()):
        """Block on the call eventfd until a used buffer may be there (notifications on only while waiting), or
        until one of the ``wake`` fds becomes readable. Without a call fd: sleep-poll. Returns True if
        something is pending."""
        if self.pending():
            return True
        self.waits += 1
        if self.callfd is None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.pending():
                    return True
                if wake and readable(wake, 0.0005):
                    return self.pending()
                if not wake:
                    time.sleep(0.0005)
            return False
        self.vq.enable_calls(True)
        self.c.calls_on = 1
        try:
            if self.pending():   # EVT-09: re-check after enabling
                return True
            r = readable([self.callfd, *wake], timeout)
            if self.callfd in r and vu.eventfd_take(self.callfd):
                self.wakeups += 1
            return self.pending()
        finally:
            self.c.calls_on = 0
            self.vq.enable_calls(False)

    def counters(self):
        c = self.c
        return {"packets": c.packets, "bytes": c.bytes, "buffers": c.bufs, "merged": c.merged,
                "refills": c.refills, "posted": c.posted, "nombuf": c.nombuf, "errors": c.errors,
                "kicks": self.kicks, "waits": self.waits, "wakeups": self.wakeups, "inflight": self.vq.inflight}


class NetQueues:
    """Guest memory + one Rx/Tx queue pair for negotiated ``features`` (the data path without the transport).
    ``kickfds``/``callfds``: eventfds per queue index (RXQ, TXQ) or None (tests, polling only)."""

    def __init__(self, features, fmt=None, size=256, nbufs=None, burst=32, buf_size=2048, headroom=HEADROOM,
                 kickfds=(None, None), callfds=(None, None), force_slow=False, indirect_max=INDIRECT_MAX,
                 **tx_variants):
        fmt = fmt or ("packed" if has(features, VIRTIO_F_RING_PACKED) else "split")
        self.features, self.fmt, self.size, self.burst = features, fmt, size, burst
        nbufs = nbufs or max(4096, 4 * size + 8 * burst)
        self.mem = GuestMemory(fmt, size, nbufs, buf_size, headroom, indirect_table_len(size, indirect_max))
        self.pool = self.mem.pool
        self.rx = RxQueue(self.mem, features, burst, kickfd=kickfds[RXQ], callfd=callfds[RXQ])
        self.tx = TxQueue(self.mem, features, kickfd=kickfds[TXQ], force_slow=force_slow, **tx_variants)
        # polling by default: ask the device not to call us (split NO_INTERRUPT / packed DISABLE)
        self.rx.vq.enable_calls(False)
        self.tx.vq.enable_calls(False)

    def set_kickfds(self, kickfds):
        """The kick eventfds per queue index, once the transport has created them (the queues notify through
        them from now on; before, a kick is only counted)."""
        for q, fd in ((self.rx, kickfds[RXQ]), (self.tx, kickfds[TXQ])):
            q.kickfd = fd
            q.c.kickfd = -1 if fd is None else fd

    @property
    def hdr_size(self):
        return self.tx.hdr_size

    def layouts(self):
        return {RXQ: self.mem.rx_layout, TXQ: self.mem.tx_layout}

    def reset_rings(self):
        """Both rings afresh (``DriverQueue.reset``): the Rx buffers go back to the pool and the ring is filled
        again; the Tx packets that were in flight are returned as (indices, lengths), to be sent again (a copy
        the old device had delivered becomes a duplicate, never a loss). A mergeable packet left half received
        is dropped; returns (indices, lengths, partial packets dropped)."""
        pool, rx, tx = self.pool, self.rx, self.tx
        pool.free(rx.vq.reset().astype(np.uint32))
        partial = 0
        if rx.c.part_left:
            pool.free(np.array([rx.c.part_head], np.uint32))
            rx.c.part_left = 0
            partial = 1
        idx = tx.vq.reset().astype(np.uint32)
        lens = np.zeros(len(idx), np.uint32)
        for k, b in enumerate(idx):   # the packet's length: its segments' data
            while b != 0xFFFFFFFF and b < pool.nbufs:
                lens[k] += pool.data_len[b]
                b = pool.next[b]
        tx.c.pending_kick = 0
        for q in (rx, tx):
            q.vq.enable_calls(False)
        rx.fill()
        return idx, lens, partial

    def counters(self):
        return {"rx": self.rx.counters(), "tx": self.tx.counters(),
                "pool": {"available": self.pool.available, "nbufs": self.pool.nbufs,
                         "bad_frees": self.pool.bad_frees}}

    def close(self):
        self.rx = self.tx = None
        self.pool = None
        self.mem.close()
