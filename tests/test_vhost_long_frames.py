"""Frames longer than one slot of the backend's intermediate queue (vring vhost --pkt-size, 2048 by default).

A driver may send longer frames than a staging slot holds (jumbo frames; DPDK's net_vhost chains mbufs for them).
The backend used to drop every frame over --pkt-size as tx_oversize: `vring driver --buf-size 4096 --pkt-size 3956`
lost all 256 it injected, and the run exited 0. Now such a frame takes as many bytes of the intermediate queue as
it needs, up to MAX_FRAME, and only a longer one is dropped (counted, its Tx buffer completed: NET-21, nothing
written into it).

NET-29/30/31: with MRG_RXBUF a long frame arrives spread over several Rx buffers, whole, num_buffers set.
"""
import numpy as np
import pytest

from rings.layout import VIRTIO_NET_F_MRG_RXBUF, bit
from rings.pcap import PcapWriter
from rings.layout import odd_line_stride as stage_stride
from vhost.datapath import MAX_FRAME
from virtio.net import HEADROOM

from tests.test_tap import frames as pcap_frames
from tests.test_vhost_direct import Loop, frame, swapped

MRG = bit(VIRTIO_NET_F_MRG_RXBUF)
FLUSH = ["rx-batch", "none", "threshold", "timer:0"]


def send(lp, frames):
    """Each frame into as many pool buffers as it needs (chained), one Tx burst. Returns the head buffers."""
    pool = lp.nq.pool
    room = pool.buf_size - HEADROOM
    heads = []
    for f in frames:
        bufs = pool.alloc(-(-len(f) // room)).copy()
        for k, b in enumerate(bufs):
            pool.write(b, f[k * room:(k + 1) * room])
        heads.append(pool.chain(bufs))
    assert lp.nq.tx.burst(np.array(heads, np.uint32), np.array([len(f) for f in frames], np.uint32)) == len(frames)
    return heads


def receive(lp):
    got, _lens = lp.nq.rx.burst(lp.nq.rx.vq.size)
    out = [lp.nq.pool.data(b) for b in got]
    lp.nq.pool.free(got)
    return out


def run(lp, iters=4):
    for _ in range(iters):
        assert lp.dp.run(max_iters=1) == {}


@pytest.mark.parametrize("flush", FLUSH)
def test_net_29_frames_longer_than_a_slot_are_forwarded_whole(variant, flush):
    """A burst mixing short frames with 3956-, 9000- and MAX_FRAME-byte ones: every frame arrives whole, MACs
    swapped, in order; none counted oversize. The short frames after a long one are in their own place (the
    long one took more than one slot)."""
    lp = Loop(variant | MRG, size=128, txq_flush=flush)
    try:
        sizes = [60, 3956, 100, 9000, 1514, MAX_FRAME, 64]
        sent = [frame(k, n) for k, n in enumerate(sizes)]
        heads = send(lp, sent)
        run(lp)
        assert receive(lp) == [swapped(f) for f in sent]
        assert [lp.nq.pool.data(b) for b in heads] == sent          # NET-21: the Tx buffers unchanged
        st = lp.dp.stats()
        assert st["tx_oversize"] == 0 and st["rx_dropped"] == 0
        assert st["tx_packets"] == st["rx_packets"] == len(sizes)
        assert st["tx_bytes"] == st["rx_bytes"] == sum(sizes)
    finally:
        lp.close()


@pytest.mark.parametrize("flush", ["none", "rx-batch"])
@pytest.mark.parametrize("mrg", [0, MRG], ids=["one-buffer", "mergeable"])
def test_net_27_a_frame_longer_than_a_slot_into_one_large_rx_buffer(variant, flush, mrg):
    """4096-byte buffers on both sides: a 3956-byte frame goes into one Rx buffer (num_buffers 1, the common enqueue)
    from the long-frame area, its MACs swapped once (with --txq-flush none a short frame is swapped in the Rx
    buffer; a long one was swapped when it was staged)."""
    lp = Loop(variant | mrg, size=64, buf_size=4096, txq_flush=flush)
    try:
        sent = [frame(1, 3956), frame(2, 60), frame(3, 3000)]
        heads = send(lp, sent)
        run(lp)
        assert receive(lp) == [swapped(f) for f in sent]
        assert lp.nq.rx.counters()["merged"] == 0 and lp.nq.rx.counters()["buffers"] == 3
        assert [lp.nq.pool.data(b) for b in heads] == sent
    finally:
        lp.close()


def test_a_frame_longer_than_max_frame_is_dropped_and_counted(variant):
    lp = Loop(variant | MRG, size=128)
    try:
        sent = [frame(1, 60), frame(2, MAX_FRAME + 1), frame(3, 70)]
        heads = send(lp, sent)
        run(lp)
        assert receive(lp) == [swapped(sent[0]), swapped(sent[2])]
        st = lp.dp.stats()
        assert st["tx_oversize"] == 1 and st["tx_packets"] == st["rx_packets"] == 2
        assert [lp.nq.pool.data(b) for b in heads] == sent
        lp.nq.tx.cleanup()
        assert lp.nq.tx.inflight == 0                                 # the dropped frame's buffers completed too
    finally:
        lp.close()


def test_the_intermediate_queue_holds_its_capacity_of_long_frames(variant):
    """--txq-flush threshold stages bursts until the threshold: with 33, two 32-frame bursts of 9000-byte frames
    (each four and a half 2048-byte slots) wait together, then all 64 are delivered whole."""
    lp = Loop(variant | MRG, size=512, txq_flush="threshold", txq_threshold=33)
    try:
        sent = [frame(k, 9000 - k) for k in range(64)]
        send(lp, sent)
        run(lp, 1)
        assert lp.dp.pending == 32
        run(lp, 1)
        st = lp.dp.stats()
        assert st["flush_threshold"] == 1 and st["rx_packets"] == 64 and st["tx_oversize"] == 0
        got = []
        while len(got) < 64 and (more := receive(lp)):
            got += more
        assert got == [swapped(f) for f in sent]
    finally:
        lp.close()


def test_the_long_frame_area_is_bounded_by_the_c_itself(variant):
    """The C checks the long-frame area's size on its own (the guide: C bounds every index it uses, whatever Python
    checked). Shrunk to 4096 bytes under it, the second of two 3956-byte frames (3968 bytes each, rounded to 64)
    finds no room: dropped and counted, the first and the short frames delivered."""
    lp = Loop(variant | MRG, size=64)
    try:
        lp.dp.n.long_size = 4096
        sent = [frame(1, 3956), frame(2, 100), frame(3, 3956), frame(4, 60)]
        send(lp, sent)
        run(lp)
        assert receive(lp) == [swapped(sent[k]) for k in (0, 1, 3)]
        st = lp.dp.stats()
        assert st["tx_oversize"] == 1 and st["rx_packets"] == 3
    finally:
        lp.close()


@pytest.mark.parametrize("size", [64, 100, 2048, 2049, 2112, 4096, 65536])
def test_staging_slots_are_an_odd_number_of_cache_lines_apart(size):
    s = stage_stride(size)
    assert s >= size and s % 64 == 0 and (s // 64) % 2 == 1 and s - size < 128


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
def test_vhost_pcap_writes_each_frame_as_sent_and_as_received(variant, flush, tmp_path):
    """--pcap: each frame as the driver sent it, then as the driver receives it (MACs swapped). With --txq-flush
    none the capture used to write the empty staging slots (the frames were still in the driver's Tx buffers, which
    were completed before the enqueue had read them); while capturing every frame is copied now, and Python reads
    only that copy, never guest memory."""
    w = PcapWriter(tmp_path / "b.pcap", None)
    lp = Loop(variant | MRG, size=64, txq_flush=flush, pcap=w)
    try:
        sent = [frame(k, n) for k, n in enumerate([60, 1500, 200])]
        send(lp, sent)
        run(lp, 1)
        assert receive(lp) == [swapped(f) for f in sent]
        w.close()
        assert [buf for _, buf in pcap_frames(tmp_path / "b.pcap")] == sent + [swapped(f) for f in sent]
    finally:
        lp.close()


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
def test_net_27_pcap_writes_a_frame_no_rx_buffer_holds_as_sent_only(variant, flush, tmp_path):
    """Without MRG_RXBUF a frame longer than one Rx buffer is consumed and counted (rx_too_big), never delivered
    (NET-27). --pcap wrote it as received too, and went on writing the frames after it (it only knew of the dropped
    tail): the capture showed a frame the driver never got."""
    w = PcapWriter(tmp_path / "b.pcap", None)
    lp = Loop(variant, size=64, txq_flush=flush, pcap=w)
    try:
        sent = [frame(1, 60), frame(2, 3956), frame(3, 100), frame(4, 2000), frame(5, 70)]
        send(lp, sent)
        run(lp, 1)
        delivered = [swapped(sent[k]) for k in (0, 2, 4)]
        assert receive(lp) == delivered
        st = lp.dp.stats()
        assert st["rx_too_big"] == 2 and st["rx_packets"] == 3 and st["tx_packets"] == 5
        w.close()
        assert [buf for _, buf in pcap_frames(tmp_path / "b.pcap")] == sent + delivered
    finally:
        lp.close()


@pytest.mark.parametrize("pkt_size", [65473, 65536])
def test_no_frame_over_max_frame_is_taken_whatever_the_slot(variant, pkt_size):
    """--pkt-size over 65472 makes a slot of 65600 bytes (an odd number of lines): frames up to that fitted a slot
    and were forwarded, though the limit is MAX_FRAME (README, --help, Options). Only MAX_FRAME bytes are taken."""
    lp = Loop(variant | MRG, size=128, pkt_size=pkt_size)
    try:
        assert stage_stride(pkt_size) == 65600
        sent = [frame(1, MAX_FRAME), frame(2, MAX_FRAME + 1), frame(3, 65600), frame(4, 60)]
        send(lp, sent[:2])
        run(lp)
        got = receive(lp)
        send(lp, sent[2:])
        run(lp)
        assert got + receive(lp) == [swapped(sent[0]), swapped(sent[3])]
        st = lp.dp.stats()
        assert st["tx_oversize"] == 2 and st["tx_packets"] == st["rx_packets"] == 2
    finally:
        lp.close()


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
def test_vhost_pcap_rxonly_writes_each_frame_taken(variant, flush, tmp_path):
    """--fwd rxonly --pcap: each frame taken off the Tx ring is written (as sent), none as received (nothing is put
    on the Rx ring). The capture used to be empty: rxonly overwrote one staging slot with every frame."""
    w = PcapWriter(tmp_path / "b.pcap", None)
    lp = Loop(variant | MRG, size=64, txq_flush=flush, fwd="rxonly", pcap=w)
    try:
        sent = [frame(k, n) for k, n in enumerate([60, 9000, 1500, MAX_FRAME, 200])]
        send(lp, sent)
        run(lp, 1)
        assert receive(lp) == []
        w.close()
        assert [buf for _, buf in pcap_frames(tmp_path / "b.pcap")] == sent
        st = lp.dp.stats()
        assert st["tx_packets"] == st["fwd_dropped"] == len(sent) and st["rx_packets"] == st["rx_dropped"] == 0, st
    finally:
        lp.close()
