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
