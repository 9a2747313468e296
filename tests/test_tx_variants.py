"""The driver's Tx variants, each a code path fixed when the queue is built (vring bench --study hdr-prepend,
hdr-init, doorbell), against the in-process device half.

NET-06/07/08: whatever the variant, the header the device reads is all zero (flags 0, GSO_NONE, num_buffers 0).
hdr-prepend: headroom -> ONE descriptor; chain -> a header descriptor chained before the data (2); indirect -> one
ring descriptor whose table holds both (SPLIT-D-09 / PACKED-D-20 on the device side).
EVT-12 / EVT-24: the doorbell variant decides how often the driver publishes and asks for a kick: once per burst
(xmit_more) or after every packet; none at all while the device suppresses kicks.
"""
import numpy as np
import pytest

from rings.errors import ConfigError
from rings.layout import VIRTIO_F_INDIRECT_DESC, bit
from rings.virtq import DeviceQueue
from virtio.net import NetQueues, TxQueue


def make(features, **kw):
    nq = NetQueues(features | bit(VIRTIO_F_INDIRECT_DESC), size=64, nbufs=1024, **kw)
    dev = DeviceQueue(nq.mem.table, nq.mem.tx_layout, features | bit(VIRTIO_F_INDIRECT_DESC))
    return nq, dev


def frames(nq, n, size=60):
    idx = nq.pool.alloc(n)
    for k, b in enumerate(idx):
        nq.pool.write(b, bytes([k + 1]) * size)
        start = int(b) * nq.pool.stride
        nq.pool.mem[start:start + nq.pool.headroom] = 0xFF   # the header must be cleared, not left over
    return idx, np.full(n, size, np.uint32)


@pytest.mark.parametrize("hdr, ndesc, nseg", [("headroom", 1, 1), ("chain", 2, 2), ("indirect", 1, 2)])
def test_net_06_hdr_prepend_variants(variant, hdr, ndesc, nseg):
    nq, dev = make(variant, hdr=hdr)
    hs = nq.hdr_size
    idx, lens = frames(nq, 4)
    assert nq.tx.burst(idx, lens) == 4
    ch = dev.poll()
    assert ch.n == 4 and list(ch.nseg) == [nseg] * 4
    assert nq.tx.vq.num_free == nq.size - 4 * ndesc
    for k in range(4):
        segs = ch.segments(k)
        data = b"".join(nq.mem.table.read(a, n) for a, n, _ in segs)
        assert data == bytes(hs) + bytes([k + 1]) * 60              # NET-06/07/08: zero header, then the frame
        if hdr != "headroom":
            assert segs[0][1] == hs                                   # the header in a segment of its own
    c = nq.tx.counters()
    assert c["hdr"] == hdr and (c["fast_path"], c["slow_path"]) == ((0, 4) if hdr == "chain" else (4, 0))
    nq.close()


def _packet(nq, data, seg=1500):
    """A packet of data in buffers of at most seg bytes each, chained."""
    bufs = nq.pool.alloc((len(data) + seg - 1) // seg)
    for b, k in zip(bufs, range(0, len(data), seg)):
        nq.pool.write(b, data[k:k + seg])
    return nq.pool.chain(bufs)


def _tx_area(nq):
    """What the device can read of the Tx side: the Tx ring, the header slots and the indirect tables."""
    m = nq.mem
    return bytes(m.region.buf[m.tx_off:m.pool_off])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_split_d_09_packed_d_18_packed_d_21_indirect_fast_path_writes_what_the_general_path_writes(variant, seed):
    """--tx-hdr indirect has a fast path of its own for one-segment packets (a run at a time, the split ring
    descriptor and the header slot stored only when they differ). Against the general path, packet by packet
    (force_slow), over random bursts, multi-segment packets among them, out-of-order completions where the ring
    allows them, and a descriptor and a header slot overwritten behind the driver's back: the Tx ring, the header
    slots and the indirect tables are byte for byte the same after every step, and so is what the device reads."""
    rng = np.random.default_rng(seed)
    sides = [make(variant, hdr="indirect"), make(variant, hdr="indirect", force_slow=True)]
    in_order = sides[0][0].tx.vq.in_order
    pending = []   # ids polled, not completed yet
    for step in range(60):
        n = int(rng.integers(1, 24))
        big = set(rng.choice(n, size=min(n, int(rng.integers(0, 3))), replace=False).tolist())
        sizes = [3000 if k in big else int(rng.integers(60, 1500)) for k in range(n)]
        sent, seen = [], []
        for nq, dev in sides:
            idx = np.array([_packet(nq, bytes([k + 1]) * sz) for k, sz in enumerate(sizes)], np.uint32)
            sent.append(nq.tx.burst(idx, np.array(sizes, np.uint32)))
            nq.pool.free(idx[sent[-1]:])
            ch = dev.poll()
            seen.append([(int(ch.id[i]), [(a, ln) for a, ln, _ in ch.segments(i)],
                          b"".join(nq.mem.table.read(a, ln) for a, ln, _ in ch.segments(i))) for i in range(ch.n)])
        assert sent[0] == sent[1] and seen[0] == seen[1]
        assert _tx_area(sides[0][0]) == _tx_area(sides[1][0])
        hs = sides[0][0].hdr_size
        assert all(data[:hs] == bytes(hs) for _, _, data in seen[0])   # NET-06/07/08
        pending += [i for i, _, _ in seen[0]]
        k = int(rng.integers(0, len(pending) + 1))
        done = pending[:k] if in_order else [pending[j] for j in rng.permutation(len(pending))[:k]]
        pending = [i for i in pending if i not in done]
        for nq, dev in sides:
            dev.push_used(done, [0] * len(done))
            dev.flush()
            nq.tx.cleanup(nq.size)
            if step % 7 == 3:   # a peer scribbling over what only the driver writes: free descriptor 0, slot 0
                if not nq.tx.vq.layout.packed and 0 not in pending:
                    nq.mem.table.write(nq.tx.vq.layout.desc, b"\xee" * 16)
                if 0 not in pending:
                    nq.mem.hdr_view[:16] = 0xEE
        assert _tx_area(sides[0][0]) == _tx_area(sides[1][0])
    c = [nq.tx.counters() for nq, _ in sides]
    assert c[0]["packets"] == c[1]["packets"] and c[0]["fast_path"] > 0 and c[1]["fast_path"] == 0
    for nq, _ in sides:
        nq.close()


@pytest.mark.parametrize("legacy", [False, True], ids=["version1", "legacy"])
@pytest.mark.parametrize("hdr_init", ["burst", "packet"])
@pytest.mark.parametrize("hdr", ["chain", "indirect"])
def test_net_06_header_slot_written_exactly(hdr, hdr_init, legacy):
    """The header slot of a chained / indirect packet: exactly hdr_size zero bytes (12, or 10 for a legacy driver
    without MRG_RXBUF, NET-03) over whatever the slot held, the rest of the slot untouched."""
    from rings.layout import VIRTIO_F_VERSION_1
    from conftest import NET_VARIANTS
    features = 0 if legacy else NET_VARIANTS["split"]
    nq, dev = make(features, hdr=hdr, hdr_init=hdr_init)
    hs = nq.hdr_size
    assert hs == (10 if legacy else 12) and bool(features & bit(VIRTIO_F_VERSION_1)) != legacy
    nq.mem.hdr_view[:] = 0xFF
    idx, lens = frames(nq, 4)
    assert nq.tx.burst(idx, lens) == 4
    ch = dev.poll()
    for k in range(4):
        data = b"".join(nq.mem.table.read(a, n) for a, n, _ in ch.segments(k))
        assert data == bytes(hs) + bytes([k + 1]) * 60
    slots = nq.mem.hdr_view.reshape(-1, 16)
    written = [i for i in range(len(slots)) if slots[i][0] != 0xFF]
    assert len(written) == 4
    for i in written:
        assert bytes(slots[i][:hs]) == bytes(hs) and bytes(slots[i][hs:]) == b"\xff" * (16 - hs)
    nq.close()


@pytest.mark.parametrize("path", ["split", "packed_in_order", "legacy"])
@pytest.mark.parametrize("headroom", [128, 140])
def test_net_06_headroom_header_rewritten_whichever_byte_differs(headroom, path):
    """The headroom header is stored only where it differs from the burst's template (a header line nobody changes
    stays shared between the two cores). One byte left over anywhere in it, num_buffers as the device's Rx header
    left it above all (NET-29), still gets the whole header rewritten (12 bytes, or 10 for a legacy driver); the
    frame after it is untouched. --headroom 128 starts each frame on a cache line, 140 its header."""
    from conftest import NET_VARIANTS
    nq, dev = make(NET_VARIANTS.get(path, 0), headroom=headroom)
    hs, pool = nq.hdr_size, nq.pool
    assert pool.headroom == headroom and hs == (10 if path == "legacy" else 12)
    for leftover in (None, *range(hs)):   # None: the header is the template already
        idx = pool.alloc(4)
        for k, b in enumerate(idx):
            pool.write(b, bytes([k + 1]) * 60)
            frame = int(b) * pool.stride + headroom
            assert (pool.gpa + frame) % 64 == (0 if headroom == 128 else 12)
            pool.mem[frame - hs:frame] = 0
            if leftover is not None:
                pool.mem[frame - hs + leftover] = 1 << k
        assert nq.tx.burst(idx, np.full(4, 60, np.uint32)) == 4
        ch = dev.poll()
        for k in range(4):
            (addr, length, _), = ch.segments(k)
            assert nq.mem.table.read(addr, length) == bytes(hs) + bytes([k + 1]) * 60, (leftover, k)
        dev.push_used(ch.id, np.zeros(ch.n))
        dev.flush()
        assert nq.tx.cleanup(0) == 4
    nq.close()


@pytest.mark.parametrize("hdr", ["chain", "indirect"])
def test_full_ring_leaves_in_flight_header_slots_alone(variant, hdr):
    """A packet that does not fit a full ring writes no header slot: the next id's slot still belongs to a buffer
    in flight, which the device may be reading."""
    nq, dev = make(variant, hdr=hdr)
    fit = nq.size // (2 if hdr == "chain" else 1)
    idx, lens = frames(nq, fit)
    assert nq.tx.burst(idx, lens) == fit and nq.tx.vq.num_free == 0
    nq.mem.hdr_view[:] = 0xAA   # stands for what the device reads: must not change while in flight
    extra, elens = frames(nq, 1)
    assert nq.tx.burst(extra, elens) == 0
    assert (nq.mem.hdr_view == 0xAA).all()
    nq.pool.free(extra)
    nq.close()


@pytest.mark.parametrize("hdr_init", ["burst", "packet"])
def test_net_06_hdr_init_variants_clear_the_whole_header(variant, hdr_init):
    nq, dev = make(variant, hdr_init=hdr_init)
    hs = nq.hdr_size
    for burst in range(3):
        idx, lens = frames(nq, 5)
        assert nq.tx.burst(idx, lens) == 5
        ch = dev.poll()
        for k in range(ch.n):
            (addr, length, _), = ch.segments(k)
            assert nq.mem.table.read(addr, hs) == bytes(hs)
        dev.push_used(ch.id, np.zeros(ch.n))
        dev.flush()
        assert nq.tx.cleanup(0) == 5
    assert nq.tx.counters()["hdr_init"] == hdr_init
    nq.close()


@pytest.mark.parametrize("doorbell, per_burst", [("burst", 1), ("packet", 6)])
def test_evt_12_doorbell_variants(variant, doorbell, per_burst):
    nq, dev = make(variant, doorbell=doorbell)
    dev.enable_kicks(True)                        # a sleeping device: every publication may ask for a kick
    idx, lens = frames(nq, 6)
    assert nq.tx.burst(idx, lens) == 6
    assert nq.tx.kicks == per_burst
    assert dev.poll().n == 6                      # everything published, whatever the variant
    dev.enable_kicks(False)                       # a polling device: no kicks at all (EVT-12 / EVT-24)
    idx, lens = frames(nq, 6)
    assert nq.tx.burst(idx, lens) == 6
    assert nq.tx.kicks == per_burst
    nq.close()


def test_tx_variant_choices_are_checked(variant):
    nq = NetQueues(variant & ~bit(VIRTIO_F_INDIRECT_DESC), size=64, nbufs=256)
    try:
        with pytest.raises(ConfigError, match="INDIRECT"):
            TxQueue(nq.mem, variant & ~bit(VIRTIO_F_INDIRECT_DESC), hdr="indirect")
        for kw in ({"hdr": "tail"}, {"hdr_init": "never"}, {"doorbell": "sometimes"}):
            with pytest.raises(ConfigError, match="must be one of"):
                TxQueue(nq.mem, variant, **kw)
    finally:
        nq.close()
