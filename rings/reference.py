"""Pure-Python reference model of the split and packed virtqueues, driver half and device half.

Written to be read beside the spec: rings/README.md is the contract (the C path, rings.virtq, writes the
same bytes for the same calls), and the IDs in comments are those of shared/spec/virtio-checklist.md.
Every access to shared memory is a struct.pack_into/unpack_from on a memoryview of the MemoryTable; every
store (and every 16-bit load) goes through _pack/_put16/_get16, which a test can record (``record``).
The acquire loads and release stores of the contract are plain loads and stores here: the model runs
in one thread, and a 2-byte aligned store is a single store.
"""
import ctypes
import functools
import struct
import sys
from collections import deque

import numpy as np

from .errors import (AddressOutOfBounds, AvailIdxJump, BaseOutOfRange, BufferIdInUse, ChainTooLong,
                     ConfigError, HeadOutOfRange, IndirectEmpty, IndirectLength, IndirectWithNext,
                     NestedIndirect, NextOutOfRange, PackedIdOutOfRange, RingError, SlotInFlight, UsageError,
                     UsedIdNotInFlight, UsedIdxJump, UsedLenTooLarge, WritableBeforeReadable)
from .layout import (ALIGN, RING_EVENT_FLAGS_DESC, RING_EVENT_FLAGS_DISABLE, RING_EVENT_FLAGS_ENABLE,
                     VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED,
                     VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT,
                     VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE, VIRTQ_USED_F_NO_NOTIFY, area_sizes,
                     check_host_alignment, has, need_event, packed_need_event)
from . import rawdump as _rawdump
from .snapshot import device_snapshot, driver_snapshot

# Indices and flags (the publication points) are read and written as one 16-bit access through a memoryview
# of format 'H': struct.pack_into first zeroes its target and '<' formats move one byte at a time, so a peer in
# another process saw idx 0 or half a value. The rings are little-endian, as this host must be.
assert sys.byteorder == "little", "the ring engines support little-endian hosts only"
_DESC = struct.Struct("<QIHH")       # split: addr len flags next (SPLIT-L-03); packed: addr len id flags
_DESC_BODY = struct.Struct("<QIH")   # packed: addr len id; flags (offset 14) are stored on their own
_LEN_ID = struct.Struct("<IH")       # packed used descriptor: len, id at offset 8
_USED_ELEM = struct.Struct("<II")    # split used.ring[i]: le32 id, le32 len (SPLIT-L-05)
U32_MAX = 0xFFFFFFFF

# Tests: record(fn) has fn(kind, host address, size, value) called for every store to ring memory, every
# 16-bit load and every point where the C path has a full fence, in program order, with the kinds of
# csrc/virtq_record.h ('S' plain, 'W' relaxed, 'R' release store, 'L' load, 'F' fence). None: off.
_record = None


def record(fn):
    global _record
    _record = fn


def _address(view):
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@functools.lru_cache(maxsize=None)
def _fields(st):
    """(offset, size) of each field of a '<'-format struct of Q/I/H fields."""
    out, off = [], 0
    for code in st.format[1:]:
        size = struct.calcsize("<" + code)
        out.append((off, size))
        off += size
    return out


def _pack(st, view, off, *values):
    """A plain store of a struct's fields (recorded field by field, as the C path stores them)."""
    st.pack_into(view, off, *values)
    if _record:
        base = _address(view) + off
        for (o, size), v in zip(_fields(st), values):
            _record("S", base + o, size, v)


def _fence():
    """Where the C path has a full fence (a no-op here: the model runs in one thread)."""
    if _record:
        _record("F", 0, 0, 0)


# Device id_inflight values
FREE, POLLED, COMPLETED = 0, 1, 2  # COMPLETED: in the shadow used array, not yet flushed


def _work(method):
    """A work method: refuses to run on a broken queue; a RingError breaks the queue for good."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.broken is not None:
            raise self.broken
        try:
            return method(self, *args, **kwargs)
        except RingError as e:
            e.side = self.side
            self.broken = e
            _rawdump.on_broken(self, e)  # a raw snapshot, if a snapshot directory is set
            raise
    return run


def _chain_flags(j, last, write):
    """NEXT on every segment but the last, WRITE on writable ones."""
    return (VIRTQ_DESC_F_NEXT if j < last else 0) | (VIRTQ_DESC_F_WRITE if write else 0)


def _ints(values, bits, what):
    """A flat integer sequence or array as a list of Python ints in 0..2^bits-1 (ConfigError otherwise)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ConfigError(f"{what} must be a flat sequence, got shape {a.shape}")
    if a.size == 0:
        return []
    if a.dtype.kind not in "iu":
        raise ConfigError(f"{what} must be integers, got {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >> bits:
        raise ConfigError(f"{what} must be in 0..{(1 << bits) - 1}, got {lo if lo < 0 else hi}")
    return a.tolist()


class _Queue:
    side = ""

    def __init__(self, mem, layout, features):
        features = int(features)
        if has(features, VIRTIO_F_RING_PACKED) != layout.packed:
            raise ConfigError(f"features have RING_PACKED={int(has(features, VIRTIO_F_RING_PACKED))} "
                              f"but the layout is {layout.fmt}")
        self.mem, self.layout, self.features, self.size = mem, layout, features, layout.size
        self.packed = layout.packed
        self.in_order = has(features, VIRTIO_F_IN_ORDER)
        self.event_idx = has(features, VIRTIO_F_EVENT_IDX)
        self.broken = None
        dsz, drv, dev = area_sizes(layout.fmt, layout.size)
        a_desc, a_drv, a_dev = ALIGN[layout.fmt]
        self.desc = self._area(layout.desc, dsz, "descriptor area", a_desc)
        if self.packed:
            self.driver_event = self._area(layout.driver, drv, "driver event suppression area", a_drv)
            self.device_event = self._area(layout.device, dev, "device event suppression area", a_dev)
        else:
            self.avail = self._area(layout.driver, drv, "available ring", a_drv)
            self.used = self._area(layout.device, dev, "used ring", a_dev)
        n = self.size
        self.id_ndesc = [0] * n    # ring descriptors per buffer id
        self.id_wlen = [0] * n     # writable bytes per buffer id
        self.id_inflight = [0] * n

    def _area(self, gpa, nbytes, what, align=None):
        try:
            view = self.mem.view(gpa, nbytes)
        except AddressOutOfBounds:
            raise ConfigError(f"{what} {gpa:#x}+{nbytes:#x} is outside the memory table") from None
        if align:   # as the C path requires (its atomic accesses); the model does not depend on it
            check_host_alignment(what, gpa, np.frombuffer(view, np.uint8).ctypes.data, align)
        return view

    @staticmethod
    def _get16(view, off):
        value = view.cast("H")[off >> 1]
        if _record:
            _record("L", _address(view) + off, 2, value)
        return value

    @staticmethod
    def _put16(view, off, value, kind="W"):
        view.cast("H")[off >> 1] = value & 0xFFFF
        if _record:
            _record(kind, _address(view) + off, 2, value & 0xFFFF)

    @classmethod
    def _release16(cls, view, off, value):
        """A publication point: a release store in the C path."""
        cls._put16(view, off, value, "R")

    # Split: avail = flags, idx, ring[size], used_event; used = flags, idx, ring[size] (id, len), avail_event
    def _used_event_off(self):
        return 4 + 2 * self.size

    def _avail_event_off(self):
        return 4 + 8 * self.size

    def _packed_notify(self, event, new, added, wrap):
        """EVT-21/23: does a packed event suppression structure ask for a notification for the last
        `added` descriptors, ending at position new with wrap counter wrap?"""
        flags = self._get16(event, 2)
        if flags == RING_EVENT_FLAGS_DISABLE:
            return False
        if flags == RING_EVENT_FLAGS_DESC and self.event_idx:
            return packed_need_event(self._get16(event, 0), new, new - added, wrap, self.size)
        return True  # ENABLE, DESC without EVENT_IDX, reserved values: notify

    def _set_packed_event_flags(self, event, on):
        self._put16(event, 2, RING_EVENT_FLAGS_ENABLE if on else RING_EVENT_FLAGS_DISABLE)

    def _desc_flags(self, slot):
        return self._get16(self.desc, 16 * slot + 14)


class DriverQueue(_Queue):
    """The driver half: adds buffers, publishes them, reclaims used ones."""

    side = "driver"

    def __init__(self, mem, layout, features, indirect=None):
        super().__init__(mem, layout, features)
        if not self.packed:
            self._put16(self.used, 0, 0)  # EVT-10: the driver initialises the used ring's flags
        n = self.size
        self.next_avail = 0   # split: free-running avail idx (u16); packed: next slot
        self.avail_wrap = 1   # packed (PACKED-D-02)
        self.last_used = 0    # split: free-running (u16); packed: next used slot
        self.used_wrap = 1    # packed (PACKED-D-24)
        self.num_free = n     # descriptors
        self.kick_added = 0   # buffers (split) / descriptors (packed) since the last kick_prepare
        self.id_token = [0] * n
        self.free_next = list(range(1, n + 1))  # normal variants (split: descriptors, packed: ids)
        self.free_head = 0    # a FIFO: taken at the head, given back at the tail (reused in ring order)
        self.free_tail = n - 1
        self.next_desc = 0    # split IN_ORDER: head of the next buffer (INORDER-03)
        self.unpublished = 0  # split: buffers added since the last publish
        self.head_flags = None  # packed: (slot, flags) of the first descriptor since the last publish
        self.indirect = None
        if indirect is not None and has(self.features, VIRTIO_F_INDIRECT_DESC):
            gpa, max_entries = indirect
            if not 2 <= max_entries <= n:  # a longer table is a chain longer than the queue (SPLIT-D-05)
                raise ConfigError(f"indirect tables must hold 2..{n} entries, not {max_entries}")
            self.tables = self._area(gpa, n * max_entries * 16, "indirect area", 16)
            self.indirect = (gpa, max_entries)
        if self.packed:
            self._place = self._place_packed
            self._reclaim = self._reclaim_packed
            self._take_id = self._take_id_in_order_packed if self.in_order else self._take_id_packed
        else:
            self._place = self._place_split
            self._reclaim = self._reclaim_split
            self._take_descs = self._take_descs_in_order_split if self.in_order else self._take_descs_split
        self._batch = self._batch_in_order if self.in_order else self._batch_single
        if self.in_order:
            self._release = self._release_in_order
        else:
            self._release = self._release_packed if self.packed else self._release_split

    def state(self):
        return {"next_avail": self.next_avail, "avail_wrap": self.avail_wrap, "last_used": self.last_used,
                "used_wrap": self.used_wrap, "num_free": self.num_free, "inflight": sum(self.id_inflight),
                "kick_added": self.kick_added}

    def snapshot(self):
        return driver_snapshot(self)

    # --- adding buffers -----------------------------------------------------------------------------

    def _descs_needed(self, nseg):
        """Ring descriptors one buffer of nseg segments takes (1 if it goes indirect)."""
        if nseg < 1:
            raise ConfigError("a buffer needs at least one segment (nreadable + nwritable >= 1)")
        if self.indirect and 1 < nseg <= self.indirect[1]:
            return 1
        if nseg > self.size:
            raise ConfigError(f"a chain of {nseg} descriptors is longer than the queue size {self.size} "
                              f"(SPLIT-D-05/PACKED-D-09)")
        return nseg

    @_work
    def add(self, addrs, lens, nreadable, nwritable, tokens):
        """Add buffers (readable segments first); stops at the first that does not fit. Returns the count."""
        addrs, lens = _ints(addrs, 64, "addrs"), _ints(lens, 32, "lens")
        nread, nwrite = _ints(nreadable, 16, "nreadable"), _ints(nwritable, 16, "nwritable")
        tokens = _ints(tokens, 64, "tokens")
        if not len(nread) == len(nwrite) == len(tokens):
            raise ConfigError(f"nreadable, nwritable and tokens need one entry per buffer "
                              f"({len(nread)}, {len(nwrite)}, {len(tokens)})")
        if not len(addrs) == len(lens) == sum(nread) + sum(nwrite):
            raise ConfigError(f"addrs and lens need nreadable+nwritable = {sum(nread) + sum(nwrite)} "
                              f"entries, got {len(addrs)} and {len(lens)}")
        bufs, start = [], 0
        for r, w in zip(nread, nwrite):  # check every buffer before writing anything
            segs = [(addrs[start + j], lens[start + j], j >= r) for j in range(r + w)]
            rlen, wlen = sum(lens[start:start + r]), sum(lens[start + r:start + r + w])
            if rlen > U32_MAX or wlen > U32_MAX:
                raise ConfigError(f"a buffer of {rlen} readable and {wlen} writable bytes is longer "
                                  f"than 2^32-1 bytes (SPLIT-D-04)")
            bufs.append((segs, self._descs_needed(r + w), wlen))
            start += r + w
        for b, (segs, needed, wlen) in enumerate(bufs):
            if needed > self.num_free:  # all or nothing per buffer (PACKED-D-11)
                return b
            id = self._place(segs, needed)
            self.id_ndesc[id], self.id_wlen[id], self.id_token[id] = needed, wlen, tokens[b]
            self.id_inflight[id] = 1
            self.num_free -= needed
        return len(bufs)

    def add_simple(self, addrs, lens, tokens, writable=False):
        """add() for one-segment buffers, all readable or all writable."""
        ones, zeros = np.ones(len(tokens), np.uint16), np.zeros(len(tokens), np.uint16)
        return self.add(addrs, lens, zeros if writable else ones, ones if writable else zeros, tokens)

    def _table(self, id, segs, entry):
        """Write the indirect table of buffer id; returns its guest address (SPLIT-D-09, PACKED-D-21)."""
        gpa, max_entries = self.indirect
        off = id * max_entries * 16
        for j, seg in enumerate(segs):
            _pack(_DESC, self.tables, off + 16 * j, *entry(j, seg))
        return gpa + off

    # Split

    def _take_descs_split(self, k):
        """k descriptors from the head of the free list, in list order."""
        idxs, x = [], self.free_head
        for _ in range(k):
            idxs.append(x)
            x = self.free_next[x]
        self.free_head = x
        return idxs

    def _take_descs_in_order_split(self, k):
        """k descriptors in ring order, wrapping at the end of the table (INORDER-03)."""
        idxs = [(self.next_desc + j) % self.size for j in range(k)]
        self.next_desc = (self.next_desc + k) % self.size
        return idxs

    def _place_split(self, segs, needed):
        idxs = self._take_descs(needed)
        head, last = idxs[0], len(segs) - 1
        if needed == 1 and len(segs) > 1:  # indirect: the table chains by next = j + 1 (INORDER-05)
            table = self._table(head, segs, lambda j, s: (s[0], s[1], _chain_flags(j, last, s[2]),
                                                          j + 1 if j < last else 0))
            _pack(_DESC, self.desc, 16 * head, table, 16 * len(segs), VIRTQ_DESC_F_INDIRECT, 0)
        else:  # next is the following descriptor taken: free-list order, or x + 1 mod size (INORDER-04)
            for j, (addr, length, write) in enumerate(segs):
                _pack(_DESC, self.desc, 16 * idxs[j], addr, length, _chain_flags(j, last, write),
                      idxs[j + 1] if j < last else 0)
        # SPLIT-D-11/13: the head goes into the next ring entry, stored only when it changes (as vq_avail_put: the
        # device's line stays shared); idx is published later
        off = 4 + 2 * (self.next_avail % self.size)
        if self._get16(self.avail, off) != head:
            self._put16(self.avail, off, head)
        self.next_avail = (self.next_avail + 1) & 0xFFFF
        self.unpublished += 1
        self.kick_added += 1
        return head

    # Packed

    def _take_id_packed(self):
        id = self.free_head
        self.free_head = self.free_next[id]
        return id

    def _take_id_in_order_packed(self):
        return self.next_avail  # the buffer id is its head slot

    def _place_packed(self, segs, needed):
        id = self._take_id()
        last = len(segs) - 1
        if needed == 1 and len(segs) > 1:  # indirect: entries carry only WRITE (PACKED-D-18)
            table = self._table(id, segs, lambda j, s: (s[0], s[1], 0, VIRTQ_DESC_F_WRITE if s[2] else 0))
            descs = [(table, 16 * len(segs), VIRTQ_DESC_F_INDIRECT)]
        else:
            descs = [(addr, length, _chain_flags(j, last, write))
                     for j, (addr, length, write) in enumerate(segs)]
        head = None
        for addr, length, flags in descs:
            slot = self.next_avail
            # PACKED-D-03/14: AVAIL = wrap, USED = !wrap in every descriptor; id in every one (PACKED-D-13)
            flags |= VIRTQ_DESC_F_AVAIL if self.avail_wrap else VIRTQ_DESC_F_USED
            _pack(_DESC_BODY, self.desc, 16 * slot, addr, length, id)
            if head is None:
                head = (slot, flags)
            else:
                self._put16(self.desc, 16 * slot + 14, flags)
            self.next_avail += 1
            if self.next_avail == self.size:  # PACKED-D-02
                self.next_avail, self.avail_wrap = 0, self.avail_wrap ^ 1
        if self.head_flags is None:  # the batch's first head: exposed by publish, after everything (MEM-06)
            self.head_flags = head
        else:  # PACKED-D-12: a list's head after the rest of the list
            self._put16(self.desc, 16 * head[0] + 14, head[1])
        self.kick_added += needed
        return id

    # --- publishing and notifying --------------------------------------------------------------------

    @_work
    def publish(self):
        """One release store exposes everything added since the last publish (MEM-02, PACKED-D-22)."""
        if self.packed:
            if self.head_flags is not None:
                slot, flags = self.head_flags
                self._release16(self.desc, 16 * slot + 14, flags)
                self.head_flags = None
        elif self.unpublished:
            self._release16(self.avail, 2, self.next_avail)  # SPLIT-D-12: idx moves by the heads added
            self.unpublished = 0

    @_work
    def kick_prepare(self):
        """Does the device want an available buffer notification for the buffers since the last call?"""
        _fence()  # EVT-25, MEM-03: the suppression is read after the publishing store
        if self.packed:
            kick = self._packed_notify(self.device_event, self.next_avail, self.kick_added, self.avail_wrap)
        elif self.event_idx:  # EVT-13/14: flags ignored, avail_event decides
            avail_event = self._get16(self.used, self._avail_event_off())
            kick = need_event(avail_event, self.next_avail, self.next_avail - self.kick_added)
        else:  # EVT-11/12
            kick = not self._get16(self.used, 0) & VIRTQ_USED_F_NO_NOTIFY
        self.kick_added = 0
        return kick

    @_work
    def enable_calls(self, on):
        """Ask for (on) or suppress used buffer notifications."""
        if self.packed:
            self._set_packed_event_flags(self.driver_event, on)
        elif self.event_idx:  # EVT-02: flags stay 0
            self._put16(self.avail, 0, 0)
            self._put16(self.avail, self._used_event_off(),
                        self.last_used if on else self.last_used + 0x7FFF)
        else:  # EVT-01
            self._put16(self.avail, 0, 0 if on else VIRTQ_AVAIL_F_NO_INTERRUPT)
        _fence()  # EVT-09/MEM-09: callers re-check the ring after enabling

    # --- reclaiming used buffers ---------------------------------------------------------------------

    @_work
    def reclaim(self, max_bufs=None):
        """Used buffers as (tokens u64, lens u32), in the order reclaimed. No new used entry is started
        once max_bufs (default: the queue size) buffers were returned; one entry may cover several."""
        tokens, lens = [], []
        self._reclaim(self.size if max_bufs is None else max_bufs, tokens, lens)
        return np.array(tokens, dtype=np.uint64), np.array(lens, dtype=np.uint32)

    def _check_in_flight(self, id, slot):
        if id >= self.size or not self.id_inflight[id]:
            where = f"slot {slot}" if self.packed else f"used.ring[{slot}]"
            raise UsedIdNotInFlight(f"used id {id} at {where} is not a buffer in flight "
                                    f"(queue size {self.size})", id, slot)

    def _check_len(self, id, length):
        if length > self.id_wlen[id]:  # SPLIT-D-15: the device wrote more than the buffer holds
            raise UsedLenTooLarge(f"used len {length} for buffer {id} is larger than its writable part "
                                  f"({self.id_wlen[id]} bytes)", id, length)

    def _batch_single(self, id):
        return [id]

    def _batch_in_order(self, id):
        """The buffers one in-order used entry covers: from the oldest in flight up to id (INORDER-06/11)."""
        if self.packed:
            head = self.last_used
        else:
            head = (self.next_desc - (self.size - self.num_free)) % self.size
        batch = [head]
        while head != id:
            head = (head + self.id_ndesc[head]) % self.size
            batch.append(head)
        return batch

    def _detach(self, batch, length, tokens, lens):
        """Return a batch: skipped buffers were used completely (INORDER-10), the last has length."""
        for k, id in enumerate(batch):
            tokens.append(self.id_token[id])
            lens.append(length if k == len(batch) - 1 else self.id_wlen[id])
            self._release(id)   # before num_free counts it (_append_free)
            self.num_free += self.id_ndesc[id]
            self.id_inflight[id] = 0

    def _release_split(self, head):
        """The chain goes back to the tail of the free list; its descriptors are still linked there."""
        tail = head
        for _ in range(self.id_ndesc[head] - 1):
            tail = self.free_next[tail]
        self._append_free(head, tail)

    def _release_packed(self, id):
        self._append_free(id, id, all(self.id_inflight))   # ids: one per buffer in flight

    def _append_free(self, head, tail, empty=None):
        """Called before the buffer is counted free: an empty list starts again at head."""
        if self.num_free == 0 if empty is None else empty:
            self.free_head = head
        else:
            self.free_next[self.free_tail] = head
        self.free_tail = tail

    def _release_in_order(self, id):
        """Nothing to do: IN_ORDER buffers come back in ring order, so num_free says what is free."""

    def _reclaim_split(self, max_bufs, tokens, lens):
        used_idx = self._get16(self.used, 2)
        pending = (used_idx - self.last_used) & 0xFFFF
        if pending > self.size:  # SPLIT-D-17
            raise UsedIdxJump(f"used idx moved by {pending} > queue size {self.size} "
                              f"(last_used={self.last_used}, used.idx={used_idx})", self.last_used, used_idx)
        while pending and len(tokens) < max_bufs:
            slot = self.last_used % self.size
            id, length = _USED_ELEM.unpack_from(self.used, 4 + 8 * slot)
            self._check_in_flight(id, slot)
            batch = self._batch(id)
            if len(batch) > pending:  # INORDER-07: the batch must be covered by the idx move
                raise UsedIdxJump(f"used.ring[{slot}] id {id} completes {len(batch)} buffers but used idx "
                                  f"only moved by {pending} (last_used={self.last_used}, "
                                  f"used.idx={used_idx})",
                                  self.last_used, used_idx)
            self._check_len(id, length)
            self._detach(batch, length, tokens, lens)
            self.last_used = (self.last_used + len(batch)) & 0xFFFF  # INORDER-09: skipped slots unread
            pending -= len(batch)

    def _reclaim_packed(self, max_bufs, tokens, lens):
        while len(tokens) < max_bufs:
            slot = self.last_used
            flags = self._desc_flags(slot)
            w = self.used_wrap  # PACKED-D-24: used iff AVAIL == USED == used wrap counter
            if bool(flags & VIRTQ_DESC_F_AVAIL) != w or bool(flags & VIRTQ_DESC_F_USED) != w:
                return
            length, id = _LEN_ID.unpack_from(self.desc, 16 * slot + 8)
            if id >= self.size:
                raise PackedIdOutOfRange(f"used descriptor at slot {slot} has buffer id {id} >= queue size "
                                         f"{self.size}", id, slot)
            self._check_in_flight(id, slot)
            batch = self._batch(id)
            if flags & VIRTQ_DESC_F_WRITE or self.id_wlen[id]:  # PACKED-D-17, lenient for QEMU
                self._check_len(id, length)
            else:
                length = 0
            self._detach(batch, length, tokens, lens)
            # PACKED-D-15, INORDER-12/14: skip the descriptors of every buffer returned
            self.last_used += sum(self.id_ndesc[b] for b in batch)
            if self.last_used >= self.size:
                self.last_used, self.used_wrap = self.last_used - self.size, self.used_wrap ^ 1


class Chains:
    """What one poll found: per-chain arrays (id, ndesc, seg_start, nseg, rlen, wlen) and per-segment
    arrays (seg_addr, seg_len, seg_write)."""

    def __init__(self, chains, segs):
        self.n = len(chains)
        cols = list(zip(*chains)) or [()] * 6
        for name, col, dtype in zip(("id", "ndesc", "seg_start", "nseg", "rlen", "wlen"), cols,
                                    (np.uint16, np.uint16, np.uint32, np.uint16, np.uint32, np.uint32)):
            setattr(self, name, np.array(col, dtype=dtype))
        cols = list(zip(*segs)) or [()] * 3
        for name, col, dtype in zip(("seg_addr", "seg_len", "seg_write"), cols,
                                    (np.uint64, np.uint32, np.uint8)):
            setattr(self, name, np.array(col, dtype=dtype))

    def segments(self, i):
        """(addr, len, write) of chain i."""
        s, k = int(self.seg_start[i]), int(self.nseg[i])
        return [(int(a), int(n), int(w)) for a, n, w in zip(self.seg_addr[s:s + k], self.seg_len[s:s + k],
                                                            self.seg_write[s:s + k])]


class DeviceQueue(_Queue):
    """The device half: polls available chains, completes them through a shadow used array."""

    side = "device"

    def __init__(self, mem, layout, features, in_order_batch=False):
        super().__init__(mem, layout, features)
        self.last_avail = 0   # split: free-running (u16); packed: next slot to poll
        self.shadow_avail_idx = 0  # split: avail.idx as read by the last poll
        self.avail_wrap = 1   # packed: the driver wrap counter expected at last_avail
        self.used_idx = 0     # split: free-running (u16); packed: next used slot
        self.used_wrap = 1    # packed (PACKED-V-01)
        self.call_added = 0   # buffers (split) / descriptors (packed) flushed since the last call_prepare
        self.inflight_slots = 0  # packed: slots of the chains in flight, from used_idx up to last_avail
        self.fifo = deque()   # IN_ORDER: ids in polled order, not yet completed
        self.shadow = []      # (id, len) completed, not yet flushed
        self.batch = self.in_order and in_order_batch
        self.seg_capacity = 2 * self.size + 64
        self._walk = self._walk_packed if self.packed else self._walk_split

    def state(self):
        return {"last_avail": self.last_avail, "avail_wrap": self.avail_wrap, "used_idx": self.used_idx,
                "used_wrap": self.used_wrap, "call_added": self.call_added,
                "inflight": sum(1 for s in self.id_inflight if s), "shadow_count": len(self.shadow)}

    def snapshot(self):
        return device_snapshot(self)

    @_work
    def set_base(self, base, taken=0):
        """Start at a vring base (vhost-user SET_VRING_BASE): split, the free-running avail idx; packed,
        slot | wrap << 15 (DPDK's encoding). The used position starts there, the device's avail position
        ``taken`` buffers (split) / descriptors (packed) further (a predecessor's chains, replayed)."""
        if any(self.id_inflight) or self.shadow or self.fifo:
            raise UsageError("set_base: the queue has buffers in flight")
        if not 0 <= base <= 0xFFFF or (self.packed and base & 0x7FFF >= self.size):
            raise BaseOutOfRange(f"vring base {base:#x} is no position of this ring (size {self.size})",
                                 base if 0 <= base <= 0xFFFFFFFF else 0xFFFFFFFF, self.size)
        if not 0 <= taken <= self.size:
            raise BaseOutOfRange(f"{taken} taken past the vring base: more than the ring holds ({self.size})",
                                 taken if taken <= 0xFFFFFFFF else 0xFFFFFFFF, self.size)
        if self.packed:
            self.used_idx, self.used_wrap = base & 0x7FFF, base >> 15
            avail = self.used_idx + taken
            self.last_avail, self.avail_wrap = avail % self.size, self.used_wrap ^ (avail >= self.size)
        else:
            self.used_idx = base
            self.last_avail = self.shadow_avail_idx = (base + taken) & 0xFFFF
        self.inflight_slots = 0

    # --- polling -------------------------------------------------------------------------------------

    @_work
    def poll(self, max_chains=None):
        """Copy out, check and return up to max_chains (default: the queue size) available chains."""
        max_chains = self.size if max_chains is None else max_chains
        chains, segs = [], []
        if not self.packed:
            avail_idx = self._get16(self.avail, 2)
            if (avail_idx - self.last_avail) & 0xFFFF > self.size:  # SPLIT-V-13
                raise AvailIdxJump(f"avail idx moved by {(avail_idx - self.last_avail) & 0xFFFF} > queue "
                                   f"size {self.size} (last_avail={self.last_avail}, avail.idx={avail_idx})",
                                   self.last_avail, avail_idx)
            self.shadow_avail_idx = avail_idx
        while len(chains) < max_chains:
            found = self._walk()
            if found is None:
                break
            id, ndesc, chain, cursor = found
            rlen = sum(length for _, length, write in chain if not write)
            wlen = sum(length for _, length, write in chain if write)
            if rlen > U32_MAX or wlen > U32_MAX:  # SPLIT-D-04
                raise ChainTooLong(f"chain {id} has {rlen} readable and {wlen} writable bytes, more than "
                                   f"2^32-1", rlen, wlen)
            if len(segs) + len(chain) > self.seg_capacity:  # left for the next poll
                break
            chains.append((id, ndesc, len(segs), len(chain), rlen, wlen))
            segs += chain
            self.id_ndesc[id], self.id_wlen[id], self.id_inflight[id] = ndesc, wlen, POLLED
            if self.packed:
                self.inflight_slots += ndesc
            if self.in_order:
                self.fifo.append(id)
            self.last_avail, self.avail_wrap = cursor
        return Chains(chains, segs)

    def _segment(self, addr, length, write, chain, where):
        """Append one segment: readable ones come first, and it must lie inside the memory table."""
        if chain and chain[-1][2] and not write:  # SPLIT-D-02, PACKED-D-10
            raise WritableBeforeReadable(f"{where}: readable segment {addr:#x}+{length:#x} after a writable "
                                         f"one", addr, length)
        try:
            self.mem.lookup(addr, length)  # FEAT-07
        except AddressOutOfBounds as e:
            raise AddressOutOfBounds(f"{where}: {e}", addr, length) from None
        chain.append((addr, length, write))

    def _indirect_table(self, addr, length, where):
        """Validate an indirect descriptor's table and return (view, entries) (SPLIT-D-09, PACKED-D-21)."""
        if length == 0:
            raise IndirectEmpty(f"{where}: indirect table at {addr:#x} is empty", addr, length)
        if length % 16:
            raise IndirectLength(f"{where}: indirect table at {addr:#x} has length {length}, not a multiple "
                                 f"of 16", addr, length)
        if length // 16 > self.size:  # SPLIT-D-05
            raise ChainTooLong(f"{where}: indirect table of {length // 16} entries is longer than the queue "
                               f"size {self.size}", length // 16, self.size)
        try:
            return self.mem.view(addr, length), length // 16
        except AddressOutOfBounds as e:
            raise AddressOutOfBounds(f"{where}: indirect table: {e}", addr, length) from None

    # Split

    def _walk_split(self):
        """The chain at avail.ring[last_avail % size], if the last avail.idx read covers it:
        (head, ring descriptors, segments, next cursor)."""
        if self.last_avail == self.shadow_avail_idx:
            return None
        slot = self.last_avail % self.size
        head = self._get16(self.avail, 4 + 2 * slot)
        # the values: the head and the free-running avail position, as the C engine reports them
        if head >= self.size:  # SPLIT-V-14
            raise HeadOutOfRange(f"avail.ring[{slot}] holds head {head}, outside the queue "
                                 f"(size {self.size})", head, self.last_avail)
        if self.id_inflight[head]:  # SPLIT-D-13: a head the device still owns
            raise BufferIdInUse(f"avail.ring[{slot}] holds head {head}, which is already in flight",
                                head, self.last_avail)
        chain, ndesc = [], 0
        table, limit, in_table = self.desc, self.size, False
        i, hops = head, 0
        while True:
            hops += 1
            if hops > limit:  # a loop, or more than the table holds (SPLIT-D-04/05)
                raise ChainTooLong(f"chain at head {head} has more than {limit} descriptors "
                                   f"{'in its indirect table' if in_table else 'in the ring'}", head, hops)
            where = f"chain {head}, {'indirect entry' if in_table else 'descriptor'} {i}"
            addr, length, flags, nxt = _DESC.unpack_from(table, 16 * i)  # copied out, then checked
            if not in_table:
                ndesc += 1
            if flags & VIRTQ_DESC_F_INDIRECT:
                if in_table:  # SPLIT-D-07
                    raise NestedIndirect(f"{where}: INDIRECT inside an indirect table", head, i)
                if flags & VIRTQ_DESC_F_NEXT:  # SPLIT-D-08
                    raise IndirectWithNext(f"{where}: INDIRECT together with NEXT", head, i)
                # SPLIT-V-05/06: WRITE on this descriptor is ignored; the walk goes on at entry 0
                table, limit = self._indirect_table(addr, length, where)
                i, hops, in_table = 0, 0, True
                continue
            self._segment(addr, length, bool(flags & VIRTQ_DESC_F_WRITE), chain, where)
            if not flags & VIRTQ_DESC_F_NEXT:
                break
            if nxt >= limit:  # SPLIT-V-14
                raise NextOutOfRange(f"{where}: next {nxt} is outside its table of {limit}", i, nxt)
            i = nxt
        return head, ndesc, chain, ((self.last_avail + 1) & 0xFFFF, self.avail_wrap)

    # Packed

    def _walk_packed(self):
        """The list at slot last_avail, if it is available: (buffer id, ndesc, segments, next cursor)."""
        slot, wrap = self.last_avail, self.avail_wrap
        flags = self._desc_flags(slot)
        # PACKED-V-04/18: available iff AVAIL == driver wrap counter and USED != it
        if bool(flags & VIRTQ_DESC_F_AVAIL) != wrap or bool(flags & VIRTQ_DESC_F_USED) == wrap:
            return None
        chain, ndesc, first = [], 0, slot
        while True:
            ndesc += 1
            if ndesc > self.size:  # PACKED-D-09
                raise ChainTooLong(f"list at slot {first} has more than {self.size} descriptors",
                                   first, ndesc)
            where = f"list at slot {first}, slot {slot}"
            if ndesc + self.inflight_slots > self.size:  # PACKED-D-11/05: the used position has not passed it
                raise SlotInFlight(f"{where}: made available again while it belongs to a chain in flight "
                                   f"({self.inflight_slots} slots in flight)", slot, self.inflight_slots)
            addr, length, id, flags = _DESC.unpack_from(self.desc, 16 * slot)  # copied out, then checked
            slot += 1
            if slot == self.size:
                slot, wrap = 0, wrap ^ 1
            if flags & VIRTQ_DESC_F_INDIRECT:  # PACKED-D-20: an indirect descriptor stands alone
                at = (first + ndesc - 1) % self.size   # its slot, as the C engine reports it
                if flags & VIRTQ_DESC_F_NEXT:
                    raise IndirectWithNext(f"{where}: INDIRECT together with NEXT", first, at)
                if ndesc > 1:
                    raise IndirectWithNext(f"{where}: INDIRECT after a NEXT descriptor", first, at)
                table, entries = self._indirect_table(addr, length, where)
                for j in range(entries):  # sequential entries; only WRITE counts (PACKED-V-13/14)
                    e_addr, e_len, _, e_flags = _DESC.unpack_from(table, 16 * j)
                    if e_flags & VIRTQ_DESC_F_INDIRECT:
                        raise NestedIndirect(f"{where}: INDIRECT in indirect entry {j}", first, j)
                    self._segment(e_addr, e_len, bool(e_flags & VIRTQ_DESC_F_WRITE), chain,
                                  f"{where}, indirect entry {j}")
            else:
                self._segment(addr, length, bool(flags & VIRTQ_DESC_F_WRITE), chain, where)
            if not flags & VIRTQ_DESC_F_NEXT:
                break
        # PACKED-V-10: the buffer id is the last descriptor's
        if id >= self.size:
            raise PackedIdOutOfRange(f"{where}: buffer id {id} >= queue size {self.size}", id, first)
        if self.id_inflight[id]:
            raise BufferIdInUse(f"{where}: buffer id {id} is already in flight", id, first)
        return id, ndesc, chain, (slot, wrap)  # PACKED-V-09: skip the whole list

    # --- completing ----------------------------------------------------------------------------------

    @_work
    def push_used(self, ids, lens):
        """Append completions (id, bytes written) to the shadow used array; all or nothing."""
        ids, lens = _ints(ids, 32, "ids"), _ints(lens, 32, "lens")
        if len(ids) != len(lens):
            raise ConfigError(f"ids and lens differ in length ({len(ids)} and {len(lens)})")
        seen = set()
        for k, id in enumerate(ids):
            if id >= self.size or self.id_inflight[id] != POLLED or id in seen:
                raise UsageError(f"buffer id {id} is not polled and pending completion")
            if self.in_order and self.fifo[k] != id:  # INORDER-02
                raise UsageError(f"IN_ORDER: buffer id {id} completed before id {self.fifo[k]}, which was "
                                 f"made available first")
            seen.add(id)
        for id, length in zip(ids, lens):
            self.id_inflight[id] = COMPLETED
            self.shadow.append((id, length))
            if self.in_order:
                self.fifo.popleft()

    def _batches(self):
        """IN_ORDER batching: a batch ends at a buffer not used completely (INORDER-10), or at the end."""
        if not self.batch:
            return [[e] for e in self.shadow]  # INORDER-15
        batches, current = [], []
        for id, length in self.shadow:
            current.append((id, length))
            if length != self.id_wlen[id]:
                batches.append(current)
                current = []
        return batches + [current] if current else batches

    @_work
    def flush(self):
        """Publish the shadow used array with one release store."""
        if not self.shadow:
            return
        if self.packed:
            head = None
            for batch in self._batches():
                id, length = batch[-1]  # INORDER-11: the id of the batch's last buffer
                # PACKED-V-01/02/11/12: at the next used slot, AVAIL = USED = wrap, WRITE iff data written
                flags = (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED if self.used_wrap else 0) | \
                        (VIRTQ_DESC_F_WRITE if length else 0)
                _pack(_LEN_ID, self.desc, 16 * self.used_idx + 8, length, id)
                if head is None:
                    head = (self.used_idx, flags)
                else:  # PACKED-V-05: body, then flags
                    self._put16(self.desc, 16 * self.used_idx + 14, flags)
                ndesc = sum(self.id_ndesc[b] for b, _ in batch)  # PACKED-V-09, INORDER-12/13
                self.used_idx += ndesc  # ndesc <= inflight_slots <= size: one lap at most
                while self.used_idx >= self.size:
                    self.used_idx, self.used_wrap = self.used_idx - self.size, self.used_wrap ^ 1
                self.inflight_slots -= ndesc
                self.call_added += ndesc
            self._release16(self.desc, 16 * head[0] + 14, head[1])  # PACKED-V-16: the first batch's flags last
        else:
            for batch in self._batches():
                id, length = batch[-1]  # INORDER-06: the head of the batch's last buffer
                # INORDER-08: the entry lands at the batch's first slot; INORDER-07: idx moves by the batch
                _pack(_USED_ELEM, self.used, 4 + 8 * (self.used_idx % self.size), id, length)
                self.used_idx = (self.used_idx + len(batch)) & 0xFFFF
            self._release16(self.used, 2, self.used_idx)  # SPLIT-V-08: entries before idx
            self.call_added += len(self.shadow)
        for id, _ in self.shadow:
            self.id_inflight[id] = FREE
        self.shadow.clear()

    @_work
    def call_prepare(self):
        """Does the driver want a used buffer notification for what was flushed since the last call?"""
        _fence()  # MEM-10: the suppression is read after the publishing store
        if self.packed:
            call = self._packed_notify(self.driver_event, self.used_idx, self.call_added, self.used_wrap)
        elif self.event_idx:  # EVT-06/07
            used_event = self._get16(self.avail, self._used_event_off())
            call = need_event(used_event, self.used_idx, self.used_idx - self.call_added)
        else:  # EVT-04/05
            call = not self._get16(self.avail, 0) & VIRTQ_AVAIL_F_NO_INTERRUPT
        self.call_added = 0
        return call

    @_work
    def enable_kicks(self, on):
        """Ask for (on) or suppress available buffer notifications."""
        if self.packed:
            self._set_packed_event_flags(self.device_event, on)
        elif self.event_idx:  # EVT-16: flags stay 0
            self._put16(self.used, 0, 0)
            self._put16(self.used, self._avail_event_off(),
                        self.last_avail if on else self.last_avail + 0x7FFF)
        else:  # EVT-15
            self._put16(self.used, 0, 0 if on else VIRTQ_USED_F_NO_NOTIFY)
        _fence()  # MEM-10: callers re-check the ring after enabling
