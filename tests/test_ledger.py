"""The frame ledger of a resilient macfwd --verify run (virtio/ledger.py): every copy a restart makes is counted,
wherever the frame's sequence field lies in its buffers."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from virtio import packets
from virtio._net import ffi, lib
from virtio.ledger import SEQ_BAD, Ledger
from virtio.net import HEADROOM
from virtio.pool import BufferPool, pool_stride

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_pool_helpers_bound_every_buffer_index_themselves():
    """vn_macswap, vn_lat_update and vn_check take buffer indices from their caller (Python's received bursts)
    and addressed pool + index * stride with no bound: an index past the pool wrote or read wherever it
    pointed (a SIGSEGV here). Each now bounds it against nbufs, as the Rx take and Tx paths do; run in a child
    so that the old behaviour fails the test instead of killing pytest."""
    code = textwrap.dedent("""
        import numpy as np
        from virtio._net import ffi, lib
        from virtio import packets
        from virtio.pool import HEADROOM, BufferPool
        pool = BufferPool(bytearray(4 * 2112), 0x1000, 4, 2048, HEADROOM)
        tmpl = packets.template(64, packets.DEFAULT_DST, packets.DEFAULT_SRC)
        pool.write(1, tmpl)
        idx = np.array([1, 0xFFFFFFF0, 4], np.uint32)
        lens = np.full(3, 64, np.uint32)
        seqs = np.zeros(3, np.uint64)
        p = lambda a, t: ffi.cast(t, ffi.from_buffer(a))
        lib.vn_macswap(pool.c, p(idx, "uint32_t *"), 3)
        bad = lib.vn_check(pool.c, p(idx, "uint32_t *"), p(lens, "uint32_t *"), 3, p(tmpl, "uint8_t *"), 64, 1,
                           packets.SEQ_OFF, packets.TS_OFF, p(seqs, "uint64_t *"))
        lat = ffi.new("struct vn_lat *")
        lat.ts_off = packets.TS_OFF
        lib.vn_lat_update(lat, pool.c, p(idx, "uint32_t *"), 3)
        print(bad, lat.bad)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.split() == ["2", "3"]  # the two out-of-pool indices refused; a zero stamp is bad for lat too


def test_a_bad_frame_has_no_sequence_number():
    """vn_check stops reading a frame at its first wrong byte, before the sequence field: the seq it gave for a
    bad frame was 0, so that --verify counted every corrupted frame as an arrival of frame 0 (frame 0 'seen', the
    frame that was corrupted not missing, and in a resilient run a 'copy' of frame 0 freed as a duplicate). A bad
    frame's seq is now SEQ_BAD, which no ledger or count tracks."""
    pool = BufferPool(bytearray(4 * 2112), 0x1000, 4, 2048, HEADROOM)
    tmpl = packets.template(64, packets.DEFAULT_DST, packets.DEFAULT_SRC)
    good = bytearray(bytes(tmpl))
    good[0:6], good[6:12] = bytes(tmpl[6:12]), bytes(tmpl[0:6])   # what macswap sends back
    good[packets.SEQ_OFF:packets.SEQ_OFF + 8] = (7 | 2 << 32).to_bytes(8, "little")
    pool.write(0, bytes(good))
    pool.write(1, bytes(tmpl))                       # MACs not swapped
    idx, lens, seqs = np.array([0, 1], np.uint32), np.full(2, 64, np.uint32), np.zeros(2, np.uint64)
    p = lambda a, t: ffi.cast(t, ffi.from_buffer(a))   # noqa: E731
    bad = lib.vn_check(pool.c, p(idx, "uint32_t *"), p(lens, "uint32_t *"), 2, p(tmpl, "uint8_t *"), 64, 1,
                       packets.SEQ_OFF, packets.TS_OFF, p(seqs, "uint64_t *"))
    assert bad == 1 and list(seqs) == [7 | 2 << 32, SEQ_BAD]
    led = Ledger(8)
    led.laps[0], led.laps[7] = 3, 2   # frame 0 on its third lap: a seq of 0 with lap 0 would be an old copy
    assert led.dedupe(pool, idx, lens, seqs, 2, advance=False) == 2 and led.duplicates == 0


def test_a_copy_with_no_restart_to_explain_it_fails_the_verdict():
    """In a resilient run copies are expected only from a restart (the successor takes again chains already
    delivered); the ledger dropped every copy silently, so a backend that sent frames twice with no restart at all
    passed `vring driver --reconnect --verify` (ok true, exit 0, only verify.duplicates said so)."""
    from virtio.app import verify_failures
    pool = BufferPool(bytearray(8 * pool_stride(2048)), 0x1000, 8, 2048, HEADROOM)
    frame = bytearray(packets.template(64))
    frame[packets.SEQ_OFF:packets.SEQ_OFF + 8] = (3).to_bytes(8, "little")
    for restarts in ([], [{"gone_t": 0.0}]):
        led = Ledger(4)
        a, b = received(pool, bytes(frame), 2048 - HEADROOM), received(pool, bytes(frame), 2048 - HEADROOM)
        lens = np.array([64, 64], np.uint32)
        idx, seqs = np.array([a, b], np.uint32), np.array([3, 3], np.uint64)   # a frame and its copy, one burst
        assert led.dedupe(pool, idx, lens, seqs, 2, restart=restarts[-1] if restarts else None) == 1
        led.count_final(seqs, 1)
        v = {"bad": 0, "missing": 0, **led.summary(restarts, 0, 0, np.array([0, 0, 0, 1], bool))}
        assert v["duplicates"] == 1 and v["population"]["absent"] == 0
        if restarts:   # the restart's own copy: expected
            assert v["duplicates_without_restart"] == 0 and verify_failures(v) == []
        else:
            assert v["duplicates_without_restart"] == 1
            assert verify_failures(v) == ["1 duplicate(s) with no backend restart to explain them: the backend "
                                          "sent a frame twice"]
        pool.free(idx[:1])
