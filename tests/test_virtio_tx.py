"""virtio-net driver Tx paths against the in-process device half (rings.virtq.DeviceQueue).

Covers: NET-02/03 (header size), NET-06/07/08 (header zeroed: num_buffers 0, flags 0, GSO_NONE), the fast path
(header in the headroom, ONE descriptor), the slow path (header descriptor + chain, or one indirect descriptor),
normal and in-order Tx cleanup (INORDER-06/09/11/12: a device writing one used entry per batch), cleanup that
must free more than the burst size, and notifications (one kick per burst at most, more=True defers).
"""
import numpy as np
import pytest

from conftest import NET_VARIANTS as VARIANTS, V1
from rings.layout import (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED,
                          VIRTIO_NET_F_MRG_RXBUF, bit)
from rings.virtq import DeviceQueue
from virtio.net import NetQueues, net_hdr_size



def make(features, size=64, batch=False, **kw):
    nq = NetQueues(features, size=size, nbufs=1024, **kw)
    dev = DeviceQueue(nq.mem.table, nq.mem.tx_layout, features, in_order_batch=batch)
    return nq, dev


def packets(nq, n, size=60, headroom_garbage=True):
    idx = nq.pool.alloc(n)
    for k, b in enumerate(idx):
        nq.pool.write(b, bytes([k & 0xFF]) * size)
        if headroom_garbage:   # the header must be cleared, not left from earlier use
            start = int(b) * nq.pool.stride
            nq.pool.mem[start:start + nq.pool.headroom] = 0xFF
    return idx, np.full(n, size, np.uint32)


def test_header_size_follows_features():  # NET-02, NET-03
    assert net_hdr_size(0) == 10
    assert net_hdr_size(bit(VIRTIO_NET_F_MRG_RXBUF)) == 12
    assert net_hdr_size(V1) == 12
    assert net_hdr_size(V1 | bit(VIRTIO_NET_F_MRG_RXBUF)) == 12


@pytest.mark.parametrize("legacy", [False, True])
def test_fast_path_one_descriptor_header_in_headroom(variant, legacy):
    features = variant & ~V1 if legacy and not variant & bit(VIRTIO_F_RING_PACKED) else variant
    nq, dev = make(features)
    hs = nq.hdr_size
    assert hs == (10 if features == 0 or features == bit(VIRTIO_F_IN_ORDER) else 12)
    idx, lens = packets(nq, 8)
    assert nq.tx.burst(idx, lens) == 8
    ch = dev.poll()
    assert ch.n == 8
    assert list(ch.ndesc) == [1] * 8 and list(ch.nseg) == [1] * 8
    for k in range(8):
        (addr, length, w), = ch.segments(k)
        b = int(idx[k])
        assert w == 0 and length == 60 + hs
        assert addr == nq.pool.gpa_of(b) + nq.pool.headroom - hs      # the header sits in the headroom
        data = nq.mem.table.read(addr, length)
        assert data[:hs] == bytes(hs)                                 # NET-06/07/08: all zero
        assert data[hs:] == bytes([k]) * 60
    c = nq.tx.counters()
    assert c["fast_path"] == 8 and c["slow_path"] == 0 and c["packets"] == 8 and c["bytes"] == 480
    nq.close()


def test_slow_path_chain_without_headroom(variant):
    features = variant & ~bit(VIRTIO_F_INDIRECT_DESC)
    nq, dev = make(features)
    hs = nq.hdr_size
    idx, lens = packets(nq, 4)
    nq.pool.write(idx[1], bytes([1]) * 60, data_off=0)    # no headroom: header from the header area
    two = nq.pool.alloc(2)                                  # a two-segment packet
    nq.pool.write(two[0], b"A" * 100)
    nq.pool.write(two[1], b"B" * 50)
    pkt = nq.pool.chain(list(two))
    idx = np.array([idx[0], idx[1], pkt, idx[2]], np.uint32)
    lens = np.array([60, 60, 150, 60], np.uint32)
    assert nq.tx.burst(idx, lens) == 4
    ch = dev.poll()
    assert ch.n == 4
    assert list(ch.nseg) == [1, 2, 3, 1]           # direct descriptors (no indirect negotiated)
    if features & bit(VIRTIO_F_RING_PACKED):
        assert list(ch.ndesc) == [1, 2, 3, 1]
    assert nq.tx.vq.num_free == nq.size - 7
    segs = ch.segments(1)
    assert [s[1] for s in segs] == [hs, 60] and all(s[2] == 0 for s in segs)
    assert nq.mem.table.read(segs[0][0], hs) == bytes(hs)
    assert nq.mem.table.read(segs[1][0], 60) == bytes([1]) * 60
    segs = ch.segments(2)
    assert [s[1] for s in segs] == [hs, 100, 50]
    assert b"".join(nq.mem.table.read(a, n) for a, n, _ in segs[1:]) == b"A" * 100 + b"B" * 50
    c = nq.tx.counters()
    assert c["fast_path"] == 2 and c["slow_path"] == 2
    # the device completes everything; every buffer (chain included) goes back to the pool
    avail = nq.pool.available
    dev.push_used(ch.id, np.zeros(ch.n))
    dev.flush()
    assert nq.tx.cleanup(0) == 4
    assert nq.pool.available == avail + 5
    nq.close()


def test_slow_path_indirect(variant):
    features = variant | bit(VIRTIO_F_INDIRECT_DESC)
    nq, dev = make(features, force_slow=True)
    hs = nq.hdr_size
    idx, lens = packets(nq, 5)
    assert nq.tx.burst(idx, lens) == 5
    ch = dev.poll()
    assert ch.n == 5
    assert list(ch.ndesc) == [1] * 5          # one ring descriptor each ...
    assert list(ch.nseg) == [2] * 5           # ... pointing at a 2-entry table: header, data
    for k in range(5):
        (ha, hl, _), (da, dl, _) = ch.segments(k)
        assert hl == hs and dl == 60
        assert nq.mem.table.read(ha, hs) == bytes(hs)
        assert nq.mem.table.read(da, 60) == bytes([k]) * 60
    assert nq.tx.counters()["slow_path"] == 5
    nq.close()


def test_normal_cleanup_reclaims_exactly_what_completed():
    for features in (VARIANTS["split"], VARIANTS["packed"]):
        nq, dev = make(features)
        idx, lens = packets(nq, 16)
        assert nq.tx.burst(idx, lens) == 16
        ch = dev.poll()
        done = [int(i) for i in ch.id[[3, 0, 7, 12, 5]]]   # out of order
        dev.push_used(done, [0] * len(done))
        dev.flush()
        avail = nq.pool.available
        assert nq.tx.cleanup(0) == 5
        assert nq.pool.available == avail + 5
        assert nq.tx.inflight == 11
        held = set(int(b) for b in idx) - set(int(b) for b in np.nonzero(nq.pool.owned == 0)[0])
        assert held == set(int(idx[k]) for k in range(16) if k not in (3, 0, 7, 12, 5))
        c = nq.tx.counters()
        assert c["reclaimed_bufs"] == 5 and c["reclaimed_descs"] == 5
        nq.close()


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_in_order_cleanup_one_used_entry_per_batch(fmt):  # INORDER-06/09 (split), INORDER-11/12 (packed)
    features = VARIANTS[fmt + "_in_order"]
    nq, dev = make(features, batch=True)
    idx, lens = packets(nq, 20)
    assert nq.tx.burst(idx, lens) == 20
    ch = dev.poll()
    dev.push_used(ch.id[:13], [0] * 13)     # one batch: the device writes ONE used entry for 13 buffers
    dev.flush()
    if fmt == "split":
        assert nq.tx.vq.c.used.idx == 13
        assert nq.tx.vq.c.used.ring[0].id == int(ch.id[12])   # the batch's last id, at the first position
    else:
        assert nq.tx.vq.c.pdesc[0].id == int(ch.id[12])       # one used descriptor, at the batch's first slot
        assert not nq.tx.vq.c.pdesc[1].flags & (1 << 15)      # the others stay available-looking
    avail = nq.pool.available
    assert nq.tx.cleanup(0) == 13
    assert nq.pool.available == avail + 13
    assert nq.tx.inflight == 7
    # the reclaimed buffers are exactly the 13 oldest
    assert all(nq.pool.owned[int(b)] == 0 for b in idx[:13])
    assert all(nq.pool.owned[int(b)] == 1 for b in idx[13:])
    nq.close()


def test_in_order_batch_with_slow_path_chains():
    """In-order packed with chains: a batch entry must skip by each buffer's descriptor count (INORDER-12/14)."""
    features = VARIANTS["packed_in_order"]
    nq, dev = make(features, batch=True, force_slow=True)
    idx, lens = packets(nq, 6)
    assert nq.tx.burst(idx, lens) == 6          # 6 x (header + data) = 12 descriptors
    ch = dev.poll()
    assert list(ch.ndesc) == [2] * 6 and list(ch.nseg) == [2] * 6
    dev.push_used(ch.id, [0] * 6)
    dev.flush()
    assert nq.tx.cleanup(0) == 6
    assert nq.tx.vq.num_free == nq.size
    nq.close()


def test_cleanup_frees_more_than_the_burst_size(variant):
    """A full ring, all completed: a burst of 8 chained packets needs 24 descriptors, so cleanup must reclaim
    (at least) 24 descriptors although the burst is 8 packets (the DPDK cleanup-capped-at-burst bug)."""
    features = variant & ~bit(VIRTIO_F_INDIRECT_DESC)
    size = 64
    nq, dev = make(features, size=size)
    idx, lens = packets(nq, size)
    assert nq.tx.burst(idx, lens) == size
    assert nq.tx.vq.num_free == 0
    ch = dev.poll()
    dev.push_used(ch.id, [0] * ch.n)
    dev.flush()
    chained = []
    for _ in range(8):
        a, b = nq.pool.alloc(2)
        nq.pool.write(a, b"x" * 30)
        nq.pool.write(b, b"y" * 30)
        chained.append(nq.pool.chain([a, b]))
    assert nq.tx.burst(np.array(chained, np.uint32), np.full(8, 60, np.uint32)) == 8
    c = nq.tx.counters()
    assert c["reclaimed_bufs"] == size and c["reclaimed_descs"] == size > 8
    assert nq.tx.vq.num_free == size - 24
    nq.close()


def test_cleanup_only_what_was_completed_then_partial_burst(variant):
    features = variant & ~bit(VIRTIO_F_INDIRECT_DESC)
    size = 32
    nq, dev = make(features, size=size)
    idx, lens = packets(nq, size)
    assert nq.tx.burst(idx, lens) == size
    ch = dev.poll()
    dev.push_used(ch.id[:10], [0] * 10)
    dev.flush()
    more, mlens = packets(nq, 16)
    nq.pool.data_off[more] = 0            # no headroom: 2 descriptors each
    sent = nq.tx.burst(more, mlens)
    assert sent == 5                      # 10 descriptors freed -> 5 two-descriptor packets
    c = nq.tx.counters()
    assert c["reclaimed_bufs"] == 10 and c["ring_full"] == 11
    nq.pool.free(more[sent:])
    nq.close()


def test_kicks_only_when_asked_and_more_defers(variant):
    nq, dev = make(variant)
    dev.enable_kicks(False)               # net_vhost: NO_NOTIFY / DISABLE
    idx, lens = packets(nq, 4)
    nq.tx.burst(idx, lens)
    assert nq.tx.kicks == 0
    dev.enable_kicks(True)
    idx, lens = packets(nq, 8)
    nq.tx.burst(idx[:4], lens[:4], more=True)
    nq.tx.burst(idx[4:6], lens[4:6], more=True)
    assert nq.tx.kicks == 0               # xmit_more: the doorbell waits
    nq.tx.burst(idx[6:], lens[6:])
    assert nq.tx.kicks == 1               # one kick for the three bursts
    idx, lens = packets(nq, 3)
    nq.tx.burst(idx, lens, more=True)
    nq.tx.flush()
    assert nq.tx.kicks == 2
    assert dev.poll().n == 4 + 8 + 3
    nq.close()


def test_kicks_with_event_idx():
    features = VARIANTS["split"] | bit(VIRTIO_F_EVENT_IDX)
    nq, dev = make(features)
    dev.enable_kicks(False)               # avail_event far ahead
    idx, lens = packets(nq, 4)
    nq.tx.burst(idx, lens)
    assert nq.tx.kicks == 0
    dev.poll()
    dev.enable_kicks(True)                # avail_event = last_avail: the next buffer crosses it
    idx, lens = packets(nq, 4)
    nq.tx.burst(idx, lens)
    assert nq.tx.kicks == 1
    nq.close()


def test_foreign_index_is_refused():
    nq, dev = make(VARIANTS["split"])
    idx, lens = packets(nq, 2)
    free_buf = int(np.nonzero(nq.pool.owned == 0)[0][0])
    assert nq.tx.burst(np.array([idx[0], free_buf, idx[1]], np.uint32), np.full(3, 60, np.uint32)) == 1
    assert nq.tx.counters()["errors"] == 1
    nq.close()


def test_hostile_used_entry_breaks_the_queue_for_good():
    """The driver checks used ids (DESIGN: trust): a bogus one raises a typed error, sticky on every later call."""
    from rings.errors import UsedIdNotInFlight
    nq, dev = make(VARIANTS["split"], size=16)
    idx, lens = packets(nq, 4)
    assert nq.tx.burst(idx, lens) == 4
    used = nq.tx.vq.c.used
    used.ring[0].id = 9          # never made available
    used.ring[0].len = 0
    used.idx = 1
    with pytest.raises(UsedIdNotInFlight) as first:
        nq.tx.cleanup(0)
    more, mlens = packets(nq, 2)
    with pytest.raises(UsedIdNotInFlight) as again:
        nq.tx.burst(more, mlens)
    assert again.value is first.value
    nq.close()
