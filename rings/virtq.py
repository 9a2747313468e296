"""The C hot path: DriverQueue and DeviceQueue over csrc/virtq.h (semantics: rings/README.md).

Python runs once per call (a burst); the C code runs once per descriptor. The variant
(split/packed x normal/in-order) is fixed in the C state when the queue is built.
"""
import numpy as np

from . import errors
from . import rawdump as _rawdump
from ._virtq import ffi, lib
from .errors import ConfigError, UsageError
from .layout import (ALIGN, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC,
                     VIRTIO_F_RING_PACKED, area_sizes, check_host_alignment, has)


class CMemory:
    """A MemoryTable as a C ``struct vq_mem`` (host pointers stay valid while this object lives)."""

    def __init__(self, mem):
        self.table = mem
        self.c = ffi.new("struct vq_mem *")
        self._keep = []
        for i, r in enumerate(mem.regions):
            base = ffi.from_buffer(r.buf, require_writable=True)
            self._keep.append(base)
            self.c.r[i].gpa = r.gpa
            self.c.r[i].size = r.size
            self.c.r[i].host = ffi.cast("uint8_t *", base) + r.offset
        self.c.nregions = len(mem.regions)

    def host(self, gpa, length):
        p = lib.vq_translate(self.c, gpa, length)
        if p == ffi.NULL:
            raise errors.AddressOutOfBounds(
                f"guest range {gpa:#x}+{length:#x} is outside the memory table", gpa, length)
        return p


def _cmem(mem):
    return mem if isinstance(mem, CMemory) else CMemory(mem)


def _ptr(ctype, arr):
    return ffi.cast(ctype, ffi.from_buffer(arr))


def _u(arr, dtype):
    """A contiguous array of dtype (no copy when it already is one)."""
    return np.ascontiguousarray(arr, dtype=dtype)


def ring_error(code, a, b, side, size):
    """The typed exception for a C error code, with a message that says what the peer did."""
    msg = {
        1: f"avail ring entry {b} holds head {a}, outside the queue (size {size})",
        2: f"descriptor {a} chains to next={b}, outside its table",
        3: f"chain at {a} is too long ({b}): more descriptors than the queue or table holds, or over 2^32 bytes",
        4: f"avail idx moved from {a} to {b}: by more than the queue size {size}",
        5: f"indirect descriptor at {a:#x} has an empty table",
        6: f"indirect table at {a:#x} has length {b}, not a multiple of 16",
        7: f"chain at {a}: indirect descriptor inside an indirect table (entry {b})",
        8: f"chain at {a}: indirect descriptor combined with a NEXT chain (at {b})",
        9: f"readable segment {a:#x}+{b:#x} after a writable one",
        10: f"packed buffer id {a} (at slot {b}) is outside the queue (size {size})",
        11: f"buffer id {a} (at {b}) is already in flight",
        12: f"guest range {a:#x}+{b:#x} is outside the memory table",
        13: f"used id {a} (at used position {b}) is not a buffer in flight",
        14: f"used length {b} for buffer {a} is larger than its writable part",
        15: f"used idx moved from {a} to {b}: by more than the queue size or than the batch allows",
        16: f"packed slot {a} made available again while it belongs to a chain in flight "
            f"({b} slots in flight, queue size {size})",
        17: f"vring base {a:#x} is no position of this ring (size {b}; packed: slot | wrap << 15), or {a} "
            f"entries taken past it are more than the ring holds",
        18: f"the inflight area was made for a {'packed' if a else 'split'} ring of {b} entries, not this one "
            f"(size {size})",
    }[code]
    return errors.RING_ERRORS[code](f"{side}: {msg}", a, b, side)


class _Queue:
    side = ""

    def __init__(self, mem, layout, features, ctype):
        self.layout = layout
        self.features = features
        self.size = layout.size
        if has(features, VIRTIO_F_RING_PACKED) != layout.packed:
            raise ConfigError(f"RING_PACKED={has(features, VIRTIO_F_RING_PACKED)} does not match "
                              f"a {layout.fmt} layout")
        self.in_order = has(features, VIRTIO_F_IN_ORDER)
        self.event_idx = has(features, VIRTIO_F_EVENT_IDX)
        self.mem = _cmem(mem)
        self.broken = None
        c = self.c = ffi.new(ctype)
        c.size = layout.size
        c.packed = layout.packed
        c.in_order = self.in_order
        c.event_idx = self.event_idx
        dsz, drv, dev = area_sizes(layout.fmt, layout.size)
        try:
            desc, driver, device = (self.mem.host(layout.desc, dsz), self.mem.host(layout.driver, drv),
                                    self.mem.host(layout.device, dev))
        except errors.AddressOutOfBounds as e:
            raise ConfigError(f"ring area outside the memory table: {e}") from None
        for what, gpa, ptr, align in zip(("descriptor area", "driver area", "device area"),
                                         (layout.desc, layout.driver, layout.device), (desc, driver, device),
                                         ALIGN[layout.fmt]):
            check_host_alignment(what, gpa, int(ffi.cast("uintptr_t", ptr)), align)
        if layout.packed:
            c.pdesc = ffi.cast("struct vring_packed_desc *", desc)
            c.driver_event = ffi.cast("struct vring_packed_event *", driver)
            c.device_event = ffi.cast("struct vring_packed_event *", device)
        else:
            c.desc = ffi.cast("struct vring_desc *", desc)
            c.avail = ffi.cast("struct vring_avail *", driver)
            c.used = ffi.cast("struct vring_used *", device)
        if layout.packed:
            c.avail_wrap = c.used_wrap = 1  # PACKED-D-02, PACKED-V-01
        n = layout.size
        self.id_ndesc = np.zeros(n, np.uint16)
        self.id_wlen = np.zeros(n, np.uint32)
        self.id_inflight = np.zeros(n, np.uint8)
        c.id_ndesc = _ptr("uint16_t *", self.id_ndesc)
        c.id_wlen = _ptr("uint32_t *", self.id_wlen)
        c.id_inflight = _ptr("uint8_t *", self.id_inflight)

    def _check(self):
        if self.broken is not None:
            raise self.broken

    def mark_broken(self):
        """Turn the C error code into the sticky typed error (for C loops that break a queue) and return it."""
        if self.broken is None:
            c = self.c
            self.broken = ring_error(c.error, c.err_a, c.err_b, self.side, self.size)
            _rawdump.on_broken(self, self.broken)  # a raw snapshot, if a snapshot directory is set
        return self.broken

    def _fail(self):
        raise self.mark_broken()

    def state(self):
        """The C state as a dict of plain ints (for snapshots)."""
        c = self.c
        return {k: int(getattr(c, k)) for k in self._state_fields}


class DriverQueue(_Queue):
    """The driver half of one virtqueue (the C path)."""

    side = "driver"
    _state_fields = ("next_avail", "avail_wrap", "last_used", "used_wrap", "num_free", "free_head", "free_tail",
                     "next_desc", "oldest", "inflight", "kick_added", "pending")

    def __init__(self, mem, layout, features, indirect=None):
        super().__init__(mem, layout, features, "struct vq_driver *")
        c, n = self.c, layout.size
        if not layout.packed:
            c.used.flags = 0  # EVT-10: the driver initialises the used ring's flags
        c.num_free = n
        c.free_tail = max(n - 1, 0)   # the free list runs 0, 1, ... n-1 (a FIFO: vq_drv_free_append)
        self.free_next = (np.arange(1, n + 1) % max(n, 1)).astype(np.uint16)
        self.id_token = np.zeros(n, np.uint64)
        c.free_next = _ptr("uint16_t *", self.free_next)
        c.id_token = _ptr("uint64_t *", self.id_token)
        self.indirect = None
        if indirect is not None and has(features, VIRTIO_F_INDIRECT_DESC):
            gpa, max_entries = indirect
            if not 2 <= max_entries <= n:
                raise ConfigError(f"indirect tables must hold 2..{n} entries, not {max_entries}")
            c.use_indirect = 1
            c.indirect_max = max_entries
            c.indirect_gpa = gpa
            c.indirect_host = self.mem.host(gpa, n * max_entries * 16)
            check_host_alignment("indirect area", gpa, int(ffi.cast("uintptr_t", c.indirect_host)), 16)
            self.indirect = (gpa, max_entries)
        self._out_tokens = np.zeros(n, np.uint64)
        self._out_lens = np.zeros(n, np.uint32)
        self._p_tokens = _ptr("uint64_t *", self._out_tokens)
        self._p_lens = _ptr("uint32_t *", self._out_lens)

    @property
    def num_free(self):
        return self.c.num_free

    @property
    def inflight(self):
        return self.c.inflight

    def add(self, addrs, lens, nreadable, nwritable, tokens):
        """Add buffers (flat segment arrays, per-buffer counts). Returns how many fitted."""
        self._check()
        nread = _u(nreadable, np.uint16)
        nwrite = _u(nwritable, np.uint16)
        tokens = _u(tokens, np.uint64)
        nseg = nread.astype(np.int64) + nwrite
        if len(nread) != len(nwrite) or len(tokens) != len(nread):
            raise ConfigError("nreadable, nwritable and tokens must have one entry per buffer")
        if (nseg == 0).any():
            raise ConfigError("a buffer needs at least one segment")
        direct = nseg if self.indirect is None else nseg[(nseg == 1) | (nseg > self.indirect[1])]
        if (direct > self.size).any():
            raise ConfigError(f"a chain of {int(direct.max())} descriptors exceeds queue size "
                              f"{self.size} (SPLIT-D-05/PACKED-D-09)")
        addrs = _u(addrs, np.uint64)
        lens = _u(lens, np.uint32)
        if len(addrs) != nseg.sum() or len(lens) != len(addrs):
            raise ConfigError("addrs and lens must hold nreadable+nwritable segments per buffer")
        if len(lens):  # SPLIT-D-04: neither part of a buffer may exceed 2^32-1 bytes
            starts = np.concatenate(([0], np.cumsum(nseg)[:-1]))
            writable = np.arange(len(lens)) >= np.repeat(starts + nread, nseg)
            per_buf = np.repeat(np.arange(len(nseg)), nseg)
            for part in (writable, ~writable):
                if (np.bincount(per_buf[part], lens[part], len(nseg)) > 0xFFFFFFFF).any():
                    raise ConfigError("a buffer's readable or writable part exceeds 2^32-1 bytes")
        return lib.vq_drv_add(self.c, _ptr("uint64_t *", addrs), _ptr("uint32_t *", lens),
                              _ptr("uint16_t *", nread), _ptr("uint16_t *", nwrite),
                              _ptr("uint64_t *", tokens), len(tokens))

    def add_simple(self, addrs, lens, tokens, writable=False):
        """Add one-segment buffers, all readable or all writable (the common fast path)."""
        self._check()
        addrs = _u(addrs, np.uint64)
        lens = _u(lens, np.uint32)
        tokens = _u(tokens, np.uint64)
        return lib.vq_drv_add_simple(self.c, _ptr("uint64_t *", addrs), _ptr("uint32_t *", lens),
                                     int(writable), _ptr("uint64_t *", tokens), len(tokens))

    def publish(self):
        self._check()
        lib.vq_drv_publish(self.c)

    def kick_prepare(self):
        self._check()
        return bool(lib.vq_drv_kick_prepare(self.c))

    def reclaim(self, max_bufs=None):
        """Used buffers as (tokens, lens) views, valid until the next reclaim."""
        self._check()
        n = lib.vq_drv_reclaim(self.c, self._p_tokens, self._p_lens,
                               self.size if max_bufs is None else max_bufs)
        if n < 0:
            self._fail()
        return self._out_tokens[:n], self._out_lens[:n]

    def enable_calls(self, on):
        self._check()
        lib.vq_drv_enable_calls(self.c, int(bool(on)))

    #: what reset() puts back as at creation (the configuration and the array pointers stay)
    _reset_fields = ("next_avail", "last_used", "free_head", "next_desc", "oldest", "inflight", "kick_added",
                     "pending", "pending_head", "pending_flags", "error", "err_a", "err_b")

    def reset(self):
        """Forget every buffer and lay the ring out afresh (zeroed areas, fresh indices and wrap counters, as at
        creation). Returns the tokens of the buffers that were in flight (oldest first with IN_ORDER), now the
        caller's again.

        For a packed ring whose device vanished without an inflight area: it may have written used
        descriptors of a batch without the head's flags (published last), and those slots would look neither
        available nor used to its successor, which would stop there for good. DPDK virtio_user resets the ring
        on reconnect for that reason."""
        c, n = self.c, self.size
        ids = np.flatnonzero(self.id_inflight)
        if self.in_order:   # ids are ring slots: oldest from the used position on
            ids = sorted(ids, key=lambda i: (int(i) - c.last_used) % n)
        tokens = self.id_token[np.asarray(ids, np.int64)].copy()
        for name in self._reset_fields:
            setattr(c, name, 0)
        c.num_free = n
        c.free_tail = max(n - 1, 0)
        c.avail_wrap = c.used_wrap = 1 if self.layout.packed else 0
        self.free_next[:] = np.arange(1, n + 1) % max(n, 1)
        for arr in (self.id_ndesc, self.id_wlen, self.id_token, self.id_inflight):
            arr[:] = 0
        for gpa, size in zip((self.layout.desc, self.layout.driver, self.layout.device),
                             area_sizes(self.layout.fmt, n)):
            ffi.memmove(self.mem.host(gpa, size), bytes(size), size)
        self.broken = None
        return tokens

    def snapshot(self):
        from .snapshot import driver_snapshot
        return driver_snapshot(self)


class Chains:
    """The result of one poll: per-chain and per-segment arrays (views valid until the next poll)."""

    def __init__(self, cap_chains, cap_segs):
        self._id = np.zeros(cap_chains, np.uint16)
        self._ndesc = np.zeros(cap_chains, np.uint16)
        self._nseg = np.zeros(cap_chains, np.uint16)
        self._seg_start = np.zeros(cap_chains, np.uint32)
        self._rlen = np.zeros(cap_chains, np.uint32)
        self._wlen = np.zeros(cap_chains, np.uint32)
        self._seg_addr = np.zeros(cap_segs, np.uint64)
        self._seg_len = np.zeros(cap_segs, np.uint32)
        self._seg_write = np.zeros(cap_segs, np.uint8)
        c = self.c = ffi.new("struct vq_chains *")
        c.cap_chains, c.cap_segs = cap_chains, cap_segs
        for name, ctype in (("id", "uint16_t *"), ("ndesc", "uint16_t *"), ("nseg", "uint16_t *"),
                            ("seg_start", "uint32_t *"), ("rlen", "uint32_t *"), ("wlen", "uint32_t *"),
                            ("seg_addr", "uint64_t *"), ("seg_len", "uint32_t *"),
                            ("seg_write", "uint8_t *")):
            setattr(c, name, _ptr(ctype, getattr(self, "_" + name)))
        self.n = 0
        self.nsegs = 0

    def _set(self, n):
        self.n, self.nsegs = n, self.c.nsegs
        for name in ("id", "ndesc", "nseg", "seg_start", "rlen", "wlen"):
            setattr(self, name, getattr(self, "_" + name)[:n])
        for name in ("seg_addr", "seg_len", "seg_write"):
            setattr(self, name, getattr(self, "_" + name)[:self.nsegs])

    def segments(self, i):
        """(addr, len, write) triples of chain i (for tests and tools, not the hot path)."""
        s, k = int(self.seg_start[i]), int(self.nseg[i])
        return [(int(self.seg_addr[j]), int(self.seg_len[j]), int(self.seg_write[j]))
                for j in range(s, s + k)]


class DeviceQueue(_Queue):
    """The device half of one virtqueue (the C path)."""

    side = "device"
    _state_fields = ("last_avail", "avail_wrap", "used_idx", "used_wrap", "call_added", "inflight",
                     "shadow_count")

    def __init__(self, mem, layout, features, in_order_batch=False, max_chains=None):
        super().__init__(mem, layout, features, "struct vq_device *")
        c, n = self.c, layout.size
        c.mem = self.mem.c
        c.batch = int(bool(in_order_batch))
        self.in_order_batch = bool(in_order_batch)
        self.fifo = np.zeros(n, np.uint16)
        self.shadow_id = np.zeros(n, np.uint32)
        self.shadow_len = np.zeros(n, np.uint32)
        c.fifo = _ptr("uint16_t *", self.fifo)
        c.shadow_id = _ptr("uint32_t *", self.shadow_id)
        c.shadow_len = _ptr("uint32_t *", self.shadow_len)
        self.chains = Chains(max_chains or n, 2 * n + 64)
        self.set_base(0x8000 if layout.packed else 0)  # PACKED-V-01: slot 0, wrap counters 1

    def set_base(self, base, taken=0):
        """Start at a vring base (vhost-user SET_VRING_BASE: split avail idx; packed slot | wrap << 15), on an
        idle queue, the avail position ``taken`` buffers (split) / descriptors (packed) further (chains a
        predecessor took, replayed from the inflight area). The C code checks both: BaseOutOfRange (sticky)."""
        self._check()
        clamp = lambda v: v if 0 <= v <= 0xFFFFFFFF else 0xFFFFFFFF  # noqa: E731
        r = lib.vq_dev_set_base(self.c, clamp(base), clamp(taken))
        if r < 0:
            self._fail()
        if r:
            raise UsageError({103: "set_base: the queue has buffers in flight",
                              104: f"set_base: queue size {self.size} is not a valid ring size"}[r])

    @property
    def inflight(self):
        return self.c.inflight

    def poll(self, max_chains=None):
        self._check()
        n = lib.vq_dev_poll(self.c, self.chains.c, self.size if max_chains is None else max_chains)
        if n < 0:
            self._fail()
        self.chains._set(n)
        return self.chains

    def push_used(self, ids, lens):
        self._check()
        ids = _u(ids, np.uint32)
        lens = _u(lens, np.uint32)
        r = lib.vq_dev_push_used(self.c, _ptr("uint32_t *", ids), _ptr("uint32_t *", lens), len(ids))
        if r:
            raise UsageError({100: "completing a buffer that is not polled-and-pending",
                              101: "IN_ORDER: completions must come in the order buffers were polled",
                              102: "shadow used array full: flush first"}[r])

    def flush(self):
        self._check()
        lib.vq_dev_flush(self.c)

    def call_prepare(self):
        self._check()
        return bool(lib.vq_dev_call_prepare(self.c))

    def enable_kicks(self, on):
        self._check()
        lib.vq_dev_enable_kicks(self.c, int(bool(on)))

    def snapshot(self):
        from .snapshot import device_snapshot
        return device_snapshot(self)
