"""Inflight I/O tracking, the backend's side (vhost-user VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD).

GET_INFLIGHT_FD: the backend creates the area (a memfd, ``num_queues`` regions of ``queue_region_size``
bytes), zeroed, packed free lists linked, and gives the fd to the frontend. The frontend keeps it across
backend restarts and hands it to every backend with SET_INFLIGHT_FD before the rings are kicked.

While a queue runs, the C data path (csrc/vhost_inflight.h) records in the queue's region what it has taken
and what it has completed. When a queue starts, ``QueueTracking.start`` reads the region the predecessor
left: it repairs the last batch if the predecessor died between publishing used entries and clearing their
inflight flags, finds every chain still in flight, sorts them by the order they were first taken (their
``counter``), and sets the device's ring positions so that the C poll takes exactly those chains again,
first, then new ones. The area is the frontend's memory: it is validated before it is believed (a value out
of range is a ``Refused`` naming it, and the queue does not start).

Layouts (shared/spec/vhost-user.md 5.1; QEMU's vhost-user spec, DPDK's ``rte_vhost_inflight_info_*``):

* split, per queue ``ALIGN64(16 + 16*Q)``: ``u64 features; u16 version, desc_num, last_batch_head, used_idx``,
  then ``DescStateSplit {u8 inflight; u8 pad[5]; u16 next; u64 counter}`` per head descriptor;
* packed, per queue ``ALIGN64(29 + 32*Q)``: ``u64 features; u16 version, desc_num, free_head, old_free_head,
  used_idx, old_used_idx; u8 used_wrap_counter, old_used_wrap_counter, pad[7]``, then from offset 32
  ``DescStatePacked {u8 inflight; u8 pad; u16 next, last, num; u64 counter; u16 id, flags; u32 len;
  u64 addr}``: a free list of entries, each in-flight chain a list of entries holding descriptor copies.
"""
from __future__ import annotations

import fcntl
import logging
import os

import numpy as np

from rings.errors import ShmError, VringError
from rings.shm import ShmRegion, seal_shrink

from ._net import ffi

log = logging.getLogger("vhost")

VERSION = 1
ALIGN = 64
VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_USED = 1 << 7, 1 << 15

DESC_SPLIT = np.dtype([("inflight", "u1"), ("padding", "u1", 5), ("next", "<u2"), ("counter", "<u8")])
HDR_SPLIT = np.dtype([("features", "<u8"), ("version", "<u2"), ("desc_num", "<u2"),
                      ("last_batch_head", "<u2"), ("used_idx", "<u2")])
DESC_PACKED = np.dtype([("inflight", "u1"), ("padding", "u1"), ("next", "<u2"), ("last", "<u2"), ("num", "<u2"),
                        ("counter", "<u8"), ("id", "<u2"), ("flags", "<u2"), ("len", "<u4"), ("addr", "<u8")])
HDR_PACKED = np.dtype([("features", "<u8"), ("version", "<u2"), ("desc_num", "<u2"), ("free_head", "<u2"),
                       ("old_free_head", "<u2"), ("used_idx", "<u2"), ("old_used_idx", "<u2"),
                       ("used_wrap_counter", "u1"), ("old_used_wrap_counter", "u1"), ("padding", "u1", 7)])
DESC_OFFSET = {False: 16, True: 32}   # where desc[] starts (the packed header is 29 bytes, desc[] 8-aligned)

# the numpy layouts are the C structs of csrc/vhost_net_types.h, byte for byte
assert DESC_SPLIT.itemsize == ffi.sizeof("struct vhi_desc_split") == 16
assert HDR_SPLIT.itemsize == ffi.sizeof("struct vhi_region_split") == 16
assert DESC_PACKED.itemsize == ffi.sizeof("struct vhi_desc_packed") == 32
assert HDR_PACKED.itemsize == 29 and ffi.sizeof("struct vhi_region_packed") == 32



class InflightError(VringError):
    """The inflight area cannot be used as given (size, layout, or contents a predecessor cannot have left)."""


def queue_region_size(packed, queue_size):
    """Bytes per queue: ALIGN64(29 + 32*Q) packed, ALIGN64(16 + 16*Q) split (as DPDK computes it)."""
    raw = 29 + 32 * queue_size if packed else 16 + 16 * queue_size
    return -(-raw // ALIGN) * ALIGN


def _views(buf, offset, packed, size):
    """(header record, desc array) of one queue's region, as writable numpy views."""
    hdr = np.ndarray((), HDR_PACKED if packed else HDR_SPLIT, buffer=buf, offset=offset)
    desc = np.ndarray((size,), DESC_PACKED if packed else DESC_SPLIT, buffer=buf, offset=offset + DESC_OFFSET[packed])
    return hdr, desc


def _init_free_lists(buf, packed, num_queues, queue_size):
    if not packed:
        return
    step = queue_region_size(True, queue_size)
    for i in range(num_queues):
        hdr, desc = _views(buf, i * step, True, queue_size)
        desc["next"] = np.arange(1, queue_size + 1)   # the last one points past the end: the list ends
        hdr["used_wrap_counter"] = hdr["old_used_wrap_counter"] = 1   # PACKED-V-01: a fresh ring's wrap is 1
        del hdr, desc


def create_area(num_queues, queue_size, packed):
    """GET_INFLIGHT_FD: a zeroed memfd of ``num_queues`` regions (packed: free lists linked, wrap counters 1).
    Returns (fd, mmap_size); the caller sends the fd and closes it."""
    if not 1 <= num_queues <= 256 or not 1 <= queue_size <= 32768:
        raise InflightError(f"GET_INFLIGHT_FD: {num_queues} queues of {queue_size} entries is out of range")
    size = num_queues * queue_region_size(packed, queue_size)
    try:   # size-sealed before the frontend gets it, so that it cannot shrink it under a later mapping of ours
        shm = ShmRegion.create_sealed(size, name="vhost-inflight")
    except ShmError as e:
        raise InflightError(f"GET_INFLIGHT_FD: {e}") from None
    try:
        _init_free_lists(shm.buf, packed, num_queues, queue_size)
        return os.dup(shm.fileno()), size
    finally:
        shm.close()


class InflightArea:
    """The area a frontend handed over with SET_INFLIGHT_FD, mapped (owns ``fd``)."""

    def __init__(self, fd, mmap_size, mmap_offset, num_queues, queue_size, packed):
        self.num_queues, self.queue_size, self.packed = num_queues, queue_size, bool(packed)
        self.step = queue_region_size(self.packed, queue_size)
        need = num_queues * self.step
        if not 1 <= queue_size <= 32768 or num_queues < 1:
            os.close(fd)
            raise InflightError(f"SET_INFLIGHT_FD: {num_queues} queues of {queue_size} entries is out of range")
        if mmap_size < need:
            os.close(fd)
            raise InflightError(f"SET_INFLIGHT_FD: {mmap_size:#x} bytes cannot hold {num_queues} "
                                f"{'packed' if packed else 'split'} regions of {self.step:#x} bytes")
        try:
            seal_shrink(fd, "SET_INFLIGHT_FD area")
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise InflightError(f"SET_INFLIGHT_FD: bad fd ({e.strerror})") from None
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            os.close(fd)
            raise InflightError("SET_INFLIGHT_FD: the area is not sealed against shrinking (F_SEAL_SHRINK); the "
                                "frontend could truncate it under the mapping (GET_INFLIGHT_FD makes sealed ones)")
        if mmap_offset + mmap_size > st.st_size:
            os.close(fd)
            raise InflightError(f"SET_INFLIGHT_FD: offset {mmap_offset:#x} + size {mmap_size:#x} ends outside "
                                f"the file ({st.st_size:#x} bytes)")
        try:   # mapped from offset 0, as the memory regions (from_fd closes fd if it fails)
            self.shm = ShmRegion.from_fd(fd, mmap_offset + mmap_size, 0)
        except ShmError as e:
            raise InflightError(f"SET_INFLIGHT_FD: {e}") from None
        self.offset = mmap_offset
        self._cbuf = ffi.from_buffer(self.shm.buf, require_writable=True)

    def region(self, index):
        """(C pointer, offset in the mapping) of queue ``index``'s region."""
        if not 0 <= index < self.num_queues:
            raise InflightError(f"the inflight area has {self.num_queues} queues, not vring {index}")
        off = self.offset + index * self.step
        return ffi.cast("uint8_t *", self._cbuf) + off, off

    def close(self):
        if self._cbuf is not None:
            ffi.release(self._cbuf)
            self._cbuf = None
        self.shm.close()


def _avail_bits(wrap):
    return VIRTQ_DESC_F_AVAIL if wrap else VIRTQ_DESC_F_USED


class QueueTracking:
    """The C ``struct vh_inflight`` of one queue over its region, and the recovery done when the queue starts."""

    def __init__(self, area: InflightArea, index, size):
        if size != area.queue_size:
            raise InflightError(f"vring {index} has {size} entries but the inflight area was made for "
                                f"{area.queue_size}")
        self.area, self.index, self.size, self.packed = area, index, size, area.packed
        ptr, self.offset = area.region(index)
        c = self.c = ffi.new("struct vh_inflight *")
        c.region = ptr
        c.size = size
        c.packed = int(self.packed)
        self.arrays = {name: np.zeros(size, np.uint16)
                       for name in ("entry_of_id", "e_next", "e_last", "e_num", "resubmit")}
        for name, arr in self.arrays.items():
            setattr(c, name, ffi.cast("uint16_t *", ffi.from_buffer(arr)))
        self._scratch = ffi.new("struct vring_packed_desc[]", size)
        c.scratch = self._scratch
        self.recovered = 0

    def views(self):
        return _views(self.area.shm.buf, self.offset, self.packed, self.size)

    # -- start -------------------------------------------------------------------------------------

    def start(self, q, mem):
        """Read the region (repairing the last batch), queue what is still in flight for resubmission and set
        the DeviceQueue ``q``'s positions (split: ``used->idx`` in ``mem`` + in flight; packed: the region's
        used position + the in-flight chains' descriptors). Returns the number of chains to resubmit."""
        if bool(q.c.packed) != self.packed or q.size != self.size:   # features changed after SET_INFLIGHT_FD
            raise InflightError(f"vring {self.index}: the inflight area was made for {self.size}-entry "
                                f"{'packed' if self.packed else 'split'} rings; this vring is a {q.size}-entry "
                                f"{'packed' if q.c.packed else 'split'} ring")
        hdr, desc = self.views()
        try:
            if int(hdr["version"]) == 0:
                self._fresh(q, hdr, desc, mem)
                return 0
            if int(hdr["version"]) != VERSION:
                raise InflightError(f"vring {self.index}: inflight region version {int(hdr['version'])} "
                                    f"(this backend knows {VERSION})")
            heads = (self._recover_packed if self.packed else self._recover_split)(q, hdr, desc, mem)
        finally:
            del hdr, desc
        log.info("vring %d: inflight region read: %d chains in flight", self.index, len(heads))
        self.recovered = len(heads)
        return len(heads)

    def _fresh(self, q, hdr, desc, mem):
        """A region nobody has used: start tracking at the ring's current position."""
        c = self.c
        hdr["desc_num"] = self.size
        desc["inflight"] = 0
        if self.packed:
            desc["next"] = np.arange(1, self.size + 1)
            self.arrays["e_next"][:] = np.arange(1, self.size + 1)
            c.free_head = 0
            c.used_idx, c.used_wrap = q.c.used_idx, q.c.used_wrap
            hdr["free_head"] = hdr["old_free_head"] = 0
            hdr["used_idx"] = hdr["old_used_idx"] = q.c.used_idx
            hdr["used_wrap_counter"] = hdr["old_used_wrap_counter"] = q.c.used_wrap
        else:
            hdr["last_batch_head"] = 0
            hdr["used_idx"] = _used_idx(q, mem)
        c.counter = 0
        hdr["version"] = VERSION

    def _resubmit(self, heads, counters):
        order = np.argsort(counters, kind="stable")
        heads = np.asarray(heads, np.uint16)[order]
        self.arrays["resubmit"][:len(heads)] = heads
        self.c.nresubmit, self.c.resubmit_pos = len(heads), 0
        last = int(counters.max()) if len(heads) else -1
        if last >= 2**64 - 1:   # no later counter to give the next chain: no backend counts that far
            raise InflightError(f"vring {self.index}: an entry in flight has counter {last:#x}, the last there is")
        self.c.counter = last + 1
        return heads

    def _recover_split(self, q, hdr, desc, mem):
        size = self.size
        used = _used_idx(q, mem)
        if int(hdr["used_idx"]) != used:   # died between used->idx and clearing the batch: clear it now
            batch = (used - int(hdr["used_idx"])) & 0xFFFF
            if batch > size:
                raise InflightError(f"vring {self.index}: used->idx {used} is {batch} past the region's "
                                    f"used_idx {int(hdr['used_idx'])} (more than the ring holds)")
            e = int(hdr["last_batch_head"])
            for _ in range(batch):
                if e >= size:
                    raise InflightError(f"vring {self.index}: the last batch lists head {e}, outside the ring")
                desc[e]["inflight"] = 0
                e = int(desc[e]["next"])
            log.info("vring %d: the predecessor died after publishing %d used entries; their inflight flags "
                     "cleared", self.index, batch)
            hdr["used_idx"] = used
        flags = desc["inflight"]
        if (flags > 1).any():
            raise InflightError(f"vring {self.index}: inflight flag {int(flags.max())} (0 or 1 expected)")
        heads = np.flatnonzero(flags == 1)
        heads = self._resubmit(heads, desc["counter"][heads])
        self.c.last_batch_head = int(hdr["last_batch_head"]) if int(hdr["last_batch_head"]) < size else 0
        # every avail entry before used->idx is used; those after it, up to the in-flight count, were taken
        q.set_base(used, len(heads))   # the ring engine bounds both
        return heads

    def _recover_packed(self, q, hdr, desc, mem):
        size, c = self.size, self.c
        for name in ("free_head", "old_free_head"):
            if int(hdr[name]) > size:
                raise InflightError(f"vring {self.index}: {name} {int(hdr[name])} is outside the region ({size})")
        for name in ("used_idx", "old_used_idx"):
            if int(hdr[name]) >= size:
                raise InflightError(f"vring {self.index}: {name} {int(hdr[name])} is outside the ring ({size})")
        for name in ("used_wrap_counter", "old_used_wrap_counter"):
            if int(hdr[name]) > 1:
                raise InflightError(f"vring {self.index}: {name} is {int(hdr[name])}")
        if (int(hdr["used_idx"]), int(hdr["used_wrap_counter"])) != \
                (int(hdr["old_used_idx"]), int(hdr["old_used_wrap_counter"])):
            # died inside a completion: published if the batch's first slot no longer shows the descriptor
            # available in the old lap (used, or already made available again by the driver)
            slot, wrap = int(hdr["old_used_idx"]), int(hdr["old_used_wrap_counter"])
            flags = _desc_flags_packed(q, mem, slot)
            published = flags & (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED) != _avail_bits(wrap)
            if published:
                e, steps = int(hdr["free_head"]), 0
                while e != int(hdr["old_free_head"]):
                    if e >= size or steps > size:
                        raise InflightError(f"vring {self.index}: the last batch's free list is broken at {e}")
                    desc[e]["inflight"] = 0
                    last = int(desc[e]["last"])
                    if last >= size:
                        raise InflightError(f"vring {self.index}: entry {e} ends at {last}, outside the region")
                    e = int(desc[last]["next"])
                    steps += 1
            for name in ("free_head", "used_idx", "used_wrap_counter"):
                if published:
                    hdr["old_" + name] = hdr[name]
                else:
                    hdr[name] = hdr["old_" + name]
            log.info("vring %d: the predecessor died inside a completion (%s)", self.index,
                     "published: kept" if published else "not published: rolled back")
        flags = desc["inflight"]
        if (flags > 1).any():
            raise InflightError(f"vring {self.index}: inflight flag {int(flags.max())} (0 or 1 expected)")
        heads = np.flatnonzero(flags == 1)
        member = np.zeros(size, bool)
        e_next, e_last, e_num = self.arrays["e_next"], self.arrays["e_last"], self.arrays["e_num"]
        total = 0
        for h in heads:   # each in-flight chain: num entries linked by next, ending at last
            h = int(h)
            num, last = int(desc[h]["num"]), int(desc[h]["last"])
            if not 1 <= num <= size:
                raise InflightError(f"vring {self.index}: in-flight chain at entry {h} has {num} descriptors")
            e = h
            for j in range(num):
                if e >= size or member[e]:
                    raise InflightError(f"vring {self.index}: in-flight chain at entry {h} runs into entry {e} "
                                        f"(outside the region or in another chain)")
                member[e] = True
                if j < num - 1:
                    nxt = int(desc[e]["next"])
                    e_next[e] = nxt
                    e = nxt
            if e != last:
                raise InflightError(f"vring {self.index}: in-flight chain at entry {h} ends at {e}, not at its "
                                    f"last entry {last}")
            e_last[h], e_num[h] = last, num
            total += num
        if total > size:
            raise InflightError(f"vring {self.index}: {total} descriptors in flight in a ring of {size}")
        # the free list, rebuilt from what no chain holds (whatever the predecessor left half-linked)
        free = np.flatnonzero(~member)
        nxt = np.append(free[1:], size).astype(np.uint16)
        e_next[free] = nxt
        desc["next"][free] = nxt
        c.free_head = int(free[0]) if len(free) else size
        hdr["free_head"] = hdr["old_free_head"] = c.free_head
        heads = self._resubmit(heads, desc["counter"][heads])
        used, wrap = int(hdr["used_idx"]), int(hdr["used_wrap_counter"])
        c.used_idx, c.used_wrap = used, wrap
        base = (q.c.used_idx, q.c.used_wrap)
        if base != (used, wrap):
            log.warning("vring %d: the frontend's base is slot %d wrap %d but the inflight region says the device "
                        "used up to slot %d wrap %d; resuming there", self.index, base[0], base[1], used, wrap)
        q.set_base(used | wrap << 15, total)   # the ring engine bounds both
        return heads

    def stats(self):
        c = self.c
        return {"inflight_taken": int(c.taken), "inflight_completed": int(c.completed),
                "inflight_resubmitted": int(c.resubmitted), "inflight_stopped": int(c.stopped)}


def _used_idx(q, mem):
    """split: used->idx as it is in ring memory (``mem`` copies guarded: a truncated region is GuestMemoryFault)."""
    return int.from_bytes(mem.read(q.layout.device + 2, 2), "little")


def _desc_flags_packed(q, mem, slot):
    """packed: the flags of descriptor ``slot`` as they are in ring memory (read as ``_used_idx``)."""
    return int.from_bytes(mem.read(q.layout.desc + 16 * slot + 14, 2), "little")
