"""The device poll's fast path over runs of one-descriptor chains (rings/csrc/virtq.h vq_dev_simple_*), against
the reference model: runs longer than one pass (VQ_RUN = 32), interrupted by chains of several descriptors and by
indirect ones, and polls capped in the middle of a run, give the same chains, ids and ring state
(SPLIT-V-04/05, PACKED-V-04/09/10/18, INORDER-02)."""
import struct

import numpy as np
import pytest

from rings import reference, virtq
from rings.errors import RingError
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, QueueLayout, bit)
from rings.shm import MemoryTable

BASE, MEMSIZE, SIZE = 0x40000, 0x80000, 256
INDIRECT, DATA = BASE + 0x20000, BASE + 0x60000


def side(impl, fmt, in_order):
    buf = bytearray(MEMSIZE)
    mem = MemoryTable([(BASE, MEMSIZE, buf)])
    lay = QueueLayout.contiguous(fmt, SIZE, BASE)
    f = bit(VIRTIO_F_INDIRECT_DESC) | (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) \
        | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
    return buf, impl.DriverQueue(mem, lay, f, indirect=(INDIRECT, 4)), impl.DeviceQueue(mem, lay, f)


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True])
def test_runs_of_one_descriptor_chains_match_the_reference(fmt, in_order):
    # 70 one-descriptor buffers, a 3-segment chain, 5 more, a 2-segment (indirect) one, 40 more; writable mixed
    shapes = [(1, 0)] * 70 + [(1, 2)] + [(0, 1)] * 5 + [(2, 0)] + [(1, 0)] * 40
    polls = [10, 50, 200, 200]           # caps that cut runs in the middle
    out = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf, drv, dev = side(impl, fmt, in_order)
        nread = np.array([r for r, _ in shapes], np.uint16)
        nwrite = np.array([w for _, w in shapes], np.uint16)
        nseg = int(nread.sum() + nwrite.sum())
        addrs = DATA + 64 * np.arange(nseg, dtype=np.uint64)
        lens = np.full(nseg, 64, np.uint32)
        assert drv.add(addrs, lens, nread, nwrite, np.arange(len(shapes), dtype=np.uint64)) == len(shapes)
        drv.publish()
        got = []
        for cap in polls:
            ch = dev.poll(cap)
            got.append([(int(ch.id[k]), int(ch.ndesc[k]), ch.segments(k), int(ch.rlen[k]), int(ch.wlen[k]))
                        for k in range(ch.n)])
            dev.push_used(ch.id, np.zeros(ch.n, np.uint32))
            dev.flush()
        state = dev.state()
        if fmt == "split":   # the wrap counters mean nothing there (the two models leave them apart)
            state = {k: v for k, v in state.items() if not k.endswith("_wrap")}
        out[name] = (got, bytes(buf), state)
    assert out["c"][0] == out["reference"][0]
    assert sum(len(g) for g in out["c"][0]) == len(shapes)
    assert out["c"][1] == out["reference"][1]
    assert out["c"][2] == out["reference"][2]


# ---- a chain left for lack of room is still checked first -------------------------------------------------

CAP_SIZE = 16   # segment capacity 2 * 16 + 64 = 96: six indirect chains of 16 entries fill it


def full_then(impl, fmt, defect):
    """Six indirect chains of 16 entries (the whole segment capacity of one poll), then a chain with a defect:
    a two-descriptor one (second descriptor outside memory, or readable after a writable head, or packed: an
    id >= size) or a one-descriptor one (packed: an id >= size)."""
    buf = bytearray(MEMSIZE)
    mem = MemoryTable([(BASE, MEMSIZE, buf)])
    lay = QueueLayout.contiguous(fmt, CAP_SIZE, BASE)
    features = bit(VIRTIO_F_INDIRECT_DESC) | (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0)
    dev = impl.DeviceQueue(mem, lay, features)
    desc, avail = lay.desc - BASE, lay.driver - BASE
    put = lambda off, *v: struct.pack_into("<QIHH", buf, off, *v)   # noqa: E731
    av = VIRTQ_DESC_F_AVAIL
    for j in range(CAP_SIZE):
        last = j == CAP_SIZE - 1
        put(INDIRECT - BASE + 16 * j, DATA, 64, 0 if last or fmt == "packed" else VIRTQ_DESC_F_NEXT,
            0 if last or fmt == "packed" else j + 1)
    for k in range(6):
        if fmt == "split":
            put(desc + 16 * k, INDIRECT, 16 * CAP_SIZE, VIRTQ_DESC_F_INDIRECT, 0)
            struct.pack_into("<H", buf, avail + 4 + 2 * k, k)
        else:
            put(desc + 16 * k, INDIRECT, 16 * CAP_SIZE, k, VIRTQ_DESC_F_INDIRECT | av)
    bad_addr = BASE + MEMSIZE - 32 if defect == "outside" else DATA
    head_w = VIRTQ_DESC_F_WRITE if defect == "readable_after_writable" else 0
    bad_id = CAP_SIZE + 3 if defect in ("id", "simple_id") else 6
    if fmt == "split":
        put(desc + 16 * 6, DATA, 64, VIRTQ_DESC_F_NEXT | head_w, 7)
        put(desc + 16 * 7, bad_addr, 64, 0, 0)
        struct.pack_into("<H", buf, avail + 4 + 2 * 6, 6)
        struct.pack_into("<H", buf, avail + 2, 7)
    elif defect == "simple_id":
        put(desc + 16 * 6, DATA, 64, bad_id, av)
    else:
        put(desc + 16 * 7, bad_addr, 64, bad_id, av)
        put(desc + 16 * 6, DATA, 64, 6, VIRTQ_DESC_F_NEXT | head_w | av)
    return buf, dev


@pytest.mark.parametrize("fmt,defect", [("split", "outside"), ("split", "readable_after_writable"),
                                        ("packed", "outside"), ("packed", "readable_after_writable"),
                                        ("packed", "id"), ("packed", "simple_id")])
def test_split_v_14_packed_d_23_chain_left_for_lack_of_room_is_refused_like_the_reference(fmt, defect):
    """SPLIT-V-14, SPLIT-D-02/PACKED-D-10, FEAT-07, PACKED-D-23: a defective chain right after a poll's segment
    capacity is full is refused by that poll, as the reference model refuses it (it walks and checks a chain
    before it asks whether it fits); the C engine left it unchecked for the next poll."""
    errors = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf, dev = full_then(impl, fmt, defect)
        before = bytes(buf)
        with pytest.raises(RingError) as info:
            dev.poll()
        assert dev.broken is info.value
        assert bytes(buf) == before, "a device that refuses a ring must not write it"
        errors[name] = type(info.value)
    assert errors["c"] is errors["reference"]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_02_packed_d_10_feat_07_segment_breaking_two_rules_refused_like_the_reference(fmt):
    """SPLIT-D-02/PACKED-D-10 and FEAT-07 at once: the readable second descriptor of a two-descriptor chain
    with a writable head also lies outside guest memory. Either rule refuses it; the C engine must name the one
    the reference model names (the order of readable before writable, then the address)."""
    errors = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf = bytearray(MEMSIZE)
        mem = MemoryTable([(BASE, MEMSIZE, buf)])
        lay = QueueLayout.contiguous(fmt, 8, BASE)
        dev = impl.DeviceQueue(mem, lay, bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0)
        desc, av = lay.desc - BASE, VIRTQ_DESC_F_AVAIL if fmt == "packed" else 0
        struct.pack_into("<QIHH", buf, desc + 16, BASE + MEMSIZE - 32, 64, *((1, av) if fmt == "packed" else (0, 0)))
        struct.pack_into("<QIHH", buf, desc, DATA, 64,
                         *((1, av | VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE) if fmt == "packed"
                           else (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 1)))
        if fmt == "split":
            struct.pack_into("<HHH", buf, lay.driver - BASE, 0, 1, 0)   # flags, idx = 1, ring[0] = head 0
        with pytest.raises(RingError) as info:
            dev.poll()
        errors[name] = type(info.value)
    assert errors["c"] is errors["reference"]


@pytest.mark.parametrize("with_next", [True, False])
def test_packed_d_20_indirect_in_a_list_reports_the_same_slot_in_both(with_next):
    """PACKED-D-20: a list whose second descriptor is INDIRECT (with NEXT, or ending the list) is refused by
    both implementations with the same values: the list's first slot and the slot of the INDIRECT descriptor."""
    got = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf = bytearray(MEMSIZE)
        mem = MemoryTable([(BASE, MEMSIZE, buf)])
        lay = QueueLayout.contiguous("packed", 8, BASE)
        dev = impl.DeviceQueue(mem, lay, bit(VIRTIO_F_RING_PACKED) | bit(VIRTIO_F_INDIRECT_DESC))
        dev.set_base(0x8000 | 5)   # the list at slots 5, 6, 7
        desc, av = lay.desc - BASE, VIRTQ_DESC_F_AVAIL
        put = lambda slot, *v: struct.pack_into("<QIHH", buf, desc + 16 * slot, *v)   # noqa: E731
        struct.pack_into("<QIHH", buf, INDIRECT - BASE, DATA, 64, 0, 0)   # a valid one-entry table
        put(7, DATA, 64, 3, av)
        put(6, INDIRECT, 16, 3, av | VIRTQ_DESC_F_INDIRECT | (VIRTQ_DESC_F_NEXT if with_next else 0))
        put(5, DATA, 64, 3, av | VIRTQ_DESC_F_NEXT)
        with pytest.raises(RingError) as info:
            dev.poll()
        got[name] = (type(info.value).__name__, info.value.a, info.value.b)
    assert got["c"] == got["reference"] == ("IndirectWithNext", 5, 6)


@pytest.mark.parametrize("defect", ["head_out_of_range", "head_in_flight"])
def test_split_v_14_split_d_13_bad_head_reports_the_same_values_in_both(defect):
    """SPLIT-V-14 / SPLIT-D-13: a head >= queue size, or one already in flight, past a vring base that is not a
    multiple of the ring size, is refused by both implementations with the same values: the head and the
    free-running avail position (not its ring slot)."""
    got = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf = bytearray(MEMSIZE)
        mem = MemoryTable([(BASE, MEMSIZE, buf)])
        lay = QueueLayout.contiguous("split", 4, BASE)
        dev = impl.DeviceQueue(mem, lay, 0)
        dev.set_base(5)
        avail = lay.driver - BASE
        struct.pack_into("<QIHH", buf, lay.desc - BASE + 16 * 2, DATA, 64, 0, 0)
        second = 9 if defect == "head_out_of_range" else 2
        struct.pack_into("<HHHHHH", buf, avail, 0, 7, 0, 2, second, 0)   # idx 7: ring[1] = 2, ring[2] = second
        with pytest.raises(RingError) as info:
            dev.poll()
        got[name] = (type(info.value).__name__, info.value.a, info.value.b)
    assert got["c"] == got["reference"]
    assert got["c"][1:] == (second, 6)


@pytest.mark.parametrize("size", [1, 2])
def test_split_d_05_two_entry_table_taken_by_the_fast_path_only_when_the_walk_would(size):
    """A ring descriptor of a two-entry indirect table (a header and a frame) goes by vq_dev_pairs_split. On a queue
    of one entry the table is longer than the queue (SPLIT-D-05 / SPLIT-V-14): refused as the general walk and the
    reference refuse it, not taken; on a queue of two, taken as one ring descriptor and two segments."""
    out = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf = bytearray(MEMSIZE)
        lay = QueueLayout.contiguous("split", size, BASE)
        dev = impl.DeviceQueue(MemoryTable([(BASE, MEMSIZE, buf)]), lay, bit(VIRTIO_F_INDIRECT_DESC))
        struct.pack_into("<QIHH", buf, INDIRECT - BASE, DATA, 12, VIRTQ_DESC_F_NEXT, 1)
        struct.pack_into("<QIHH", buf, INDIRECT - BASE + 16, DATA + 64, 64, 0, 0)
        struct.pack_into("<QIHH", buf, lay.desc - BASE, INDIRECT, 32, VIRTQ_DESC_F_INDIRECT, 0)
        struct.pack_into("<HH", buf, lay.driver - BASE, 0, 1)   # avail flags, idx 1; ring[0] = 0
        try:
            ch = dev.poll()
            out[name] = [(int(ch.id[k]), int(ch.ndesc[k]), ch.segments(k)) for k in range(ch.n)]
        except RingError as e:
            out[name] = type(e).__name__   # the two word their messages apart
    assert out["c"] == out["reference"]
    assert out["c"] == ([(0, 1, [(DATA, 12, 0), (DATA + 64, 64, 0)])] if size == 2 else "ChainTooLong")
