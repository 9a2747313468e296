"""`vring conform device`: we are the frontend (a virtio-net driver); the backend under test is checked.

The backend must be a virtio-net device that loops what it receives on the driver's Tx queue (vring 1) back
into the driver's Rx queue (vring 0): DPDK ``dpdk-testpmd --vdev net_vhost0,iface=S -- --forward-mode=io``
(or ``mac``/``macswap``, which rewrite only the MAC addresses), or ``vring vhost --socket S --fwd macswap``.
A backend that does not loop still gets its Tx side checked; the Rx rows then stay "not exercised".

How it drives the backend. The control plane is ``virtio.frontend.VhostUserFrontend``; the rings are two
``rings.virtq.DriverQueue`` over one POSIX shared-memory region. The harness builds every buffer itself
(Ethernet frames stamped with a sequence number, the virtio-net header, segments placed with canary bytes
between them, Rx buffers filled with the canary), lets the DriverQueue write the descriptors, reads back
from memory what it wrote (its own model of every buffer in flight), sometimes edits descriptors before
publishing them (legal but unusual encodings: WRITE on an indirect descriptor, an indirect table walked
0->2->1, garbage ids in non-last packed descriptors, reserved bits inside packed indirect tables), publishes,
and kicks when the device asks. Scenarios: the GEN-01 window before DRIVER_OK, batches of every size 1..ring,
chains and indirect tables, a 12-byte header descriptor on Rx, small mergeable Rx buffers, notifications
suppressed, spurious kicks; split rings start near the 16-bit wrap of the ring indices.

What it checks (from ring memory and the call eventfds, never from the backend's word): every used entry /
used descriptor against the buffers in flight (ids, order, batches, skipped slots, len, WRITE flag, wrap
bits), every received packet against the frame that was sent (header fields, num_buffers, lengths, content,
canary bytes that should have been overwritten), descriptor tables, indirect tables, the avail ring / driver
event area, readable buffers, the canaries around every buffer and around the ring areas against the harness's
own copies (nothing the device may not write has changed), and used buffer notifications against the
suppression in force.
"""
from __future__ import annotations

import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rings.errors import ConfigError, RingError, VringError
from rings.layout import (RING_EVENT_FLAGS_DESC, RING_EVENT_FLAGS_DISABLE, RING_EVENT_FLAGS_ENABLE,
                          VHOST_USER_F_PROTOCOL_FEATURES, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE,
                          QueueLayout, align_up, area_sizes, bit, feature_names, has, need_event)
from rings import vhost_user as vu
from rings.shm import MemoryTable, ShmRegion
from rings.virtq import DriverQueue
from virtio.frontend import ACKNOWLEDGE, DRIVER, DRIVER_OK, FEATURES_OK, VhostUserFrontend, want_features

from . import frames
from .report import Report, check_seconds
from .ringview import used_bits, view_for

R = vu.VhostUserRequest
RX, TX = 0, 1
GPA_BASE = 0x1_0000_0000
PAGE = 4096
SLOT = 4096                # guest memory per buffer token (segments with canary gaps between them)
GAP = 16                   # canary bytes before, between and after segments
INDIRECT_MAX = 4           # Tx: 2..4 segments go indirect, longer chains stay direct
RX_BUF = 1536              # one Rx buffer: header + the largest frame
USED_CANARY = (0xFFFFFFFF, 0xC0DECAFE)   # split used elements the harness consumed (INORDER-08)
LATE_LEN_WAIT = 0.25       # seconds to wait for a used len that was not set before used idx (SPLIT-V-08)
OOO_WAIT = 0.05            # seconds to wait for the entry after one that names a buffer beyond used idx (INORDER-02/07)
EVENT_AHEAD = (0, 0, 1, 2, 3, 5, 8, 13, 40)   # where EVENT_IDX rounds put the event, past the next used index
CALL_WAIT = 0.25           # seconds to wait after a round for a notification still due (a busy machine delays it)

#: rows a frame is tagged with when it was sent with one of the harness's unusual (legal) encodings
ENCODINGS = {"SPLIT-V-01", "SPLIT-V-05", "SPLIT-V-07", "PACKED-V-08", "PACKED-V-10", "PACKED-V-13", "PACKED-V-14",
             "INORDER-16"}

SCENARIOS = ("start", "batches", "chains", "rx-hdr-split", "mergeable", "notify-off", "spurious-kicks")

IDS = ["FEAT-05", "GEN-01",
       "SPLIT-L-01", "SPLIT-L-02", "SPLIT-L-05", "SPLIT-L-08",
       "SPLIT-V-01", "SPLIT-V-02", "SPLIT-V-04", "SPLIT-V-05", "SPLIT-V-07", "SPLIT-V-08", "SPLIT-V-09",
       "SPLIT-V-11", "SPLIT-V-12", "SPLIT-V-13", "SPLIT-V-15",
       "EVT-04", "EVT-05", "EVT-06", "EVT-07", "EVT-15", "EVT-16", "EVT-17", "EVT-19", "EVT-21", "EVT-22",
       "EVT-23", "EVT-24",
       "PACKED-L-03", "PACKED-V-01", "PACKED-V-02", "PACKED-V-03", "PACKED-V-04", "PACKED-V-05", "PACKED-V-08",
       "PACKED-V-09", "PACKED-V-10", "PACKED-V-11", "PACKED-V-12", "PACKED-V-13", "PACKED-V-14",
       "PACKED-V-15", "PACKED-V-16", "PACKED-V-18",
       "INORDER-02", "INORDER-07", "INORDER-08", "INORDER-10", "INORDER-13", "INORDER-15", "INORDER-16",
       "MEM-07",
       "NET-02", "NET-03", "NET-17", "NET-18", "NET-21", "NET-27", "NET-28", "NET-29", "NET-30", "NET-31", "NET-33",
       "NET-34", "NET-35"]

# rows that only one ring format can exercise (SPLIT-V-01, message framing, holds for both)
SPLIT_ONLY = {i for i in IDS if i.startswith("SPLIT-") and i != "SPLIT-V-01"} | {
    "EVT-04", "EVT-05", "EVT-06", "EVT-07", "EVT-15", "EVT-16", "INORDER-07", "INORDER-08"}
PACKED_ONLY = {i for i in IDS if i.startswith("PACKED-")} | {"EVT-19", "EVT-21", "EVT-22", "EVT-23", "EVT-24",
                                                            "MEM-07", "INORDER-13"}


def _brief(ids, k=8):
    return ", ".join(map(str, ids[:k])) + (" ..." if len(ids) > k else "")


class Stalled(VringError):
    """The backend stopped using buffers it was given (no progress within the stall time)."""


class Broken(VringError):
    """A device behaviour left a queue in a state the harness cannot continue from (already reported)."""


@dataclass
class DeviceOptions:
    socket: str
    packed: bool = False
    in_order: bool = True
    mrg_rxbuf: bool = False
    event_idx: bool = False
    indirect: bool = True          # use VIRTIO_F_INDIRECT_DESC when the backend offers it
    ring_size: int = 256
    timeout: float = 5.0           # seconds for each vhost-user reply
    stall: float = 5.0             # seconds without progress on a queue before giving up
    rx_wait: float = 1.0           # seconds to wait for a frame to come back
    base: int | None = None        # split: first ring index (default: 1.5 rings before the 16-bit wrap)
    layout: str = "spread"         # "spread": areas apart, reverse order, minimum alignment; "contiguous"
    scenarios: tuple = SCENARIOS
    seed: int = 1

    def __post_init__(self):
        QueueLayout.bytes_needed("packed" if self.packed else "split", self.ring_size)   # checks the size
        check_seconds(timeout=self.timeout, stall=self.stall, rx_wait=self.rx_wait)
        if self.layout not in ("spread", "contiguous"):
            raise ConfigError(f"layout must be spread or contiguous, not {self.layout!r}")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad:
            raise ConfigError(f"unknown scenario(s) {bad}; known: {', '.join(SCENARIOS)}")
        if self.base is not None and not 0 <= self.base <= 0xFFFF:
            raise ConfigError(f"base must be 0..65535, not {self.base}")


@dataclass
class Buf:
    """One buffer the harness made available, as its model knows it."""

    id: int
    token: int
    chain: object                 # ringview.Chain as written (before publishing)
    wlen: int
    order: int                    # position in avail order (free-running)
    seq: int | None = None        # Tx: the frame's sequence number
    image: bytes | None = None    # Tx: the token slot as written (readable data + canaries)
    seg_offs: list = field(default_factory=list)   # offsets of the segments in the token slot
    tags: set = field(default_factory=set)         # checklist IDs this buffer exercises (credited on return)
    planted_ids: set = field(default_factory=set)  # packed: garbage ids written in non-last descriptors


class GuestRegion:
    """The one shared-memory region the backend maps (gpa == uaddr, as virtio_user does)."""

    def __init__(self, size):
        self.shm = ShmRegion.create(size, prefix="vring-conform")
        self.shm.unlink()   # the backend gets the fd; nothing is left in /dev/shm whatever happens
        self.gpa = GPA_BASE
        self.size = size
        self.table = MemoryTable([(GPA_BASE, size, self.shm.buf)])
        self.u8 = np.frombuffer(self.shm.buf, np.uint8)

    def fileno(self):
        return self.shm.fileno()

    def at(self, gpa, n):
        off = gpa - GPA_BASE
        return self.u8[off:off + n]

    def close(self):
        self.u8 = None
        self.table = None
        self.shm.close()


class Queue:
    """One vring driven by a DriverQueue, with the harness's model of what is in flight and the checks of what
    the device wrote. ``index``: RX (0) or TX (1)."""

    def __init__(self, h, index, layout, indirect, token_base, base):
        self.h, self.index, self.layout = h, index, layout
        self.name = "rx" if index == RX else "tx"
        self.packed = layout.packed
        self.size = n = layout.size
        self.r = h.report
        self.dq = DriverQueue(h.mem.table, layout, h.features, indirect=indirect)
        self.view = view_for(h.mem.table, layout)
        self.indirect_area = (indirect[0], n * indirect[1] * 16) if indirect else None
        self.token_base = token_base
        self.slots = h.mem.at(token_base, n * SLOT).reshape(n, SLOT)
        self.free_tokens = deque(range(n))
        self.inflight: dict[int, Buf] = {}
        self.fifo: deque[int] = deque()      # ids in avail order
        self.order = 0
        self.max_used_order = -1             # the latest (in avail order) buffer used so far
        self.round_used = 0                  # used buffers seen since the last notification check
        self.round_calls = 0                 # notifications read while the round ran (before its final check)
        self.call_seen_at = 0                # round_used when the latest of them was read (EVT-05/EVT-24 order)
        self.callfd = h.fe.callfds[index]
        self.kickfd = h.fe.kickfds[index]
        self.unpublished: list[Buf] = []
        if self.packed:
            self.avail_pos, self.avail_wrap = 0, 1
            self.used_pos, self.used_wrap = 0, 1
            self.shadow = self.view.desc_bytes.reshape(n, 16).copy()
            self.slot_kind = ["free"] * n      # free | inflight | used (a used descriptor consumed) | skipped
        else:
            self.dq.c.next_avail = self.dq.c.last_used = base
            self.avail_ctr = base               # avail idx as the harness last published it
            self.used_ctr = base                # the harness's own used index (free-running)
            self.consumed = []                  # used slots read since the last reclaim
            self.garbage_heads = {}             # head planted beyond avail idx -> its avail position (SPLIT-V-13)
            self.len_never_set = False          # a used len never came (SPLIT-V-08): wait for no other
        self.take_shadows()

    # -- shadows: what the device may not change -------------------------------------------------------------

    def take_shadows(self):
        """The copies start as the areas are before the device runs; from then on they take only what the
        harness itself writes (``publish``, ``write_driver_area``), so any other change is the device's."""
        v = self.view
        if self.packed:
            self.drv_shadow = v.driver_bytes.copy()
        else:
            self.desc_shadow = v.desc_bytes.copy()
            self.avail_shadow = v.driver_bytes.copy()
        if self.indirect_area:
            self.ind_shadow = self.h.mem.at(*self.indirect_area).copy()

    def verify_owned(self):
        """Compare everything the device may not write with the harness's copies; report each difference. Run
        after every round and before the harness writes into those areas again (a change it wrote over would
        go unseen)."""
        v, r = self.view, self.r
        if self.indirect_area:
            now = self.h.mem.at(*self.indirect_area)
            diff = np.nonzero(now != self.ind_shadow)[0]
            rid = "PACKED-V-03" if self.packed else "SPLIT-V-04"
            if not r.check(rid, not len(diff), lambda: f"{self.name}: indirect table memory changed at byte "
                           f"{int(diff[0])} ({len(diff)} bytes): the device wrote a descriptor table"):
                self.ind_shadow = now.copy()
        if self.packed:
            ok = r.check("EVT-22", np.array_equal(v.driver_bytes, self.drv_shadow),
                         lambda: f"{self.name}: driver event suppression area changed "
                                 f"{self.drv_shadow.tobytes().hex()} -> {v.driver_bytes.tobytes().hex()}")
            if not ok:
                self.drv_shadow = v.driver_bytes.copy()
            self._verify_owned_slots()
        else:
            diff = np.nonzero(v.desc_bytes != self.desc_shadow)[0]
            if not r.check("SPLIT-V-04", not len(diff), lambda: self._desc_change(diff)):
                self.desc_shadow = v.desc_bytes.copy()
            diff = np.nonzero(v.driver_bytes != self.avail_shadow)[0]
            if not r.check("SPLIT-L-08", not len(diff), lambda: self._avail_change(diff)):
                self.avail_shadow = v.driver_bytes.copy()
            if self.garbage_heads:   # stale heads sat beyond avail idx all round; none was consumed
                r.ok("SPLIT-V-13")

    def _desc_change(self, diff):
        ids = sorted({int(d) // 16 for d in diff})
        i = ids[0]
        was = np.frombuffer(self.desc_shadow[16 * i:16 * i + 16].tobytes(), self.view.desc.dtype)[0]
        now = self.view.desc[i]
        changed = ", ".join(f"{f} {int(was[f])} -> {int(now[f])}" for f in was.dtype.names if was[f] != now[f])
        return (f"{self.name}: the device wrote descriptor table entry {i}: {changed}"
                + (f" (entries {_brief(ids[1:])} changed too)" if len(ids) > 1 else ""))

    def _avail_change(self, diff):
        n = self.size
        ks = sorted({int(d) // 2 for d in diff})
        was, now = self.avail_shadow.view("<u2"), self.view.avail
        name = lambda k: {0: "flags", 1: "idx", 2 + n: "used_event"}.get(k, f"ring[{k - 2}]")
        return (f"{self.name}: the device wrote the avail ring (driver area): "
                + ", ".join(f"{name(k)} {int(was[k]):#x} -> {int(now[k]):#x}" for k in ks[:8])
                + (f" and {len(ks) - 8} more fields" if len(ks) > 8 else ""))

    def _inflight_descs(self):
        return sum(b.chain.ndesc for b in self.inflight.values())

    def _verify_owned_slots(self):
        """Packed: slots outside [used_pos, avail_pos) belong to the driver; none may differ from the copy."""
        n = self.size
        ring = self.view.desc_bytes.reshape(n, 16)
        owned = np.ones(n, bool)
        k = self._inflight_descs()
        if k:
            idx = (self.used_pos + np.arange(k)) % n
            owned[idx] = False
        diff = np.nonzero(owned & (ring != self.shadow).any(axis=1))[0]
        if not len(diff):
            kinds = {self.slot_kind[s] for s in np.nonzero(owned)[0]}
            for kind, rid in (("free", "PACKED-V-04"), ("used", "PACKED-V-05"), ("skipped", "PACKED-V-09"),
                              ("skipped", "PACKED-V-18")):
                if kind in kinds:   # such slots sat in the ring (stale descriptors included) and stayed as they were
                    self.r.ok(rid)
            return
        for s in diff[:3]:
            s = int(s)
            kind = self.slot_kind[s]
            rid = {"used": "PACKED-V-05", "skipped": "PACKED-V-09"}.get(kind, "PACKED-V-04")
            what = {"used": "a used descriptor already consumed", "skipped": "a slot skipped inside a used list",
                    "free": "a slot not made available"}.get(kind, kind)
            flags = int.from_bytes(ring[s][14:16].tobytes(), "little")
            a, u = used_bits(flags)
            looks = (f": a used descriptor (id {int.from_bytes(ring[s][12:14].tobytes(), 'little')}, flags "
                     f"{flags:#x})" if a == u else "")
            self.r.fail(rid, f"{self.name}: slot {s} ({what}) changed{looks}: {self.shadow[s].tobytes().hex()} -> "
                             f"{ring[s].tobytes().hex()}")
            if kind == "skipped" and self.h.in_order:
                self.r.fail("INORDER-13", f"{self.name}: slot {s} inside an in-order batch was written")
                a, u = used_bits(int.from_bytes(ring[s][14:16].tobytes(), "little"))
                if a == u:
                    self.r.fail("INORDER-02", f"{self.name}: a used descriptor (id "
                                              f"{int.from_bytes(ring[s][12:14].tobytes(), 'little')}) was written "
                                              f"inside an in-order batch, after a buffer made available later")
        self.shadow[diff] = ring[diff]

    def verify_device_flags(self):
        """Packed, when the harness waited the stall time for the used descriptor at its used position: in the
        slots the device owns (the lists in flight, from the used position on) every flags word the device
        changed must be a used marking, AVAIL == USED == the device wrap counter for that slot (PACKED-V-02); with
        IN_ORDER none may be one while the used position, the first slot of the oldest buffer in flight, still
        holds the driver's descriptor: the next batch's used descriptor belongs there (INORDER-13). Checked only
        then: a device may write the two flag bytes apart, or its used descriptors out of order."""
        n, v = self.size, self.view
        untouched = True   # the used position still holds the driver's descriptor
        for j in range(self._inflight_descs()):
            s = (self.used_pos + j) % n
            flags, was = v.flags(s), int.from_bytes(self.shadow[s][14:16].tobytes(), "little")
            if flags == was:
                continue
            wrap = self.used_wrap ^ (self.used_pos + j >= n)
            a, u = used_bits(flags)
            desc = f"id {int(v.desc[s]['id'])} len {int(v.desc[s]['len'])}"
            if not a == u == wrap:
                self.r.fail("PACKED-V-02", f"{self.name}: slot {s} (the device's, wrap {wrap}) flags {was:#x} -> "
                                           f"{flags:#x} (AVAIL={a} USED={u}; {desc}) for {self.h.o.stall}s: "
                                           f"neither the driver's descriptor nor a used one")
            elif j and untouched and self.h.in_order:
                self.r.fail("INORDER-13", f"{self.name}: slot {s} holds a used descriptor ({desc}, flags "
                                          f"{flags:#x}), but slot {self.used_pos}, the next used position (where "
                                          f"buffer {self.fifo[0]}, the oldest in flight, starts), still holds the "
                                          f"driver's descriptor after {self.h.o.stall}s")
            untouched = False   # the used position moved, or one report said it did not

    # -- adding buffers ---------------------------------------------------------------------------------------

    def room(self):
        return len(self.free_tokens), self.dq.num_free

    def add(self, specs, mutate=None):
        """Add buffers. ``specs``: per buffer (segment datas or lengths, writable, seq, tags). Returns the Bufs
        added (in avail order); nothing is published yet (``publish``)."""
        self.verify_owned()   # the driver is about to write over descriptors and avail slots the device gave back
        addrs, lens, nread, nwrite, tokens, metas = [], [], [], [], [], []
        for datas, writable, seq, tags in specs:
            if not self.free_tokens:
                break
            t = self.free_tokens.popleft()
            slot = self.slots[t]
            slot[:] = self.h.pattern
            off, offs, segs = GAP, [], []
            for d in datas:
                raw = isinstance(d, (bytes, bytearray))
                n = len(d) if raw else int(d)
                if off + n + GAP > SLOT:
                    raise ConfigError(f"segments do not fit a {SLOT}-byte slot")
                if raw:
                    slot[off:off + n] = np.frombuffer(d, np.uint8)
                segs.append((self.token_base + t * SLOT + off, n))
                offs.append(off)
                off += n + GAP
            addrs += [a for a, _n in segs]
            lens += [n for _a, n in segs]
            nread.append(0 if writable else len(segs))
            nwrite.append(len(segs) if writable else 0)
            tokens.append(t)
            metas.append((t, seq, set(tags), offs, segs, None if writable else slot.tobytes()))
        if not tokens:
            return []
        start_ctr = None if self.packed else self.dq.c.next_avail
        got = self.dq.add(np.array(addrs, np.uint64), np.array(lens, np.uint32), np.array(nread, np.uint16),
                          np.array(nwrite, np.uint16), np.array(tokens, np.uint64))
        for m in reversed(metas[got:]):
            self.free_tokens.appendleft(m[0])
        bufs = []
        pending_head = int(self.dq.c.pending_head) if self.packed and self.dq.c.pending else None
        for k, (t, seq, tags, offs, segs, image) in enumerate(metas[:got]):
            if self.packed:
                head = self.avail_pos
                hf = int(self.dq.c.pending_flags) if head == pending_head else None
                chain = self.view.walk(head, head_flags=hf)
                bid = chain.ids[-1]
                self.avail_pos += chain.ndesc
                if self.avail_pos >= self.size:
                    self.avail_pos -= self.size
                    self.avail_wrap ^= 1
                    if self.avail_pos:
                        tags.add("PACKED-V-08")   # the list crosses the ring end
            else:
                bid = self.view.avail_ring((start_ctr + k) & 0xFFFF)
                chain = self.view.walk(bid)
            if bid in self.inflight or [(a, n) for a, n, _w in chain.segs] != segs:
                raise Broken(f"harness: buffer {bid} in memory {chain.segs} is not what was added {segs}")
            b = Buf(bid, t, chain, chain.wlen, self.order, seq, image, offs, tags)
            self.order += 1
            self.inflight[bid] = b
            self.fifo.append(bid)
            self.unpublished.append(b)
            bufs.append(b)
        if mutate:
            for b in bufs:
                mutate(self, b)
        return bufs

    def publish(self, kick=True):
        """Publish what was added, plant garbage beyond avail idx (split), and kick if the device asks
        (``kick=False``: not now, e.g. before DRIVER_OK). The copies take what the harness wrote, and only that:
        the descriptors and indirect tables of the new buffers (read before the device may see them), their
        avail slots, avail idx and the planted heads (the values written)."""
        n = self.size
        slots = [s for b in self.unpublished for s in b.chain.slots]
        ring = self.view.desc_bytes.reshape(n, 16)
        if self.indirect_area:
            for b in self.unpublished:
                if b.chain.table:
                    gpa, nbytes = b.chain.table
                    off = gpa - self.indirect_area[0]
                    self.ind_shadow[off:off + nbytes] = self.h.mem.at(gpa, nbytes)
        if self.packed:
            c = self.dq.c
            self.shadow[slots] = ring[slots]
            for s in slots:
                self.slot_kind[s] = "inflight"
            if c.pending:   # the head flags are still kept aside by the driver: the value they will have
                self.shadow[int(c.pending_head)][14:16] = np.frombuffer(
                    int(c.pending_flags).to_bytes(2, "little"), np.uint8)
            self.dq.publish()
        else:
            self.desc_shadow.reshape(n, 16)[slots] = ring[slots]
            avail = self.avail_shadow.view("<u2")
            for k, b in enumerate(self.unpublished):
                avail[2 + (self.avail_ctr + k) % n] = b.id
            self.dq.publish()
            self.avail_ctr = avail[1] = int(self.dq.c.next_avail)
            self._plant_garbage()
        self.unpublished = []
        if kick:
            self.kick()

    def write_driver_area(self, fields):
        """Write 16-bit fields of the driver area (``{index: value}``; split: the avail ring's u16 array, packed:
        off_wrap, flags); the copy takes the same values."""
        area = self.view.driver_event if self.packed else self.view.avail
        shadow = (self.drv_shadow if self.packed else self.avail_shadow).view("<u2")
        for i, value in fields.items():
            area[i] = shadow[i] = value

    def kick(self):
        if self.dq.kick_prepare():
            os.eventfd_write(self.kickfd, 1)
            self.h.kicks[self.index] += 1

    def _plant_garbage(self):
        """SPLIT-V-13: avail slots beyond avail idx hold heads of free descriptors (stale chains)."""
        self.garbage_heads, slots = {}, {}
        free = [i for i in range(self.size) if i not in self.inflight]
        nxt = self.dq.c.next_avail
        for k in range(min(len(free), 8, self.size - len(self.inflight))):
            pos = (nxt + k) & 0xFFFF
            head = self.h.rng.choice(free)
            slots[2 + pos % self.size] = head
            self.garbage_heads[head] = pos
        self.write_driver_area(slots)

    # -- used side --------------------------------------------------------------------------------------------

    def scan(self):
        """Read what the device used since the last scan, check it, recycle it. Returns the completions as
        (Buf, len, skipped) in used order."""
        out = self._scan_packed() if self.packed else self._scan_split()
        if out:
            self._recycle(out)
        return out

    def _check_used_flags_split(self):
        f = self.view.used_flags
        if self.h.event_idx:
            self.r.check("EVT-16", f == 0, lambda: f"{self.name}: used flags {f:#x} with EVENT_IDX (must be 0)")
        else:
            self.r.check("EVT-15", f in (0, 1), lambda: f"{self.name}: used flags {f:#x} (must be 0 or 1)")

    def _scan_split(self):
        r, n = self.r, self.size
        self._check_used_flags_split()
        used_idx = self.view.used_idx
        pending = (used_idx - self.used_ctr) & 0xFFFF
        if pending == 0:
            return []
        if pending > len(self.inflight):   # reported; the entries themselves say more (read on)
            r.fail("SPLIT-V-12", f"{self.name}: used idx moved {self.used_ctr}->{used_idx} (+{pending}) with "
                                 f"only {len(self.inflight)} buffers in flight")
        out = []
        while self.used_ctr != used_idx:
            pos = self.used_ctr
            slot = pos % n
            uid, ulen = (int(x) for x in self.view.used_raw[slot])
            left = (used_idx - pos) & 0xFFFF
            canary = (uid, ulen) == USED_CANARY   # the device wrote no entry here
            stray = self._misplaced_entry_split(pos, left) if canary and self.h.in_order else None
            if stray is not None:   # reported (INORDER-08); go on with the entry where the device put it, copied
                uid, ulen = stray[1:]   # where our driver reads it (it refuses the canary)
                self.view.used_raw[slot] = (uid, ulen)
            elif not canary:
                r.check("SPLIT-L-05", uid < 0x10000, lambda: f"{self.name}: used.ring[{slot}].id = {uid:#x}: "
                        f"high bytes not 0")
            b = self.inflight.get(uid)
            if b is None:
                planted = self.garbage_heads.get(uid)
                if planted is not None:
                    r.fail("SPLIT-V-13", f"{self.name}: used head {uid}, which the harness had written only in "
                                         f"avail slot {planted} beyond avail idx")
                r.fail("SPLIT-V-15", f"{self.name}: used.ring[{slot}] (used idx {pos}) = id {uid} len {ulen}: "
                                     + ("still the canary the harness wrote there: no entry was written before "
                                        f"used idx moved to {used_idx}" if canary else
                                        f"not a head in flight (in flight: {self._fifo_brief()})"))
                raise Broken(f"{self.name}: used id not in flight")
            r.ok("SPLIT-V-15")
            r.ok("SPLIT-V-12")
            if ulen == USED_CANARY[1]:   # no len is that long: the harness's canary, the len not written yet
                ulen = self._len_set_late(slot, pos, used_idx, uid)
            if ulen > b.wlen:   # reported with the buffer (_tx_done/_rx_done); let our driver recycle it
                self.view.used_raw[slot, 1] = b.wlen
            if self.h.in_order:
                batch = self._batch_upto(uid)
                nb = len(batch)
                if nb > left:
                    older = self._used_next_split(pos, left, batch[:-1])
                    if older is not None:
                        r.fail("INORDER-02", f"{self.name}: entry at used idx {pos} names buffer {uid}, the {nb}th in "
                                             f"avail order, and the next one names buffer {older}, made available "
                                             f"before it: buffers used out of order")
                    else:
                        r.fail("INORDER-07", f"{self.name}: entry at used idx {pos} names buffer {uid}, the {nb}th "
                                             f"in avail order (a batch of {nb}), but used idx only reaches "
                                             f"{used_idx} ({left} entries)")
                    raise Broken(f"{self.name}: batch beyond used idx")
                r.ok("INORDER-02")
                r.ok("INORDER-07")
                self._check_skipped_used_slots(pos, batch, stray[0] if stray else None)
                for sb in batch[:-1]:
                    out.append((sb, sb.wlen, True))
                out.append((b, ulen, False))
                self.consumed += [(pos + k) % n for k in range(nb)]
                if stray is not None and stray[0] not in self.consumed and (stray[0] - pos) % n < left:
                    self.consumed.append(stray[0])   # inside used idx: ours to write the canary into again
                self.used_ctr = (pos + nb) & 0xFFFF
            else:
                self.fifo.remove(uid)
                del self.inflight[uid]
                r.ok("INORDER-15")
                out.append((b, ulen, False))
                self.consumed.append(slot)
                self.used_ctr = (pos + 1) & 0xFFFF
        return out

    def _used_next_split(self, pos, left, older):
        """An entry at used idx ``pos`` names a buffer later in avail order than used idx covers: a batch whose
        used idx fell short (INORDER-07), or the first of buffers used out of order (INORDER-02). Which one the
        entry after it tells, once published: waits a little for it; returns the id it names if that is one of
        ``older`` (made available before the first entry's buffer), else None."""
        deadline = time.monotonic() + OOO_WAIT
        while ((self.view.used_idx - pos) & 0xFFFF) < 2:   # the entry after it published
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0002)
        nxt = int(self.view.used_raw[(pos + 1) % self.size][0])
        return nxt if any(b.id == nxt for b in older) else None

    def _len_set_late(self, slot, pos, used_idx, uid):
        """SPLIT-V-08: used.ring[slot] names buffer ``uid`` but its len still holds the canary the harness wrote
        there, though used idx already covers the slot. Waits a little for the len, so the buffer is judged by
        the len the device gives it (one never set stays the canary and fails with the buffer too)."""
        t0 = time.monotonic()
        ulen, waits = USED_CANARY[1], not self.len_never_set
        while ulen == USED_CANARY[1] and waits and time.monotonic() - t0 < LATE_LEN_WAIT:
            time.sleep(0.0005)
            ulen = int(self.view.used_raw[slot, 1])
        late = time.monotonic() - t0
        if ulen != USED_CANARY[1]:
            then = f"it became {ulen} {late * 1000:.1f} ms later"
        else:
            self.len_never_set = True
            then = f"still not set {late:.2f} s later" if waits else "not waited for: an earlier len never came"
        self.r.fail("SPLIT-V-08", f"{self.name}: used.ring[{slot}] (used idx {pos}) names buffer {uid} with len "
                                  f"{USED_CANARY[1]:#x}, the canary the harness wrote there, after used idx moved "
                                  f"to {used_idx}: the len was not set before used idx ({then})")
        return ulen

    def _fifo_brief(self):
        return _brief(list(self.fifo))

    def _batch_upto(self, uid):
        """IN_ORDER: the buffers from the oldest in flight up to ``uid`` (removed from the fifo)."""
        batch = []
        while self.fifo:
            bid = self.fifo.popleft()
            batch.append(self.inflight.pop(bid))
            if bid == uid:
                if len(batch) > 1:
                    self.h.batched[self.index] += 1
                return batch
        raise Broken("harness: in-order batch walk ran past the fifo")

    def _misplaced_entry_split(self, pos, left):
        """IN_ORDER: used.ring at used idx ``pos`` still holds the canary, though used idx moved ``left`` past it.
        Looks for the entry in the next slots (as far as buffers are in flight, within used idx or beyond it);
        reports INORDER-08 and returns (slot, id, len) of the entry found, or None."""
        n, fifo = self.size, list(self.fifo)
        slot = pos % n
        for j in range(1, min(len(fifo), n)):
            s = (pos + j) % n
            got = tuple(int(x) for x in self.view.used_raw[s])
            if got == USED_CANARY or got[0] not in self.inflight:
                continue
            uid, ulen = got
            if uid == fifo[j]:
                what = (f"the entry for the batch of {j + 1} buffers ({fifo[0]}..{uid}) was written at "
                        f"used.ring[{s}] (used idx {(pos + j) & 0xFFFF}), the batch's last slot, not its first")
            else:
                what = f"the entry id {uid} len {ulen} was written at used.ring[{s}] (used idx {(pos + j) & 0xFFFF})"
            self.r.fail("INORDER-08", f"{self.name}: used.ring[{slot}] (used idx {pos}) still holds the canary the "
                                      f"harness wrote there after used idx moved {left} past it; {what}")
            return s, uid, ulen
        return None

    def _check_skipped_used_slots(self, pos, batch, reported=None):
        """INORDER-08: the used slots inside a batch keep the canary the harness wrote after the last lap
        (``reported``: a slot already blamed for holding the batch's misplaced entry)."""
        n = self.size
        for k in range(1, len(batch)):
            slot = (pos + k) % n
            if slot == reported:
                continue
            got = tuple(int(x) for x in self.view.used_raw[slot])
            if got != USED_CANARY:
                self.r.fail("INORDER-08", f"{self.name}: used.ring[{slot}] inside the batch at used idx {pos} "
                                          f"({len(batch)} buffers) was written: id {got[0]} len {got[1]}")
                names = [b for b in batch[:-1] if b.id == got[0]]
                if names:
                    self.r.fail("INORDER-02", f"{self.name}: buffer {got[0]} was used after buffer {batch[-1].id}"
                                              f", which was made available after it (entries {pos} and "
                                              f"{pos + k})")
            else:
                self.r.ok("INORDER-08")

    def _scan_packed(self):
        r, n, v = self.r, self.size, self.view
        self._check_event_area()
        out = []
        while self.inflight:
            s = self.used_pos
            flags = v.flags(s)
            a, u = used_bits(flags)
            if not (a == u == self.used_wrap):
                if flags != int.from_bytes(self.shadow[s][14:16].tobytes(), "little") and a == u:
                    r.fail("PACKED-V-02", f"{self.name}: slot {s} flags {flags:#x}: AVAIL=USED={a}, but the "
                                          f"device wrap counter is {self.used_wrap}")
                    raise Broken(f"{self.name}: used descriptor with the wrong wrap")
                break
            d = v.desc[s]
            uid, ulen = int(d["id"]), int(d["len"])
            r.ok("PACKED-V-02")
            if self.used_wrap == 0:
                r.ok("PACKED-V-01")
            b = self.inflight.get(uid)
            if b is None:
                if uid in self.garbage_ids():
                    r.fail("PACKED-V-10", f"{self.name}: used id {uid} at slot {s} is a garbage id the harness "
                                          f"wrote in a non-last descriptor")
                stale = self.slot_kind[s] != "inflight"
                r.fail("PACKED-V-18" if stale else "PACKED-V-11",
                       f"{self.name}: used descriptor at slot {s} (wrap {self.used_wrap}) names id {uid}, not a "
                       f"buffer in flight (in flight: {self._fifo_brief()})")
                raise Broken(f"{self.name}: used id not in flight")
            r.ok("PACKED-V-11")
            if self.h.in_order:
                oldest = self.inflight[self.fifo[0]]
                if not r.check("INORDER-13", oldest.chain.head == s, lambda: f"{self.name}: used descriptor at slot "
                               f"{s}, but the oldest buffer in flight starts at slot {oldest.chain.head}"):
                    raise Broken(f"{self.name}: in-order used position")
                batch = self._batch_upto(uid)
                r.ok("INORDER-02")
            else:
                self.fifo.remove(uid)
                del self.inflight[uid]
                r.ok("INORDER-15")
                batch = [b]
            if b.wlen and ulen:
                r.check("PACKED-V-12", flags & VIRTQ_DESC_F_WRITE, lambda: f"{self.name}: used descriptor for Rx "
                        f"buffer {uid} (len {ulen}) without the WRITE flag ({flags:#x})")
            elif not b.wlen:
                was = int.from_bytes(self.shadow[s][14:16].tobytes(), "little")
                if not r.check("PACKED-V-12", not flags & VIRTQ_DESC_F_WRITE, lambda: f"{self.name}: used descriptor "
                               f"for Tx buffer {uid} has the WRITE flag ({flags:#x}): nothing was written (the "
                               f"driver's descriptor in that slot had flags {was:#x})"):
                    if was & VIRTQ_DESC_F_INDIRECT and was & VIRTQ_DESC_F_WRITE:
                        r.fail("PACKED-V-14", f"{self.name}: the reserved WRITE bit of the INDIRECT descriptor "
                                              f"(flags {was:#x}) came back as WRITE in the used descriptor "
                                              f"({flags:#x}) with len {ulen}: not ignored")
            adv = sum(x.chain.ndesc for x in batch)
            if ulen > b.wlen or (flags & VIRTQ_DESC_F_WRITE and not b.wlen):
                # reported above or with the buffer; the descriptor is ours again: make it one our driver
                # recycles (it refuses a used length beyond the writable part, as a strict driver does)
                v.desc[s]["len"] = min(ulen, b.wlen)
                if not b.wlen:
                    v.desc[s]["flags"] = flags & ~VIRTQ_DESC_F_WRITE
            self.shadow[s] = v.desc_bytes.reshape(n, 16)[s]
            self.slot_kind[s] = "used"
            for k in range(1, adv):
                self.slot_kind[(s + k) % n] = "skipped"
            for sb in batch[:-1]:
                out.append((sb, sb.wlen, True))
            out.append((b, ulen, False))
            if any(x.chain.table for x in batch):
                r.ok("PACKED-V-15")
            self.used_pos += adv
            if self.used_pos >= n:
                self.used_pos -= n
                self.used_wrap ^= 1
        return out

    def garbage_ids(self):
        return set().union(*(b.planted_ids for b in self.inflight.values())) if self.inflight else set()

    def _check_event_area(self):
        f = int(self.view.device_event[1])
        self.r.check("EVT-19", not f & ~3, lambda: f"{self.name}: device event flags {f:#x}: reserved bits set")
        self.r.check("EVT-21", (f & 3) != 3 and ((f & 3) != RING_EVENT_FLAGS_DESC or self.h.event_idx),
                     lambda: f"{self.name}: device event flags {f:#x}" + (" (DESC without EVENT_IDX)" if f & 3 == 2
                                                                          else " (reserved value 3)"))

    def _recycle(self, out):
        """Give the used buffers back to the DriverQueue (it reclaims exactly what was checked)."""
        self.max_used_order = max(self.max_used_order, max(b.order for b, _l, _s in out))
        try:
            tokens, _lens = self.dq.reclaim(len(out))
        except RingError as e:
            raise Broken(f"{self.name}: our driver refused the used ring: {type(e).__name__}: {e}") from None
        got = [int(t) for t in tokens]
        want = [b.token for b, _l, _s in out]
        if got != want:
            raise Broken(f"harness: reclaim returned tokens {got[:8]}, the oracle {want[:8]}")
        if not self.packed:   # INORDER-08: consumed used elements get the canary (never idx or flags)
            self.view.used_raw[self.consumed] = USED_CANARY
            self.consumed = []
        self.free_tokens.extend(got)
        self.round_used += len(out)

    # -- notifications ----------------------------------------------------------------------------------------

    def calls(self):
        return vu.eventfd_take(self.callfd)


class DeviceHarness:
    """One run of `vring conform device`. ``run()`` returns the Report."""

    def __init__(self, opts: DeviceOptions):
        self.o = opts
        self.rng = random.Random(opts.seed)
        self.event_rng = random.Random(opts.seed ^ 0xE7)   # used_event placements (apart: the rest keeps its draws)
        self.run_id = (os.getpid() << 8 ^ int(time.time())) & 0xFFFFFFFF
        self.report = Report("device", IDS)
        self.fe = None
        self.mem = None
        self.q = [None, None]
        self.seq = 0
        self.sent: dict[int, tuple] = {}          # seq -> (frame, tags, tx layout)
        self.sent_len: dict[int, int] = {}        # seq -> frame length (kept after the frame came back)
        self.received: set[int] = set()
        self.foreign = 0
        self.damaged = 0                           # frames of this run back damaged beyond telling which one
        self.loops = None                          # does the backend bring frames back? (None: not known yet)
        self.kicks = [0, 0]
        self.batched = [0, 0]
        self.call_mode = None
        self.rx_mode = "one"
        self.partial = None                        # a packet whose buffers are not all visible yet
        self.hold_rx = False                       # no Rx refill (switching to another kind of Rx buffer)
        self.pattern = np.frombuffer(random.Random(opts.seed ^ 0x5A5A).randbytes(SLOT), np.uint8)

    # -- setup ------------------------------------------------------------------------------------------------

    @property
    def in_order(self):
        return has(self.features, VIRTIO_F_IN_ORDER)

    @property
    def event_idx(self):
        return has(self.features, VIRTIO_F_EVENT_IDX)

    @property
    def mrg(self):
        return has(self.features, VIRTIO_NET_F_MRG_RXBUF)

    def _layouts(self):
        o, n = self.o, self.o.ring_size
        fmt = "packed" if o.packed else "split"
        dsz, drv, dev = area_sizes(fmt, n)
        lay, off = [], 0
        for _ in range(2):
            if o.layout == "contiguous":
                lay.append(QueueLayout.contiguous(fmt, n, GPA_BASE + off))
                off = align_up(off + QueueLayout.bytes_needed(fmt, n), PAGE)
                continue
            # SPLIT-L-01/02, EVT-20: device area first, then the driver area, then the descriptors, each at
            # the least alignment the spec allows (used 4 mod 8, avail 2 mod 4, packed events 4 mod 8)
            dev_at = GPA_BASE + off + 4
            drv_at = align_up(dev_at + dev, PAGE) + (4 if o.packed else 2)
            desc_at = align_up(drv_at + drv, PAGE)
            lay.append(QueueLayout(fmt, n, desc_at, drv_at, dev_at))
            off = align_up(desc_at + dsz, PAGE) - GPA_BASE
        return lay, off

    def _connect(self):
        o = self.o
        self.fe = VhostUserFrontend(o.socket, timeout=o.timeout)
        self.fe.connect()
        want = want_features(VERSION_1=True, RING_PACKED=o.packed, IN_ORDER=o.in_order, MRG_RXBUF=o.mrg_rxbuf,
                             EVENT_IDX=o.event_idx, INDIRECT_DESC=o.indirect)
        required = want & ~bit(VIRTIO_F_INDIRECT_DESC)
        self.features = self.fe.negotiate(want, required=required)
        self.report.check("FEAT-05", has(self.fe.offered, VIRTIO_F_VERSION_1),
                          f"offered features {self.fe.offered:#x} lack VERSION_1")
        self.report.context.update(
            peer=o.socket, ring=f"{'packed' if o.packed else 'split'}, {o.ring_size} entries, {o.layout} layout",
            offered=f"{self.fe.offered:#x}",
            negotiated=" ".join(n for n in feature_names(self.features) if n != "PROTOCOL_FEATURES"))

    def _setup_memory(self):
        n = self.o.ring_size
        layouts, off = self._layouts()
        self.ind_gpa = GPA_BASE + off
        off = align_up(off + n * INDIRECT_MAX * 16, PAGE)
        self.tok_gpa = [GPA_BASE + off, GPA_BASE + off + n * SLOT]
        off += 2 * n * SLOT
        self.mem = GuestRegion(off)
        self.layouts = layouts
        self._fill_gaps()
        if not self.o.packed:
            base = self.o.base if self.o.base is not None else (0x10000 - n * 3 // 2) & 0xFFFF
            for lay in layouts:     # avail idx and used idx start at the base we announce
                self.mem.at(lay.driver + 2, 2)[:] = np.frombuffer(base.to_bytes(2, "little"), np.uint8)
                self.mem.at(lay.device + 2, 2)[:] = np.frombuffer(base.to_bytes(2, "little"), np.uint8)
                used = np.frombuffer(self.mem.table.view(lay.device + 4, 8 * n), "<u4").reshape(n, 2)
                used[:] = USED_CANARY
            self.base = base
            self.report.context["base"] = f"split ring indices start at {base}"
        else:
            self.base = 0
        self.report.context["layout"] = "; ".join(
            f"vring {i}: desc {lay.desc:#x} driver {lay.driver:#x} device {lay.device:#x}"
            for i, lay in enumerate(layouts))

    def _fill_gaps(self):
        """SPLIT-L-02 / PACKED-L-03: the device is given the ring areas at their sizes (split used ring 6+8*QS,
        avail ring 6+2*QS, descriptors 16*QS; packed descriptors 16*QS, event areas 4) and nothing around them.
        The memory between and after them up to the buffer slots (alignment gaps, page tails) gets a canary,
        checked after every round (``_verify_gaps``)."""
        names = (("descriptor ring", "driver event suppression area", "device event suppression area")
                 if self.o.packed else ("descriptor table", "avail ring", "used ring"))
        areas = [(at, size, f"vring {i}'s {name}") for i, lay in enumerate(self.layouts)
                 for name, at, size in zip(names, (lay.desc, lay.driver, lay.device), area_sizes(lay.fmt, lay.size))]
        if has(self.features, VIRTIO_F_INDIRECT_DESC):
            areas.append((self.ind_gpa, self.o.ring_size * INDIRECT_MAX * 16, "the Tx indirect tables"))
        self.gaps = []   # (gpa, canary, the area before it or None, the area after it)
        pos, before = GPA_BASE, None
        for area in sorted(areas) + [(self.tok_gpa[0], 0, None)]:
            at, size, _what = area
            if at > pos:
                canary = np.resize(self.pattern, at - pos)
                self.mem.at(pos, at - pos)[:] = canary
                self.gaps.append((pos, canary, before, area))
            pos, before = at + size, area

    def _verify_gaps(self):
        rid = "PACKED-L-03" if self.o.packed else "SPLIT-L-02"
        for gpa, canary, before, after in self.gaps:
            now = self.mem.at(gpa, len(canary))
            diff = np.nonzero(now != canary)[0]
            if not len(diff):
                self.report.ok(rid)
                continue
            a, b = int(diff[0]), int(diff[-1]) + 1
            if before is not None:
                where = (f"{f'{a} bytes' if a else 'just'} past the end of {before[2]} ({before[0]:#x}, "
                         f"{before[1]} bytes)")
            else:
                where = f"{after[0] - gpa - a} bytes before {after[2]} ({after[0]:#x})"
            self.report.fail(rid, f"bytes {gpa + a:#x}..{gpa + b - 1:#x} changed ({len(diff)} bytes, "
                                  f"{canary[a:b][:8].tobytes().hex()} -> {now[a:b][:8].tobytes().hex()}"
                                  f"{' ...' if b - a > 8 else ''}), {where}: the device wrote memory outside "
                                  f"every ring area it was given")
            canary[:] = now   # each change reported once

    def _start(self):
        """SET_MEM_TABLE, the vrings (with our base), enable; the GEN-01 window; DRIVER_OK."""
        fe = self.fe
        fe.set_mem_table(self.mem)
        for i, lay in enumerate(self.layouts):
            fe.call(R.SET_VRING_NUM, vu.VringState(i, lay.size).pack())
            fe.call(R.SET_VRING_BASE, vu.VringState(i, 0x8000 if lay.packed else self.base).pack())
            fe.call(R.SET_VRING_ADDR, vu.VringAddr(i, 0, desc=lay.desc, used=lay.device, avail=lay.driver).pack())
            fe.kickfds[i] = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            fe.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), fds=[fe.kickfds[i]])
        if has(self.features, VHOST_USER_F_PROTOCOL_FEATURES):
            for i in range(2):
                fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
        fe.started = True
        ind = (self.ind_gpa, INDIRECT_MAX) if has(self.features, VIRTIO_F_INDIRECT_DESC) else None
        self.q = [Queue(self, RX, self.layouts[RX], None, self.tok_gpa[RX], self.base),
                  Queue(self, TX, self.layouts[TX], ind, self.tok_gpa[TX], self.base)]
        for q in self.q:
            self._set_calls(q, "on")
        self._refill_rx()
        early = []
        if fe.has_status and "start" in self.o.scenarios:
            early = self._send([self._tx_spec(self.rng.randint(60, 1514), 1) for _ in range(4)], kick=False)
            time.sleep(0.25)
            self._gen01_check(early)
        if fe.has_status:
            fe.call(R.SET_STATUS, vu.pack_u64(ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK), ack=fe.reply_ack)
            fe.status |= DRIVER_OK
            for q in self.q:
                q.kick()
        else:
            self.report.set_note("GEN-01", "STATUS not negotiated: DRIVER_OK is not visible to the backend")
        return early

    def _gen01_check(self, early):
        r = self.report
        tx, rx = self.q[TX], self.q[RX]
        if tx.packed:   # no used index: the head of every buffer made available (Tx and Rx) must be as written
            touched = [f"{q.name} slot {b.chain.head}" for q, bufs in ((tx, early), (rx, list(rx.inflight.values())))
                       for b in bufs
                       if q.view.flags(b.chain.head) != int.from_bytes(q.shadow[b.chain.head][14:16].tobytes(),
                                                                        "little")]
            ok = not touched
            moved = f"descriptors marked used ({', '.join(touched[:4])})"
        else:
            ok = tx.view.used_idx == tx.used_ctr and rx.view.used_idx == rx.used_ctr
            moved = f"used idx moved to {tx.view.used_idx} (tx) / {rx.view.used_idx} (rx)"
        calls = tx.calls() + rx.calls()
        r.check("GEN-01", ok and not calls, lambda: f"before DRIVER_OK: {moved if not ok else ''}"
                f"{' and ' if not ok and calls else ''}{f'{calls} used buffer notifications' if calls else ''}")

    # -- traffic ----------------------------------------------------------------------------------------------

    def _tx_spec(self, size, nseg, tags=(), garbage_hdr=False):
        """(segment datas, writable, seq, tags) for one frame cut into ``nseg`` pieces."""
        self.seq += 1
        frame = frames.make_frame(size, self.run_id, self.seq)
        if garbage_hdr:   # NET-17/NET-18: fields the device must not use without NEEDS_CSUM / GUEST_HDRLEN
            hdr = frames.net_hdr(hdr_len=self.rng.randrange(1 << 16), gso_size=self.rng.randrange(1 << 16),
                                 csum_start=self.rng.randrange(1 << 16), csum_offset=self.rng.randrange(1 << 16))
            tags = set(tags) | {"NET-17", "NET-18"}
        else:
            hdr = frames.net_hdr()
        data = hdr[:self.hdr] + frame
        cuts = sorted(self.rng.sample(range(1, len(data)), nseg - 1)) if nseg > 1 else []
        if nseg > 1 and self.rng.random() < 0.5:   # SPLIT-V-01: a cut inside the header, between two fields
            cuts[0] = self.rng.choice([1, 2, 3, 5, 7, 9, 11])
            cuts = sorted(set(cuts))
        tags = set(tags) | {"NET-21"} | ({"SPLIT-V-01"} if nseg > 1 else set())
        pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        self.sent[self.seq] = (frame, tags, f"{len(pieces)} segments")
        self.sent_len[self.seq] = len(frame)
        return pieces, False, self.seq, tags

    def _send(self, specs, mutate=None, kick=True):
        tx = self.q[TX]
        bufs = tx.add(specs, mutate)
        for spec in specs[len(bufs):]:   # did not fit: forget them
            self.sent.pop(spec[2], None)
            self.sent_len.pop(spec[2], None)
        if bufs:
            if self.in_order and len({b.chain.ndesc for b in bufs}) > 1:
                for b in bufs:
                    b.tags.add("INORDER-16")
            for b in bufs:
                self.sent[b.seq][1].update(b.tags)
            tx.publish(kick)
        return bufs

    def _rx_sizes(self):
        if self.rx_mode == "hdr-split":
            return [self.hdr, RX_BUF - self.hdr]
        if self.rx_mode == "small":
            return [self.rng.randint(128, 320)]
        return [RX_BUF]

    def _refill_rx(self):
        rx = self.q[RX]
        if self.hold_rx:
            return
        specs = []
        while len(specs) < len(rx.free_tokens):
            sizes = self._rx_sizes()
            if len(specs) * len(sizes) + len(sizes) > rx.dq.num_free:
                break
            specs.append((sizes, True, None, ()))
        if specs:
            rx.add(specs)
            rx.publish()

    def _rx_capacity(self):
        """Frames the posted Rx buffers can hold for sure."""
        rx = self.q[RX]
        if not rx.inflight:
            return 0
        if self.rx_mode == "small":
            smallest = min(b.wlen for b in rx.inflight.values())
            return len(rx.inflight) // -(-(frames.MAX_FRAME + self.hdr) // smallest)
        return len(rx.inflight)

    # -- checks of what came back -----------------------------------------------------------------------------

    def _tx_done(self, b, length, skipped):
        r, tx = self.report, self.q[TX]
        if not tx.packed and not skipped:   # packed: the len of a used descriptor without WRITE is reserved
            if not r.check("SPLIT-V-11", length == 0, lambda: f"tx: used len {length} for Tx buffer {b.id} "
                           f"(nothing is written into a Tx buffer: 0)"):
                r.fail("NET-21", f"tx: used len {length} for Tx buffer {b.id} of {b.chain.rlen} readable bytes: "
                                 f"a transmitted packet's used len is 0")
        now = tx.slots[b.token].tobytes()
        if now != b.image:
            i = next(k for k in range(SLOT) if now[k] != b.image[k])
            inside = any(o <= i < o + n for o, (_a, n, _w) in zip(b.seg_offs, b.chain.segs))
            r.fail("PACKED-V-03" if tx.packed else "SPLIT-V-02",
                   f"tx: buffer {b.id}: byte {i} of its slot changed ({b.image[i]:#04x} -> {now[i]:#04x}), "
                   + ("inside a device-readable segment" if inside else "outside every segment (canary)"))
        else:
            r.ok("PACKED-V-03" if tx.packed else "SPLIT-V-02")

    def _rx_guards_ok(self, b):
        rx = self.q[RX]
        slot = rx.slots[b.token]
        mask = np.ones(SLOT, bool)
        for o, (_a, n, _w) in zip(b.seg_offs, b.chain.segs):
            mask[o:o + n] = False
        diff = np.nonzero(mask & (slot != self.pattern))[0]
        rid = "PACKED-V-03" if rx.packed else "SPLIT-V-02"
        return self.report.check(rid, not len(diff), lambda: f"rx: buffer {b.id}: byte {int(diff[0])} of its slot "
                                 f"changed outside every writable segment (canary {int(self.pattern[diff[0]]):#04x}"
                                 f" -> {int(slot[diff[0]]):#04x})")

    def _rx_bytes(self, b, length):
        """The first ``length`` bytes of an Rx buffer, across its segments."""
        rx = self.q[RX]
        slot = rx.slots[b.token]
        out, left = bytearray(), length
        for o, (_a, n, _w) in zip(b.seg_offs, b.chain.segs):
            k = min(n, left)
            out += slot[o:o + k].tobytes()
            left -= k
            if not left:
                break
        return bytes(out)

    def _canary_bytes(self, b, length):
        """What the first ``length`` bytes of the buffer held before the device wrote (the canary)."""
        out, left = bytearray(), length
        for o, (_a, n, _w) in zip(b.seg_offs, b.chain.segs):
            k = min(n, left)
            out += self.pattern[o:o + k].tobytes()
            left -= k
        return bytes(out)

    def _rx_done(self, comps):
        """Used Rx buffers, in used order -> packets; check every header and frame."""
        r, rx = self.report, self.q[RX]
        len_id = "PACKED-V-12" if rx.packed else "SPLIT-V-11"
        data_id = "MEM-07" if rx.packed else "SPLIT-V-09"
        for b, ln, sk in comps:
            self._rx_guards_ok(b)
            if ln > b.wlen:
                r.fail(len_id, f"rx: used len {ln} for buffer {b.id} of {b.wlen} writable bytes")
        items = list(comps)
        if self.partial:
            items = self.partial + items
            self.partial = None
        i = 0
        while i < len(items):
            b, ln, sk = items[i]
            if sk and self._rx_bytes(b, b.wlen) == self._canary_bytes(b, b.wlen):
                entry = next((x.id for x, _l, s in items[i + 1:] if not s), None)
                r.fail("INORDER-10", f"rx: buffer {b.id} ({b.wlen} writable bytes) was skipped by the in-order "
                                     f"batch entry" + (f" for buffer {entry}" if entry is not None else "")
                       + ": a skipped buffer counts as used with all its bytes written, but the device wrote none "
                         "of them (still the canary the harness filled it with)")
                i += 1
                continue
            if ln < self.hdr:
                r.fail(len_id, f"rx: used len {ln} for buffer {b.id}: shorter than the {self.hdr}-byte header")
                i += 1
                continue
            first = self._rx_bytes(b, min(ln, b.wlen))
            shift, sseq = self._frame_after_header(first)
            flags, gso, _hl, _gs, _cs, _co, nb = frames.parse_net_hdr(first)
            r.check("NET-33", flags == 0, lambda: f"rx: header flags {flags:#x} without GUEST_CSUM")
            r.check("NET-34", gso == 0, lambda: f"rx: gso_type {gso:#x} without GUEST_TSO4/6, UFO, USO")
            r.check("NET-35", not flags & frames.VIRTIO_NET_HDR_F_RSC_INFO, lambda: f"rx: RSC_INFO set ({flags:#x})")
            if self.mrg:
                span = self._frame_span(items, i, sseq, shift)
                if span:   # the buffers the frame sent fills, whatever num_buffers says
                    if shift >= 0:   # (a shorter header has no num_buffers: NET-03 below)
                        r.check("NET-29", nb == span, lambda: self._num_buffers_evidence(items, i, nb, span, sseq,
                                                                                         shift))
                    nb = span
                elif shift < 0:   # a header too short to hold num_buffers (NET-03 below), the frame not all
                    nb = len(items) - i   # there: its packet is what is visible (no next packet begins in it)
                elif not r.check("NET-29", nb >= 1, f"rx: num_buffers {nb} in buffer {b.id}"):
                    nb = 1
            else:
                if shift >= 0:   # a shorter header has no num_buffers where a 12-byte one has it (NET-03 below)
                    r.check("NET-28", nb == 1, lambda: f"rx: num_buffers {nb} (bytes {first[10:12].hex()}) without "
                            f"MRG_RXBUF (must be 1)" + (" - the canary the harness filled the buffer with: not "
                                                        "written" if first[10:12] == self._canary_bytes(b, 12)[10:12]
                                                        else ""))
                nb = 1
                r.ok("NET-27")
            if i + nb > len(items):
                self.partial = items[i:]
                r.fail("NET-31", f"rx: packet in buffer {b.id} has num_buffers {nb}, only {len(items) - i} of its "
                                 f"buffers were visible as used")
                if rx.packed:
                    r.fail("PACKED-V-16", f"rx: the first buffer ({b.id}) of a {nb}-buffer packet was marked "
                                          f"used before the others")
                return
            bufs = items[i:i + nb]
            i += nb
            if nb > 1:
                r.ok("NET-31")
                if rx.packed:
                    r.ok("PACKED-V-16")
                for x, xl, _ in bufs[:-1]:
                    r.check("NET-30", xl == x.wlen, lambda: f"rx: buffer {x.id} of a {nb}-buffer packet used "
                            f"{xl} of {x.wlen} bytes (all but the last must be full)")
            packet = first + b"".join(self._rx_bytes(x, min(xl, x.wlen)) for x, xl, _ in bufs[1:])
            if shift:
                self._header_size_wrong(packet, bufs, shift, sseq)
            else:
                self._frame_back(packet[self.hdr:], bufs, (len_id,) if rx.packed else (len_id, "SPLIT-V-08"),
                                 data_id)

    def _frame_after_header(self, first):
        """(shift, seq): where the frame in a packet's first buffer starts, against the negotiated header size:
        (0, seq) when stamped at its place (seq None: not one of ours); (k, seq) when an intact stamp of this run
        sits k bytes later (k < 0: earlier), the device having written a header of hdr + k bytes. Headers of 0
        to 32 bytes (the largest layout) are looked for."""
        seq = frames.stamp_of(first[self.hdr:], self.run_id)
        if seq is not None:
            return 0, seq
        found = frames.find_stamp(first[self.hdr:], self.run_id, self.hdr, 32 - self.hdr)
        return found if found is not None and found[1] in self.sent_len else (0, None)

    def _frame_span(self, items, i, seq, shift=0):
        """MRG_RXBUF: how many of the used buffers from ``items[i]`` on frame ``seq`` (stamped in the first buffer,
        after a header of hdr + ``shift`` bytes) spans: header + frame length against the bytes the entries
        cover. None when the frame is not one of ours, or the visible entries do not hold all of it (not all
        published, or the device wrote less than the frame: judged by num_buffers and by the frame itself). A
        buffer that begins the next packet ends the span before it: used lens short of the frame are the len
        row's failure, not a reason to count the next packet's buffers in (and fail num_buffers, the next
        packet, ...), nor to fall back on a num_buffers a header of another size does not have."""
        need = self.hdr + shift + self.sent_len[seq] if seq in self.sent_len else None
        if need is None:
            return None
        have = 0
        for m, (x, xl, _s) in enumerate(items[i:], 1):
            if m > 1 and self._starts_frame(x, xl, shift):
                return m - 1
            have += min(xl, x.wlen)
            if have >= need:
                return m
        return None

    def _starts_frame(self, b, ln, shift=0):
        """Rx buffer ``b``, used with ``ln`` bytes, begins a packet: a header of hdr + ``shift`` bytes (the size
        the device writes them), then the stamp of a frame this run sent."""
        size = self.hdr + shift
        end = size + frames.STAMP_OFF + frames.STAMP.size
        return min(ln, b.wlen) >= end and frames.stamp_of(self._rx_bytes(b, end)[size:], self.run_id) in self.sent_len

    def _num_buffers_evidence(self, items, i, nb, span, seq, shift):
        bufs = items[i:i + max(span, min(nb, len(items) - i))]
        return (f"rx: num_buffers {nb} in buffer {bufs[0][0].id}, but frame {seq} ({self.hdr + shift}-byte header + "
                f"{self.sent_len[seq]} bytes) spans {span} buffer(s): used entries (id used/posted bytes) "
                + ", ".join(f"{x.id} {xl}/{x.wlen}" for x, xl, _s in bufs)
                + (f" (the entries after the first {span} belong to the next packet)" if nb > span else ""))

    def _still_canary(self, data, bufs):
        """The packet bytes ``data`` (after the header) where a stamp would be, or all of them when the packet is
        shorter, are still the canary the Rx buffers were filled with (nothing written there)."""
        canary = b"".join(self._canary_bytes(b, min(ln, b.wlen)) for b, ln, _s in bufs)[self.hdr:]
        end = frames.STAMP_OFF + frames.STAMP.size
        if len(data) >= end:
            return data[frames.STAMP_OFF:end] == canary[frames.STAMP_OFF:end]
        return len(data) >= 4 and data == canary[:len(data)]

    def _claim(self, seq):
        """Frame ``seq`` came back: (frame, tags, how it was sent), or None when it had already (reported)."""
        if seq in self.received:
            self.report.fail("PACKED-V-18" if self.q[RX].packed else "SPLIT-V-13",
                             f"rx: frame {seq} arrived twice: a Tx buffer was consumed twice")
            return None
        sent = self.sent[seq]
        self.received.add(seq)
        self.sent[seq] = (None, (), sent[2])   # keep the memory small; the seq stays known
        return sent

    def _stamp_damaged(self, data, bufs, data_id):
        """A frame of this run (the same outside its stamp) whose stamp the device changed: the data row fails.
        The frame counts as back when its sequence number survived (one not back yet, of this length)."""
        got = data[frames.STAMP_OFF:frames.STAMP_OFF + frames.STAMP.size]
        seq = frames.STAMP.unpack_from(got)[2]
        known = seq in self.sent and seq not in self.received and self.sent_len[seq] == len(data)
        if known:
            self._claim(seq)
        else:
            self.damaged += 1   # ours, though which one is lost: the backend does loop (_wait)
        self.report.fail(data_id, f"rx: buffers {[b.id for b, _l, _s in bufs]} hold a frame of this run "
                                  f"({len(data)} bytes, the same outside its stamp) whose stamp was changed to "
                                  f"{got.hex()}" + (f" (frame {seq} was sent with "
                                                    f"{frames.stamp(self.run_id, seq).hex()})" if known else "")
                                  + ": the device damaged the packet bytes")

    def _header_size_wrong(self, packet, bufs, shift, seq):
        """NET-02 / NET-03: frame ``seq`` starts ``shift`` bytes away from where the negotiated header size puts
        it: the device wrote a header of another size. The frame counts as back; its data rows are not judged."""
        size = self.hdr + shift
        sent = self._claim(seq)
        if sent is None:
            return
        frame = sent[0]
        got = packet[size:]
        layout = {10: " (the legacy layout without num_buffers: with VERSION_1 the header is 12 bytes)",
                  20: " (the HASH_REPORT layout, not negotiated)"}.get(size, "")
        self.report.fail("NET-03" if size == 10 else "NET-02",
                         f"rx: frame {seq} came back in buffers {[b.id for b, _l, _s in bufs]} with its stamp at "
                         f"offset {size + frames.STAMP_OFF} of the packet, not {self.hdr + frames.STAMP_OFF}: the "
                         f"device wrote a {size}-byte virtio-net header ({packet[:size].hex()}){layout}, the "
                         f"negotiated features give {self.hdr} bytes; the frame after it: "
                         + ("intact" if frames.same_frame(got, frame) else frames.first_difference(got, frame)))

    def _frame_back(self, data, bufs, len_ids, data_id):
        r = self.report
        seq = frames.stamp_of(data, self.run_id)
        if seq is None and self._still_canary(data, bufs):
            r.fail(data_id, f"rx: used entries for buffers {[b.id for b, _l, _s in bufs]} cover {len(data)} packet "
                            f"bytes after the header that still hold the canary the harness filled the buffers "
                            f"with: the packet was not written before the used index/flags")
            return
        if seq is None or seq not in self.sent:
            st = frames.read_stamp(data)
            if st is None and len(data) in set(self.sent_len.values()) and frames.same_but_stamp(data, self.run_id):
                self._stamp_damaged(data, bufs, data_id)
                return
            self.foreign += 1   # (an intact stamp of another run: a frame the device kept since that run)
            if seq is None and len(bufs) == 1 and any(sk for _b, _l, sk in bufs):
                r.fail("INORDER-10", f"rx: buffer {bufs[0][0].id} was skipped by an in-order batch and holds no "
                                     f"complete frame")
            return
        sent = self._claim(seq)
        if sent is None:
            return
        frame, tags, how = sent
        if any(b.chain.ndesc > 1 for b, _l, _s in bufs) and not self.q[RX].packed:   # 12-byte header descriptor
            tags = set(tags) | {"SPLIT-V-01"}
        skipped = [b.id for b, _l, sk in bufs if sk]
        if frames.same_frame(data, frame):
            r.ok(data_id)
            for rid in len_ids:
                r.ok(rid)
            for t in tags:
                r.ok(t)
            if skipped:
                r.ok("INORDER-10")
            r.ok("NET-02")
            r.ok("NET-03")
            return
        diff = frames.first_difference(data, frame)
        where = f"rx: frame {seq} (sent in {how}) came back in buffers {[b.id for b, _l, _s in bufs]}: {diff}"
        n = min(len(data), len(frame))
        last, last_len, last_skipped = bufs[-1]
        last_from = max(0, len(data) - min(last_len, last.wlen))   # where the last buffer's bytes start in data
        if len(data) != len(frame) and data[frames.CMP_FROM:n] == frame[frames.CMP_FROM:n] and not last_skipped \
                and last_from <= len(frame):
            # every byte there is the frame's and only the last buffer, whose len a used entry gives, holds too
            # many or too few: the len is wrong (what an in-order batch skipped is all frame bytes: written whole)
            if skipped:
                r.ok("INORDER-10")
            r.fail(len_ids[0], where)
        elif skipped:
            r.fail("INORDER-10", where + f"; buffers {skipped} were skipped by an in-order batch")
        elif len(data) != len(frame):
            r.fail(len_ids[0], where)
        else:
            canary = b"".join(self._canary_bytes(b, min(ln, b.wlen)) for b, ln, _s in bufs)
            i = next(k for k in range(len(frame)) if k >= frames.CMP_FROM and data[k] != frame[k])
            if data[i:i + 4] == canary[self.hdr + i:self.hdr + i + 4]:
                r.fail(data_id, where + " (still the canary: not written before the used index/flags)")
            else:   # blame the unusual encodings the frame was sent with, or else the Rx side
                encodings = sorted(set(tags) & ENCODINGS) or sorted(set(tags) & {"NET-17", "NET-18"})
                for rid in encodings or [data_id]:
                    r.fail(rid, where + (f" (sent with {', '.join(encodings)})" if encodings else ""))

    # -- rounds -----------------------------------------------------------------------------------------------

    def _set_calls(self, q, mode, low_bit=False):
        """Ask for used buffer notifications ("on") or suppress them ("off"), by the spec's means."""
        v = q.view
        q.verify_owned()   # before the harness writes over part of the driver area
        # EVENT_IDX "on": the event at the next used index / slot, or (EVT-07/EVT-23's other cases; not in EVT-06's
        # rounds, whose only question is the flags bit) inside or past what the round will use, judged at the end
        # over what it did use (a packed event slot stays within one lap)
        ahead = 0
        if self.event_idx and mode == "on" and not low_bit:
            ahead = self.event_rng.choice([j for j in EVENT_AHEAD if not q.packed or j < q.size])
        if q.packed:   # off_wrap, flags
            if mode == "on" and self.event_idx:   # DESC
                pos = q.used_pos + ahead
                q.write_driver_area({0: pos % q.size | (q.used_wrap ^ (pos >= q.size)) << 15,
                                     1: RING_EVENT_FLAGS_DESC})
            else:
                q.write_driver_area({1: RING_EVENT_FLAGS_ENABLE if mode == "on" else RING_EVENT_FLAGS_DISABLE})
        else:          # flags, used_event
            n = q.size
            if self.event_idx:   # EVT-06: the device must ignore bit 0 of flags (set on purpose in some rounds)
                q.write_driver_area({0: VIRTQ_AVAIL_F_NO_INTERRUPT if low_bit else 0,
                                     2 + n: (q.used_ctr + (ahead if mode == "on" else -1)) & 0xFFFF})
            else:                 # EVT-04: used_event holds garbage the device must ignore
                q.write_driver_area({0: 0 if mode == "on" else VIRTQ_AVAIL_F_NO_INTERRUPT,
                                     2 + n: self.rng.randrange(1 << 16)})
        q.call_state = (mode, low_bit, q.used_ctr if not q.packed else (q.used_pos, q.used_wrap),
                        ahead if q.packed else int(v.avail[2 + q.size]))

    def _check_calls(self, q, late, stray=0):
        """After a round: the calls that arrived for the used buffers it produced (``late``: read after the round's
        last used buffer was seen; ``q.round_calls``: read while the round ran; ``stray``: calls on the other
        queue's eventfd while only this one asked)."""
        r = self.report
        mode, low_bit, start, used_event = q.call_state
        if not q.round_used:
            return
        if not self.event_idx or mode != "on":
            uncrossed = False
        elif q.packed:   # used_event: the event slot's distance from the round's first used slot
            uncrossed = used_event >= _slots_moved(start, (q.used_pos, q.used_wrap), q.size)
        else:
            uncrossed = not need_event(used_event, q.used_ctr, start)
        if mode == "on" and not uncrossed:
            # without EVENT_IDX every publication asks for a notification after it (flags 0 / ENABLE): the round's
            # last one too, so the last call must come after it, not only before
            every = not self.event_idx
            if not late and (not q.round_calls or every and q.call_seen_at < q.round_used):
                deadline = time.monotonic() + CALL_WAIT
                while not late and time.monotonic() < deadline:
                    time.sleep(0.001)
                    late = q.calls()
            got = q.round_calls + late
            early = every and got and not late and q.call_seen_at < q.round_used
            if q.packed:
                rid = "EVT-23" if self.event_idx else "EVT-24"
            elif self.event_idx:
                rid = "EVT-06" if low_bit else "EVT-07"
            else:
                rid = "EVT-05"
            if rid in ("EVT-06", "EVT-07") and used_event != start:   # (the rows' old evidence when it is start)
                what = (f"{q.name}: used idx moved {start} -> {q.used_ctr}, crossing used_event {used_event} "
                        f"(vring_need_event), and no notification")
            elif rid == "EVT-23" and used_event:
                what = (f"{q.name}: used descriptors written from slot {start[0]} (wrap {start[1]}) to "
                        f"{q.used_pos} (wrap {q.used_wrap}), over the event slot {used_event} past the first, and "
                        f"no notification")
            elif early:
                what = (f"{q.name}: the last notification was read when {q.call_seen_at} of the round's "
                        f"{q.round_used} used buffers were visible, and none followed the rest: it came before the "
                        f"used {'descriptors' if q.packed else 'index'} it announces (a driver woken by it finds "
                        f"nothing new and goes back to sleep)")
            else:
                what = (f"{q.name}: {q.round_used} buffers used" + (f" past used_event {used_event}" if
                                                                    self.event_idx and not q.packed else "")
                        + ", no notification" + (f" (the other queue's eventfd got {stray} while only this queue "
                                                 f"asked: sent on the wrong eventfd?)" if stray else ""))
            if r.check(rid, got > 0 and not early, what):
                if rid == "EVT-06":
                    r.ok("EVT-07")
                if rid == "EVT-05":
                    r.ok("EVT-04")
            elif rid == "EVT-05" and not got and not stray and not need_event(used_event, q.used_ctr, start):
                r.fail("EVT-04", f"{q.name}: no notification while flags were 0; the garbage used_event "
                                 f"{used_event} did not cover {start}..{q.used_ctr}, as if the device read it")
        elif q.round_calls + late:   # suppressed, or used_event past the round's last index (SHOULD NOT notify)
            rid = "EVT-24" if q.packed else ("EVT-07" if self.event_idx else "EVT-05")
            why = "while suppressed"
            if uncrossed:
                why = (f"used descriptors written from slot {start[0]} (wrap {start[1]}) to {q.used_pos} (wrap "
                       f"{q.used_wrap}), short of the event slot {used_event} past the first" if q.packed else
                       f"used idx moved {start} -> {q.used_ctr} without crossing used_event {used_event}")
            r.warn(rid, f"{q.name}: {q.round_calls + late} notification(s) for {q.round_used} buffers used {why}")
        q.round_used = 0

    def _quiesce_calls(self):
        time.sleep(0.03)
        for q in self.q:
            q.calls()
            q.round_used = 0

    def _round(self, specs, mutate=None, call_mode="on", low_bit=False):
        """Send one batch and wait until every buffer is used and every frame is back (or given up on).
        ``call_mode``: "on" / "off" for both queues, or (Rx mode, Tx mode)."""
        modes = (call_mode, call_mode) if isinstance(call_mode, str) else tuple(call_mode)
        if modes != self.call_mode:
            for q, mode in zip(self.q, modes):
                self._set_calls(q, mode)
            self._quiesce_calls()
            self.call_mode = modes
        for q, mode in zip(self.q, modes):
            self._set_calls(q, mode, low_bit)
            q.calls()
            q.round_used = q.round_calls = q.call_seen_at = 0
        self._refill_rx()
        bufs = self._send(specs, mutate)
        self._wait(bufs)
        late = [q.calls() for q in self.q]
        # calls on a queue that asked for none, while the other asked: maybe sent on the wrong eventfd
        stray = [q.round_calls + n if modes[i] == "off" and modes[i ^ 1] == "on" else 0
                 for i, (q, n) in enumerate(zip(self.q, late))]
        for i, q in enumerate(self.q):
            self._check_calls(q, late[i], stray[i ^ 1])
            q.verify_owned()
        self._verify_gaps()
        return len(bufs)

    def _wait(self, bufs):
        """Scan both queues until ``bufs`` are used and their frames are back (or the waits run out)."""
        rx, tx = self.q
        seqs = {b.seq for b in bufs}
        t_last = time.monotonic()
        t_tx_done = None
        while True:
            moved = False
            for q in (tx, rx):
                # a call read here announces at most what the scan right after it finds (EVT-05/EVT-24 order)
                calls = q.calls()
                comps = q.scan()
                if comps:
                    moved = True
                    if q is tx:
                        for b, ln, sk in comps:
                            self._tx_done(b, ln, sk)
                    else:
                        self._rx_done(comps)
                        self._refill_rx()
                if calls:
                    q.round_calls += calls
                    q.call_seen_at = q.round_used
            now = time.monotonic()
            if moved:
                t_last = now
            tx_done = not any(b.id in tx.inflight and tx.inflight[b.id] is b for b in bufs)
            if tx_done and t_tx_done is None:
                t_tx_done = now
            back = seqs <= self.received
            if tx_done and (back or self.loops is False or now - t_tx_done > self.o.rx_wait):
                if self.loops is None and seqs:
                    self.loops = bool(seqs & self.received) or self.damaged > 0
                    if not self.loops:
                        self.report.notes.append("the backend did not bring frames back on the Rx queue: Rx "
                                                 "requirements are not exercised (configure it to forward)")
                return
            if not tx_done and now - t_last > self.o.stall:
                left = [b for b in bufs if b.id in tx.inflight]
                raise Stalled(self._stall_evidence(tx, left))
            time.sleep(0.0002 if moved else 0.001)

    def _stall_evidence(self, q, left):
        """The run is about to end stalled on ``q`` (``left``: its buffers not used): the checks of what the
        device wrote first, then where the queue stands."""
        head = left[0]
        if q.packed:
            s = q.used_pos
            state = (f"next used slot {s} (wrap {q.used_wrap}) holds flags {q.view.flags(s):#x} id "
                     f"{int(q.view.desc[s]['id'])}")
        else:
            state = f"used idx {q.view.used_idx}, avail idx {q.view.avail_idx}"
        nfail = self.report.nfail()
        for x in self.q:   # what the device wrote instead of what the harness waits for names what it broke
            x.verify_owned()
            if x.packed:
                x.verify_device_flags()
        if q.packed and self.in_order and self.report.nfail() == nfail and self._probe(q):
            q.verify_device_flags()
        if not self.in_order and q.max_used_order > head.order and self.report.nfail() == nfail:
            self.report.fail("INORDER-15", f"{q.name}: buffer {head.id} and others made available before buffers "
                                           f"that were used are never used (one used entry for several buffers "
                                           f"without IN_ORDER?)")
        return (f"{q.name}: {len(left)} buffers not used after {self.o.stall}s (first: id {head.id}, "
                f"{head.chain.ndesc} descriptors); {state}")

    def _probe(self, q):
        """Tx stalled, packed, IN_ORDER, nothing named: one more buffer, made available after those waited for,
        shows where the device writes its next used descriptor (past them: it moved its used position over
        buffers it never used). Its frame is not waited for. False when there is no room for it."""
        if not (q.free_tokens and q.dq.num_free):
            return False
        for b in self._send([self._tx_spec(60, 1)]):
            del self.sent[b.seq], self.sent_len[b.seq]
        time.sleep(min(self.o.stall, self.o.rx_wait))
        return True

    # -- scenarios --------------------------------------------------------------------------------------------

    def _max_batch(self, nseg=1):
        tx = self.q[TX]
        self._refill_rx()
        return max(1, min(len(tx.free_tokens), tx.dq.num_free // nseg, self._rx_capacity() or self.o.ring_size))

    def _scenario(self, name, fn):
        t0 = time.monotonic()
        rec = {"name": name, "buffers": 0, "status": "ok"}
        self.report.scenarios.append(rec)
        try:
            rec["buffers"] = fn()
        except Stalled as e:
            rec["status"] = f"stalled: {e}"
            raise
        except Broken as e:
            rec["status"] = f"broken: {e}"
            raise
        finally:
            rec["seconds"] = round(time.monotonic() - t0, 3)

    def _sc_start(self, early):
        self._wait(early)
        return len(early) + self._round([self._tx_spec(self.rng.randint(60, 1514), 1)])

    def _sc_batches(self):
        """Batches of every size 1..ring (bounded by the Rx buffers), one-segment frames of random size."""
        total, k, rounds = 0, 1, 0
        top = self._max_batch()
        while k <= top:
            specs = [self._tx_spec(self.rng.randint(60, 1514), 1) for _ in range(k)]
            total += self._round(specs, low_bit=bool(rounds % 2))
            k += 1
            rounds += 1
        return total

    def _mutate(self, q, b):
        """Legal but unusual encodings, written before the buffer is published."""
        v, rng = q.view, self.rng
        c = b.chain
        if q.packed:
            if c.table is not None:
                if rng.random() < 0.5:   # PACKED-V-13: reserved flags and ids inside the table are ignored
                    t = np.frombuffer(self.mem.table.view(*c.table), q.view.desc.dtype)
                    t["flags"] |= VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED
                    t["id"] = [rng.randrange(1 << 16) for _ in range(len(t))]
                    b.tags.add("PACKED-V-13")
                if rng.random() < 0.5:   # PACKED-V-14: WRITE on the INDIRECT descriptor is ignored
                    self._packed_or_flags(q, c.head, VIRTQ_DESC_F_WRITE)
                    b.tags.add("PACKED-V-14")
            elif c.ndesc > 1:            # PACKED-V-10: the id is the last descriptor's; others hold garbage
                # never an id in flight: a device returning the garbage must meet "not in flight" (PACKED-V-11)
                # with the id the harness planted, not complete another buffer (all of a round is added already)
                idle = [i for i in range(q.size) if i not in q.inflight]
                for s in c.slots[:-1]:
                    g = rng.choice(idle)
                    v.desc[s]["id"] = g
                    b.planted_ids.add(g)
                b.tags.add("PACKED-V-10")
        elif c.table is not None:
            if rng.random() < 0.5:       # SPLIT-V-05: WRITE on the descriptor that refers to the table
                v.desc[c.slots[0]]["flags"] |= VIRTQ_DESC_F_WRITE
                b.tags.add("SPLIT-V-05")
            k = len(c.table_entries)
            if not self.in_order and k >= 3:   # SPLIT-V-07: the table walked 0 -> k-1 -> ... (next, not order)
                t = np.frombuffer(self.mem.table.view(*c.table), v.desc.dtype)
                old = [tuple(int(x) for x in e) for e in t]
                pos = [0] + list(range(k - 1, 0, -1))
                for j, p in enumerate(pos):
                    last = j == k - 1
                    t[p] = (old[j][0], old[j][1], (old[j][2] & ~VIRTQ_DESC_F_NEXT) | (0 if last else VIRTQ_DESC_F_NEXT),
                            0 if last else pos[j + 1])
                b.tags.add("SPLIT-V-07")
        for t in b.tags:
            if b.seq in self.sent:
                self.sent[b.seq][1].add(t)

    def _packed_or_flags(self, q, slot, bits):
        c = q.dq.c
        if c.pending and int(c.pending_head) == slot:
            c.pending_flags = int(c.pending_flags) | bits
        else:
            q.view.desc[slot]["flags"] |= bits

    def _sc_chains(self):
        """Frames in 1..8 segments: indirect tables (2..4) and direct chains, then direct only; header garbage."""
        total = 0
        tx = self.q[TX]
        for use_indirect in ((1, 0) if tx.indirect_area else (0,)):
            tx.dq.c.use_indirect = use_indirect
            done = 0
            while done < 2 * self.o.ring_size:
                k = self.rng.randint(1, self._max_batch(8))
                specs = [self._tx_spec(self.rng.randint(60, 1514), self.rng.randint(1, 8),
                                       garbage_hdr=self.rng.random() < 0.5) for _ in range(k)]
                done += self._round(specs, mutate=self._mutate)
            total += done
        tx.dq.c.use_indirect = 1 if tx.indirect_area else 0
        return total

    def _switch_rx(self, mode):
        """Post a different kind of Rx buffer: small frames use up the posted ones first (no refill meanwhile)."""
        rx = self.q[RX]
        if self.loops is False:
            return False
        self.hold_rx = True
        try:
            while rx.inflight:
                k = min(len(rx.inflight), len(self.q[TX].free_tokens), self.q[TX].dq.num_free)
                self._wait(self._send([self._tx_spec(60, 1) for _ in range(k)]))
                if self.loops is False:
                    return False
        finally:
            self.hold_rx = False
        self.rx_mode = mode
        self._refill_rx()
        return True

    def _sc_rx_hdr_split(self):
        if not self._switch_rx("hdr-split"):
            return 0
        total = 0
        while total < self.o.ring_size:
            k = self.rng.randint(1, self._max_batch())
            total += self._round([self._tx_spec(self.rng.randint(60, 1514), 1) for _ in range(k)])
        self._switch_rx("one")
        return total

    def _sc_mergeable(self):
        if not self.mrg:
            return 0
        if not self._switch_rx("small"):
            return 0
        total = 0
        while total < self.o.ring_size:
            k = self.rng.randint(1, self._max_batch())
            total += self._round([self._tx_spec(self.rng.choice((1514, self.rng.randint(60, 1514))), 1)
                                  for _ in range(k)])
        self._switch_rx("one")
        return total

    def _sc_notify_off(self):
        total = 0
        while total < self.o.ring_size:
            k = self.rng.randint(1, self._max_batch())
            total += self._round([self._tx_spec(self.rng.randint(60, 1514), 1) for _ in range(k)], call_mode="off")
        # one queue asks, the other does not: each queue's notifications on its own eventfd (EVT-05/EVT-24: a
        # device that signals the other queue's call fd passes every round where both queues ask)
        for modes in (("off", "on"), ("on", "off")) * 2:
            total += self._round([self._tx_spec(self.rng.randint(60, 1514), 1)
                                  for _ in range(self.rng.randint(1, self._max_batch()))], call_mode=modes)
        return total

    def _sc_spurious_kicks(self):
        """EVT-17: 100 kicks on each queue with nothing new; nothing may be used, then traffic goes on."""
        rx, tx = self.q
        before = [q.view.used_idx if not q.packed else q.view.flags(q.used_pos) for q in self.q]
        for _ in range(100):
            for q in self.q:
                os.eventfd_write(q.kickfd, 1)
            time.sleep(0.0005)
        time.sleep(0.05)
        comps = tx.scan()
        after = [q.view.used_idx if not q.packed else q.view.flags(q.used_pos) for q in self.q]
        ok = not comps and before[TX] == after[TX]
        self.report.check("EVT-17", ok, lambda: f"after 100 spurious kicks with nothing new the Tx queue changed "
                          f"({before[TX]} -> {after[TX]}, {len(comps)} used)")
        return self._round([self._tx_spec(self.rng.randint(60, 1514), 1) for _ in range(8)])

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self):
        """Connect, run the scenarios, stop the vrings. A usage or connection error before the rings run is raised
        (the command prints one line); one after that ends the run and is reported with what was checked."""
        r = self.report
        try:
            self._connect()
            self.hdr = frames.hdr_size(self.features)
            self._setup_memory()
            early = self._start()
            steps = {"start": lambda: self._sc_start(early), "batches": self._sc_batches,
                     "chains": self._sc_chains, "rx-hdr-split": self._sc_rx_hdr_split,
                     "mergeable": self._sc_mergeable, "notify-off": self._sc_notify_off,
                     "spurious-kicks": self._sc_spurious_kicks}
            for name in SCENARIOS:
                if name in self.o.scenarios:
                    self._scenario(name, steps[name])
            try:
                self.fe.stop()
            except VringError as e:
                r.notes.append(f"stopping the vrings: {type(e).__name__}: {e}")
        except VringError as e:
            if self.q[TX] is None:
                raise
            r.error = f"{type(e).__name__}: {e}"
        finally:
            if self.q[TX] is not None:
                self._summarize()
            self._close()
        return r

    def _summarize(self):
        r = self.report
        if self.o.layout == "spread" and self.q[TX] is not None and not self.o.packed:
            if r.status("SPLIT-V-15") == "pass":
                r.ok("SPLIT-L-01")
                r.ok("SPLIT-L-02")
        lost = max(0, len(self.sent) - len(self.received) - self.damaged) if self.loops else 0
        damaged = f"{self.damaged} of this run damaged beyond telling which, " if self.damaged else ""
        r.context["traffic"] = (f"{len(self.sent)} frames sent, {len(self.received)} came back, {self.foreign} "
                                f"foreign, {damaged}{lost} not back; batch entries covering >1 buffer: tx "
                                f"{self.batched[TX]}, rx {self.batched[RX]}; kicks sent: tx {self.kicks[TX]}, rx "
                                f"{self.kicks[RX]}")
        if lost:
            r.notes.append(f"{lost} frames did not come back (a device may drop; not a ring violation)")
        for rid in IDS:
            if r.status(rid) == "not exercised":
                why = self._why_not(rid)
                if why:
                    r.set_note(rid, why)

    def _why_not(self, rid):
        """Why a row cannot be exercised with this configuration or this backend ('' when it could)."""
        packed, ei, io, mrg = self.o.packed, self.event_idx, self.in_order, self.mrg
        rules = [
            (rid in SPLIT_ONLY and packed, "split rings only"),
            (rid in PACKED_ONLY and not packed, "packed rings only"),
            (rid in ("EVT-04", "EVT-05", "EVT-15", "EVT-24") and ei, "without EVENT_IDX only (--no-event-idx)"),
            (rid in ("EVT-06", "EVT-07", "EVT-16", "EVT-23") and not ei, "with EVENT_IDX only (--event-idx)"),
            (rid.startswith("INORDER-") and rid != "INORDER-15" and not io, "with IN_ORDER only (--in-order)"),
            (rid in ("INORDER-15", "SPLIT-V-07") and io, "without IN_ORDER only (--no-in-order)"),
            (rid in ("NET-27", "NET-28") and mrg, "without MRG_RXBUF only"),
            (rid in ("NET-29", "NET-30", "NET-31", "PACKED-V-16") and not mrg, "with MRG_RXBUF only (--mrg-rxbuf)"),
            (rid in ("SPLIT-V-05", "SPLIT-V-07", "PACKED-V-13", "PACKED-V-14", "PACKED-V-15")
             and not has(self.features, VIRTIO_F_INDIRECT_DESC), "INDIRECT_DESC not negotiated"),
            (rid in ("INORDER-07", "INORDER-08") and not any(self.batched), "the device wrote no batch entry"),
            (rid == "INORDER-10" and not self.batched[RX], "the device wrote no Rx batch entry (no buffer skipped)"),
            (rid == "GEN-01" and not self.fe.has_status, "STATUS not negotiated: DRIVER_OK is not visible"),
        ]
        return next((why for cond, why in rules if cond), "")

    def _close(self):
        if self.fe is not None:
            self.fe.close()
        for q in self.q:
            if q is not None:
                q.view = q.slots = q.dq = None
        self.q = [None, None]
        if self.mem is not None:
            self.mem.close()
            self.mem = None


def _slots_moved(start, end, size):
    """Packed: how many slots the used position moved from ``start`` to ``end`` ((slot, wrap) each; at most one
    lap, as within one round)."""
    (p0, w0), (p1, w1) = start, end
    return p1 - p0 if w1 == w0 and p1 >= p0 else p1 + size - p0 if w1 != w0 and p1 <= p0 else 0
