"""virtio-net driver Rx: refill in bursts, header strip, mergeable reassembly (NET-25, NET-29, NET-32),
against the in-process device half (rings.virtq.DeviceQueue)."""
import struct

import pytest

from conftest import NET_VARIANTS as VARIANTS
from rings.layout import VIRTIO_NET_F_MRG_RXBUF, bit
from rings.virtq import DeviceQueue
from virtio.net import NetQueues

MRG = bit(VIRTIO_NET_F_MRG_RXBUF)


def make(features, size=64, burst=8, buf_size=2048):
    nq = NetQueues(features, size=size, nbufs=1024, burst=burst, buf_size=buf_size)
    dev = DeviceQueue(nq.mem.table, nq.mem.rx_layout, features)
    nq.rx.fill()
    return nq, dev


def hdr(num_buffers, size=12):
    return struct.pack("<BBHHHH", 0, 0, 0, 0, 0, 0) + (struct.pack("<H", num_buffers) if size == 12 else b"")


def deliver(nq, dev, frames, mrg=False):
    """The device side: write each frame into as many posted buffers as it needs (NET-29/30), in the order
    they were posted; returns (ids, lens) to push_used. Buffers polled but not used stay for the next call."""
    hs = nq.hdr_size
    if not hasattr(dev, "pending"):
        dev.pending = []
    pending = dev.pending
    ch = dev.poll()
    for k in range(ch.n):
        (addr, wl, w), = ch.segments(k)
        assert w  # writable
        pending.append((int(ch.id[k]), addr, wl))
    ids, lens = [], []
    for data in frames:
        parts = [data] if not mrg else []
        if mrg:
            room = pending[0][2] - hs
            parts.append(data[:room])
            data = data[room:]
            while data:
                parts.append(data[:pending[len(parts)][2]])
                data = data[len(parts[-1]):]
        for j, part in enumerate(parts):
            bid, addr, wl = pending.pop(0)
            payload = (hdr(len(parts) if mrg else 0, hs) + part) if j == 0 else part
            assert len(payload) <= wl
            nq.mem.table.write(addr, payload)
            ids.append(bid)
            lens.append(len(payload))
    return None, ids, lens


def test_fill_posts_writable_buffers_with_header_in_headroom(variant):
    nq, dev = make(variant)
    ch = dev.poll()
    assert ch.n == nq.size
    hs = nq.hdr_size
    pool = nq.pool
    for k in range(ch.n):
        (addr, length, w), = ch.segments(k)
        assert w  # writable
        assert length == pool.buf_size - pool.headroom + hs >= hs        # NET-25
        assert (addr - pool.gpa - pool.headroom + hs) % pool.stride == 0
    assert nq.rx.counters()["posted"] == nq.size
    nq.close()


def test_rx_strips_header(variant):
    nq, dev = make(variant)
    frames = [bytes([k]) * (60 + k) for k in range(5)]
    ch, ids, lens = deliver(nq, dev, frames)
    dev.push_used(ids, lens)
    dev.flush()
    idx, plen = nq.rx.burst(32)
    assert list(plen) == [60 + k for k in range(5)]
    assert [nq.pool.data(b) for b in idx] == frames
    c = nq.rx.counters()
    assert c["packets"] == 5 and c["bytes"] == sum(map(len, frames)) and c["errors"] == 0
    nq.pool.free(idx)
    nq.close()


@pytest.mark.parametrize("fmt", ["split", "packed_in_order"])
def test_mergeable_packet_comes_back_as_one(fmt):  # NET-29, NET-32
    features = VARIANTS[fmt] | MRG
    nq, dev = make(features, buf_size=256)        # 256 - 140 headroom + 12 = 128-byte buffers
    frame = bytes(range(256)) * 5 + bytes(234)    # 1514 bytes -> ceil((12 + 1514) / 128) = 12 buffers
    small = b"s" * 60
    ch, ids, lens = deliver(nq, dev, [small, frame, small], mrg=True)
    assert len(ids) == 1 + 12 + 1
    dev.push_used(ids, lens)
    dev.flush()
    idx, plen = nq.rx.burst(8)
    assert list(plen) == [60, 1514, 60]
    assert nq.pool.data(idx[1]) == frame
    assert nq.pool.data(idx[0]) == small == nq.pool.data(idx[2])
    c = nq.rx.counters()
    assert c["packets"] == 3 and c["buffers"] == 14 and c["merged"] == 1
    held = nq.pool.nbufs - nq.pool.available - nq.rx.vq.inflight
    assert held == 14                              # the packets hold all 14 buffers (chained)
    nq.pool.free(idx)
    assert nq.pool.nbufs - nq.pool.available - nq.rx.vq.inflight == 0
    nq.close()


def test_mergeable_partial_packet_waits_for_its_buffers():
    features = VARIANTS["split"] | MRG
    nq, dev = make(features, buf_size=256)
    frame = bytes(range(175)) * 2                  # 350 bytes + 12 header: 3 buffers of 128
    ch, ids, lens = deliver(nq, dev, [frame], mrg=True)
    assert len(ids) == 3
    dev.push_used(ids[:2], lens[:2])               # a device that publishes early (not allowed, NET-31) ...
    dev.flush()
    idx, plen = nq.rx.burst(8)
    assert len(idx) == 0                           # ... gets nothing delivered yet
    dev.push_used(ids[2:], lens[2:])
    dev.flush()
    idx, plen = nq.rx.burst(8)
    assert list(plen) == [350] and nq.pool.data(idx[0]) == frame
    nq.close()


def test_without_mrg_num_buffers_is_ignored():  # DPDK leaves num_buffers unwritten without MRG_RXBUF
    nq, dev = make(VARIANTS["split"])
    ch, ids, lens = deliver(nq, dev, [b"a" * 60, b"b" * 70])
    dev.push_used(ids, lens)
    dev.flush()
    idx, plen = nq.rx.burst(8)
    assert list(plen) == [60, 70]
    nq.close()


def test_short_used_length_is_an_error_not_a_packet():
    nq, dev = make(VARIANTS["split"])
    ch = dev.poll()
    dev.push_used([int(ch.id[0]), int(ch.id[1])], [5, 72])
    dev.flush()
    before = nq.pool.available
    idx, plen = nq.rx.burst(8)
    assert list(plen) == [60]
    c = nq.rx.counters()
    assert c["errors"] == 1 and c["packets"] == 1
    assert nq.pool.available == before + 1         # the bad buffer went back to the pool
    nq.close()


def test_refill_in_bursts(variant):
    nq, dev = make(variant, burst=8)
    posted = nq.rx.counters()["posted"]
    ch, ids, lens = deliver(nq, dev, [b"x" * 60] * 5)
    dev.push_used(ids, lens)
    dev.flush()
    idx, _ = nq.rx.burst(32)
    nq.pool.free(idx)
    assert nq.rx.counters()["posted"] == posted     # 5 free slots < burst 8: no refill yet
    ch, ids, lens = deliver(nq, dev, [b"y" * 60] * 4)
    dev.push_used(ids, lens)
    dev.flush()
    idx, _ = nq.rx.burst(32)
    nq.pool.free(idx)
    c = nq.rx.counters()
    assert c["posted"] == posted + 9 and c["refills"] == 2 and nq.rx.vq.num_free == 0
    nq.close()


def test_wait_without_call_fd_times_out_quickly():
    nq, dev = make(VARIANTS["split"])
    assert nq.rx.wait(0.01) is False
    ch, ids, lens = deliver(nq, dev, [b"z" * 60])
    dev.push_used(ids, lens)
    dev.flush()
    assert nq.rx.wait(0.01) is True
    nq.close()


@pytest.mark.parametrize("fmt", ["split_in_order", "packed_in_order"])
def test_in_order_batched_used_entries_with_mergeable(fmt):  # INORDER-10: skipped buffers were fully used
    features = VARIANTS[fmt] | MRG
    nq = NetQueues(features, size=64, nbufs=1024, burst=8, buf_size=256)
    dev = DeviceQueue(nq.mem.table, nq.mem.rx_layout, features, in_order_batch=True)
    nq.rx.fill()
    frame = bytes(range(250)) + bytes(range(100))       # 350 bytes + 12 header: 128 + 128 + 106
    _, ids, lens = deliver(nq, dev, [frame], mrg=True)
    assert lens == [128, 128, 106]
    dev.push_used(ids, lens)
    dev.flush()                                          # one used entry for the three buffers
    if fmt.startswith("split"):
        assert nq.rx.vq.c.used.idx == 3 and nq.rx.vq.c.used.ring[0].id == ids[-1]
    idx, plen = nq.rx.burst(8)
    assert list(plen) == [350] and nq.pool.data(idx[0]) == frame
    nq.close()


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_net_26_python_macfwd_reposts_rx_before_it_sends(fmt):
    """NET-26 (the driver keeps Rx buffers posted): macfwd's Python path (--verify, --pcap) must repost before it
    sends, as vn_fwd_burst does. A 600-byte frame takes 5 of the 8 Rx buffers (128 bytes each); the receive does
    not repost them (fewer than its threshold are free), so unless _forward does, the backend gets this frame back
    into a ring with 3 buffers and drops it. Deterministic: what the Rx ring holds when the send happens."""
    from virtio.app import DriverConfig, _Loop, _Stop
    nq, dev = make(VARIANTS[fmt] | MRG, size=8, burst=32, buf_size=256)
    try:
        frame = bytes(range(256)) * 2 + bytes(88)
        ch, ids, lens = deliver(nq, dev, [frame], mrg=True)
        assert len(ids) == 5
        dev.push_used(ids, lens)
        dev.flush()
        loop = _Loop(DriverConfig("", ring_size=8, buf_size=256, mode="macfwd"), nq, _Stop())
        idx, plen = nq.rx.burst(8)
        assert list(plen) == [600] and nq.rx.vq.num_free == 5   # received, not reposted yet
        loop.idx[:1], loop.lens[:1] = idx, plen
        free_at_send = []
        burst = nq.tx.burst
        nq.tx.burst = lambda i, l, *a: (free_at_send.append(nq.rx.vq.num_free), burst(i, l, *a))[1]
        loop._forward(1)
        assert free_at_send == [0] and nq.tx.counters()["packets"] == 1
    finally:
        nq.close()
