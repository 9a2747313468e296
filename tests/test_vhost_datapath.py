"""The backend's C data path in one process: retries (OVS semantics), intermediate Tx queue, batched used
writes, forwarding modes. The driver halves (rings.virtq.DriverQueue) share the memory with the device halves.

Retry rule under test: after an enqueue attempt that delivered at least one packet, retry (at most --retries
times); after an attempt that delivered nothing, stop; whatever is left is dropped and counted.
"""
import struct
import threading
import time

import numpy as np
import pytest

from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF,
                          QueueLayout, bit)
from rings.pcap import PcapWriter
from rings.shm import MemoryTable, ShmRegion
from rings.virtq import DeviceQueue, DriverQueue
from vhost._net import ffi
from vhost.datapath import Datapath, Options
from vhost.inflight import InflightArea, QueueTracking, create_area

GPA = 0x1000_0000
SIZE = 256
PKT = 2048
HDR = 12


class Pair:
    """Driver + device halves of the Rx (vring 0) and Tx (vring 1) queues over one region."""

    def __init__(self, options, packed=False, in_order=False, mrg=False, size=SIZE, tracked=False):
        self.features = bit(VIRTIO_F_VERSION_1) | (bit(VIRTIO_F_RING_PACKED) if packed else 0) \
            | (bit(VIRTIO_F_IN_ORDER) if in_order else 0) | (bit(VIRTIO_NET_F_MRG_RXBUF) if mrg else 0)
        fmt = "packed" if packed else "split"
        self.region = ShmRegion.create(0x20000 + 4 * size * PKT, prefix="vhost-dp-test")
        self.mem = MemoryTable([(GPA, self.region.size, self.region.buf)])
        self.layouts = [QueueLayout.contiguous(fmt, size, GPA + i * 0x10000) for i in range(2)]
        self.drv = [DriverQueue(self.mem, lay, self.features) for lay in self.layouts]
        self.dev = [DeviceQueue(self.mem, lay, self.features, in_order_batch=options.in_order_batch)
                    for lay in self.layouts]
        self.area, tracking = None, (None, None)
        if tracked:   # INFLIGHT_SHMFD on both queues, started fresh
            fd, area_size = create_area(2, size, packed)
            self.area = InflightArea(fd, area_size, 0, 2, size, packed)
            tracking = tuple(QueueTracking(self.area, i, size) for i in range(2))
            assert [t.start(q, self.mem) for t, q in zip(tracking, self.dev)] == [0, 0]
        self.dp = Datapath(self.dev[0], self.dev[1], self.features, options, tracking=tracking)
        self.free = list(range(4 * size))
        self.seq = 0

    def buf(self, slot):
        return GPA + 0x20000 + slot * PKT

    def post_rx(self, n, size=PKT):
        if n <= 0:
            return 0
        slots = [self.free.pop() for _ in range(n)]
        got = self.drv[0].add_simple(np.array([self.buf(s) for s in slots], np.uint64),
                                     np.full(n, size, np.uint32), np.array(slots, np.uint64), writable=True)
        assert got == n
        self.drv[0].publish()
        return got

    def send(self, n, size=60):
        slots = [self.free.pop() for _ in range(n)]
        for s in slots:
            f = bytes.fromhex("aaaaaaaaaaaa" "bbbbbbbbbbbb") + self.seq.to_bytes(4, "little")
            self.seq += 1
            self.mem.write(self.buf(s), bytes(HDR) + f + bytes(size - len(f)))
        got = self.drv[1].add_simple(np.array([self.buf(s) for s in slots], np.uint64),
                                     np.full(n, HDR + size, np.uint32), np.array(slots, np.uint64))
        assert got == n
        self.drv[1].publish()

    def received(self):
        tokens, lens = self.drv[0].reclaim()
        out = [self.mem.read(self.buf(int(t)), int(n)) for t, n in zip(tokens, lens)]
        self.free.extend(int(t) for t in tokens)
        return out

    def reclaim_tx(self):
        tokens, _ = self.drv[1].reclaim()
        self.free.extend(int(t) for t in tokens)
        return len(tokens)

    def close(self):
        self.dp = self.dev = self.drv = None
        self.mem = None
        if self.area is not None:
            self.area.close()
        self.region.close()


@pytest.fixture
def pairs():
    made = []

    def make(options, **kw):
        p = Pair(options, **kw)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()


# The hook is a C callback (cffi extern "Python"): the test's driver acts between two enqueue attempts.
_hook_state = {}


@ffi.def_extern()
def vh_test_hook(ctx, attempt, delivered, left):
    st = _hook_state
    st["trace"].append((attempt, delivered, left))
    posts = st["posts"]
    if attempt < len(posts):
        st["pair"].post_rx(posts[attempt])
    if st.get("probe"):
        st["probe"]()


def run_with_hook(pair, initial, posts):
    _hook_state.clear()
    _hook_state.update(trace=[], posts=posts, pair=pair)
    pair.dp.set_hook(_lib_hook())
    pair.post_rx(initial)
    pair.send(32)
    pair.dp.step()
    return _hook_state["trace"]


def _lib_hook():
    from vhost._net import lib
    return lib.vh_test_hook


@pytest.mark.parametrize("retries,initial,posts,want_attempts,want_delivered", [
    (0, 10, [5, 5], 1, 10),              # no retries: the rest is dropped at once
    (4, 10, [3] * 8, 5, 22),             # progress every time: exactly 4 retries, no more
    (8, 0, [5] * 8, 1, 0),               # first attempt made no progress: no retry at all
    (8, 5, [2, 0, 9], 3, 7),             # a retry that delivers nothing ends the retries
    (8, 20, [20], 2, 32),                # everything delivered: retrying stops
])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_retry_only_after_progress(pairs, retries, initial, posts, want_attempts, want_delivered, packed):
    p = pairs(Options(retries=retries, fwd="io", txq_threshold=32), packed=packed)
    trace = run_with_hook(p, initial, posts)
    st = p.dp.stats()
    assert len(trace) == want_attempts <= retries + 1
    for k in range(1, len(trace)):
        assert trace[k - 1][1] > 0, "a retry followed an attempt without progress"
    assert st["rx_retries"] == want_attempts - 1
    assert st["rx_packets"] == sum(d for _a, d, _l in trace) == want_delivered
    assert st["rx_dropped"] == 32 - want_delivered          # every packet delivered or counted dropped
    assert len(p.received()) == want_delivered
    assert p.reclaim_tx() == 32


@pytest.mark.parametrize("mode", ["loop", "pcap", "direct"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_staged_frames_tx_completed_before_the_enqueue(pairs, tmp_path, packed, mode):
    """Frames copied out of their Tx buffers have their Tx chains completed before the enqueue (as DPDK's vhost
    does): a driver that gets a frame back finds its Tx descriptors free (with the Tx ring full, testpmd drops
    otherwise; 71945e2). --pcap copies every frame too, and completed Tx only after the enqueue. Without the
    staging copy (--txq-flush none) the enqueue reads the Tx buffers, so their chains are completed after it but
    before its Rx publish: the Rx side published and the Tx side not, `vring driver --count 34 --burst 33
    --ring-size 64` found its Tx ring full thousands of times a second, and dropped frames whenever the backend
    was preempted in between."""
    w = PcapWriter(tmp_path / "c.pcap", None) if mode == "pcap" else None
    p = pairs(Options(fwd="io", pcap=w, txq_flush="none" if mode == "direct" else "rx-batch"), packed=packed)
    seen = []
    _hook_state.clear()
    _hook_state.update(trace=[], posts=[], pair=p, probe=lambda: seen.append(p.reclaim_tx()))
    p.dp.set_hook(_lib_hook())
    p.post_rx(32)
    p.send(32)
    p.dp.step()
    assert seen == [32] and len(p.received()) == 32


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_tracked_direct_frames_rx_published_before_tx_completed(pairs, packed):
    """With inflight tracking and no staging copy (--txq-flush none) the order is the other way round from the
    untracked one: the Rx used entries are published first, the Tx chains completed after. A kill -9 between the
    two stores then leaves frames delivered and their Tx chains still in flight: the successor takes them again
    (a duplicate, never a loss). Completed first, the same kill would lose frames that no successor can find.
    The hook runs between the two stores; what memory holds there is what a kill -9 would leave, and a successor
    is started on a copy of it."""
    p = pairs(Options(fwd="io", txq_flush="none"), packed=packed, tracked=True)
    tx_trk = p.dp.tracking[1]
    at_hook = {}

    def probe():   # reads only: the driver halves must not move, so that the copy is what a successor would see
        at_hook.update(completed=int(tx_trk.c.completed), rx_delivered=int(p.dp.tracking[0].c.completed),
                       memory=bytes(p.region.buf), area=bytes(p.area.shm.buf))
    _hook_state.clear()
    _hook_state.update(trace=[], posts=[], pair=p, probe=probe)
    p.dp.set_hook(_lib_hook())
    p.post_rx(32)
    p.send(32)
    p.dp.step()
    assert at_hook["rx_delivered"] == 32 and at_hook["completed"] == 0, "Tx completed before the Rx publish"
    assert int(tx_trk.c.completed) == 32 and p.reclaim_tx() == 32 and len(p.received()) == 32
    # the kill -9 at the hook: memory and area as they were there, and a successor on the Tx queue
    p.region.buf[:] = at_hook["memory"]
    p.area.shm.buf[:] = at_hook["area"]
    q = DeviceQueue(p.mem, p.layouts[1], p.features)   # at the driver's position before it reclaimed: the start
    again = QueueTracking(p.area, 1, SIZE).start(q, p.mem)
    assert again == 32
    # and the Rx buffers the frames went into were given back: a successor on the Rx queue takes none of them again
    # (it would write into buffers the driver owns); the counter above is no proof that their flags were cleared
    rq = DeviceQueue(p.mem, p.layouts[0], p.features)
    assert QueueTracking(p.area, 0, SIZE).start(rq, p.mem) == 0, "Rx buffers published and still in flight"


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_tracked_data_path_runs_the_copy_without_store_points(pairs, packed, flush):
    """The tracked poll and flush are built twice (vhost_inflight.h): the copy with store points only for a test
    that set die_at. With die_at 0 the other one runs, both queues, taken and completed: die_at stays 0, where
    the copy with points would count it down past 0 (to 2**32 - 1), and the data path would pay for the points.
    With die_at set the copy with points runs (tests/test_inflight_crash_points.py kills at each)."""
    p = pairs(Options(fwd="io", txq_flush=flush), packed=packed, tracked=True)
    trk = p.dp.tracking
    for die_at in (0, 1 << 30):
        for t in trk:
            t.c.die_at = die_at
        for _ in range(12):   # 12 x 32 frames: around the ring (256) and past it
            p.post_rx(32)
            p.send(32)
            assert p.dp.step() == {}
            assert len(p.received()) == 32 and p.reclaim_tx() == 32
        if die_at == 0:
            assert [int(t.c.die_at) for t in trk] == [0, 0], "the copy with store points ran with die_at 0"
        else:   # at least one point per chain taken and one per chain completed, each queue
            assert all(int(t.c.die_at) <= die_at - 2 * 12 * 32 for t in trk), [int(t.c.die_at) for t in trk]
    assert [int(t.c.taken) for t in trk] == [2 * 12 * 32] * 2 and [int(t.c.completed) for t in trk] == [2 * 12 * 32] * 2


def test_slow_driver_every_packet_delivered_or_dropped(pairs):
    """A driver thread posts Rx buffers slowly while the backend runs: retries stay within the limit per
    flush, and sent == delivered + dropped."""
    p = pairs(Options(retries=3, fwd="io", txq_threshold=32, burst=32))
    stop = threading.Event()
    lock = threading.Lock()

    def driver():
        while not stop.is_set():
            with lock:
                if p.drv[0].num_free >= 4 and len(p.free) > 64:
                    p.post_rx(4)
                p.received()
            time.sleep(0.0002)
    t = threading.Thread(target=driver)
    t.start()
    sent = 0
    try:
        for _ in range(200):
            with lock:
                if p.drv[1].num_free >= 32 and len(p.free) > 64:
                    p.send(32)
                    sent += 32
                p.reclaim_tx()
            p.dp.run(budget_us=200)
    finally:
        stop.set()
        t.join()
    st = p.dp.stats()
    flushes = st["flush_threshold"] + st["flush_rx_batch"]
    assert st["tx_packets"] == sent
    assert st["rx_packets"] + st["rx_dropped"] == sent
    assert st["rx_retries"] <= 3 * flushes
    assert st["rx_attempts"] == flushes + st["rx_retries"]
    assert st["rx_packets"] > 0 and st["rx_dropped"] > 0


def test_intermediate_queue_flush_causes(pairs):
    p = pairs(Options(fwd="io", txq_threshold=8, txq_flush="threshold"))
    p.post_rx(64)
    p.send(10)
    p.dp.step()                          # 10 >= 8: one enqueue of all 10
    assert p.dp.stats()["flush_threshold"] == 1 and p.dp.pending == 0
    p.send(3)
    p.dp.step()                          # 3 < 8 and the poll found packets: they wait
    assert p.dp.pending == 3
    p.dp.step()                          # the Tx queue ran dry: drained, never stranded
    st = p.dp.stats()
    assert p.dp.pending == 0 and st["flush_idle"] == 1 and st["rx_packets"] == 13

    q = pairs(Options(fwd="io", txq_threshold=32, txq_flush="timer:50000"))
    q.post_rx(64)
    q.send(5)
    q.dp.step()
    assert q.dp.pending == 5 and q.dp.stats()["flush_timer"] == 0
    time.sleep(0.06)
    q.dp.step()
    assert q.dp.pending == 0 and q.dp.stats()["flush_timer"] == 1

    r = pairs(Options(fwd="io", txq_threshold=32))   # rx-batch: drained after every poll iteration
    r.post_rx(64)
    r.send(5)
    r.dp.step()
    assert r.dp.pending == 0 and r.dp.stats()["flush_rx_batch"] == 1


@pytest.mark.parametrize("fwd", ["macswap", "io", "rxonly"])
def test_forwarding_modes(pairs, fwd):
    p = pairs(Options(fwd=fwd))
    p.post_rx(8)
    p.send(4)
    p.dp.step()
    got = p.received()
    st = p.dp.stats()
    if fwd == "rxonly":
        assert got == [] and st["fwd_dropped"] == 4 and st["tx_packets"] == 4
        return
    assert len(got) == 4
    for d in got:
        f = d[HDR:]
        mac = (f[0:6], f[6:12])
        assert mac == ((b"\xbb" * 6, b"\xaa" * 6) if fwd == "macswap" else (b"\xaa" * 6, b"\xbb" * 6))


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_in_order_batch_one_used_entry_per_batch(pairs, packed):
    """INORDER-06/07/11: with --in-order-batch the Tx completions of a burst are one used entry carrying the
    last buffer's id; without it, one entry per buffer. The driver gets all 32 back either way."""
    for batch in (False, True):
        p = pairs(Options(fwd="rxonly", in_order_batch=batch), packed=packed, in_order=True)
        p.send(32)
        p.dp.step()
        lay = p.layouts[1]
        if packed:
            ids = [struct.unpack_from("<H", p.mem.read(lay.desc + 16 * i + 12, 2))[0] for i in range(32)]
            flags = [struct.unpack_from("<H", p.mem.read(lay.desc + 16 * i + 14, 2))[0] for i in range(32)]
            used = [i for i in range(32) if flags[i] & 0x8000]
            assert used == ([0] if batch else list(range(32)))
            assert ids[0] == (31 if batch else 0)
        else:
            used_idx = struct.unpack_from("<H", p.mem.read(lay.device + 2, 2))[0]
            first_id = struct.unpack_from("<I", p.mem.read(lay.device + 4, 4))[0]
            second = struct.unpack_from("<I", p.mem.read(lay.device + 12, 4))[0]
            assert used_idx == 32
            assert first_id == (31 if batch else 0) and second == (0 if batch else 1)
        assert p.reclaim_tx() == 32


@pytest.mark.parametrize("used_batch", ["per-buffer", "per-burst"])
@pytest.mark.parametrize("packed,in_order,mrg", [(False, False, False), (False, True, True),
                                                 (True, False, True), (True, True, False)])
def test_variants_move_every_packet(pairs, used_batch, packed, in_order, mrg):
    p = pairs(Options(fwd="macswap", used_batch=used_batch), packed=packed, in_order=in_order, mrg=mrg)
    total = 0
    for _ in range(20):   # 20 x 30 = 600 packets: every ring wraps twice
        p.post_rx(30)
        p.send(30)
        p.dp.step()
        total += len(p.received())
        assert p.reclaim_tx() == 30
    st = p.dp.stats()
    assert total == st["rx_packets"] == st["tx_packets"] == 600 and st["rx_dropped"] == 0


def test_too_big_without_mrg_is_dropped_and_buffer_kept(pairs):
    p = pairs(Options(fwd="io"))
    p.post_rx(1, size=64)                # 12 + 60 = 72 bytes do not fit
    p.send(1)
    p.dp.step()
    st = p.dp.stats()
    assert st["rx_too_big"] == 1 and st["rx_packets"] == 0
    p.send(1, size=40)                   # 52 bytes fit the same buffer
    p.dp.step()
    got = p.received()
    assert len(got) == 1 and len(got[0]) == 52


def test_broken_tx_ring_is_reported_typed(pairs):
    p = pairs(Options())
    lay = p.layouts[1]
    p.mem.write(lay.driver + 2, struct.pack("<H", 999))
    errors = p.dp.step()
    from rings.errors import AvailIdxJump
    assert set(errors) == {1} and isinstance(errors[1], AvailIdxJump)
    assert p.dp.idle and p.dev[1].broken is errors[1]
    assert p.dp.step() == {}             # reported once; the loop no longer touches that ring


def test_net_29_mergeable_reservation_does_not_wrap_32_bits():
    """NET-29/30: the buffers reserved for a mergeable packet are summed in 64 bits. A 64-byte buffer
    followed by one of 0xFFFFFFF0 writable bytes (an indirect table of 256 entries over one 16 MiB area)
    holds a 100-byte frame in 2 buffers; a 32-bit sum wrapped to 48 and took a third buffer (used with
    len 0, counted in num_buffers)."""
    from rings.layout import VIRTIO_F_INDIRECT_DESC
    features = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_NET_F_MRG_RXBUF) | bit(VIRTIO_F_INDIRECT_DESC)
    big, ind, data = GPA + 0x20000, GPA + 0x120000, GPA + 0x1120000
    buf = bytearray(0x1120000 + 0x10000)
    mem = MemoryTable([(GPA, len(buf), buf)])
    layouts = [QueueLayout.contiguous("split", SIZE, GPA + i * 0x10000) for i in range(2)]
    rx = DriverQueue(mem, layouts[0], features, indirect=(ind, SIZE))
    tx = DriverQueue(mem, layouts[1], features)
    dev = [DeviceQueue(mem, lay, features) for lay in layouts]
    dp = Datapath(dev[0], dev[1], features, Options(fwd="io"))
    seg = 0x1000000
    addrs = [data] + [big] * SIZE + [data + 0x1000]
    lens = [64] + [seg] * (SIZE - 1) + [seg - 16] + [2048]
    assert rx.add(addrs, lens, [0, 0, 0], [1, SIZE, 1], [1, 2, 3]) == 3
    rx.publish()
    f = bytes(range(100))
    mem.write(data + 0x8000, bytes(HDR) + f)
    assert tx.add_simple([data + 0x8000], [HDR + len(f)], [9]) == 1
    tx.publish()
    dp.step()
    tokens, used = rx.reclaim()
    assert list(tokens) == [1, 2] and list(used) == [64, 100 + HDR - 64]
    assert struct.unpack_from("<H", mem.read(data, HDR), 10)[0] == 2   # num_buffers
    assert dev[0].inflight == 1                                          # the third buffer stays posted
    assert mem.read(data, 64)[HDR:] + mem.read(big, 48) == f
