"""Two-descriptor direct chains (a header and a frame: what a driver posts when the header is not in the frame's
headroom), which the C engine takes on a fast path of their own (rings/csrc/virtq.h vq_dev_pairs_*). The oracle
is the spec, read from the ring bytes with ring.py's walkers: every chain comes out whole, with the right id and
lengths, and every defect a driver can put into one is refused with the same typed error as on the general walk,
also in the middle of a run, for the C engine and the reference model."""
import struct

import pytest

from rings.errors import (AddressOutOfBounds, BufferIdInUse, IndirectWithNext, NextOutOfRange, PackedIdOutOfRange,
                          SlotInFlight, WritableBeforeReadable)
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT,
                          VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE, split_desc_dtype)

from ring import BASE, DATA, MEMSIZE, SCRATCH, Ring, segments

SIZE = 16


def expect_refused(r, exc):
    snapshot = bytes(r.buf)
    with pytest.raises(exc) as info:
        r.dev.poll()
    assert r.dev.broken is info.value
    assert bytes(r.buf) == snapshot, "a device that refuses a ring must not write it"
    return info.value


def add_pairs(r, n, shape=(1, 1)):
    """n published two-descriptor buffers; returns the ring positions of their two descriptors (split: head
    and next; packed: the two slots)."""
    assert r.add([shape] * n)[0] == n
    r.drv.publish()
    if r.packed:
        return [(2 * k % r.size, (2 * k + 1) % r.size) for k in range(n)]
    heads = r.published_heads_split()[-n:]
    return [(h, int(r.desc[h]["next"])) for h in heads]


# ---- runs of them, taken whole -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True])
def test_split_v_01_packed_v_09_packed_v_10_two_descriptor_runs_taken_whole(impl, fmt, in_order):
    """SPLIT-V-01, PACKED-V-09/10: lap after lap, runs of two-descriptor buffers (readable + writable, two
    readable, two writable) between one- and three-descriptor ones, polled with caps that cut the runs: each
    buffer comes out with the segments, descriptor count and id the ring bytes give it (packed: the id of the
    last descriptor, PACKED-V-10), and the used ring skips by that count (PACKED-V-09)."""
    r = Ring(impl, fmt, SIZE, *((VIRTIO_F_IN_ORDER,) if in_order else ()))
    shapes = [(1, 1)] * 3 + [(1, 0)] + [(2, 0)] + [(0, 2)] + [(2, 1)] + [(1, 1)]   # 16 descriptors
    slot = 0
    for lap in range(5):
        n, tokens = r.add(shapes, base_slot=16 * lap)
        assert n == len(shapes)
        first = len(r.published_heads_split()) if not r.packed else None
        r.drv.publish()
        if r.packed:
            # PACKED-V-10: the id is the last descriptor's; poison the others' to show it
            pos = slot
            expected = []
            for rd, wr in shapes:
                walk = r.walk_packed(pos)
                assert len(walk) == rd + wr
                for a, length, f, i, where in walk[:-1]:
                    r.desc[where[1]]["id"] = 0xBEEF
                expected.append((walk[-1][3], rd + wr, segments(walk)))
                pos = (pos + rd + wr) % SIZE
            slot = pos
        else:
            heads = r.published_heads_split()[first:]
            expected = [(h, len(r.walk_split(h)), segments(r.walk_split(h))) for h in heads]
        got = []
        for cap in (2, 3, 100):
            ch = r.dev.poll(cap)
            for k in range(ch.n):
                segs = [(a, n, bool(w)) for a, n, w in ch.segments(k)]
                rlen = sum(n for _, n, w in segs if not w)
                assert (int(ch.rlen[k]), int(ch.wlen[k])) == (rlen, sum(n for _, n, w in segs if w))
                got.append((int(ch.id[k]), int(ch.ndesc[k]), segs))
            r.dev.push_used(ch.id, ch.wlen)
            r.dev.flush()
        assert got == expected, f"lap {lap}"
        done, _ = r.drv.reclaim()
        assert list(done) == tokens


# ---- defects in the middle of a run ------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_02_packed_d_10_writable_before_readable_in_a_run_refused(impl, fmt):
    """SPLIT-D-02 / PACKED-D-10 (SPLIT-V-14): the third of five buffers has its writable descriptor first."""
    r = Ring(impl, fmt, SIZE)
    pos = add_pairs(r, 5)
    first, second = pos[2]
    r.desc[first]["flags"] |= VIRTQ_DESC_F_WRITE
    r.desc[second]["flags"] &= 0xFFFF & ~VIRTQ_DESC_F_WRITE
    expect_refused(r, WritableBeforeReadable)


def test_split_v_14_next_out_of_range_in_a_run_refused(impl):
    """SPLIT-V-14: the third of five buffers names a next >= queue size, where the bytes past the descriptor
    table (unused avail ring entries) look like a valid one-descriptor buffer."""
    r = Ring(impl, "split", SIZE)
    pos = add_pairs(r, 5)
    fake = SIZE + 1   # 16 bytes from 16 bytes into the avail ring: its entries 6..13, none published
    ring_off = r.layout.driver - BASE
    assert r.layout.desc + 16 * fake == r.layout.driver + 16 and int(r.avail["idx"]) <= 6
    r.buf[ring_off + 16:ring_off + 32] = struct.pack("<QIHH", DATA, 64, 0, 0)
    r.desc[pos[2][0]]["next"] = fake
    expect_refused(r, NextOutOfRange)


def test_split_d_08_split_v_14_indirect_with_next_in_a_run_refused(impl):
    """SPLIT-D-08 / SPLIT-V-14: the third of five buffers has INDIRECT and NEXT on its head."""
    r = Ring(impl, "split", SIZE, VIRTIO_F_INDIRECT_DESC)
    pos = add_pairs(r, 5)
    r.desc[pos[2][0]]["flags"] |= VIRTQ_DESC_F_INDIRECT
    expect_refused(r, IndirectWithNext)


def test_packed_d_20_indirect_in_a_list_in_a_run_refused(impl):
    """PACKED-D-20: the third of five lists ends in a descriptor with INDIRECT set."""
    r = Ring(impl, "packed", SIZE, VIRTIO_F_INDIRECT_DESC)
    pos = add_pairs(r, 5)
    t = r.table(SCRATCH, 16, split_desc_dtype)   # a valid one-entry table, so only the rule can refuse it
    t[0] = (DATA, 64, 0, 0)
    r.desc[pos[2][1]]["addr"], r.desc[pos[2][1]]["len"] = SCRATCH, 16
    r.desc[pos[2][1]]["flags"] |= VIRTQ_DESC_F_INDIRECT
    expect_refused(r, IndirectWithNext)


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("which", [0, 1])
def test_split_v_14_segment_outside_memory_in_a_run_refused(impl, fmt, which):
    """SPLIT-V-14 (and packed): either descriptor of the third of five buffers reaches past guest memory."""
    r = Ring(impl, fmt, SIZE)
    pos = add_pairs(r, 5)
    r.desc[pos[2][which]]["addr"] = BASE + MEMSIZE - 32   # 64 bytes from 32 bytes before the end
    expect_refused(r, AddressOutOfBounds)


def test_split_v_15_head_repeated_in_a_run_refused(impl):
    """SPLIT-V-15: the avail ring names the head of the second buffer again as the fourth: one buffer in flight
    twice."""
    r = Ring(impl, "split", SIZE)
    add_pairs(r, 5)
    r.avail["ring"][3] = r.avail["ring"][1]
    expect_refused(r, BufferIdInUse)


def test_packed_d_23_id_repeated_in_a_run_refused(impl):
    """PACKED-D-23: the fourth list carries the second's buffer id."""
    r = Ring(impl, "packed", SIZE)
    pos = add_pairs(r, 5)
    r.desc[pos[3][1]]["id"] = r.desc[pos[1][1]]["id"]
    expect_refused(r, BufferIdInUse)


def test_packed_v_10_packed_d_23_id_out_of_range_in_a_run_refused(impl):
    """PACKED-V-10 / PACKED-D-23: the id of the third list's last descriptor is >= queue size (its first
    descriptor's, which the device ignores, is valid)."""
    r = Ring(impl, "packed", SIZE)
    pos = add_pairs(r, 5)
    r.desc[pos[2][0]]["id"] = 2
    r.desc[pos[2][1]]["id"] = SIZE + 3
    expect_refused(r, PackedIdOutOfRange)


def test_packed_d_11_two_descriptor_lists_reoffered_in_flight_refused(impl):
    """PACKED-D-11/05: with every slot in flight in two-descriptor lists, a driver that marks the next two
    slots available for the next lap offers slots the device has not used yet."""
    r = Ring(impl, "packed", 8)
    add_pairs(r, 4)
    assert r.dev.poll().n == 4
    # next lap: wrap 0 means AVAIL=0, USED=1
    r.desc[1]["id"] = 5   # an id not in flight: only the slots' rule can refuse the list
    r.desc[1]["flags"] = VIRTQ_DESC_F_USED
    r.desc[0]["flags"] = VIRTQ_DESC_F_USED | VIRTQ_DESC_F_NEXT
    expect_refused(r, SlotInFlight)


def test_packed_v_04_stale_two_descriptor_lists_of_a_batch_not_available(impl):
    """PACKED-V-04 (PACKED-V-18) for two-descriptor lists: an IN_ORDER batch of four lists comes back as one
    used descriptor at slot 0, so slots 2-7 keep last lap's flags (AVAIL=1, USED=0, NEXT on 2, 4, 6: available
    for wrap 1 only). Next lap, the list at slots 0-1 is available, and nothing after it."""
    size = 8
    r = Ring(impl, "packed", size, VIRTIO_F_IN_ORDER, batch=True)
    add_pairs(r, 4)
    ch = r.dev.poll()
    assert ch.n == 4
    r.dev.push_used(ch.id, ch.wlen)   # all written in full: one batch, one used descriptor
    r.dev.flush()
    assert len(r.drv.reclaim()[0]) == 4
    assert all(r.packed_avail(slot, 1) for slot in range(2, size))   # stale, from lap 1
    assert int(r.desc[2]["flags"]) & VIRTQ_DESC_F_NEXT and int(r.desc[2]["flags"]) & VIRTQ_DESC_F_AVAIL
    add_pairs(r, 1)   # lap 2: slots 0-1, wrap 0
    ch = r.dev.poll()
    assert ch.n == 1 and ch.ndesc[0] == 2
    assert r.dev.poll().n == 0, "a list of the last lap was taken as available"
    assert r.dev.snapshot()["indices"]["last_avail"] == 2
