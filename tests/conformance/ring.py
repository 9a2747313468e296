"""One virtqueue in test memory for the conformance suite: both halves of one implementation, raw numpy views of
the spec structs, and readers that decode what a peer would see in ring memory (the spec is the oracle: these
walk the bytes, they do not ask the implementation)."""
import numpy as np

from rings.layout import (VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE,
                          QueueLayout, avail_dtype, bit, packed_desc_dtype, split_desc_dtype, used_dtype)
from rings.shm import MemoryTable

BASE = 0x100000
MEMSIZE = 1 << 20
TABLES = BASE + 0x40000     # the driver's indirect tables
SCRATCH = BASE + 0x70000    # hand-made indirect tables
DATA = BASE + 0x80000       # buffers: 256 bytes each
BUF = 256


def feats(fmt, *bits):
    return (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | sum(bit(b) for b in bits)


class Ring:
    """``mod``: rings.virtq, rings.reference or the recording build. ``indirect``: table entries (needs the
    INDIRECT_DESC feature to be used). ``fill``: the byte the memory starts with."""

    def __init__(self, mod, fmt, size, *bits, indirect=None, batch=False, fill=0, driver=True, device=True):
        self.mod, self.fmt, self.size, self.packed = mod, fmt, size, fmt == "packed"
        self.buf = bytearray([fill]) * MEMSIZE
        self.mem = MemoryTable([(BASE, MEMSIZE, self.buf)])
        self.layout = QueueLayout.contiguous(fmt, size, BASE)
        self.features = feats(fmt, *bits)
        lay = self.layout
        self.drv = mod.DriverQueue(self.mem, lay, self.features,
                                   indirect=(TABLES, indirect) if indirect else None) if driver else None
        self.dev = mod.DeviceQueue(self.mem, lay, self.features, in_order_batch=batch) if device else None
        off = lambda gpa: gpa - BASE  # noqa: E731
        if self.packed:
            self.desc = np.frombuffer(self.buf, packed_desc_dtype, size, off(lay.desc))
            self.driver_event = np.frombuffer(self.buf, "<u2", 2, off(lay.driver))   # off_wrap, flags
            self.device_event = np.frombuffer(self.buf, "<u2", 2, off(lay.device))
        else:
            self.desc = np.frombuffer(self.buf, split_desc_dtype, size, off(lay.desc))
            self.avail = np.frombuffer(self.buf, avail_dtype(size), 1, off(lay.driver))[0]
            self.used = np.frombuffer(self.buf, used_dtype(size), 1, off(lay.device))[0]
        self.token = 0

    # ---- memory ----------------------------------------------------------------------------------

    def read(self, gpa, n):
        return bytes(self.buf[gpa - BASE:gpa - BASE + n])

    def write(self, gpa, data):
        self.buf[gpa - BASE:gpa - BASE + len(data)] = data

    def area(self, which):
        """(gpa, length) of 'desc', 'driver' or 'device'."""
        from rings.layout import area_sizes
        sizes = dict(zip(("desc", "driver", "device"), area_sizes(self.fmt, self.size)))
        return getattr(self.layout, which), sizes[which]

    # ---- driving the driver ----------------------------------------------------------------------

    def add(self, shapes, lens=None, base_slot=0):
        """Add buffers of the given (nreadable, nwritable) shapes; segment k of the call uses buffer slot
        base_slot + k (BUF bytes apart). Returns (count added, tokens)."""
        nread = [r for r, _ in shapes]
        nwrite = [w for _, w in shapes]
        nseg = sum(nread) + sum(nwrite)
        addrs = [DATA + BUF * ((base_slot + k) % 512) for k in range(nseg)]
        lens = [64] * nseg if lens is None else lens
        tokens = list(range(self.token, self.token + len(shapes)))
        n = self.drv.add(addrs, lens, nread, nwrite, tokens)
        self.token += n
        return n, tokens[:n]

    # ---- what the device would see (split) -------------------------------------------------------

    def table(self, gpa, length, dtype):
        return np.frombuffer(self.buf, dtype, length // 16, gpa - BASE)

    def walk_split(self, head):
        """Descriptors of the chain at head as (addr, len, flags, next, where) following the bytes: where is
        ('ring', i) or ('table', gpa, j). Raises on a loop or an index outside its table."""
        out, seen = [], set()
        table, where, i = self.desc, "ring", head
        while True:
            key = (where if where == "ring" else where[1], i)
            assert key not in seen, f"loop in the chain at {head}: {key} visited twice"
            seen.add(key)
            assert i < len(table), f"chain at {head}: index {i} outside its table of {len(table)}"
            d = table[i]
            addr, length, flags, nxt = int(d["addr"]), int(d["len"]), int(d["flags"]), int(d["next"])
            out.append((addr, length, flags, nxt, ("ring", i) if where == "ring" else ("table", where[1], i)))
            if flags & VIRTQ_DESC_F_INDIRECT and where == "ring":
                table, where, i = self.table(addr, length, split_desc_dtype), ("table", addr), 0
                continue
            if not flags & VIRTQ_DESC_F_NEXT:
                return out
            i = nxt

    def published_heads_split(self, start=0):
        idx = int(self.avail["idx"])
        return [int(self.avail["ring"][k % self.size]) for k in range(start, idx)]

    # ---- what the device would see (packed) ------------------------------------------------------

    def walk_packed(self, slot):
        """Descriptors of the list at slot as (addr, len, flags, id, where); an indirect descriptor is followed
        by its table entries (where = ('table', gpa, j))."""
        out = []
        for _ in range(self.size):
            d = self.desc[slot]
            addr, length, flags, id = int(d["addr"]), int(d["len"]), int(d["flags"]), int(d["id"])
            out.append((addr, length, flags, id, ("ring", slot)))
            if flags & VIRTQ_DESC_F_INDIRECT:
                for j, e in enumerate(self.table(addr, length, packed_desc_dtype)):
                    out.append((int(e["addr"]), int(e["len"]), int(e["flags"]), int(e["id"]),
                                ("table", addr, j)))
            if not flags & VIRTQ_DESC_F_NEXT:
                return out
            slot = (slot + 1) % self.size
        raise AssertionError(f"list at {slot} longer than the ring")

    def packed_avail(self, slot, wrap):
        f = int(self.desc[slot]["flags"])
        return bool(f & VIRTQ_DESC_F_AVAIL) == bool(wrap) and bool(f & VIRTQ_DESC_F_USED) != bool(wrap)

    def packed_used(self, slot, wrap):
        f = int(self.desc[slot]["flags"])
        return bool(f & VIRTQ_DESC_F_AVAIL) == bool(wrap) == bool(f & VIRTQ_DESC_F_USED)


def segments(walk):
    """The buffer segments (addr, len, write) of a walked chain (a ring descriptor that points to an indirect
    table is not one)."""
    return [(a, n, bool(f & VIRTQ_DESC_F_WRITE)) for a, n, f, _, where in walk
            if not (f & VIRTQ_DESC_F_INDIRECT and where[0] == "ring")]
