"""macfwd (virtio/csrc/vnet.h vn_fwd_burst) against our backend in one process, steps interleaved by hand: with
fewer packets in flight than the Rx ring holds, no interleaving may make the backend drop one for want of an Rx
buffer. The driver cannot see how many posted Rx buffers the backend can still fill (used entries it has not
received yet, packets staged after their Tx completion was reclaimed), so it reposts before every send."""
import numpy as np
import pytest

from rings.layout import VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, \
    VIRTIO_NET_F_MRG_RXBUF, bit
from vhost import _net as vh
from virtio import _net as vn
from virtio import packets

from test_vhost_direct import Loop


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
def test_fwd_burst_reposts_before_the_send_whatever_the_backend_interleaving(packed, in_order):
    ring, burst, inject = 8, 4, 6
    f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_INDIRECT_DESC) | bit(VIRTIO_NET_F_MRG_RXBUF)
    f |= (bit(VIRTIO_F_RING_PACKED) if packed else 0) | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
    lp = Loop(f, size=ring, burst=burst)
    nq, dp = lp.nq, lp.dp
    try:
        tmpl = bytes(packets.template(64))
        idx = np.zeros(ring + burst, np.uint32)
        lens = np.full(ring + burst, len(tmpl), np.uint32)
        idx[:inject] = nq.pool.alloc(inject)
        for b in idx[:inject]:
            nq.pool.write(b, tmpl)
        assert nq.tx.burst(idx[:inject], lens[:inject]) == inject
        p_idx = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(idx))
        p_lens = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(lens))
        # backend twice (all 6 in the Rx ring, Tx all used), then two short driver bursts (Tx reclaimed: the
        # 3 packets still in the Rx ring are counted nowhere), then the backend with 3 packets to deliver
        for step in ("backend", "backend", 1, 2, "backend"):
            if step == "backend":
                assert vh.lib.vh_run(dp.n, 1, 1 << 40) == 0
            else:
                assert vn.lib.vn_fwd_burst(nq.rx.c, nq.tx.c, p_idx, p_lens, step) == step
        assert dp.stats()["rx_dropped"] == 0
        assert nq.tx.c.dropped == 0
    finally:
        lp.close()


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_net_26_net_29_rx_ring_refilled_when_idle_below_the_threshold(packed):
    """NET-26/NET-29: with MRG_RXBUF each 100-byte frame takes 3 short Rx buffers of an 8-entry ring, and the
    driver reposts in batches of its refill threshold (here the whole ring). Received one at a time through
    vn_rx_burst (what macfwd --verify/--pcap, rxonly --verify/--wait and the drain use), two frames leave 2 buffers
    posted and 6 free: fewer than a frame needs, fewer free than the threshold. A receive that finds nothing must
    repost what it can, or every later frame is dropped by the backend for want of buffers (the driver saw 2 of
    10)."""
    f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_NET_F_MRG_RXBUF) | (bit(VIRTIO_F_RING_PACKED) if packed else 0)
    lp = Loop(f, rx_room=40, size=8, burst=8, txq_flush="none")
    nq, pool = lp.nq, lp.nq.pool
    try:
        got = 0
        for k in range(10):
            b = pool.alloc(1)
            pool.write(b[0], bytes(packets.template(100)))
            assert nq.tx.burst(b, np.full(1, 100, np.uint32)) == 1
            nq.rx.burst(8)          # the driver polls first (nothing there yet)
            lp.dp.run(max_iters=1)  # the backend moves the frame into the Rx ring, if it finds room
            idx, _ = nq.rx.burst(8)
            got += len(idx)
            pool.free(idx)
            nq.tx.cleanup(0)
        assert lp.dp.stats()["rx_dropped"] == 0 and got == 10, (got, lp.dp.stats())
    finally:
        lp.close()
