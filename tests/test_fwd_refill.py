"""macfwd (virtio/csrc/vnet.h vn_fwd_burst) against our backend in one process, steps interleaved by hand: with
fewer packets in flight than the Rx ring holds, no interleaving may make the backend drop one for want of an Rx
buffer. The driver cannot see how many posted Rx buffers the backend can still fill (used entries it has not
received yet, packets staged after their Tx completion was reclaimed), so it reposts before every send."""
import numpy as np
import pytest

from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1,
                          VIRTIO_NET_F_MRG_RXBUF, bit)
from rings.virtq import CMemory, DeviceQueue
from vhost import _net as vh
from vhost.datapath import Datapath, Options
from virtio import _net as vn
from virtio import packets
from virtio.net import NetQueues


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
def test_fwd_burst_reposts_before_the_send_whatever_the_backend_interleaving(packed, in_order):
    ring, burst, inject = 8, 4, 6
    f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_INDIRECT_DESC) | bit(VIRTIO_NET_F_MRG_RXBUF)
    f |= (bit(VIRTIO_F_RING_PACKED) if packed else 0) | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
    nq = NetQueues(f, size=ring, burst=burst, indirect_max=ring)
    try:
        nq.rx.fill()
        cmem = CMemory(nq.mem.table)
        dev = [DeviceQueue(cmem, lay, f) for lay in (nq.mem.rx_layout, nq.mem.tx_layout)]
        for q in dev:
            q.enable_kicks(False)
        dp = Datapath(dev[0], dev[1], f, Options(burst=burst))
        tmpl = packets.template(64)
        idx = np.zeros(ring + burst, np.uint32)
        lens = np.full(ring + burst, len(tmpl), np.uint32)
        p_idx = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(idx))
        p_lens = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(lens))
        k = vn.lib.vn_gen(nq.pool.c, p_idx, inject, vn.ffi.cast("uint8_t *", vn.ffi.from_buffer(tmpl)), len(tmpl), 0, packets.SEQ_OFF, 0, 0)
        assert nq.tx.burst(idx[:k], lens[:k]) == inject
        # backend twice (all 6 in the Rx ring, Tx all used), then two short driver bursts (Tx reclaimed: the
        # 3 packets still in the Rx ring are counted nowhere), then the backend with 3 packets to deliver
        for step in ("backend", "backend", 1, 2, "backend"):
            if step == "backend":
                assert vh.lib.vh_run(dp.n, 1, 1 << 40) == 0
            else:
                assert vn.lib.vn_fwd_burst(nq.rx.c, nq.tx.c, p_idx, p_lens, step, 0) == step
        assert dp.stats()["rx_dropped"] == 0
        assert nq.tx.c.dropped == 0
    finally:
        nq.close()
