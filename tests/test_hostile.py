"""Hostile rings: one test per error of the Trust rules, for the C path and the reference model.

Each test arranges ring memory the way a buggy or hostile peer would, then checks: the typed error,
the sticky broken state (the next call raises the same object), and that nothing else was touched.
Checklist IDs: SPLIT-V-13/14, SPLIT-D-02/04/05/07/08/09/17, PACKED-D-09/18/20/23/24, PACKED-V-10, FEAT-07.
"""
import importlib

import numpy as np
import pytest

from rings import errors
from rings.layout import (VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE, QueueLayout, avail_dtype, bit, packed_desc_dtype,
                          split_desc_dtype, used_dtype)
from rings.shm import MemoryTable

BASE = 0x100000
MEMSIZE = 1 << 20
DATA = BASE + 0x80000
TABLE = BASE + 0x90000  # a spare area for hand-made indirect tables
SIZE = 8


@pytest.fixture(params=["c", "reference"])
def impl(request):
    return importlib.import_module("rings.virtq" if request.param == "c" else "rings.reference")


class Ring:
    """A queue in a bytearray with both halves and raw numpy views of its areas."""

    def __init__(self, impl, fmt, extra_features=0):
        self.buf = bytearray(MEMSIZE)
        self.mem = MemoryTable([(BASE, MEMSIZE, self.buf)])
        self.layout = QueueLayout.contiguous(fmt, SIZE, BASE)
        feats = (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | extra_features
        self.drv = impl.DriverQueue(self.mem, self.layout, feats)
        self.dev = impl.DeviceQueue(self.mem, self.layout, feats)
        off = lambda gpa: gpa - BASE  # noqa: E731
        if fmt == "split":
            self.desc = np.frombuffer(self.buf, split_desc_dtype, SIZE, off(self.layout.desc))
            self.avail = np.frombuffer(self.buf, avail_dtype(SIZE), 1, off(self.layout.driver))[0]
            self.used = np.frombuffer(self.buf, used_dtype(SIZE), 1, off(self.layout.device))[0]
        else:
            self.desc = np.frombuffer(self.buf, packed_desc_dtype, SIZE, off(self.layout.desc))

    def table(self, entries, dtype):
        t = np.frombuffer(self.buf, dtype, len(entries), TABLE - BASE)
        for i, e in enumerate(entries):
            t[i] = e
        return TABLE

    def add_one(self, n=1):
        """n valid one-descriptor readable buffers, published."""
        added = self.drv.add_simple(np.full(n, DATA, np.uint64), np.full(n, 64, np.uint32), np.arange(n))
        assert added == n
        self.drv.publish()


def expect_device_error(ring, exc):
    snapshot = bytes(ring.buf)
    with pytest.raises(exc) as info:
        ring.dev.poll()
    assert ring.dev.broken is info.value
    with pytest.raises(exc) as again:  # sticky: refuses further work with that error
        ring.dev.poll()
    assert again.value is info.value
    with pytest.raises(exc):
        ring.dev.flush()
    assert bytes(ring.buf) == snapshot, "a broken device must not write ring memory"
    return info.value


def expect_driver_error(ring, exc):
    with pytest.raises(exc) as info:
        ring.drv.reclaim()
    assert ring.drv.broken is info.value
    with pytest.raises(exc):
        ring.drv.reclaim()
    with pytest.raises(exc):
        ring.drv.add_simple([DATA], [64], [99])
    return info.value


# ---- split device side -------------------------------------------------------------------------

def test_head_out_of_range_split(impl):
    """SPLIT-V-14: an avail ring entry naming a head >= queue size."""
    r = Ring(impl, "split")
    r.add_one()
    r.avail["ring"][0] = SIZE
    e = expect_device_error(r, errors.HeadOutOfRange)
    assert "outside" in str(e)


def test_next_out_of_range_split(impl):
    r = Ring(impl, "split")
    r.add_one()
    r.desc[0]["flags"] = VIRTQ_DESC_F_NEXT
    r.desc[0]["next"] = SIZE + 3
    expect_device_error(r, errors.NextOutOfRange)


def test_chain_loop_split(impl):
    """SPLIT-D-04 / SPLIT-V-14: a loop is found within `size` hops, never spins."""
    r = Ring(impl, "split")
    r.add_one()
    r.desc[0] = (DATA, 64, VIRTQ_DESC_F_NEXT, 1)
    r.desc[1] = (DATA, 64, VIRTQ_DESC_F_NEXT, 0)
    expect_device_error(r, errors.ChainTooLong)


def test_avail_idx_jump_split(impl):
    """SPLIT-V-13: avail idx moving by more than the queue size."""
    r = Ring(impl, "split")
    r.add_one()
    r.avail["idx"] = SIZE + 1
    e = expect_device_error(r, errors.AvailIdxJump)
    assert e.b == SIZE + 1


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_indirect_empty(impl, fmt):
    r = Ring(impl, fmt, bit(VIRTIO_F_INDIRECT_DESC))
    r.add_one()
    r.desc[0]["addr"], r.desc[0]["len"] = TABLE, 0
    r.desc[0]["flags"] |= VIRTQ_DESC_F_INDIRECT
    expect_device_error(r, errors.IndirectEmpty)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_indirect_length_not_multiple_of_16(impl, fmt):
    """SPLIT-D-09 / PACKED-D-21."""
    r = Ring(impl, fmt, bit(VIRTIO_F_INDIRECT_DESC))
    r.add_one()
    r.desc[0]["addr"], r.desc[0]["len"] = TABLE, 24
    r.desc[0]["flags"] |= VIRTQ_DESC_F_INDIRECT
    expect_device_error(r, errors.IndirectLength)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_nested_indirect(impl, fmt):
    """SPLIT-D-07 / PACKED-D-18: an INDIRECT descriptor inside an indirect table."""
    r = Ring(impl, fmt, bit(VIRTIO_F_INDIRECT_DESC))
    r.add_one()
    if fmt == "split":
        r.table([(TABLE, 32, VIRTQ_DESC_F_INDIRECT, 0)], split_desc_dtype)
    else:
        r.table([(TABLE, 32, 0, VIRTQ_DESC_F_INDIRECT)], packed_desc_dtype)
    r.desc[0]["addr"], r.desc[0]["len"] = TABLE, 16
    r.desc[0]["flags"] |= VIRTQ_DESC_F_INDIRECT
    expect_device_error(r, errors.NestedIndirect)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_indirect_with_next(impl, fmt):
    """SPLIT-D-08 / PACKED-D-20: INDIRECT combined with NEXT."""
    r = Ring(impl, fmt, bit(VIRTIO_F_INDIRECT_DESC))
    r.add_one(2)
    dtype = split_desc_dtype if fmt == "split" else packed_desc_dtype
    r.table([(DATA, 16, 0, 0)], dtype)
    r.desc[0]["addr"], r.desc[0]["len"] = TABLE, 16
    r.desc[0]["flags"] |= VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_NEXT
    if fmt == "split":
        r.desc[0]["next"] = 1
    expect_device_error(r, errors.IndirectWithNext)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_writable_before_readable(impl, fmt):
    """SPLIT-D-02 / PACKED-D-10."""
    r = Ring(impl, fmt)
    n = r.drv.add([DATA, DATA + 64], [64, 64], [1], [1], [7])
    assert n == 1
    r.drv.publish()
    r.desc[0]["flags"] |= VIRTQ_DESC_F_WRITE
    r.desc[1]["flags"] ^= VIRTQ_DESC_F_WRITE
    expect_device_error(r, errors.WritableBeforeReadable)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_address_outside_memory_table(impl, fmt):
    """FEAT-07: every address + length must be inside the memory table, without overflow."""
    r = Ring(impl, fmt)
    r.add_one()
    r.desc[0]["addr"] = BASE + MEMSIZE - 32
    r.desc[0]["len"] = 64
    expect_device_error(r, errors.AddressOutOfBounds)


def test_address_wrapping_2_64(impl):
    r = Ring(impl, "split")
    r.add_one()
    r.desc[0]["addr"] = (1 << 64) - 16
    r.desc[0]["len"] = 32
    expect_device_error(r, errors.AddressOutOfBounds)


# ---- packed device side ------------------------------------------------------------------------

def test_packed_v_10_packed_d_23_id_out_of_range_in_the_last_descriptor(impl):
    """PACKED-D-23 / PACKED-V-10: the id is the last descriptor's: out of range there breaks the queue, while
    an out-of-range id in a non-last descriptor is none of the device's business."""
    r = Ring(impl, "packed")
    assert r.drv.add([DATA, DATA + 64, DATA + 128], [64, 64, 64], [3], [0], [1]) == 1   # slots 0-2
    r.desc[0]["id"] = r.desc[1]["id"] = SIZE + 5   # garbage in the non-last ones
    r.drv.publish()
    ch = r.dev.poll()
    assert ch.n == 1 and ch.id[0] == r.desc[2]["id"] and ch.ndesc[0] == 3
    r = Ring(impl, "packed")
    assert r.drv.add([DATA, DATA + 64, DATA + 128], [64, 64, 64], [3], [0], [1]) == 1
    r.desc[2]["id"] = SIZE   # the last one
    r.drv.publish()
    expect_device_error(r, errors.PackedIdOutOfRange)


def test_packed_id_already_in_flight(impl):
    r = Ring(impl, "packed")
    r.add_one(2)
    r.desc[1]["id"] = r.desc[0]["id"]
    expect_device_error(r, errors.BufferIdInUse)


def test_packed_chain_longer_than_ring(impl):
    """PACKED-D-09: a list that never ends (every slot NEXT, all available)."""
    r = Ring(impl, "packed")
    r.add_one()
    for i in range(SIZE):
        r.desc[i] = (DATA, 64, 0, VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_NEXT)
    expect_device_error(r, errors.ChainTooLong)


# ---- driver side (the used ring is hostile too) -------------------------------------------------

def _complete(r, n=1, lens=None):
    ch = r.dev.poll()
    assert ch.n == n
    r.dev.push_used(ch.id, np.zeros(n, np.uint32) if lens is None else lens)
    r.dev.flush()


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_used_id_not_in_flight(impl, fmt):
    """SPLIT-D-17: a used id that is not an outstanding head."""
    r = Ring(impl, fmt)
    r.add_one(2)
    _complete(r, 2)
    if fmt == "split":
        r.used["ring"][0]["id"] = 5  # a descriptor that is not in flight
    else:
        r.desc[0]["id"] = 5
    e = expect_driver_error(r, errors.UsedIdNotInFlight)
    assert e.a == 5


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_used_len_too_large(impl, fmt):
    """SPLIT-D-15: used len beyond the writable part of the buffer."""
    r = Ring(impl, fmt)
    assert r.drv.add_simple([DATA], [64], [1], writable=True) == 1
    r.drv.publish()
    _complete(r, 1, lens=np.array([64], np.uint32))
    if fmt == "split":
        r.used["ring"][0]["len"] = 65
    else:
        r.desc[0]["len"] = 65
    expect_driver_error(r, errors.UsedLenTooLarge)


def test_used_idx_jump_split(impl):
    r = Ring(impl, "split")
    r.add_one()
    r.used["idx"] = SIZE + 1
    expect_driver_error(r, errors.UsedIdxJump)


def test_packed_used_id_out_of_range(impl):
    r = Ring(impl, "packed")
    r.add_one()
    _complete(r)
    r.desc[0]["id"] = 0xFFFF
    expect_driver_error(r, errors.PackedIdOutOfRange)


def test_packed_d_24_used_flags_of_the_wrong_lap_are_not_a_completion(impl):
    """PACKED-D-24: a device that writes a used descriptor with the other lap's flags (AVAIL = USED = 0 while
    the driver's used wrap counter is 1, as a zeroed slot also reads) completes nothing; a naive AVAIL == USED
    check would return the buffer. The same slot with AVAIL = USED = 1 is the completion."""
    r = Ring(impl, "packed")
    r.add_one()
    ch = r.dev.poll()
    assert ch.n == 1
    r.desc[0]["len"], r.desc[0]["flags"] = 0, 0   # "used" in the wrong lap
    tokens, _ = r.drv.reclaim()
    assert len(tokens) == 0 and r.drv.broken is None
    r.desc[0]["flags"] = VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED
    tokens, _ = r.drv.reclaim()
    assert tokens.tolist() == [0]


# ---- packed: slots still in flight offered again (issue 8) --------------------------------------------

def _packed_list(r, first, n, id, wrap):
    """Write an available list of n one-segment descriptors from slot `first` (hostile: no free-slot check)."""
    bits = VIRTQ_DESC_F_AVAIL if wrap else VIRTQ_DESC_F_USED
    for k in range(n):
        slot = (first + k) % SIZE
        flags = bits | (VIRTQ_DESC_F_NEXT if k + 1 < n else 0)
        r.desc[slot] = (DATA + 64 * k, 64, id, flags)


def test_packed_d_11_reoffered_slots_in_flight_in_order_batch(impl):
    """PACKED-D-11/05: a driver that offers slots of chains still in flight again (here: a whole-ring chain,
    re-offered once the device's avail position wrapped) gets SlotInFlight. On main the device took it,
    and with IN_ORDER batching one flush moved the used position past twice the ring (out-of-bounds write)."""
    from rings.layout import VIRTIO_F_IN_ORDER
    buf = bytearray(MEMSIZE)
    mem = MemoryTable([(BASE, MEMSIZE, buf)])
    layout = QueueLayout.contiguous("packed", SIZE, BASE)
    feats = bit(VIRTIO_F_RING_PACKED) | bit(VIRTIO_F_IN_ORDER)
    dev = impl.DeviceQueue(mem, layout, feats, in_order_batch=True)
    r = type("R", (), {})()
    r.desc = np.frombuffer(buf, packed_desc_dtype, SIZE, layout.desc - BASE)
    _packed_list(r, 0, SIZE, 0, 1)           # id 0: the whole ring
    assert dev.poll().n == 1
    _packed_list(r, 0, SIZE, 1, 0)           # the same slots again, with the next lap's wrap bit
    snapshot = bytes(buf)
    with pytest.raises(errors.SlotInFlight) as info:
        dev.poll()
    assert (info.value.a, info.value.b) == (0, SIZE)
    assert dev.broken is info.value
    with pytest.raises(errors.SlotInFlight):
        dev.flush()
    assert bytes(buf) == snapshot


def test_packed_d_11_reoffered_one_descriptor_slots_in_flight(impl):
    """PACKED-D-11/05 on the one-descriptor fast path: a full ring of one-descriptor buffers in flight, then
    slot 0 offered again with the next lap's wrap bit: SlotInFlight, nothing written."""
    r = Ring(impl, "packed")
    for k in range(SIZE):
        _packed_list(r, k, 1, k, 1)
    assert r.dev.poll().n == SIZE
    _packed_list(r, 0, 1, 0, 0)
    e = expect_device_error(r, errors.SlotInFlight)
    assert (e.a, e.b) == (0, SIZE)


def test_packed_d_11_partial_overlap_is_refused(impl):
    """PACKED-D-11: a list whose tail reaches into the slots of a chain in flight; the error names the slot."""
    r = Ring(impl, "packed")
    _packed_list(r, 0, 6, 0, 1)              # slots 0..5 in flight
    assert r.dev.poll().n == 1
    _packed_list(r, 6, 3, 1, 1)              # slots 6, 7, then 0 (still in flight)
    r.desc[0]["flags"] = VIRTQ_DESC_F_USED      # the list ends at slot 0, in the next lap (wrap 0)
    e = expect_device_error(r, errors.SlotInFlight)
    assert (e.a, e.b) == (0, 6)


def test_packed_v_09_whole_ring_in_flight_then_reused_legitimately(impl):
    """The check does not refuse a driver that waits for the used descriptors: the whole ring in flight,
    completed, then offered again; the used position stays inside the ring."""
    r = Ring(impl, "packed")
    for lap in range(3):
        r.add_one(SIZE)
        ch = r.dev.poll()
        assert ch.n == SIZE
        r.dev.push_used(ch.id, np.zeros(SIZE, np.uint32))
        r.dev.flush()
        assert r.dev.state()["used_idx"] == 0 and r.dev.state()["used_wrap"] == (lap + 1) % 2 ^ 1
        tokens, _ = r.drv.reclaim()
        assert len(tokens) == SIZE


# ---- vring base: bounded by the ring engine itself (issue 8) ------------------------------------------

@pytest.mark.parametrize("fmt,base", [("packed", 0x8000 | SIZE), ("packed", SIZE + 100), ("packed", 0x7FFF),
                                      ("split", 0x10000), ("packed", -1), ("split", 1 << 40)])
def test_set_base_outside_the_ring_is_refused(impl, fmt, base):
    """A vring base that is no position of the ring: BaseOutOfRange (sticky), nothing touched."""
    r = Ring(impl, fmt)
    snapshot = bytes(r.buf)
    with pytest.raises(errors.BaseOutOfRange) as info:
        r.dev.set_base(base)
    assert info.value.a == (base if 0 <= base <= 0xFFFFFFFF else 0xFFFFFFFF) and info.value.b == SIZE
    with pytest.raises(errors.BaseOutOfRange):
        r.dev.poll()
    assert bytes(r.buf) == snapshot


def test_set_base_packed_resumes_at_slot_and_wrap(impl):
    """PACKED-V-01 with a base: slot 5, wrap 0 -> the device polls slot 5 with wrap 0 and uses it there."""
    r = Ring(impl, "packed")
    r.dev.set_base(5)
    _packed_list(r, 5, 1, 3, 0)
    ch = r.dev.poll()
    assert ch.n == 1 and list(ch.id) == [3]
    r.dev.push_used([3], [0])
    r.dev.flush()
    assert r.desc[5]["id"] == 3 and r.desc[5]["flags"] == 0       # used with wrap 0: AVAIL = USED = 0
    assert r.dev.state()["used_idx"] == 6


def test_set_base_split_resumes_at_index(impl):
    r = Ring(impl, "split")
    r.dev.set_base(0xFFFE)
    r.desc[0] = (DATA, 64, 0, 0)
    r.avail["ring"][0xFFFE % SIZE] = 0
    r.avail["idx"] = 0xFFFF
    assert r.dev.poll().n == 1
    r.dev.push_used([0], [0])
    r.dev.flush()
    assert r.used["idx"] == 0xFFFF and r.used["ring"][0xFFFE % SIZE]["id"] == 0


def test_set_base_needs_an_idle_queue(impl):
    r = Ring(impl, "packed")
    r.add_one()
    assert r.dev.poll().n == 1
    with pytest.raises(errors.UsageError):
        r.dev.set_base(0x8000)
    assert r.dev.broken is None


# ---- found by fuzz/ (ring_device): alignment (issue 8) ---------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("misalign", [1, 2, 8])
def test_indirect_table_at_any_address(impl, fmt, misalign):
    """No alignment is required of an indirect table: one at TABLE + misalign reads like an aligned one.
    (The C path read it through struct pointers: undefined behaviour, reported by UBSan under fuzz/.)"""
    r = Ring(impl, fmt, bit(VIRTIO_F_INDIRECT_DESC))
    r.add_one()
    dtype = split_desc_dtype if fmt == "split" else packed_desc_dtype
    entries = [(DATA, 16, VIRTQ_DESC_F_NEXT, 1), (DATA + 64, 32, VIRTQ_DESC_F_WRITE, 0)] if fmt == "split" else \
        [(DATA, 16, 0, 0), (DATA + 64, 32, 0, VIRTQ_DESC_F_WRITE)]
    raw = np.zeros(2, dtype)
    for i, e in enumerate(entries):
        raw[i] = e
    r.buf[TABLE - BASE + misalign:TABLE - BASE + misalign + 32] = raw.tobytes()
    r.desc[0]["addr"], r.desc[0]["len"] = TABLE + misalign, 32
    r.desc[0]["flags"] |= VIRTQ_DESC_F_INDIRECT
    ch = r.dev.poll()
    assert ch.n == 1 and ch.segments(0) == [(DATA, 16, 0), (DATA + 64, 32, 1)]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_ring_misaligned_in_this_process_is_refused(impl, fmt):
    """A region mapped at an offset that breaks the rings' alignment in this process (a vhost-user memory table
    whose mmap_offset disagrees with its guest address) is refused up front, not accessed misaligned."""
    buf = bytearray(MEMSIZE + 16)
    mem = MemoryTable([(BASE, MEMSIZE, buf, 2)])   # guest BASE (16-aligned) at buffer offset 2
    layout = QueueLayout.contiguous(fmt, SIZE, BASE)
    feats = bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0
    base = np.frombuffer(buf, np.uint8).ctypes.data
    if (base + 2) % 16 == 0:
        pytest.skip("the buffer happens to be aligned so that offset 2 is aligned")
    for half in (impl.DeviceQueue, impl.DriverQueue):
        with pytest.raises(errors.ConfigError, match="not 16-byte aligned"):
            half(mem, layout, feats)
