"""Fuzz target ring_device: the device half of every ring variant over arbitrary ring memory and call
sequences.

The input picks a variant (split/packed x normal/in-order, EVENT_IDX, INDIRECT_DESC, in-order batching on or
off), a ring size and a vring base, then a sequence of operations: the driver's writes (raw bytes anywhere in
the ring areas and indirect tables, whole descriptors, avail entries and idx, packed flags with either wrap
bit, event suppression fields) between the device's calls (poll, push_used with polled or arbitrary ids and
lengths, flush, call_prepare, enable_kicks, set_base, snapshot). Every ring area and the indirect/data areas are
separate exact-size heap blocks, so ASan reports any access outside one.

Expected: typed RingErrors (the queue is then broken: every later call raises the same object) and
UsageErrors for calls this harness makes out of contract. A finding: any other exception, a sanitizer report,
or a device state outside the ring (checked after every call).
"""
from common import GuestMemory, Reader, SnapshotOnce, Writer
from rings import virtq
from rings.errors import RingError, UsageError
from rings.layout import (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED,
                          VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE, QueueLayout, area_sizes, bit)

SPLIT_SIZES = (1, 2, 4, 8, 16, 64, 256)
PACKED_SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 64, 255)
DESC, DRIVER, DEVICE, TABLE, DATA = 0x10000, 0x30000, 0x40000, 0x50000, 0x60000
TABLE_SIZE, DATA_SIZE = 0x1000, 0x2000
MAX_OPS = 200


def address(r):
    """A guest address: mostly inside the data or table areas, sometimes anywhere."""
    k = r.u8() % 8
    if k < 5:
        return DATA + r.u16() % DATA_SIZE
    if k < 7:
        return TABLE + 16 * (r.u8() % (TABLE_SIZE // 16))
    return r.u64()


def length(r):
    return r.pick(64, 1514, 0, lambda: 16 * (r.u8() % 40), r.u8, r.u16, r.u32, 0xFFFFFFFF)


def flags(r, wrap, packed):
    f = r.u8()
    out = (f & 1) * VIRTQ_DESC_F_NEXT | (f >> 1 & 1) * VIRTQ_DESC_F_WRITE | (f >> 2 & 1) * VIRTQ_DESC_F_INDIRECT
    if packed:
        mode = f >> 3 & 3   # available in the current lap, in the other lap, used, or raw
        if mode == 0:
            out |= VIRTQ_DESC_F_AVAIL if wrap else VIRTQ_DESC_F_USED
        elif mode == 1:
            out |= VIRTQ_DESC_F_USED if wrap else VIRTQ_DESC_F_AVAIL
        elif mode == 2:
            out |= (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED) if wrap else 0
        else:
            out = r.u16()
    elif f >> 5 & 1:
        out = r.u16()
    return out


class Harness(SnapshotOnce):
    def __init__(self, r):
        cfg = r.u8()
        self.packed = bool(cfg & 1)
        fmt = "packed" if self.packed else "split"
        self.size = size = r.choice(PACKED_SIZES if self.packed else SPLIT_SIZES)
        features = ((bit(VIRTIO_F_RING_PACKED) if self.packed else 0) | (cfg >> 1 & 1) * bit(VIRTIO_F_IN_ORDER)
                    | (cfg >> 2 & 1) * bit(VIRTIO_F_EVENT_IDX) | (cfg >> 3 & 1) * bit(VIRTIO_F_INDIRECT_DESC))
        dsz, drv, dev = area_sizes(fmt, size)
        self.mem = GuestMemory([("desc", DESC, dsz), ("driver", DRIVER, drv), ("device", DEVICE, dev),
                                ("table", TABLE, TABLE_SIZE), ("data", DATA, DATA_SIZE)])
        layout = QueueLayout(fmt, size, DESC, DRIVER, DEVICE)
        self.q = virtq.DeviceQueue(self.mem.table, layout, features, in_order_batch=bool(cfg >> 4 & 1),
                                   max_chains=(None, 1, 3, size)[cfg >> 5 & 3])
        self.polled = []   # (id, wlen), in poll order, not yet pushed
        self.wrap = 1      # the driver's idea of the lap (packed), for well-formed flags
        self.avail_idx = 0
        self.start_at_base = bool(cfg >> 7)

    def base(self, r):
        k = r.u8() % 4
        if k == 0:
            return r.u32()
        if self.packed:
            return (r.u8() % (self.size + 2)) | (k & 1) << 15
        return r.u16()

    def call(self, fn, *args):
        try:
            return fn(*args)
        except UsageError:
            return None

    def check(self):
        """Device state that must hold whatever the input did."""
        c, size = self.q.c, self.size
        assert c.inflight <= size and c.shadow_count <= size and c.fifo_count <= size, self.q.state()
        if self.packed:
            assert c.last_avail < size and c.used_idx < size and c.inflight_slots <= size, self.q.state()
            assert c.avail_wrap in (0, 1) and c.used_wrap in (0, 1)

    # -- the driver's side: writes into ring memory -----------------------------------------------

    def index(self, r):
        """A descriptor index or buffer id: mostly near the ring, sometimes anything."""
        return r.u16() % (self.size + 1) if r.u8() % 4 else r.u16()

    def write_desc(self, r):
        slot = r.below(self.size)
        addr, ln = address(r), length(r)
        f = flags(r, self.wrap, self.packed)
        idx = self.index(r)
        last2 = (idx, f) if self.packed else (f, idx)   # packed: id, flags; split: flags, next
        body = addr.to_bytes(8, "little") + ln.to_bytes(4, "little") + b"".join(
            (v & 0xFFFF).to_bytes(2, "little") for v in last2)
        self.mem.write("desc", 16 * slot, body)
        if self.packed and slot == self.size - 1 and r.u8() & 1:
            self.wrap ^= 1

    def write_table(self, r):
        entry = r.below(TABLE_SIZE // 16)
        body = address(r).to_bytes(8, "little") + length(r).to_bytes(4, "little")
        body += flags(r, self.wrap, False).to_bytes(2, "little") + (r.u8() % 8).to_bytes(2, "little")
        self.mem.write("table", 16 * entry, body)

    def publish(self, r):
        if self.packed:   # driver event suppression: off_wrap, flags
            self.mem.write("driver", 0, r.bytes(4))
            return
        k = r.u8()
        if k & 1:   # an avail ring entry
            slot = r.below(self.size)
            self.mem.write("driver", 4 + 2 * slot, self.index(r).to_bytes(2, "little"))
        step = (r.u8() % (self.size + 2)) if k & 4 else r.u16()
        self.avail_idx = (self.avail_idx + step) & 0xFFFF
        self.mem.write("driver", 2, self.avail_idx.to_bytes(2, "little"))
        if k & 8:   # used_event
            self.mem.write("driver", 4 + 2 * self.size, r.bytes(2))

    def raw(self, r):
        area = r.choice(("desc", "driver", "device", "table", "data"))
        self.mem.write(area, r.u16(), r.bytes(r.u8() % 64))

    # -- the device's calls -------------------------------------------------------------------------

    def poll(self, r):
        ch = self.q.poll(r.u8() % 40 or None)
        for i in range(ch.n):
            self.polled.append((int(ch.id[i]), int(ch.wlen[i])))
        if ch.n:
            ch.segments(ch.n - 1)

    def push_used(self, r):
        k = r.u8()   # bits 0-2: how many; 6: the oldest first; 7: arbitrary ids
        n = min(k % 8, len(self.polled))
        if k & 0x80 or not n:   # arbitrary ids: out of contract, UsageError
            ids = [r.u16() for _ in range(k % 4 + 1)]
            lens = [r.u32() for _ in ids]
        else:
            chosen = self.polled[:n] if k & 0x40 else [self.polled[r.below(len(self.polled))] for _ in range(n)]
            ids = [i for i, _ in chosen]
            lens = [r.pick(w, 0, w // 2, r.u32) for _, w in chosen]
        self.call(self.q.push_used, ids, lens)
        self.polled = [p for p in self.polled if self.q.id_inflight[p[0]] == 1]   # still waiting for a push

    def run(self, r):
        ops = {"desc": self.write_desc, "table": self.write_table, "publish": self.publish, "raw": self.raw,
               "poll": self.poll, "push": self.push_used, "flush": lambda r: self.q.flush(),
               "call": lambda r: self.q.call_prepare(), "kicks": lambda r: self.q.enable_kicks(r.u8() & 1),
               "base": lambda r: self.call(self.q.set_base, self.base(r)), "snapshot": lambda r: self.snapshot()}
        for step in range(MAX_OPS):
            if not r.left:
                break
            op = ops["base"] if step == 0 and self.start_at_base else ops[OPS[r.below(len(OPS))]]
            try:
                op(r)
            except RingError as e:
                assert self.q.broken is e
                try:   # sticky: the same error object, and nothing runs
                    self.q.poll()
                except RingError as again:
                    assert again is e
                else:
                    raise AssertionError("a broken queue polled again")
                self.snapshot()
                return
            self.check()


OPS = ("desc", "desc", "table", "publish", "raw", "poll", "poll", "push", "flush", "call", "kicks", "base",
       "snapshot")


def TestOneInput(data):
    r = Reader(data)
    h = Harness(r)
    h.run(r)
    return h


# ---- seeds: well-formed traffic for each variant (the same encoding, written) ---------------------------

def _op(w, name):
    w.u8(OPS.index(name))


def _desc(w, size, packed, slot, addr_off, write=False, next_=False, idx=0, table=0):
    _op(w, "desc")
    if table:   # an indirect descriptor: the table at entry 0 of the table area, `table` entries long
        w.u8(slot).u8(5).u8(0).u8(3).u8(table).u8(4)
    else:       # slot; address: the data area + offset; length 64; flags (available in the current lap)
        w.u8(slot).u8(0).u16(addr_off).u8(0).u8(next_ | write << 1)
    w.u8(1).u16(idx)                                    # id (packed) / next (split), near the ring
    if packed and slot == size - 1:
        w.u8(1)                                         # the driver's lap turns after the last slot


def _table_entry(w, entry, addr_off, write, next_):
    _op(w, "table")
    w.u8(entry).u8(0).u16(addr_off).u8(0).u8(write << 1 | next_).u8(entry + 1)


def _publish_split(w, slot, head):
    _op(w, "publish")
    w.u8(0b101).u8(slot).u8(1).u16(head).u8(1)          # avail.ring[slot] = head, idx += 1


def seeds():
    out = []
    for packed in (0, 1):
        for in_order in (0, 1):
            for batch in (0, 1):
                for indirect in (0, 1):
                    cfg = packed | in_order << 1 | indirect << 3 | batch << 4
                    sizes = PACKED_SIZES if packed else SPLIT_SIZES
                    size = 8
                    w = Writer().u8(cfg).u8(sizes.index(size))
                    slot = 0
                    for lap in range(3):   # 3 rounds of 3 buffers (one a 2-descriptor chain): the ring wraps
                        ids = []
                        for b in range(3):
                            n = 2 if b == 1 else 1
                            head = slot
                            for k in range(n):
                                s = (slot + k) % size
                                _desc(w, size, packed, s, 64 * (b * 2 + k), write=b == 2,
                                      next_=k + 1 < n, idx=(head if packed else (s + 1) % size))
                            if not packed:
                                _publish_split(w, (lap * 3 + b) % size, head)
                            ids.append(head)
                            slot = (slot + n) % size
                        _op(w, "poll")
                        w.u8(0)
                        _op(w, "push")
                        w.u8(0x40 | 3).u8(0).u8(0).u8(0)       # the three, oldest first, fully used
                        _op(w, "flush")
                        _op(w, "call")
                    out.append(w.bytes())
        for in_order in (0, 1):   # an indirect buffer: 2 entries, readable then writable
            cfg = packed | in_order << 1 | 1 << 3
            w = Writer().u8(cfg).u8((PACKED_SIZES if packed else SPLIT_SIZES).index(8))
            _table_entry(w, 0, 0, 0, 1)
            _table_entry(w, 1, 64, 1, 0)
            _desc(w, 8, packed, 0, 0, idx=0, table=2)
            if not packed:
                _publish_split(w, 0, 0)
            _op(w, "poll")
            w.u8(0)
            _op(w, "push")
            w.u8(0x40 | 1).u8(0)
            _op(w, "flush")
            out.append(w.bytes())
    return out
