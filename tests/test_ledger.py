"""The frame ledger of a resilient macfwd --verify run (virtio/ledger.py): every copy a restart makes is counted,
wherever the frame's sequence field lies in its buffers."""
import numpy as np
import pytest

from virtio import packets
from virtio.ledger import Ledger
from virtio.net import HEADROOM
from virtio.pool import BufferPool, pool_stride


def received(pool, frame, room):
    """frame as the device delivers it into mergeable Rx buffers of `room` data bytes: a chain of segments."""
    bufs = pool.alloc(-(-len(frame) // room))
    for k, b in enumerate(bufs):
        pool.write(b, frame[k * room:(k + 1) * room])
    return pool.chain(bufs)


@pytest.mark.parametrize("buf_size", [192, 256, 2048])
def test_ledger_counts_a_copy_whose_sequence_field_spans_two_buffers(buf_size):
    """--buf-size 192 leaves 52 data bytes a buffer after the 140-byte headroom: the u64 sequence field at
    packets.SEQ_OFF (50..57) straddles a frame's first two Rx buffers. The ledger wrote the lap, and looked for
    copies, only where the field lay whole in the first buffer: such frames were never tracked, a restart's copies
    circulated as originals (vring driver --reconnect --verify --buf-size 192: verify.duplicates 0 for 32 chains
    re-taken, the copies left over as population.extra)."""
    room = buf_size - HEADROOM
    pool = BufferPool(bytearray(64 * pool_stride(buf_size)), 0x1000, 64, buf_size, HEADROOM)
    frame = bytearray(packets.template(64))
    frame[packets.SEQ_OFF:packets.SEQ_OFF + 8] = (7).to_bytes(8, "little")   # sequence number 7, lap 0
    led = Ledger(16)
    a, b = received(pool, bytes(frame), room), received(pool, bytes(frame), room)   # the original, a restart's copy
    idx, lens = np.array([a], np.uint32), np.array([64], np.uint32)
    seqs = np.array([7], np.uint64)
    assert led.dedupe(pool, idx, lens, seqs, 1) == 1 and led.duplicates == 0
    assert pool.data(a)[packets.SEQ_OFF:packets.SEQ_OFF + 8] == (7 | 1 << 32).to_bytes(8, "little")   # lap 1 out
    idx, seqs = np.array([b], np.uint32), np.array([7], np.uint64)                # the copy: still lap 0
    assert led.dedupe(pool, idx, lens, seqs, 1) == 0 and led.duplicates == 1
    assert pool.available == 64 - -(-64 // room)                                   # the copy's buffers freed


@pytest.mark.parametrize("buf_size", [192, 256, 1984, 2048, 2112, 4096])
def test_pool_buffers_are_an_odd_number_of_cache_lines_apart(buf_size):
    """A power-of-two stride puts the same line of every buffer into the same few cache sets: the stride is
    buf_size when that is an odd number of 64-byte lines, else 64 bytes more, and the C engine (vn_gpa, the Rx
    addresses it posts) and the Python helpers agree on it; each buffer still holds buf_size bytes."""
    stride = pool_stride(buf_size)
    assert stride in (buf_size, buf_size + 64) and (stride // 64) % 2 == 1
    pool = BufferPool(bytearray(8 * stride), 0x1000, 8, buf_size, HEADROOM)
    assert pool.stride == pool.c.stride == stride and pool.c.buf_size == buf_size
    assert [pool.gpa_of(b) for b in range(3)] == [0x1000, 0x1000 + stride, 0x1000 + 2 * stride]
    bufs = pool.alloc(8)
    room = buf_size - HEADROOM
    for b in bufs:
        pool.write(b, bytes([b]) * room)   # a whole buffer each: none overlaps the next
    assert all(pool.data(b) == bytes([b]) * room for b in bufs)
    with pytest.raises(ValueError):
        BufferPool(bytearray(8 * buf_size - 1), 0x1000, 8, buf_size, HEADROOM)  # too small for 8 at this stride
