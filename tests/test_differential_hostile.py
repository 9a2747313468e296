"""Differential test over hostile ring memory: the device half of the C engine and of the reference model, given
the same bytes written by a driver that breaks the rules (descriptors with any flags, next pointers and ids,
avail entries and indices, packed AVAIL/USED bits of either lap, indirect tables too long for the poll's segment
capacity), must return the same chains, refuse with the same typed error and values, and leave the same ring
memory and state. Mostly two-descriptor chains, so that the C fast paths (vq_dev_simple_*, vq_dev_pairs_*) meet
every rule the general walk checks: polls capped inside runs, runs straddling the ring end, odd packed sizes,
vring bases anywhere, ids repeated. tests/test_differential.py does the same with a well-behaved driver."""
import struct

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from rings import reference, virtq
from rings.errors import RingError, UsageError
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE,
                          QueueLayout, bit)
from rings.shm import MemoryTable

BASE, MEMSIZE = 0x40000, 0x40000
JUNK = BASE + 0x20000     # an indirect "table" of random entries
TABLE = BASE + 0x28000    # valid tables of `size` and `1 + size // 2` entries (split: linked 0 -> 1 -> ...)
TABLE2 = BASE + 0x29000
PAIRS = BASE + 0x2A000    # split: a two-entry table per head (a header and a frame, as a driver's Tx without headroom)
DATA = BASE + 0x30000
NEXT, WRITE, INDIRECT = VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, VIRTQ_DESC_F_INDIRECT
FLAGS = [NEXT, NEXT | WRITE, 0, WRITE, INDIRECT, INDIRECT | NEXT]
ADDRS = [DATA, DATA + 64, BASE + MEMSIZE - 32, 0]   # the last two: outside guest memory for 64 bytes
LENS = [0, 32, 64, 1500, 0xFFFFFFFF]


class Sides:
    """The same guest memory and device queue twice: [0] the C engine, [1] the reference model."""

    def __init__(self, fmt, size, in_order, batch):
        self.fmt, self.size, self.packed = fmt, size, fmt == "packed"
        self.layout = QueueLayout.contiguous(fmt, size, BASE)
        f = bit(VIRTIO_F_INDIRECT_DESC) | (bit(VIRTIO_F_RING_PACKED) if self.packed else 0) \
            | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
        self.bufs, self.devs = [], []
        for impl in (virtq, reference):
            buf = bytearray(MEMSIZE)
            self.bufs.append(buf)
            self.devs.append(impl.DeviceQueue(MemoryTable([(BASE, MEMSIZE, buf)]), self.layout, f,
                                              in_order_batch=batch))
        self.avail_idx, self.slot, self.wrap = 0, 0, 1   # where this "driver" writes next
        self.polled = []   # ids polled and not completed, in polled order
        self.next_id = 0   # of the next big indirect buffer: in ring order, as a driver would

    def put(self, gpa, fmt, *values):
        for buf in self.bufs:
            struct.pack_into(fmt, buf, gpa - BASE, *values)

    def desc(self, k, addr, length, flags, other):
        """Descriptor k: split (addr, len, flags, next = other); packed (addr, len, id = other, flags)."""
        if self.packed:
            self.put(self.layout.desc + 16 * k, "<QIHH", addr, length, other, flags)
        else:
            self.put(self.layout.desc + 16 * k, "<QIHH", addr, length, flags, other)

    def avail_bits(self, wrap):
        return VIRTQ_DESC_F_AVAIL if wrap else VIRTQ_DESC_F_USED

    def offer(self, head, step=1):
        """Split: head at avail.ring[avail_idx], avail.idx moved by step."""
        self.put(self.layout.driver + 4 + 2 * (self.avail_idx % self.size), "<H", head)
        self.avail_idx = (self.avail_idx + step) & 0xFFFF
        self.put(self.layout.driver + 2, "<H", self.avail_idx)

    def both(self, fn):
        out = []
        for dev in self.devs:
            try:
                out.append(("ok", fn(dev)))
            except (RingError, UsageError) as e:
                out.append(("error", type(e).__name__, getattr(e, "a", None), getattr(e, "b", None)))
        note(f"{out}")
        assert out[0] == out[1]
        return out[0]

    def check_same(self):
        assert self.bufs[0] == self.bufs[1]
        a, b = (dev.snapshot() for dev in self.devs)
        a.pop("broken"), b.pop("broken")   # the message texts differ; type and values are compared above
        assert a == b
        sa, sb = (dev.state() for dev in self.devs)
        if not self.packed:   # the wrap counters mean nothing there (the two models leave them apart)
            sa, sb = ({k: v for k, v in s.items() if not k.endswith("_wrap")} for s in (sa, sb))
        assert sa == sb


def chains(ch):
    return [(int(ch.id[k]), int(ch.ndesc[k]), int(ch.rlen[k]), int(ch.wlen[k]),
             [tuple(map(int, s)) for s in ch.segments(k)]) for k in range(ch.n)]


def step(s, data):
    size = s.size
    op = data.draw(st.sampled_from(["pair"] * 6 + ["raw", "big", "big", "poll", "poll", "complete", "flush", "base"]))
    if op == "pair":   # a two-descriptor chain, most often well formed
        good = data.draw(st.integers(0, 7)) > 0
        w0, w1 = data.draw(st.sampled_from([(0, WRITE), (0, 0), (WRITE, WRITE)] + ([] if good else [(WRITE, 0)])))
        l0, l1 = (data.draw(st.sampled_from(LENS if not good else [12, 64, 1500])) for _ in range(2))
        a1 = data.draw(st.sampled_from(ADDRS)) if not good else DATA + 64
        if s.packed:
            s0, s1 = s.slot, (s.slot + 1) % size
            w_1 = s.wrap ^ (s1 == 0)
            fresh = good or data.draw(st.booleans())
            s.desc(s1, a1, l1, w1 | (s.avail_bits(w_1) if fresh else s.avail_bits(not w_1)),
                   data.draw(st.integers(0, size if not good else size - 1)))
            s.desc(s0, DATA, l0, NEXT | w0 | s.avail_bits(s.wrap), data.draw(st.integers(0, size)))
            s.slot += 2
            if s.slot >= size:
                s.slot, s.wrap = s.slot - size, s.wrap ^ 1
        elif data.draw(st.integers(0, 2)) == 0:   # split: one ring descriptor, a table of two (vq_dev_pairs_split)
            head = data.draw(st.integers(0, size - 1))
            table = PAIRS + 32 * head
            # well formed, or exactly one defect, so that each check of the general walk meets the fast path alone
            bad = "" if good else data.draw(st.sampled_from(
                ["len", "outside", "desc_flags", "e0_last", "e0_nested", "e0_next", "e1_next", "e1_nested",
                 "e1_outside", "order"]))
            if bad == "order":
                w0, w1 = WRITE, 0
            f0 = {"e0_last": w0, "e0_nested": INDIRECT | NEXT | w0}.get(bad, NEXT | w0)
            f1 = {"e1_next": NEXT | w1, "e1_nested": INDIRECT | w1}.get(bad, w1)
            s.put(table, "<QIHH", DATA, 64, f0, data.draw(st.sampled_from([0, 2, 0xFFFF])) if bad == "e0_next" else 1)
            s.put(table + 16, "<QIHH", BASE + MEMSIZE - 32 if bad == "e1_outside" else DATA + 64, 64, f1,
                  data.draw(st.sampled_from([0, 1])))
            s.desc(head, BASE + MEMSIZE - 16 if bad == "outside" else table,
                   data.draw(st.sampled_from([16, 48, 0, 17])) if bad == "len" else 32,
                   INDIRECT | (data.draw(st.sampled_from([WRITE, NEXT])) if bad == "desc_flags" else 0),
                   data.draw(st.integers(0, size)))
            s.offer(head)
        else:
            head = data.draw(st.integers(0, size - 1))
            nxt = data.draw(st.integers(0, size - 1 if good else size))
            if good and nxt == head and size > 1:
                nxt = (head + 1) % size
            if nxt < size and nxt != head:
                s.desc(nxt, a1, l1, w1, data.draw(st.integers(0, size)))
            s.desc(head, DATA, l0, NEXT | w0, nxt)
            s.offer(head)
    elif op == "raw":   # any descriptor at any position; split: maybe offered, avail.idx moved anyhow
        k = data.draw(st.integers(0, size - 1))
        flags = data.draw(st.sampled_from(FLAGS))
        if flags & INDIRECT:
            addr, length = JUNK, data.draw(st.sampled_from([0, 8, 16, 48, 16 * size, 16 * size + 16]))
        else:
            addr, length = data.draw(st.sampled_from(ADDRS)), data.draw(st.sampled_from(LENS))
        if s.packed:
            flags |= data.draw(st.sampled_from([s.avail_bits(s.wrap), s.avail_bits(not s.wrap), 0,
                                                VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED]))
        s.desc(k, addr, length, flags, data.draw(st.sampled_from([k, (k + 1) % size, 0, size, 0xFFFF])))
        if not s.packed and data.draw(st.booleans()):
            s.offer(data.draw(st.sampled_from([k, size, 0xFFFF])), data.draw(st.sampled_from([1, 1, 2, 0])))
    elif op == "big":   # indirect buffers of up to `size` entries, enough to fill the segment capacity 2 * size + 64
        for _ in range(data.draw(st.integers(1, 2 + 96 // size))):
            table, entries = data.draw(st.sampled_from([(TABLE, size), (TABLE, size), (TABLE2, 1 + size // 2)]))
            if s.packed:
                s.desc(s.slot, table, 16 * entries, INDIRECT | s.avail_bits(s.wrap),
                       s.next_id)
                s.slot += 1
                if s.slot == size:
                    s.slot, s.wrap = 0, s.wrap ^ 1
            else:
                s.desc(s.next_id, table, 16 * entries, INDIRECT, 0)
                s.offer(s.next_id)
            s.next_id = (s.next_id + 1) % size
    elif op == "poll":
        cap = data.draw(st.integers(1, 2 * size + 2))
        got = s.both(lambda dev: chains(dev.poll(cap)))
        if got[0] == "ok":
            s.polled += [c[0] for c in got[1]]
    elif op == "complete" and s.polled:   # the oldest k, in polled order (IN_ORDER allows no other)
        k = data.draw(st.integers(1, len(s.polled)))
        ids, s.polled = s.polled[:k], s.polled[k:]
        s.both(lambda dev: dev.push_used(ids, [0] * k))
    elif op == "flush":
        s.both(lambda dev: dev.flush())
    else:
        base = data.draw(st.sampled_from([0, size - 1, 0x8000 | (size - 1), 0x8000, 0xFFFF]))
        if s.both(lambda dev: dev.set_base(base))[0] == "ok":
            if s.packed:
                s.slot, s.wrap = base & 0x7FFF, base >> 15
            else:
                s.avail_idx = base
                s.put(s.layout.driver + 2, "<H", base)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), fmt=st.sampled_from(["split", "packed"]), in_order=st.booleans(), batch=st.booleans())
def test_c_matches_reference_on_hostile_rings(data, fmt, in_order, batch):
    size = data.draw(st.sampled_from([1, 2, 4, 8, 16, 16, 16] if fmt == "split" else [1, 2, 3, 5, 7, 8, 16, 16, 255]))
    s = Sides(fmt, size, in_order, batch)
    for j in range(64):   # the junk table: random flags (NEXT, WRITE, INDIRECT) and links
        s.put(JUNK + 16 * j, "<QIHH", DATA + 64 * (j % 8), 64, [0, 0, NEXT, WRITE, INDIRECT, NEXT | WRITE][j % 6],
              (j * 7 + 1) % 64)
    for table, entries in ((TABLE, size), (TABLE2, 1 + size // 2)):   # valid tables (split: linked in order)
        for j in range(entries):
            link = j + 1 < entries and not s.packed
            s.put(table + 16 * j, "<QIHH", DATA, 64, NEXT if link else 0, j + 1 if link else 0)
    for _ in range(data.draw(st.integers(1, 50))):
        step(s, data)
        s.check_same()
        if s.devs[0].broken is not None:
            s.both(lambda dev: dev.poll(1))   # sticky: the same error again
            return
