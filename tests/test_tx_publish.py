"""When macfwd makes its Tx descriptors visible (virtio/csrc/vnet.h vn_fwd_burst, ``--tx-publish N``).

When everything it sent has come back and its Rx ring is drained, the loop is waiting for the device: the driver
then publishes its Tx burst in pieces, whenever the next ring slot is a multiple of N, so that the device starts on
the first packets while the rest is written. Otherwise (a backlog in Rx, packets still out) it publishes the burst
once: a device that is busy would see it in pieces, one poll each. Either way every piece is whole before its one
release store (MEM-02, PACKED-D-22: the ring layer's publish), nothing is published twice, and the device finds
every packet in order.
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


def pieces(start, n, every, size=None):
    """The publications of n descriptors from ring position `start`: one per run up to the next multiple of
    `every` (`size`: a packed ring, whose slots wrap there, mid-run)."""
    if not every:
        return 1
    k, pos = 0, start
    while n:
        step = min(n, every - pos % every)
        pos = (pos + step) % size if size else pos + step
        n -= step
        k += 1
    return k


def frame(k, size=64):
    """A frame numbered k (its byte 50)."""
    tmpl = bytes(packets.template(size))
    return tmpl[:50] + bytes([k]) + tmpl[51:]


def run(packed, in_order, every, inject, take, kept=0, size=64, skip=0, long=()):
    """Inject `inject` frames, let our backend move them all into the Rx ring, then one macfwd step of at most
    `take` (`kept`: that many more counted as sent, as if the device had kept them; negative: frames the device
    delivered of its own). `skip` frames go round first (the rings' positions move on); the frames numbered in
    `long` are 150 bytes, received in two mergeable buffers and sent back by the slow path. Returns
    (publications of that step, Tx position it started at, frames the backend then forwards)."""
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
        nq.tx.c.packets += kept
        start = nq.tx.vq.c.next_avail
        before = nq.tx.c.publishes
        p_idx = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(idx))
        p_lens = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(lens))
        assert vn.lib.vn_fwd_burst(nq.rx.c, nq.tx.c, p_idx, p_lens, take) == take
        published = nq.tx.c.publishes - before
        assert nq.tx.vq.c.pending == 0                       # nothing left kept aside
        assert nq.tx.c.every_now == 0                        # the piece size lasts one burst
        assert vh.lib.vh_run(lp.dp.n, 1, 1 << 40) == 0
        got, _ = nq.rx.burst(64)
        order = [nq.pool.data(b)[50] for b in got]
        nq.pool.free(got)
        assert lp.dp.stats()["rx_dropped"] == 0
        return published, start, order
    finally:
        lp.close()


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("every", [0, 1, 4, 16])
def test_mem_02_packed_d_22_tx_published_in_ring_aligned_pieces_when_rx_is_drained(packed, in_order, every):
    published, start, order = run(packed, in_order, every, inject=10, take=10)
    assert start == 10
    assert published == pieces(start, 10, every)        # 0: 1; 1: 10; 4: [10,12) [12,16) [16,20): 3; 16: 2
    # the backend forwards the ten again, in order: whatever the pieces, the device saw each packet once
    assert order == list(range(10))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("every", [4, 16])
def test_mem_02_tx_published_once_per_burst_with_a_backlog(packed, every):
    """20 frames in the Rx ring, 10 taken: the device has work queued, the burst goes out whole."""
    published, start, order = run(packed, False, every, inject=20, take=10)
    assert published == 1
    assert order == list(range(10, 20)) + list(range(10))   # the ten left in Rx, then the ten forwarded


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_mem_02_tx_published_once_per_burst_while_sent_exceeds_received(packed):
    """Rx drained, but one packet sent never came back (a device that dropped or keeps it): the driver cannot
    tell that the device is idle, the burst goes out whole."""
    published, start, order = run(packed, False, 4, inject=10, take=10, kept=1)
    assert published == 1 and order == list(range(10))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_mem_02_tx_published_once_per_burst_with_a_backlog_of_the_devices_own_frames(packed):
    """20 frames in the Rx ring, 10 taken, ten of the twenty the device's own (a peer that also sends): what was
    received has caught up with what was sent, only the Rx ring shows the device busy; the burst goes out whole."""
    published, start, order = run(packed, False, 4, inject=20, take=10, kept=-10)
    assert published == 1
    assert order == list(range(10, 20)) + list(range(10))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("slow", [4, 9])
def test_mem_02_packed_d_22_tx_pieces_around_a_slow_path_packet(packed, in_order, slow):
    """Frame `slow` comes back in two mergeable buffers and goes out by the slow path (one indirect descriptor):
    the fast path publishes the part of its piece it added before it; the slow packet's descriptor goes with the
    next piece, or at the end of the burst when it is the last packet. Nothing stays unpublished."""
    published, start, order = run(packed, in_order, 4, inject=10, take=10, long=(slow,))
    assert start == 10
    # 9: [10,12) [12,16) [16,19), the slow one at 19 at the end; 4: [10,12) [12,14), the slow one at 14 with [15],
    # then [16,20)
    assert published == 4
    assert order == list(range(10))


@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
@pytest.mark.parametrize("size,skip,inject,every", [(100, 70, 20, 16), (100, 66, 30, 16), (5, 2, 5, 4), (3, 1, 3, 1),
                                                    (13, 10, 13, 3)])
def test_packed_d_12_packed_d_22_tx_pieces_across_the_wrap_of_an_odd_packed_ring(in_order, size, skip, inject, every):
    """Packed queue sizes need not be powers of two, nor multiples of the piece size: a piece runs on across the
    wrap (its first head's flags kept aside until the piece is whole: PACKED-D-12), and the device finds every
    frame once, in order."""
    published, start, order = run(True, in_order, every, inject=inject, take=inject, size=size, skip=skip)
    assert start == (skip + inject) % size
    assert published == pieces(start, inject, every, size)
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
