"""How much one macfwd step takes and when its Tx becomes visible (virtio/csrc/vnet.h vn_fwd_take, vn_fwd_burst,
``--tx-publish N``).

With no more than a burst out (sent, not received yet) the loop is bound by latency: the driver receives, sends
and publishes N packets a step, so that the device starts on the first piece while the driver receives the next.
With more out (the device has work queued), or when the counts cannot tell (more received than sent, or more than
a burst's worth sent and not back), a step takes a whole burst. Whatever the pieces, each step's Tx is published
once, whole, by one release store (MEM-02, PACKED-D-22: the ring layer's publish), nothing is published twice, and
the device finds every packet once, in order.
"""
import numpy as np
import pytest

from rings.errors import ConfigError
from rings.layout import VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, \
    VIRTIO_NET_F_MRG_RXBUF, bit
from vhost import _net as vh
from virtio import _net as vn
from virtio import packets
from virtio.net import PUBLISH_EVERY_MAX, NetQueues

from test_vhost_direct import Loop


def features(packed, in_order):
    f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_INDIRECT_DESC) | bit(VIRTIO_NET_F_MRG_RXBUF)
    return f | (bit(VIRTIO_F_RING_PACKED) if packed else 0) | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)


def frame(k, size=64):
    """A frame numbered k (its byte 50)."""
    tmpl = bytes(packets.template(size))
    return tmpl[:50] + bytes([k]) + tmpl[51:]


def run(packed, in_order, every, inject, take, burst=None, sent=0, received=0, size=64, skip=0, long=()):
    """Inject `inject` frames and let our backend move them all into the Rx ring; then macfwd steps of at most
    `burst` (default `take`) until `take` frames are forwarded. `sent` / `received`: that many more counted as sent
    (as if the device had kept them) / received (frames the device delivered of its own before). `skip` frames go
    round first (the rings' positions move on); the frames numbered in `long` are 150 bytes, received in two
    mergeable buffers and sent back by the slow path. Returns (the frames each step took, publications, Tx position
    the steps started at, frames the backend then forwards, in its order)."""
    lp = Loop(features(packed, in_order), size=size, burst=32, txq_flush="none", rx_room=100 if long else None)
    nq = lp.nq
    try:
        nq.tx.c.publish_every = every
        idx = np.zeros(64, np.uint32)
        lens = np.zeros(64, np.uint32)
        while skip:
            k = min(skip, size, 32)
            b = nq.pool.alloc(k)
            for j in b:
                nq.pool.write(j, frame(0))
            assert nq.tx.burst(b, np.full(k, 64, np.uint32)) == k
            assert vh.lib.vh_run(lp.dp.n, 1, 1 << 40) == 0
            got, _ = nq.rx.burst(k)
            assert len(got) == k
            nq.pool.free(got)
            nq.rx.fill()   # the ring full again (a burst refills only past a threshold)
            skip -= k
        idx[:inject] = nq.pool.alloc(inject)
        for k, b in enumerate(idx[:inject]):
            nq.pool.write(b, frame(k, 150 if k in long else 64))
            lens[k] = 150 if k in long else 64
        assert nq.tx.burst(idx[:inject], lens[:inject]) == inject
        assert vh.lib.vh_run(lp.dp.n, 1, 1 << 40) == 0
        nq.tx.c.packets += sent
        nq.rx.c.packets += received
        start = nq.tx.vq.c.next_avail
        before = nq.tx.c.publishes
        p_idx = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(idx))
        p_lens = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(lens))
        steps = []
        while sum(steps) < take:
            n = vn.lib.vn_fwd_burst(nq.rx.c, nq.tx.c, p_idx, p_lens, burst or take)
            assert n > 0
            steps.append(n)
            assert nq.tx.vq.c.pending == 0                   # nothing left kept aside
        published = nq.tx.c.publishes - before
        assert vh.lib.vh_run(lp.dp.n, 1, 1 << 40) == 0
        got, _ = nq.rx.burst(64)
        order = [nq.pool.data(b)[50] for b in got]
        nq.pool.free(got)
        assert lp.dp.stats()["rx_dropped"] == 0
        return steps, published, start, order
    finally:
        lp.close()


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("every,pieces", [(0, [10]), (1, [1] * 10), (4, [4, 4, 2]), (10, [10]), (16, [10])])
def test_mem_02_packed_d_22_one_burst_out_goes_in_pieces_each_published_once(packed, in_order, every, pieces):
    """Ten frames out, a burst of ten: pieces of `every` (0, or the burst size or more: one whole step), each piece
    published once, and the device sees each frame once, in order."""
    steps, published, start, order = run(packed, in_order, every, inject=10, take=10)
    assert start == 10
    assert steps == pieces
    assert published == len(pieces)
    assert order == list(range(10))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("every", [4, 16])
def test_mem_02_whole_bursts_with_more_than_a_burst_out(packed, every):
    """20 frames out, bursts of 10: the device has work queued, a step takes a whole burst and publishes it once."""
    steps, published, start, order = run(packed, False, every, inject=20, take=10)
    assert steps == [10] and published == 1
    assert order == list(range(10, 20)) + list(range(10))   # the ten left in Rx, then the ten forwarded


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("sent,received", [(1, 0), (0, 11)], ids=["device-kept-one", "device-sent-its-own"])
def test_mem_02_whole_bursts_when_the_counts_cannot_tell(packed, sent, received):
    """One frame sent that never came back (a device that dropped or keeps it) makes a burst and one more out;
    eleven received that were never sent (a device that also sends frames of its own) make more received than sent:
    the driver cannot tell how much is out, a step takes a whole burst."""
    steps, published, start, order = run(packed, False, 4, inject=10, take=10, sent=sent, received=received)
    assert steps == [10] and published == 1 and order == list(range(10))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("every,pieces", [(4, [4, 4, 4]), (16, [10])])
def test_mem_02_pieces_leave_the_rest_in_rx_for_the_next_step(packed, every, pieces):
    """20 frames in the Rx ring, 10 of them counted as out (the rest the device's own, not yet received), bursts of
    10: pieces of 4, or whole bursts of 10 for a piece size past the burst (never more than the caller's arrays
    hold); each step publishes once, and the device forwards the frames not taken, then the taken ones, each once."""
    steps, published, start, order = run(packed, False, every, inject=20, take=10, burst=10, sent=-10)
    assert steps == pieces and published == len(pieces)
    taken = sum(pieces)
    assert order == list(range(taken, 20)) + list(range(taken))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("slow", [4, 9])
def test_mem_02_packed_d_22_a_slow_path_packet_goes_with_its_piece(packed, in_order, slow):
    """Frame `slow` comes back in two mergeable buffers and goes out by the slow path (one indirect descriptor) in
    the middle or at the end of its piece: each piece, fast and slow packets together, is published once."""
    steps, published, start, order = run(packed, in_order, 4, inject=10, take=10, long=(slow,))
    assert start == 10
    assert steps == [4, 4, 2] and published == 3
    assert order == list(range(10))


@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("size,skip,inject,every,pieces", [(100, 70, 20, 16, [16, 4]), (100, 66, 30, 16, [16, 14]),
                                                           (5, 2, 5, 4, [4, 1]), (3, 1, 3, 1, [1, 1, 1]),
                                                           (13, 10, 13, 3, [3, 3, 3, 3, 1])])
def test_packed_d_12_packed_d_22_pieces_across_the_wrap_of_an_odd_packed_ring(in_order, size, skip, inject, every,
                                                                            pieces):
    """Packed queue sizes need not be powers of two, nor multiples of the piece size: a piece runs on across the
    wrap (its first head's flags kept aside until the piece is whole: PACKED-D-12), and the device finds every
    frame once, in order."""
    steps, published, start, order = run(True, in_order, every, inject=inject, take=inject, size=size, skip=skip)
    assert start == (skip + inject) % size
    assert steps == pieces and published == len(pieces)
    assert order == list(range(inject))


def test_tx_publish_choice_is_checked():
    f = features(False, False)
    for bad in (-1, PUBLISH_EVERY_MAX + 1, 2.5, "4", True):
        with pytest.raises(ConfigError, match="publish_every"):
            NetQueues(f, size=64, nbufs=256, publish_every=bad)
    nq = NetQueues(f, size=64, nbufs=256, publish_every=np.uint16(8))   # any integer type
    try:
        assert nq.tx.publish_every == 8 and nq.tx.counters()["publish_every"] == 8
    finally:
        nq.close()
