"""`vring conform driver`: we are the backend (a virtio-net device); the frontend under test is checked.

The driver must forward what it receives back out (DPDK ``dpdk-testpmd --vdev virtio_user0,path=S ...
--forward-mode=mac|io|macswap``, ``vring driver --socket S --mode macfwd``): the harness injects numbered
frames into the driver's Rx queue (vring 0) and expects each back, once and intact up to the MAC addresses,
on the driver's Tx queue (vring 1), where it is replaced by a new one. Frames the driver originates
(testpmd's ``tx_first``) are counted and replaced by numbered ones.

The control plane is ``vhost.device.NetDevice`` (the same message handling as ``vring vhost``) with the data
path replaced by this harness; the rings are ``rings.virtq.DeviceQueue`` (which rejects a malformed chain with a
typed error that names the requirement). The harness behaves as every legal device may, phase by phase:
one used entry per buffer; with IN_ORDER one used entry for batches of random size (Rx buffers filled exactly
included, so skipped buffers are full ones); without IN_ORDER completions in random order and Rx buffers
picked at random; Tx completions only when the Tx ring is full; completions held back 5-30 ms; spurious used
buffer notifications; bytes after ``len`` in Rx buffers; with MRG_RXBUF frames spread over several buffers;
kicks asked for (used flags 0 / ENABLE / avail_event) and suppressed.

What it checks, from ring memory and the kick eventfds: every chain as it is made available (the typed errors
of the DeviceQueue, then the harness's own reading: wrap bits of every descriptor of a packed list, in-order
head and next values, indirect entries, the Tx virtio-net header); each chain again when it is completed (a
driver that changes a descriptor or a readable buffer after publishing it is seen: the first read was taken
when avail idx / the head flags said the chain was complete); avail idx against used idx; the suppression
fields the driver writes; the device area (only we may write it); kicks against the suppression in force; and
end to end, that every frame comes back exactly once and unchanged (a driver that mishandles a batch entry,
a skipped buffer or an out-of-order completion loses, duplicates or corrupts frames).
"""
from __future__ import annotations

import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rings import errors as E
from rings import vhost_user as vu
from rings.errors import ConfigError, PeerGone, ProtocolError, RingError, VringError
from rings.interrupts import readable
from rings.layout import (VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, VIRTQ_USED_F_NO_NOTIFY,
                          bit, feature_names, has)
from rings.shm import WatchedMemoryTable
from rings.virtq import DeviceQueue
from vhost.device import STATUS_DRIVER_OK, NetDevice, Refused

from . import frames
from .report import Report, check_seconds
from .ringview import Malformed, avail_bits_ok, view_for

R = vu.VhostUserRequest
PF = vu.VhostUserProtocolFeature
RX, TX = 0, 1

OFFERED = (bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_RING_PACKED) | bit(VIRTIO_F_IN_ORDER) | bit(VIRTIO_NET_F_MRG_RXBUF)
           | bit(VHOST_USER_F_PROTOCOL_FEATURES))
OFFERED_PROTOCOL = bit(PF.REPLY_ACK) | bit(PF.STATUS)

PHASES = ("per-buffer", "kicks", "batches", "ring-full", "late", "spurious-calls")
KICK_GRACE = 0.1        # seconds a kick may take after the publication it is owed for
LOSS_AFTER = 1.0        # seconds after which a frame that did not come back counts as lost
GARBAGE = 64            # bytes written after len in an Rx buffer (SPLIT-V-10: a device MAY write more)

IDS = ["FEAT-02", "FEAT-07", "NOTIF-08",
       "SPLIT-D-01", "SPLIT-D-02", "SPLIT-D-04", "SPLIT-D-05", "SPLIT-D-06", "SPLIT-D-07", "SPLIT-D-08",
       "SPLIT-D-09", "SPLIT-D-10", "SPLIT-D-13", "SPLIT-D-14", "SPLIT-D-15", "SPLIT-D-16", "SPLIT-L-08",
       "MEM-02", "MEM-04", "MEM-11",
       "EVT-01", "EVT-02", "EVT-03", "EVT-10", "EVT-11", "EVT-12", "EVT-13", "EVT-14", "EVT-19", "EVT-21",
       "EVT-22", "EVT-24",
       "PACKED-L-05", "PACKED-D-01", "PACKED-D-02", "PACKED-D-03", "PACKED-D-04", "PACKED-D-10",
       "PACKED-D-12", "PACKED-D-14", "PACKED-D-15", "PACKED-D-18", "PACKED-D-20", "PACKED-D-21",
       "PACKED-D-23", "PACKED-D-26",
       "INORDER-03", "INORDER-04", "INORDER-05", "INORDER-06", "INORDER-09", "INORDER-10", "INORDER-11",
       "INORDER-12",
       "NET-06", "NET-07", "NET-08", "NET-14", "NET-24", "NET-25", "NET-32"]


def ring_error_ids(e: RingError, packed):
    """The driver requirement a DeviceQueue error stands for (the error's own label names the device-side
    check)."""
    table = {
        E.HeadOutOfRange: ("SPLIT-D-13", "PACKED-D-23"), E.NextOutOfRange: ("SPLIT-D-04", "PACKED-D-21"),
        E.ChainTooLong: ("SPLIT-D-05", "PACKED-D-21"), E.AvailIdxJump: ("SPLIT-D-10", "SPLIT-D-10"),
        E.IndirectEmpty: ("SPLIT-D-09", "PACKED-D-21"), E.IndirectLength: ("SPLIT-D-09", "PACKED-D-21"),
        E.NestedIndirect: ("SPLIT-D-07", "PACKED-D-18"), E.IndirectWithNext: ("SPLIT-D-08", "PACKED-D-20"),
        E.WritableBeforeReadable: ("SPLIT-D-02", "PACKED-D-10"), E.PackedIdOutOfRange: ("PACKED-D-23",) * 2,
        E.BufferIdInUse: ("SPLIT-D-13", "PACKED-D-23"), E.AddressOutOfBounds: ("FEAT-07", "FEAT-07"),
    }
    return table.get(type(e), ("SPLIT-D-13", "PACKED-D-23"))[1 if packed else 0]


class SessionEnded(VringError):
    """The driver stopped the vrings (or a queue broke): this data path is over."""


@dataclass
class DriverOptions:
    socket: str
    client: bool = False
    seconds: float = 10.0
    wait: float = 60.0            # for the driver to connect and start its vrings
    timeout: float = 5.0
    seed: int = 1
    event_idx: bool = True        # offer VIRTIO_F_EVENT_IDX
    indirect: bool = True         # offer VIRTIO_F_INDIRECT_DESC
    population: int = 48          # frames kept circulating
    phases: tuple = PHASES

    def __post_init__(self):
        check_seconds(seconds=self.seconds, wait=self.wait, timeout=self.timeout)
        bad = [p for p in self.phases if p not in PHASES]
        if bad:
            raise ConfigError(f"unknown phase(s) {bad}; known: {', '.join(PHASES)}")


@dataclass
class Held:
    """A chain the device polled: what it was when it was published, to compare when it is completed."""

    id: int
    chain: object           # ringview.Chain
    raw: bytes              # descriptor (and indirect table) bytes as first read
    payload: bytes          # readable bytes as first read
    wlen: int
    ndesc: int
    t: float                # when polled
    gen: int                # flush generation when polled (packed: slots we overwrote later are excluded)
    due: float = 0.0        # late phase: not before this time


@dataclass
class Delivery:
    seq: int
    frame: bytes
    t: float
    rx_ids: list = field(default_factory=list)
    how: set = field(default_factory=set)     # IDs exercised by the way it was delivered
    phase: str = ""
    note: str = ""                            # how its buffers were completed (for evidence)


class DriverMemory(WatchedMemoryTable):
    """The driver's memory. The oracle reads the rings through numpy views (conform.ringview) and polls them with
    the C ring code, so a driver that truncates a region it did not let us seal does not kill the harness: the
    pages read as zeros, and the harness ends the run on it (DriverHarness.memory_intact) instead of judging
    them."""

    def __init__(self, harness):
        self.harness = harness
        super().__init__(whose="the driver under test")

    def release(self):   # a table replaced or closed: its fault must not go unreported with it
        self.harness.memory_lost(self.vanished())
        super().release()


class ConformDevice(NetDevice):
    """vhost's device model with the data path replaced: the harness starts and stops its session."""

    def memory_table(self):
        return DriverMemory(self.harness)

    def __init__(self, harness, features, protocol_features):
        super().__init__(features=features, protocol_features=protocol_features)
        self.harness = harness

    def update(self):
        h = self.harness
        if self.ready():
            if h.session is None and not h.session_broken:
                h.start_session(self)
        elif h.session is not None:
            h.stop_session("the vrings are no longer ready")

    def _stop(self, why):
        if self.harness.session is not None:
            self.harness.stop_session(why)


class Vq:
    """One vring from the device side: a DeviceQueue plus the harness's view of memory."""

    def __init__(self, s, index, dev, v):
        self.s, self.index = s, index
        self.name = "rx" if index == RX else "tx"
        self.layout = dev._layout(v, v.addr)
        self.size = self.layout.size
        self.packed = self.layout.packed
        self.dq = DeviceQueue(dev.cmem, self.layout, s.features, in_order_batch=s.in_order)
        self.view = view_for(dev.mem, self.layout)
        self.vring = v
        c = self.dq.c
        if self.packed:
            c.last_avail = c.used_idx = v.base & 0x7FFF
            c.avail_wrap = c.used_wrap = (v.base >> 15) & 1
        else:
            base = v.base & 0xFFFF
            if self.view.used_idx != base:   # as vhost/device.py: resume at the used index in memory
                base = self.view.used_idx
            c.last_avail = c.used_idx = base
        self.fresh = (v.base & 0x7FFF) == 0
        self.held: dict[int, Held] = {}
        self.order: deque[int] = deque()     # polled ids, in poll order
        self.gen = 0                         # flushes so far
        self.wrote_gen = np.zeros(self.size, np.int64)   # packed: the flush that last gave each slot back
        self.next_head = 0 if self.fresh else None       # split in-order: the head expected next (INORDER-03)
        self.kicks = 0
        self.low_bit = False                 # kicks phase, EVENT_IDX: bit 0 of used flags set on purpose (EVT-13)
        self.avail_pending_seen = False
        self.armed = None                    # kicks phase: the avail position after which a kick is owed
        self.kicks_since_arm = 0
        self.debt_since = None
        self.device_shadow = None

    # -- the device area is ours ------------------------------------------------------------------------------

    def device_bytes(self):
        return self.view.device_bytes

    def take_device_shadow(self):
        self.device_shadow = self.device_bytes().copy()

    def check_device_area(self, r):
        now = self.device_bytes()
        diff = np.nonzero(now != self.device_shadow)[0]
        rid = "EVT-22" if self.packed else "SPLIT-L-08"
        if not r.check(rid, not len(diff), lambda: f"{self.name}: byte {int(diff[0])} of the device area changed "
                       f"{int(self.device_shadow[diff[0]]):#x} -> {int(now[diff[0]]):#x}: the driver wrote it"):
            self.take_device_shadow()

    def callfd(self):
        return self.vring.callfd if self.vring.callfd >= 0 else None

    def read_kicks(self):
        fd = self.vring.kickfd
        if fd < 0:
            return 0
        if not readable([fd], 0):
            return 0
        n = vu.eventfd_take(fd)
        self.kicks += n
        return n

    def avail_pending(self):
        """Something published that the DeviceQueue has not polled yet?"""
        c = self.dq.c
        if self.packed:
            return avail_bits_ok(self.view.flags(c.last_avail), c.avail_wrap)
        return self.view.avail_idx != c.last_avail

    def held_descs(self):
        return sum(h.ndesc for h in self.held.values())


class Session:
    """One run of the data path (from the driver's DRIVER_OK to its stopping the vrings)."""

    def __init__(self, h, dev):
        self.h, self.r = h, h.report
        self.dev = dev
        self.features = f = dev.features
        self.packed = has(f, VIRTIO_F_RING_PACKED)
        self.in_order = has(f, VIRTIO_F_IN_ORDER)
        self.event_idx = has(f, VIRTIO_F_EVENT_IDX)
        self.mrg = has(f, VIRTIO_NET_F_MRG_RXBUF)
        self.indirect = has(f, VIRTIO_F_INDIRECT_DESC)
        self.hdr = frames.hdr_size(f)
        self.q = [Vq(self, i, dev, dev.vrings[i]) for i in (RX, TX)]
        self.rx_free: deque[Held] = deque()      # polled Rx buffers not used yet
        self.rx_shadow: list = []                # (Held, len, Delivery) pushed, not flushed
        self.rx_flush_at = 0.0
        self.max_tx_desc = 2
        self._initial_checks()
        for q in self.q:
            q.dq.enable_kicks(False)
            q.take_device_shadow()

    # -- start ------------------------------------------------------------------------------------------------

    def _initial_checks(self):
        r = self.r
        for q in self.q:
            if not q.fresh:
                continue
            if q.packed:   # PACKED-L-05: zero, or a descriptor the driver made available already
                bad = [s for s in range(q.size) if q.view.desc_bytes[16 * s:16 * s + 16].any()
                       and not avail_bits_ok(q.view.flags(s), 1)]

                def show(s):
                    d = q.view.desc[s]
                    return f"slot {s}: addr {int(d['addr']):#x} len {int(d['len'])} id {int(d['id'])} flags " \
                           f"{int(d['flags']):#x}"
                r.check("PACKED-L-05", not bad, lambda: f"{q.name}: {len(bad)} slots that are not available "
                        f"descriptors are not zero at DRIVER_OK ({'; '.join(show(x) for x in bad[:3])})")
            elif self.h.first_session:
                f = q.view.used_flags
                r.check("EVT-10", f == 0, lambda: f"{q.name}: used flags {f:#x} at DRIVER_OK (must be 0)")

    # -- polling ----------------------------------------------------------------------------------------------

    def _fail_ring(self, q, e):
        rid = ring_error_ids(e, q.packed)
        self.r.fail(rid, f"{q.name}: {type(e).__name__}: {e}")
        raise SessionEnded(f"{q.name}: the driver broke the ring ({type(e).__name__})")

    def poll(self, q):
        """Poll one queue; check and remember every new chain. Returns the new Held records."""
        try:
            ch = q.dq.poll()
        except RingError as e:
            self._fail_ring(q, e)
        if not ch.n:
            return []
        out = []
        slot = None
        if q.packed:   # the slots of the lists just polled: from where the poll started
            total = int(sum(int(x) for x in ch.ndesc))
            slot = (q.dq.c.last_avail - total) % q.size
        for k in range(ch.n):
            bid, nd = int(ch.id[k]), int(ch.ndesc[k])
            head = slot if q.packed else bid
            try:
                chain = q.view.walk(head)
            except Malformed as e:
                self.r.fail("PACKED-D-12" if q.packed else "MEM-02", f"{q.name}: chain at {head} changed while it "
                            f"was read: {e}")
                raise SessionEnded(f"{q.name}: a chain changed under the device") from None
            segs = ch.segments(k)
            if [(a, n, bool(w)) for a, n, w in segs] != chain.segs:
                self.r.fail("PACKED-D-12" if q.packed else "MEM-02",
                            f"{q.name}: chain {bid} read twice right after it was published differs: "
                            f"{segs[:3]} then {chain.segs[:3]}")
            self._check_chain(q, bid, chain)
            payload = b"".join(self.dev.mem.read(a, n) for a, n, w in chain.segs if not w)
            hd = Held(bid, chain, q.view.raw(chain), payload, int(ch.wlen[k]), nd, time.monotonic(), q.gen)
            q.held[bid] = hd
            q.order.append(bid)
            out.append(hd)
            if q.packed:
                slot = (slot + nd) % q.size
        self._check_avail_ahead(q)
        return out

    def _check_chain(self, q, bid, c):
        """What the DeviceQueue does not check itself, read from the raw descriptors."""
        r, n = self.r, q.size
        if q.packed:   # every slot of the list must carry the wrap that was current at it
            ok = True
            for s, f in zip(c.slots, c.flags):
                w = self._slot_wrap(q, s, c)
                if not avail_bits_ok(f, w):
                    ok = False
                    r.fail("PACKED-D-14" if s != c.slots[0] else "PACKED-D-03",
                           f"{q.name}: buffer {bid}: slot {s} flags {f:#x}, expected AVAIL={w} USED={1 - w}")
            if ok:
                r.ok("PACKED-D-03")
                r.ok("PACKED-D-14")
                if len(c.slots) > 1:
                    r.ok("PACKED-D-12")
                if not all(self._slot_wrap(q, s, c) for s in c.slots):
                    r.ok("PACKED-D-02")   # made available with the wrap counter toggled after the ring end
            if c.table:
                r.check("PACKED-D-18", self.indirect and all(not ef & ~VIRTQ_DESC_F_WRITE
                                                             for _a, _l, ef, _i in c.table_entries),
                        lambda: f"{q.name}: buffer {bid}: indirect table entries with flags "
                                f"{[hex(e[2]) for e in c.table_entries]}" + ("" if self.indirect else
                                                                              " (INDIRECT_DESC not negotiated)"))
                r.ok("PACKED-D-20")
                r.ok("PACKED-D-21")
            r.ok("PACKED-D-23")
            r.ok("PACKED-D-10")
        else:
            if c.table:
                r.check("SPLIT-D-06", self.indirect, f"{q.name}: chain {bid} uses INDIRECT without INDIRECT_DESC")
                r.ok("SPLIT-D-07")
                r.ok("SPLIT-D-08")
                r.ok("SPLIT-D-09")
            r.ok("SPLIT-D-02")
            r.ok("SPLIT-D-13")
            r.ok("SPLIT-D-04")
            r.ok("SPLIT-D-05")
            if self.in_order:
                if q.next_head is not None:
                    r.check("INORDER-03", bid == q.next_head, lambda: f"{q.name}: head {bid}, the next descriptor "
                            f"in ring order is {q.next_head}")
                q.next_head = (bid + c.ndesc) % n
                for x, f in zip(c.slots, c.flags):
                    if f & VIRTQ_DESC_F_NEXT:
                        nxt = int(q.view.desc[x]["next"])
                        r.check("INORDER-04", nxt == (x + 1) % n, lambda: f"{q.name}: descriptor {x} of chain {bid} "
                                f"has next {nxt}, not {(x + 1) % n}")
                for j, (_a, _l, ef, nxt) in enumerate(c.table_entries):
                    if ef & VIRTQ_DESC_F_NEXT:
                        r.check("INORDER-05", nxt == j + 1, lambda: f"{q.name}: indirect entry {j} of chain {bid} "
                                f"has next {nxt}, not {j + 1}")
        r.ok("FEAT-07")

    def _slot_wrap(self, q, s, c):
        """The driver wrap counter a slot of a list just polled was made available with."""
        c_now = q.dq.c
        # slots from the list's head up to the end of the ring share the head's lap; later ones the next lap
        pos_after, wrap_after = int(c_now.last_avail), int(c_now.avail_wrap)
        # distance back from the poll position to slot s (s is behind pos_after by 1..size)
        back = (pos_after - s) % q.size or q.size
        return wrap_after if back <= pos_after else wrap_after ^ 1

    def _check_avail_ahead(self, q):
        """The driver cannot have more than a ring outstanding (SPLIT-D-10 for split)."""
        if q.packed:
            return
        ahead = (q.view.avail_idx - int(q.dq.c.used_idx)) & 0xFFFF
        self.r.check("SPLIT-D-10", ahead <= q.size, lambda: f"{q.name}: avail idx {q.view.avail_idx} is {ahead} "
                     f"ahead of used idx {int(q.dq.c.used_idx)} (queue size {q.size})")

    # -- completing -------------------------------------------------------------------------------------------

    def _reread(self, q, hd, what):
        """A completed chain must still be what the driver published (and its readable bytes too)."""
        r = self.r
        now = q.view.raw(hd.chain)
        if q.packed:   # leave out slots used entries gave back to the driver since the chain was polled
            keep = [k for k, s in enumerate(hd.chain.slots) if q.wrote_gen[s] <= hd.gen]
            a = b"".join(hd.raw[16 * k:16 * k + 16] for k in keep) + hd.raw[16 * hd.chain.ndesc:]
            b = b"".join(now[16 * k:16 * k + 16] for k in keep) + now[16 * hd.chain.ndesc:]
        else:
            a, b = hd.raw, now
        ids = ("PACKED-D-04", "MEM-04") if q.packed else ("SPLIT-D-14", "MEM-02")
        if a == b:
            for rid in ids:
                r.ok(rid)
        else:
            i = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
            for rid in ids:
                r.fail(rid, f"{q.name}: {what} {hd.id}: descriptor bytes changed between the publication and the "
                            f"completion {1000 * (time.monotonic() - hd.t):.1f} ms later (byte {i}: "
                            f"{a[i]:#04x} -> {b[i]:#04x})")
        if hd.payload:
            now_p = b"".join(self.dev.mem.read(x, n) for x, n, w in hd.chain.segs if not w)
            r.check("MEM-11", now_p == hd.payload, lambda: f"{q.name}: {what} {hd.id}: readable bytes changed "
                    f"after the buffer was made available ({frames.first_difference(now_p, hd.payload)})")

    def flush(self, q, ids, lens, batch):
        """Complete ``ids`` (in this order) with one flush: ``batch`` lets IN_ORDER runs of full buffers share one
        used entry. Re-reads every chain first; then calls the driver if it asks."""
        if not ids:
            return
        for i in ids:
            self._reread(q, q.held[i], "buffer")
        c = q.dq.c
        c.batch = int(bool(batch and self.in_order))
        before = int(c.used_idx) + q.size * int(c.used_wrap)
        try:
            q.dq.push_used(np.array(ids, np.uint32), np.array(lens, np.uint32))
        except VringError as e:
            raise SessionEnded(f"harness: {e}") from None
        q.dq.flush()
        if q.packed:   # the slots given back: a used entry covers as many slots as its buffers had descriptors,
            # from the used position, whichever buffers were published there (the driver may write new
            # descriptors in them while other buffers published there are still held)
            covered = (int(c.used_idx) + q.size * int(c.used_wrap) - before) % (2 * q.size)
            q.wrote_gen[(before + np.arange(covered)) % q.size] = q.gen + 1
        q.gen += 1
        for i in ids:
            del q.held[i]
            q.order.remove(i)
        q.take_device_shadow()
        self.call(q)

    def call(self, q, spurious=False):
        fd = q.callfd()
        if fd is None:
            return
        if spurious or q.dq.call_prepare():
            os.eventfd_write(fd, 1)
            self.h.calls[q.index] += 1

    def check_driver_fields(self):
        """EVT-01/02 (split) and EVT-19/21 (packed): the suppression fields the driver writes."""
        r = self.r
        for q in self.q:
            if q.packed:
                f = int(q.view.driver_event[1])
                r.check("EVT-19", not f & ~3, lambda: f"{q.name}: driver event flags {f:#x}: reserved bits set")
                r.check("EVT-21", (f & 3) != 3 and (f & 3 != 2 or self.event_idx),
                        lambda: f"{q.name}: driver event flags {f:#x}" + (" (DESC without EVENT_IDX)"
                                                                          if f & 3 == 2 else " (reserved 3)"))
            elif self.event_idx:
                f = q.view.avail_flags
                r.check("EVT-02", f == 0, lambda: f"{q.name}: avail flags {f:#x} with EVENT_IDX (must be 0)")
            else:
                f = q.view.avail_flags
                r.check("EVT-01", f in (0, 1), lambda: f"{q.name}: avail flags {f:#x} (must be 0 or 1)")
            q.check_device_area(r)


class DriverHarness:
    """One run of `vring conform driver`. ``run()`` returns the Report. ``session_class`` builds each data path
    (tests give it a deliberately wrong one)."""

    session_class = Session

    def __init__(self, opts: DriverOptions):
        self.o = opts
        self.rng = random.Random(opts.seed)
        self.run_id = (os.getpid() << 8 ^ int(time.time()) ^ 0x5A) & 0xFFFFFFFF
        self.report = Report("driver", IDS)
        self.session: Session | None = None
        self.session_broken = False
        self.sessions = 0
        self.first_session = True
        self.conn = None
        self.listener = None
        self._listener_ino = None   # its socket file's inode: removed at the end only if still that one
        self.dev = None
        self.seq = 0
        self.delivered: dict[int, Delivery] = {}
        self.returned = 0
        self.abandoned = 0                         # outstanding when a data path stopped
        self.written_off = 0                       # not back before the driver started forwarding
        self.foreign = 0
        self.calls = [0, 0]
        self.phase = None
        self.phase_t0 = 0.0
        self.phase_log = []
        self.tx_batch_entries = 0                  # Tx used entries that covered more than one buffer
        self.t_first = None
        self.population = opts.population
        self.offered = OFFERED | (bit(VIRTIO_F_EVENT_IDX) if opts.event_idx else 0) | (
            bit(VIRTIO_F_INDIRECT_DESC) if opts.indirect else 0)
        self.memory_fault = None                   # the driver took memory away under us (GuestMemoryFault)
        self.report.evidence_valid = self.memory_intact

    def memory_intact(self):
        """False once the driver has truncated memory under the harness: what was read since is zeros, not
        evidence (the report drops fails found from then on; the run ends with the fault as its error)."""
        if self.memory_fault is None and self.dev is not None and self.dev.mem is not None:
            self.memory_lost(self.dev.mem.vanished())
        return self.memory_fault is None

    def memory_lost(self, fault):
        """The first GuestMemoryFault (None: nothing lost): kept, and the passes since the last sound step go."""
        if fault is not None and self.memory_fault is None:
            self.memory_fault = fault
            self.report.drop_passes_since_checkpoint()

    def _end_if_memory_vanished(self):
        """After a step: what it read was there (its passes stand), or the run ends on the truncation."""
        if not self.memory_intact():
            raise SessionEnded(self._why_ended(None))
        self.report.checkpoint()

    def _why_ended(self, e):
        """Why a data path ended: the driver's truncation first (a ring error read from zeros is its echo)."""
        return str(e) if self.memory_intact() else f"{type(self.memory_fault).__name__}: {self.memory_fault}"

    # -- sessions ---------------------------------------------------------------------------------------------

    def start_session(self, dev):
        try:
            self.session = self.session_class(self, dev)
        except (Refused, VringError) as e:
            self.report.notes.append(f"cannot start the data path: {type(e).__name__}: {e}")
            self.session_broken = True
            return
        self.sessions += 1
        s = self.session
        self.report.context["negotiated"] = " ".join(n for n in feature_names(dev.features)
                                                     if n != "PROTOCOL_FEATURES")
        self.report.context["rings"] = (f"{'packed' if s.packed else 'split'}, {s.q[RX].size}/{s.q[TX].size} "
                                        f"entries, header {s.hdr} bytes")
        self.t_session = self.warm_mark = self.last_back = time.monotonic()

    def stop_session(self, why):
        s, self.session = self.session, None
        if s is None:
            return
        self.first_session = False
        for q in s.q:   # keep the ring positions for GET_VRING_BASE, as vring vhost does
            c = q.dq.c
            q.vring.base = (int(c.used_idx) | (int(c.used_wrap) << 15)) if q.packed else int(c.used_idx)
        outstanding = [d for d in self.delivered.values() if d is not None]
        self.abandoned += len(outstanding)
        for d in outstanding:
            self.delivered[d.seq] = None
        self.report.notes.append(f"data path {self.sessions} stopped: {why}")

    # -- control plane ----------------------------------------------------------------------------------------

    def _open(self):
        o = self.o
        if o.client:
            deadline = time.monotonic() + o.wait
            while True:
                try:
                    self.conn = vu.connect_unix(o.socket, timeout=o.timeout)
                    break
                except (PeerGone, ProtocolError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        else:
            self.listener = vu.listen_unix(o.socket)
            self._listener_ino = os.lstat(o.socket).st_ino
            self.conn = vu.accept_unix(self.listener, timeout=o.wait)
        self.dev = ConformDevice(self, self.offered, OFFERED_PROTOCOL)
        self.report.context["peer"] = f"{o.socket} ({'we connect' if o.client else 'we listen'})"
        self.report.context["offered"] = " ".join(feature_names(self.offered))

    def _serve_one(self, timeout):
        """At most one control message. Returns False when the frontend left."""
        conn = self.conn
        if not readable([conn.sock], timeout):
            return True
        try:
            msg = conn.recv(timeout=self.o.timeout)
        except PeerGone:
            return False
        try:
            value = vu.decode(msg)
        except ProtocolError as e:
            return self._refuse(msg, str(e))
        self._observe_message(msg, value)
        try:
            payload = self.dev.handle(msg, value)
        except Refused as e:
            return self._refuse(msg, str(e))
        if vu.has_reply(msg.request):
            conn.send(vu.reply(msg, payload or b""), timeout=self.o.timeout)
        elif vu.wants_ack(msg):
            conn.send(vu.ack(msg, True), timeout=self.o.timeout)
        return True

    def _refuse(self, msg, why):
        self.report.notes.append(f"refused {msg.name}: {why}")
        if msg.need_reply:
            self.conn.send(vu.ack(msg, ok=False), timeout=self.o.timeout)
            return True
        return False   # as DPDK: no NEED_REPLY, close the connection

    def _observe_message(self, msg, value):
        r, dev = self.report, self.dev
        if msg.request == R.SET_FEATURES:
            extra = value & ~self.offered
            r.check("FEAT-02", not extra, lambda: f"SET_FEATURES {value:#x} accepts {feature_names(extra)}, "
                    f"which were not offered")
        elif msg.request == R.SET_VRING_ADDR:
            packed = has(dev.features, VIRTIO_F_RING_PACKED)
            rid = "PACKED-D-01" if packed else "SPLIT-D-01"
            need = (16, 4, 4) if packed else (16, 2, 4)
            bad = [(name, a, k) for name, a, k in zip(("desc", "driver", "device"),
                                                      (value.desc, value.avail, value.used), need) if a % k]
            r.check(rid, not bad, lambda: f"vring {value.index}: " + ", ".join(
                f"{name} area at {a:#x} not {k}-byte aligned" for name, a, k in bad))
        elif msg.request == R.SET_STATUS and value & STATUS_DRIVER_OK and not dev.status & STATUS_DRIVER_OK:
            kicks = []
            for v in dev.vrings:
                if v.kickfd >= 0:
                    kicks.append(vu.eventfd_take(v.kickfd) if readable([v.kickfd], 0) else 0)
            r.check("NOTIF-08", not any(kicks), lambda: f"{sum(kicks)} kick(s) before DRIVER_OK")

    # -- traffic ----------------------------------------------------------------------------------------------

    def _new_frame(self, s, max_len):
        self.seq += 1
        if s.mrg and self.rng.random() < 0.3:
            size = self.rng.randint(min(2 * frames.MAX_FRAME, max_len), max_len)
        else:
            size = self.rng.randint(frames.MIN_FRAME, min(frames.MAX_FRAME, max_len))
        return Delivery(self.seq, frames.make_frame(size, self.run_id, self.seq), time.monotonic())

    def _outstanding(self):
        return sum(1 for d in self.delivered.values() if d is not None)

    def _can_deliver(self, s, frame_len):
        tx = s.q[TX]
        per = max(s.max_tx_desc, -(-frame_len // 1900) + 1)
        return tx.held_descs() + (self._outstanding() + 1) * per <= tx.size

    def _deliver(self, s, now):
        """Fill Rx buffers with new frames while the population is short and the Tx ring has room for them."""
        batch = self.phase == "batches"
        while s.rx_free and self._outstanding() < self.population:
            first = s.rx_free[0] if s.in_order else self.rng.choice(s.rx_free)
            if s.mrg:
                room = sum(h.wlen for h in s.rx_free) - s.hdr
                max_len = min(room, 3 * first.wlen, 9000)
            else:
                max_len = first.wlen - s.hdr
            if max_len < frames.MIN_FRAME:
                break
            d = self._new_frame(s, max_len)
            if batch and not s.mrg and self.rng.random() < 0.5 and first.wlen - s.hdr <= 9000:
                # a frame that fills the buffer exactly: such buffers may be skipped by a batch entry
                d = Delivery(d.seq, frames.make_frame(first.wlen - s.hdr, self.run_id, d.seq), now)
            if not self._can_deliver(s, len(d.frame)):
                self.seq -= 1
                break
            data = frames.net_hdr(num_buffers=1) + d.frame
            bufs = self._take_rx(s, first, len(data))
            if s.mrg:
                data = frames.net_hdr(num_buffers=len(bufs)) + d.frame
                if len(bufs) > 1:
                    d.how.add("NET-32")
            lens = self._write_rx(s, bufs, data)
            if lens[-1] < bufs[-1].wlen:
                d.how.add("SPLIT-D-15")
            d.rx_ids = [b.id for b in bufs]
            d.phase = self.phase
            self.delivered[d.seq] = d
            for b, n in zip(bufs, lens):
                s.rx_shadow.append((b, n, d))
        self._flush_rx(s, now)

    def _take_rx(self, s, first, nbytes):
        """The Rx buffers for ``nbytes``: ``first``, then (MRG_RXBUF) more in poll order."""
        s.rx_free.remove(first)
        bufs, left = [first], nbytes - first.wlen
        while left > 0 and s.mrg and s.rx_free:
            b = s.rx_free.popleft() if s.in_order else s.rx_free[self.rng.randrange(len(s.rx_free))]
            if not s.in_order:
                s.rx_free.remove(b)
            bufs.append(b)
            left -= b.wlen
        return bufs

    def _write_rx(self, s, bufs, data):
        """Write ``data`` across the writable segments of ``bufs``; garbage after it in the last. Returns the
        used length of each buffer."""
        mem = s.dev.mem
        lens, off = [], 0
        for b in bufs:
            used = 0
            for a, n, w in b.chain.segs:
                if not w:
                    continue
                k = min(n, len(data) - off)
                if k > 0:
                    mem.write(a, data[off:off + k])
                    off += k
                    used += k
                if k < n:   # SPLIT-V-10: a device may write more than len; the driver must not use it
                    g = min(GARBAGE, n - max(k, 0))
                    mem.write(a + max(k, 0), self.rng.randbytes(g))
                    break
            lens.append(used)
        return lens

    def _flush_rx(self, s, now, force=False):
        """Publish the used Rx buffers as the phase says."""
        if not s.rx_shadow:
            return
        late = self.phase == "late"
        if not force:
            if late and now < s.rx_flush_at:
                return
            if self.phase == "batches" and len(s.rx_shadow) < self.rng.randint(1, 8) and now < s.rx_flush_at:
                return
        rx = s.q[RX]
        items, s.rx_shadow = s.rx_shadow, []
        ids = [b.id for b, _n, _d in items]
        lens = [n for _b, n, _d in items]
        batch = self.phase == "batches" and s.in_order
        k = 0
        while k < len(items):   # the batches the flush will make (the DeviceQueue's rule: full buffers run on)
            j = k
            while batch and j + 1 < len(items) and items[j][1] == items[j][0].wlen:
                j += 1
            if j > k:           # one used entry, at the first buffer's slot, names the last buffer
                ids_ = [b.id for b, _n, _d in items[k:j + 1]]
                for b, _n, d in items[k:j + 1]:
                    d.note = f" (in a batch used entry for buffers {ids_})"
                    d.how |= {"INORDER-11", "INORDER-12"} if s.packed else {"INORDER-06", "INORDER-09"}
                for _b, _n, d in items[k:j]:
                    d.how.add("INORDER-10")
            k = j + 1
        if not s.in_order:
            for _b, _n, d in items:
                d.how |= {"PACKED-D-15", "PACKED-D-26"} if s.packed else {"SPLIT-D-16"}
        s.flush(rx, ids, lens, batch)
        s.rx_flush_at = now + (self.rng.uniform(0.005, 0.03) if late else 0.002)

    def _tx_returned(self, s, hd):
        """A frame the driver sent: check its header, match it with what we delivered."""
        r = self.report
        data = hd.payload
        if len(data) < s.hdr:   # not even a header: nothing to match (counted)
            self.foreign += 1
            return
        flags, gso, _hl, _gs, _cs, _co, nb = frames.parse_net_hdr(data)
        s.max_tx_desc = max(s.max_tx_desc, hd.ndesc)
        if self.t_first is None:   # the driver forwards: the phases start now
            self.t_first = time.monotonic()
        frame = data[s.hdr:]
        seq = frames.stamp_of(frame, self.run_id)
        d = self.delivered.get(seq) if seq is not None else None
        echo = (" - the num_buffers the device wrote in this frame's Rx header, sent back unchanged"
                if d is not None and nb == (len(d.rx_ids) if s.mrg else 1) else "")
        r.check("NET-06", nb == 0, lambda: f"tx: num_buffers {nb} in the header of Tx buffer {hd.id} (must be 0)"
                + echo)
        r.check("NET-07", flags == 0, lambda: f"tx: header flags {flags:#x} without CSUM (must be 0)")
        r.check("NET-08", gso == 0, lambda: f"tx: gso_type {gso:#x} without HOST_TSO4/6, UFO, USO")
        r.check("NET-14", not flags & 6, lambda: f"tx: header flags {flags:#x} include DATA_VALID or RSC_INFO")
        if seq is None or seq not in self.delivered:
            self.foreign += 1
            return
        if d is None:   # back a second time (or from a stopped data path)
            if seq in self.returned_seqs:
                for rid in self._integrity_ids(s):
                    r.fail(rid, f"frame {seq} came back twice (the second time in Tx buffer {hd.id}): the driver "
                                f"received one Rx buffer twice or sent one Tx buffer twice")
            return
        self.delivered[seq] = None
        self.returned_seqs.add(seq)
        self.returned += 1
        self.last_back = time.monotonic()
        self.newest_back = max(self.newest_back, d.t)
        if frames.same_frame(frame, d.frame):
            for rid in sorted(d.how):
                r.ok(rid)
            return
        where = (f"[{d.phase}] frame {seq} delivered in Rx buffers {d.rx_ids}{d.note} came back from Tx buffer "
                 f"{hd.id} changed: {frames.first_difference(frame, d.frame)}")
        for rid in self._blame(s, d, frame):
            r.fail(rid, where)

    BATCH_IDS = ("INORDER-06", "INORDER-09", "INORDER-10", "INORDER-11", "INORDER-12")

    def _blame(self, s, d, frame=None):
        """The requirements a lost or changed frame speaks against, from the way it was delivered."""
        batch = sorted(d.how & set(self.BATCH_IDS))
        if batch:
            return batch
        if frame is not None and "SPLIT-D-15" in d.how and len(frame) > len(d.frame) and \
                frame[frames.CMP_FROM:len(d.frame)] == d.frame[frames.CMP_FROM:]:
            return ["SPLIT-D-15"]
        if "NET-32" in d.how:
            return ["NET-32"]
        return sorted(d.how - {"SPLIT-D-15"}) or self._integrity_ids(s)

    def _integrity_ids(self, s):
        if s.in_order:
            return ["INORDER-11", "INORDER-12"] if s.packed else ["INORDER-06", "INORDER-09"]
        return ["PACKED-D-15", "PACKED-D-26"] if s.packed else ["SPLIT-D-16"]

    def _complete_tx(self, s, now):
        tx = s.q[TX]
        if not tx.held:
            return
        order = list(tx.order)
        ph = self.phase
        if ph == "ring-full":
            if tx.held_descs() + s.max_tx_desc <= tx.size and now - min(h.t for h in tx.held.values()) < 0.5:
                return   # room for one more packet: wait (unless the driver stopped filling the ring)
            ids = order
        elif ph == "late":
            ids = []
            for i in order:
                if tx.held[i].due > now:
                    if s.in_order:
                        break
                    continue
                ids.append(i)
        else:
            ids = order
        if not ids:
            return
        if not s.in_order and ph in ("batches", "ring-full", "late"):
            self.rng.shuffle(ids)
        if ph in ("batches", "ring-full") and s.in_order:
            k = 0
            while k < len(ids):   # one used entry per chunk of random size (Tx used len 0 == wlen 0)
                m = self.rng.randint(1, 8) if ph == "batches" else len(ids) - k
                chunk = ids[k:k + m]
                s.flush(tx, chunk, [0] * len(chunk), True)
                if len(chunk) > 1:
                    self.tx_batch_entries += 1
                k += m
        else:
            for i in ids:
                s.flush(tx, [i], [0], False)

    # -- kicks ------------------------------------------------------------------------------------------------

    def _kick_ids(self, s):
        if s.packed:
            return "EVT-24"
        return "EVT-14" if s.event_idx else "EVT-12"

    def _kicks_step(self, s, now, want):
        """Kicks phase: kicks asked for (``want``) or suppressed; owed kicks are checked (see module doc)."""
        r = self.report
        for q in s.q:
            k = q.read_kicks()
            if not want:
                if k and now - self.phase_t0 > 0.05 and self.kicks_off_since and now > self.kicks_off_since:
                    r.warn(self._kick_ids(s), f"{q.name}: {k} kick(s) while the device suppressed them")
                continue
            q.kicks_since_arm += k
            if q.armed is not None and q.avail_pending_seen:
                if q.kicks_since_arm:
                    r.ok(self._kick_ids(s))
                    if not s.event_idx and not s.packed:
                        r.ok("EVT-11")
                    if s.event_idx and not s.packed and q.low_bit:
                        r.ok("EVT-13")
                    q.armed = None
                elif now - q.debt_since > KICK_GRACE:
                    what = (f"{q.name}: buffers published after the device asked for kicks ("
                            + (f"avail_event {q.armed}" if s.event_idx and not s.packed else
                               "used flags 0" if not s.packed else "device event flags ENABLE")
                            + f"), no kick within {KICK_GRACE * 1000:.0f} ms")
                    r.fail(self._kick_ids(s), what)
                    if s.event_idx and not s.packed and q.low_bit:
                        r.fail("EVT-13", what + " (used flags had bit 0 set, which the driver must ignore)")
                    q.armed = None

    def _arm_kicks(self, s):
        """After a poll: ask for kicks; if nothing new was published since, a kick is owed for the next one."""
        for q in s.q:
            if q.armed is not None:
                continue
            q.low_bit = bool(s.event_idx and not s.packed and self.rng.random() < 0.5)
            q.dq.enable_kicks(True)
            if not s.packed:
                if s.event_idx and q.low_bit:   # EVT-13: bit 0 of flags must be ignored with EVENT_IDX
                    q.view.used_hdr[0] = VIRTQ_USED_F_NO_NOTIFY
                elif not s.event_idx:            # EVT-11: avail_event is garbage the driver must ignore
                    q.view.avail_event_arr[0] = self.rng.randrange(1 << 16)
            q.take_device_shadow()
            if not q.avail_pending():
                q.armed = int(q.dq.c.last_avail)
                q.kicks_since_arm = 0
                q.avail_pending_seen = False
                q.debt_since = None

    def _note_publication(self, s, q, now):
        if self.phase == "kicks" and self.kicks_on and q.armed is not None and not q.avail_pending_seen:
            q.avail_pending_seen = True
            q.debt_since = now

    # -- phases -----------------------------------------------------------------------------------------------

    def _set_phase(self, name, now):
        s = self.session
        if self.phase is not None:
            self.phase_log.append({"name": self.phase, "seconds": round(now - self.phase_t0, 3),
                                   "buffers": self.phase_done})
            if self.phase == "spurious-calls" and self.phase_done:
                self.report.ok("EVT-03", self.calls_spurious)
            if self.phase in ("batches", "ring-full") and s is not None and self.tx_batch_entries:
                for rid in self._integrity_ids(s):
                    self.report.ok(rid, self.tx_batch_entries)
                self.tx_batch_entries = 0
        self.phase, self.phase_t0, self.phase_done = name, now, 0
        self.kicks_on = name == "kicks"
        self.kicks_off_since = None
        if s is not None:
            for q in s.q:
                q.armed = None
                if name != "kicks":
                    q.dq.enable_kicks(False)
                    q.take_device_shadow()
            if name == "late":
                for q in s.q:
                    for h in q.held.values():
                        h.due = now + self.rng.uniform(0.005, 0.03)

    def _step(self, s, now):
        if self.t_first is None:   # waiting for the driver to forward: deliver, poll, complete promptly
            self._warmup(s, now)
            return
        names = list(self.o.phases)
        share = self.o.seconds / len(names)
        idx = min(int((now - self.t_first) / share), len(names) - 1)
        if names[idx] != self.phase:
            self._set_phase(names[idx], now)
        if self.phase == "kicks":
            half = self.phase_t0 + share / 2
            if self.kicks_on and now > half:   # second half: kicks suppressed
                self.kicks_on = False
                for q in s.q:
                    q.dq.enable_kicks(False)
                    q.take_device_shadow()
                    q.armed = None
                self.kicks_off_since = now + 0.03
            self._kicks_step(s, now, self.kicks_on)
        s.check_driver_fields()
        rx, tx = s.q
        for q in s.q:
            if q.avail_pending():
                self._note_publication(s, q, now)
        for hd in s.poll(tx):
            if self.phase == "late":
                hd.due = now + self.rng.uniform(0.005, 0.03)
            self._tx_returned(s, hd)
            self.phase_done += 1
        for hd in s.poll(rx):
            self._check_rx_buffer(s, hd)
            s.rx_free.append(hd)
        if self.phase == "kicks" and self.kicks_on:
            self._arm_kicks(s)
        self._complete_tx(s, now)
        self._deliver(s, now)
        if self.phase == "spurious-calls" and self.rng.random() < 0.2:
            for q in s.q:
                s.call(q, spurious=True)
                self.calls_spurious += 1
        self._check_lost(s, now)

    def _warmup(self, s, now):
        """Before the driver forwards (testpmd drops what waits in its Rx queue when it starts forwarding):
        frames that did not come back within a second are written off, not counted as lost."""
        if now - self.warm_mark > 1.0:
            gone = [d for d in self.delivered.values() if d is not None]
            for d in gone:
                self.delivered[d.seq] = None
            self.written_off += len(gone)
            self.warm_mark = now
        s.check_driver_fields()
        for hd in s.poll(s.q[TX]):
            self._tx_returned(s, hd)
        for hd in s.poll(s.q[RX]):
            self._check_rx_buffer(s, hd)
            s.rx_free.append(hd)
        self._complete_tx(s, now)
        self._deliver(s, now)

    def _check_rx_buffer(self, s, hd):
        r = self.report
        if s.mrg:
            r.check("NET-25", hd.wlen >= s.hdr, lambda: f"rx: buffer {hd.id} has {hd.wlen} writable bytes, less "
                    f"than the {s.hdr}-byte header")
        elif hd.wlen < 1526:
            r.warn("NET-24", f"rx: buffer {hd.id} has {hd.wlen} writable bytes (SHOULD be at least 1526)")
        else:
            r.ok("NET-24")

    def _check_lost(self, s, now, final=False):
        """A frame is lost once a frame delivered after it came back and it did not within LOSS_AFTER (or, at the
        end, once the drain is over). A driver that returns nothing for a while has stalled: reported once, against
        the oldest frame it holds, and the run ends."""
        if not final and now - self._last_loss_check < 0.25:
            return
        self._last_loss_check = now
        out = [d for d in self.delivered.values() if d is not None and not self._still_ours(s, d)]
        if not out:
            return
        if not final and now - self.last_back > 3 * LOSS_AFTER:
            d = min(out, key=lambda x: x.t)
            why = (f"the driver stopped sending frames back: nothing for {now - self.last_back:.1f} s; the oldest of "
                   f"the {len(out)} it holds is frame {d.seq} delivered in phase {d.phase} in Rx buffers "
                   f"{d.rx_ids}{d.note}")
            for rid in self._blame(s, d):
                self.report.fail(rid, why)
            raise SessionEnded(why + "; later phases not run")
        for d in out:
            if final or (now - d.t > LOSS_AFTER and d.t < self.newest_back):
                self.delivered[d.seq] = None
                self.lost += 1
                for rid in self._blame(s, d):
                    self.report.fail(rid, f"[{d.phase}] frame {d.seq} delivered in Rx buffers {d.rx_ids}{d.note} "
                                          f"never came back (lost by the driver; later frames did)")

    def _still_ours(self, s, d):
        """Not lost while its Rx buffers are not even published as used yet (held back by a phase)."""
        return any(x[2] is d for x in s.rx_shadow)

    @staticmethod
    def _why_not(rid, f):
        """Why a row cannot be exercised with the features the driver chose ('' when it could)."""
        packed, ei, io = has(f, VIRTIO_F_RING_PACKED), has(f, VIRTIO_F_EVENT_IDX), has(f, VIRTIO_F_IN_ORDER)
        rules = [
            ((rid.startswith("SPLIT-") or rid in ("MEM-02", "EVT-01", "EVT-02", "EVT-10", "EVT-11", "EVT-12",
                                                   "EVT-13", "EVT-14", "INORDER-03", "INORDER-04", "INORDER-05",
                                                   "INORDER-06", "INORDER-09")) and packed, "split rings only"),
            ((rid.startswith("PACKED-") or rid in ("MEM-04", "EVT-19", "EVT-21", "EVT-22", "EVT-24",
                                                    "INORDER-11", "INORDER-12")) and not packed, "packed rings only"),
            (rid in ("EVT-02", "EVT-13", "EVT-14") and not ei, "the driver did not negotiate EVENT_IDX"),
            (rid in ("EVT-01", "EVT-11", "EVT-12") and ei, "without EVENT_IDX only"),
            (rid.startswith("INORDER-") and not io, "the driver did not negotiate IN_ORDER"),
            (rid in ("SPLIT-D-16", "PACKED-D-15", "PACKED-D-26") and io, "without IN_ORDER only"),
            (rid == "NET-24" and has(f, VIRTIO_NET_F_MRG_RXBUF), "without MRG_RXBUF only"),
            (rid in ("NET-25", "NET-32") and not has(f, VIRTIO_NET_F_MRG_RXBUF), "with MRG_RXBUF only"),
            (rid in ("SPLIT-D-06", "SPLIT-D-07", "SPLIT-D-08", "SPLIT-D-09", "INORDER-05", "PACKED-D-18",
                     "PACKED-D-20", "PACKED-D-21"), "the driver used no indirect table"),
        ]
        return next((why for cond, why in rules if cond), "")

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self):
        r, o = self.report, self.o
        self.returned_seqs = set()
        self.lost = 0
        self.newest_back = 0.0
        self._last_loss_check = 0.0
        self.calls_spurious = 0
        self.phase_done = 0
        self.kicks_on = False
        self.kicks_off_since = None
        try:
            self._open()
            deadline_start = time.monotonic() + o.wait
            while True:
                now = time.monotonic()
                s = self.session
                if self.t_first is None and now > deadline_start:
                    raise PeerGone(f"the driver did not start its vrings within {o.wait}s" if s is None else
                                   f"the driver sent nothing back within {o.wait}s (is it forwarding?)")
                if self.t_first is not None and now - self.t_first >= o.seconds:
                    break
                if not self._serve_one(0 if s is not None else 0.05):
                    if self.t_first is None:
                        r.error = "PeerGone: the driver closed the connection before it sent anything back"
                    else:   # README: a run that ended early (the peer left) is no pass
                        r.error = (f"PeerGone: the driver closed the connection {now - self.t_first:.1f} s into the "
                                   f"{o.seconds:g} s run (phase {self.phase})")
                    if self.session is not None:
                        self.stop_session("the driver left")
                    break
                s = self.session
                if s is not None:
                    try:
                        self._step(s, now)
                        self._end_if_memory_vanished()
                    except SessionEnded as e:
                        why = self._why_ended(e)
                        self.stop_session(why)
                        self.session_broken = True
                        r.error = why
                        break
                elif self.t_first is not None and self.session_broken:
                    break
            self._drain()
        except VringError as e:
            if self.t_first is None:
                raise
            r.error = f"{type(e).__name__}: {e}"
        finally:
            self._finish()
        return r

    def _drain(self):
        """Stop injecting; let the frames in flight come back; complete everything."""
        s = self.session
        if s is None:
            return
        self.population = 0
        if self.phase is not None:
            self._set_phase("drain", time.monotonic())
        end = time.monotonic() + min(LOSS_AFTER, 1.0) + 0.5
        while time.monotonic() < end and self._outstanding():
            if not self._serve_one(0):
                return
            s = self.session
            if s is None:
                return
            try:
                now = time.monotonic()
                for hd in s.poll(s.q[TX]):
                    self._tx_returned(s, hd)
                for hd in s.poll(s.q[RX]):
                    s.rx_free.append(hd)
                self._complete_tx(s, now)
                self._flush_rx(s, now, force=True)
                self._end_if_memory_vanished()
            except SessionEnded as e:
                self.stop_session(self._why_ended(e))
                return
            time.sleep(0.0005)

    def _finish(self):
        r = self.report
        s = self.session
        if not self.memory_intact() and not (r.error or "").startswith("GuestMemoryFault"):
            r.error = self._why_ended(None)   # found as the driver left or replaced its memory
        if s is not None:
            self._check_lost(s, time.monotonic(), final=True)   # what is still out after the drain is lost
            self.stop_session("end of the run")
        if self.phase not in (None, "drain"):
            self.phase_log.append({"name": self.phase, "seconds": round(time.monotonic() - self.phase_t0, 3),
                                   "buffers": self.phase_done})
        r.scenarios = [p for p in self.phase_log if p["name"] != "drain"]
        if self.dev is not None and self.dev.features_set:
            for rid in IDS:
                if r.status(rid) != "not exercised":
                    continue
                why = self._why_not(rid, self.dev.features) or ("the run ended early" if r.error else "")
                if why:
                    r.set_note(rid, why)
        r.context["traffic"] = (f"{self.seq} frames delivered, {self.returned} came back, {self.lost} lost, "
                                f"{self.written_off} dropped before the driver forwarded, {self.abandoned} left in a "
                                f"stopped data path, {self.foreign} foreign; calls "
                                f"rx {self.calls[RX]} tx {self.calls[TX]} ({self.calls_spurious} spurious)")
        if self.conn is not None:
            self.conn.close()
        if self.dev is not None:
            self.dev.close()
        if self.listener is not None:   # the file, if it is still ours (not one somebody bound since)
            vu.close_listener(self.listener, self.o.socket, self._listener_ino)
            self.listener = None
