"""The backend without an intermediate queue (vring vhost --txq-flush none): one-segment frames are copied straight
from the driver's Tx buffer into its Rx buffer and their MACs swapped there.

NET-21: the device never writes into a Tx (device-readable) buffer: the frames the driver sent are unchanged.
NET-29/30/31: a frame spread over several mergeable Rx buffers (the general path, from a staged copy) arrives
whole, with num_buffers set; retries re-send the staged copy, never swap twice.
NET-28/29: the backend leaves an Rx header it would write unchanged alone (vh_hdr_put), so what a buffer held
before must never survive in its place.
"""
import struct

import numpy as np
import pytest

from rings.layout import VIRTIO_NET_F_MRG_RXBUF, bit
from rings.virtq import CMemory, DeviceQueue
from vhost.datapath import Datapath, Options
from virtio.net import NetQueues


def frame(k, size):
    return bytes.fromhex("aaaaaaaaaaaa" "bbbbbbbbbbbb") + bytes([k]) * (size - 12)


def swapped(f):
    return f[6:12] + f[:6] + f[12:]


class Loop:
    """Our driver's queues and our backend's data path over them, in one process (also tests/test_fwd_refill.py)."""

    def __init__(self, features, rx_room=None, size=64, burst=32, buf_size=2048, **opts):
        self.nq = NetQueues(features, size=size, nbufs=1024, burst=burst, indirect_max=min(size, 8), buf_size=buf_size)
        if rx_room is not None:   # the driver posts short Rx buffers: a frame needs several (mergeable)
            self.nq.rx.c.post_len = self.nq.hdr_size + rx_room
        self.nq.rx.fill()
        cmem = CMemory(self.nq.mem.table)
        self.dev = [DeviceQueue(cmem, lay, features) for lay in (self.nq.mem.rx_layout, self.nq.mem.tx_layout)]
        self.dp = Datapath(self.dev[0], self.dev[1], features, Options(**opts))

    def close(self):
        self.nq.close()


@pytest.mark.parametrize("size", [60, 100, 1500])
def test_net_21_direct_frames_swapped_in_rx_never_in_tx(variant, size):
    lp = Loop(variant | bit(VIRTIO_NET_F_MRG_RXBUF), txq_flush="none")
    pool = lp.nq.pool
    idx = pool.alloc(8)
    for k, b in enumerate(idx):
        pool.write(b, frame(k, size))
    assert lp.nq.tx.burst(idx, np.full(8, size, np.uint32)) == 8
    assert lp.dp.run(max_iters=1) == {}
    assert [pool.data(b) for b in idx] == [frame(k, size) for k in range(8)]   # NET-21: Tx buffers untouched
    got, lens = lp.nq.rx.burst(32)
    assert [pool.data(b) for b in got] == [swapped(frame(k, size)) for k in range(8)]
    st = lp.dp.stats()
    assert st["tx_packets"] == st["rx_packets"] == 8 and st["rx_dropped"] == 0
    pool.free(got)
    lp.close()


@pytest.mark.parametrize("retries", [0, 2])
def test_net_29_direct_frames_spread_over_mergeable_buffers(variant, retries):
    lp = Loop(variant | bit(VIRTIO_NET_F_MRG_RXBUF), rx_room=40, txq_flush="none", retries=retries)
    pool = lp.nq.pool
    frames = [frame(k, 100 + k) for k in range(6)]
    idx = pool.alloc(6)
    for b, f in zip(idx, frames):
        pool.write(b, f)
    assert lp.nq.tx.burst(idx, np.array([len(f) for f in frames], np.uint32)) == 6
    assert lp.dp.run(max_iters=1) == {}
    got, lens = lp.nq.rx.burst(32)
    assert [pool.data(b) for b in got] == [swapped(f) for f in frames]
    assert lp.nq.rx.counters()["merged"] == 6                                 # NET-29..31: 3 buffers each
    assert [pool.data(b) for b in idx] == frames
    pool.free(got)
    lp.close()


def test_direct_and_staged_deliver_the_same(variant):
    """--txq-flush none and the default (a staged copy per frame) move the same bytes."""
    out = []
    for flush in ("none", "rx-batch"):
        lp = Loop(variant, txq_flush=flush)
        pool = lp.nq.pool
        idx = pool.alloc(16)
        for k, b in enumerate(idx):
            pool.write(b, frame(k, 60 + 7 * k))
        assert lp.nq.tx.burst(idx, np.array([60 + 7 * k for k in range(16)], np.uint32)) == 16
        lp.dp.run(max_iters=2)
        got, _ = lp.nq.rx.burst(32)
        out.append([pool.data(b) for b in got])
        lp.close()
    assert out[0] == out[1] and len(out[0]) == 16


RX_HDR_1 = struct.pack("<BBHHHHH", 0, 0, 0, 0, 0, 0, 1)   # nothing offloaded, num_buffers 1
LEGACY_HDR = bytes(10)   # NET-02: without VERSION_1 and MRG_RXBUF the header is 10 bytes, no num_buffers


def rx_headers_over(features, flush, stale):
    """Every header room (the posted Rx buffers' included) holds `stale`; 8 frames go round: the Rx headers they
    arrive with (their frames checked)."""
    lp = Loop(features, txq_flush=flush)
    pool, hs = lp.nq.pool, lp.nq.hdr_size
    assert hs == len(stale)
    at = np.arange(pool.nbufs)[:, None] * pool.stride + pool.headroom - hs + np.arange(hs)
    pool.mem[at] = np.frombuffer(stale, np.uint8)
    idx = pool.alloc(8)
    for k, b in enumerate(idx):
        pool.write(b, frame(k, 60))
    assert lp.nq.tx.burst(idx, np.full(8, 60, np.uint32)) == 8
    assert lp.dp.run(max_iters=1) == {}
    got, lens = lp.nq.rx.burst(32)
    assert [pool.data(b) for b in got] == [swapped(frame(k, 60)) for k in range(8)]
    hdrs = [bytes(pool.mem[at[b]]) for b in got]
    pool.free(got)
    lp.close()
    return hdrs


@pytest.mark.parametrize("stale", [RX_HDR_1, b"\x01" + RX_HDR_1[1:], RX_HDR_1[:8] + b"\x07\x00" + RX_HDR_1[10:],
                                   RX_HDR_1[:10] + b"\x00\x00", RX_HDR_1[:10] + b"\x02\x00", bytes(range(1, 13))],
                         ids=["same", "flags", "csum_offset", "num_buffers_0", "num_buffers_2", "garbage"])
@pytest.mark.parametrize("mrg", [True, False], ids=["mrg", "no_mrg"])
@pytest.mark.parametrize("flush", ["none", "rx-batch"])
def test_net_28_net_29_rx_header_rewritten_whatever_the_buffer_held(variant, mrg, flush, stale):
    features = variant | (bit(VIRTIO_NET_F_MRG_RXBUF) if mrg else 0)
    assert rx_headers_over(features, flush, stale) == [RX_HDR_1] * 8


@pytest.mark.parametrize("stale", [LEGACY_HDR, LEGACY_HDR[:8] + b"\x07\x00", LEGACY_HDR[:9] + b"\x01",
                                   b"\x01" + LEGACY_HDR[1:], bytes(range(1, 11))],
                         ids=["same", "csum_offset", "csum_offset_hi", "flags", "garbage"])
@pytest.mark.parametrize("flush", ["none", "rx-batch"])
def test_net_02_net_28_legacy_rx_header_rewritten_whatever_the_buffer_held(flush, stale):
    """The 10-byte header's branch of vh_hdr_put (split, no VERSION_1): bytes 8..9 (csum_offset) count too."""
    assert rx_headers_over(0, flush, stale) == [LEGACY_HDR] * 8
