"""Ring memory as the harnesses see it: numpy views of the three areas of a split or packed queue, and
chain walks that read descriptors straight from memory (no engine in between).

The views alias the shared memory: reading an element is one load of the peer's current value. The walks
are bounded (at most ``size`` hops, one indirect level) and raise ``Malformed`` instead of looping; they are
used on rings whose rules were already enforced (by our own driver, or by ``rings.DeviceQueue``), to learn
which descriptors and bytes a buffer is made of.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rings.layout import (VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE, packed_desc_dtype, split_desc_dtype, used_elem_dtype)


class Malformed(Exception):
    """A chain that cannot be walked (the caller turns it into evidence)."""


def _u8(mem, gpa, n):
    return np.frombuffer(mem.view(gpa, n), np.uint8)


@dataclass
class Chain:
    """One buffer as found in memory. ``slots``: ring descriptor indices (split) or slots (packed), in chain
    order; ``table``: (gpa, bytes) of its indirect table; ``segs``: (gpa, len, writable) in order;
    ``ids``/``flags``: per ring descriptor (packed ids; flags as read)."""

    head: int
    slots: list = field(default_factory=list)
    flags: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    table: tuple | None = None
    table_entries: list = field(default_factory=list)   # (addr, len, flags, next-or-id) per table entry
    segs: list = field(default_factory=list)

    @property
    def ndesc(self):
        return len(self.slots)

    @property
    def wlen(self):
        return sum(n for _a, n, w in self.segs if w)

    @property
    def rlen(self):
        return sum(n for _a, n, w in self.segs if not w)


class _View:
    def __init__(self, mem, layout, desc_dtype):
        n = self.size = layout.size
        self.mem = mem
        self.layout = layout
        self.desc = np.frombuffer(mem.view(layout.desc, 16 * n), desc_dtype)
        self.desc_bytes = _u8(mem, layout.desc, 16 * n)

    def raw(self, chain):
        """The bytes of the chain's ring descriptors and indirect table as they are now (for re-reads)."""
        parts = [self.desc_bytes[16 * i:16 * i + 16].tobytes() for i in chain.slots]
        if chain.table:
            parts.append(self.mem.read(*chain.table))
        return b"".join(parts)


class SplitView(_View):
    def __init__(self, mem, layout):
        super().__init__(mem, layout, split_desc_dtype)
        n = self.size
        self.avail = np.frombuffer(mem.view(layout.driver, 6 + 2 * n), "<u2")   # flags, idx, ring[n], used_event
        self.driver_bytes = _u8(mem, layout.driver, 6 + 2 * n)
        self.used_hdr = np.frombuffer(mem.view(layout.device, 4), "<u2")        # flags, idx
        self.used = np.frombuffer(mem.view(layout.device + 4, 8 * n), used_elem_dtype)
        self.used_raw = np.frombuffer(mem.view(layout.device + 4, 8 * n), "<u4").reshape(n, 2)
        self.avail_event_arr = np.frombuffer(mem.view(layout.device + 4 + 8 * n, 2), "<u2")
        self.device_bytes = _u8(mem, layout.device, 6 + 8 * n)

    avail_flags = property(lambda s: int(s.avail[0]))
    avail_idx = property(lambda s: int(s.avail[1]))
    used_event = property(lambda s: int(s.avail[2 + s.size]))
    used_flags = property(lambda s: int(s.used_hdr[0]))
    used_idx = property(lambda s: int(s.used_hdr[1]))
    avail_event = property(lambda s: int(s.avail_event_arr[0]))

    def avail_ring(self, pos):
        return int(self.avail[2 + (pos % self.size)])

    def walk(self, head):
        """The chain at ``head`` (descriptor table, then at most one indirect table)."""
        n = self.size
        if head >= n:
            raise Malformed(f"head {head} outside the table ({n})")
        c = Chain(head)
        i, hops = head, 0
        while True:
            d = self.desc[i]
            flags = int(d["flags"])
            c.slots.append(i)
            c.flags.append(flags)
            hops += 1
            if hops > n:
                raise Malformed(f"chain at {head} loops (more than {n} descriptors)")
            if flags & VIRTQ_DESC_F_INDIRECT:
                self._walk_table(c, int(d["addr"]), int(d["len"]))
                return c
            c.segs.append((int(d["addr"]), int(d["len"]), bool(flags & VIRTQ_DESC_F_WRITE)))
            if not flags & VIRTQ_DESC_F_NEXT:
                return c
            i = int(d["next"])
            if i >= n:
                raise Malformed(f"descriptor {c.slots[-1]} chains to {i}, outside the table")

    def _walk_table(self, c, addr, nbytes):
        if nbytes == 0 or nbytes % 16:
            raise Malformed(f"indirect table length {nbytes}")
        count = nbytes // 16
        t = np.frombuffer(self.mem.view(addr, nbytes), split_desc_dtype)
        c.table = (addr, nbytes)
        j, hops = 0, 0
        while True:
            e = t[j]
            flags = int(e["flags"])
            c.table_entries.append((int(e["addr"]), int(e["len"]), flags, int(e["next"])))
            hops += 1
            if hops > count or flags & VIRTQ_DESC_F_INDIRECT:
                raise Malformed("indirect table loops or nests")
            c.segs.append((int(e["addr"]), int(e["len"]), bool(flags & VIRTQ_DESC_F_WRITE)))
            if not flags & VIRTQ_DESC_F_NEXT:
                return
            j = int(e["next"])
            if j >= count:
                raise Malformed(f"indirect entry chains to {j}, outside the table ({count})")


class PackedView(_View):
    def __init__(self, mem, layout):
        super().__init__(mem, layout, packed_desc_dtype)
        self.driver_event = np.frombuffer(mem.view(layout.driver, 4), "<u2")   # off_wrap, flags
        self.device_event = np.frombuffer(mem.view(layout.device, 4), "<u2")
        self.driver_bytes = _u8(mem, layout.driver, 4)
        self.device_bytes = _u8(mem, layout.device, 4)

    def flags(self, slot):
        return int(self.desc[slot]["flags"])

    def walk(self, slot, head_flags=None):
        """The list starting at ``slot`` (consecutive slots while NEXT). ``head_flags``: the head's flags when
        they are not in memory yet (our driver keeps them aside until it publishes)."""
        n = self.size
        c = Chain(slot)
        i = slot
        while True:
            d = self.desc[i]
            flags = int(d["flags"]) if (i != slot or head_flags is None) else head_flags
            c.slots.append(i)
            c.flags.append(flags)
            c.ids.append(int(d["id"]))
            if len(c.slots) > n:
                raise Malformed(f"list at slot {slot} is longer than the ring ({n})")
            if flags & VIRTQ_DESC_F_INDIRECT:
                addr, nbytes = int(d["addr"]), int(d["len"])
                if nbytes == 0 or nbytes % 16:
                    raise Malformed(f"indirect table length {nbytes}")
                c.table = (addr, nbytes)
                for e in np.frombuffer(self.mem.view(addr, nbytes), packed_desc_dtype):
                    ef = int(e["flags"])
                    c.table_entries.append((int(e["addr"]), int(e["len"]), ef, int(e["id"])))
                    c.segs.append((int(e["addr"]), int(e["len"]), bool(ef & VIRTQ_DESC_F_WRITE)))
                return c
            c.segs.append((int(d["addr"]), int(d["len"]), bool(flags & VIRTQ_DESC_F_WRITE)))
            if not flags & VIRTQ_DESC_F_NEXT:
                return c
            i = i + 1 if i + 1 < n else 0


def avail_bits_ok(flags, wrap):
    """PACKED-D-03: AVAIL == wrap and USED == !wrap."""
    return bool(flags & VIRTQ_DESC_F_AVAIL) == bool(wrap) and bool(flags & VIRTQ_DESC_F_USED) != bool(wrap)


def used_bits(flags):
    """(AVAIL, USED) bits of a descriptor's flags as 0/1."""
    return int(bool(flags & VIRTQ_DESC_F_AVAIL)), int(bool(flags & VIRTQ_DESC_F_USED))


def view_for(mem, layout):
    return PackedView(mem, layout) if layout.packed else SplitView(mem, layout)
