"""Inflight I/O tracking (vhost-user INFLIGHT_SHMFD) against the spec's semantics, in one process.

A device takes chains and completes some of them OUT OF ORDER (allowed without IN_ORDER), then "dies" (its
objects are dropped, nothing more is written). Its successor reads the frontend-kept area and must take again
exactly the chains that were taken and not completed, in the order they were first taken, and nothing that
was completed. Without the area it cannot: restarting at the used position re-takes completed buffers.
Also: a death inside a completion (used entries published, inflight flags not yet cleared: the last-batch
repair; packed: not yet published: the roll-back), a hostile area (Refused-style InflightError), and the
layout sizes DPDK computes (shared/spec/vhost-user.md 5.1).
"""
import contextlib

import numpy as np
import pytest

from rings.layout import VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, QueueLayout, bit
from rings.shm import MemoryTable
from rings.virtq import DeviceQueue, DriverQueue
from vhost._net import lib
from vhost.datapath import _cast_dev, _ChainsBuf
from vhost.inflight import InflightArea, InflightError, QueueTracking, create_area, queue_region_size

SIZE = 8
GPA = 0x10000
BUF = GPA + 0x4000


class Pair:
    """A driver half and a device half of one queue over plain memory, and the inflight area."""

    def __init__(self, packed):
        self.packed = packed
        self.features = bit(VIRTIO_F_VERSION_1) | (bit(VIRTIO_F_RING_PACKED) if packed else 0)
        self.layout = QueueLayout.contiguous("packed" if packed else "split", SIZE, GPA)
        self.mem = MemoryTable([(GPA, 0x8000, bytearray(0x8000))])
        self.drv = DriverQueue(self.mem, self.layout, self.features)
        fd, size = create_area(2, SIZE, packed)
        self.area = InflightArea(fd, size, 0, 2, SIZE, packed)
        self.chains = _ChainsBuf(SIZE, 4 * SIZE)
        self.id_of = {}

    def add(self, tokens):
        n = len(tokens)
        got = self.drv.add_simple(np.array([BUF + 256 * t for t in tokens], np.uint64), np.full(n, 64, np.uint32),
                                  np.array(tokens, np.uint64))
        assert got == n
        self.drv.publish()

    def device(self, tracked=True, base=None):
        """A new device half at the driver's own position (what a reconnecting frontend sends)."""
        q = DeviceQueue(self.mem, self.layout, self.features)
        c = q.c
        if base is None:
            base = (self.drv.c.last_used, self.drv.c.used_wrap)
        c.last_avail = c.used_idx = base[0]
        if self.packed:
            c.avail_wrap = c.used_wrap = base[1]
        trk = QueueTracking(self.area, 1, SIZE) if tracked else None
        resubmit = trk.start(q, self.mem) if tracked else 0
        return q, trk, resubmit

    def poll(self, q, trk):
        """The buffers (driver tokens) of the chains a poll takes, in order."""
        c = self.chains.c
        c.n = c.nsegs = 0
        n = lib.vhi_poll(_cast_dev(q), c, SIZE, trk.c if trk is not None else _null())
        assert n >= 0, q.mark_broken()
        ids = [int(x) for x in self.chains.arrays["id"][:n]]
        tokens = [int(self.drv.id_token[i]) for i in ids]
        self.id_of.update(zip(tokens, ids))
        return tokens

    def complete(self, q, trk, tokens):
        """Complete these buffers, in this order."""
        ids = [self.id_of[t] for t in tokens]
        q.push_used(ids, [0] * len(ids))
        lib.vhi_flush(_cast_dev(q), trk.c if trk is not None else _null())

    def reclaim(self):
        tokens, _ = self.drv.reclaim()
        return sorted(int(t) for t in tokens)

    def close(self):
        self.area.close()


def _null():
    from vhost._net import ffi
    return ffi.NULL


@pytest.fixture(params=["split", "packed"])
def pair(request):
    p = Pair(request.param == "packed")
    yield p
    p.close()


def test_region_sizes_are_dpdks():
    # ALIGN64(16*Q + 16) split, ALIGN64(32*Q + 29) packed; 2 queues of 256: 8320 / 16512 bytes as observed
    assert 2 * queue_region_size(False, 256) == 8320
    assert 2 * queue_region_size(True, 256) == 16512


def test_successor_takes_again_exactly_what_was_in_flight(pair):
    q, trk, again = pair.device()
    assert again == 0
    pair.add([0, 1, 2, 3])
    assert pair.poll(q, trk) == [0, 1, 2, 3]
    pair.complete(q, trk, [2, 3])           # out of order: 0 and 1 stay in flight
    assert pair.reclaim() == [2, 3]
    del q, trk                              # killed: nothing more is written
    q2, trk2, again = pair.device()
    assert again == 2
    assert pair.poll(q2, trk2) == [0, 1]    # in the order first taken, and nothing completed
    pair.add([4])
    assert pair.poll(q2, trk2) == [4]       # then new buffers, from where the predecessor stopped
    pair.complete(q2, trk2, [1, 4, 0])
    assert pair.reclaim() == [0, 1, 4]
    assert trk2.c.resubmitted == 2 and trk2.c.taken == 1


def test_without_the_area_a_restart_takes_completed_buffers_again(pair):
    q, trk, _ = pair.device()
    pair.add([0, 1, 2, 3])
    pair.poll(q, trk)
    pair.complete(q, trk, [2, 3])
    pair.reclaim()
    q2, _, _ = pair.device(tracked=False)
    assert pair.poll(q2, None) == [2, 3]    # the wrong ones: 0 and 1 are lost, 2 and 3 done twice


def test_death_after_publishing_before_clearing(pair):
    """The last batch's used entries are visible but its inflight flags still say 1: repaired, not redone."""
    q, trk, _ = pair.device()
    pair.add([0, 1, 2])
    pair.poll(q, trk)
    hdr, desc = trk.views()
    before = hdr.copy()
    pair.complete(q, trk, [1, 2])
    if pair.packed:   # as if it died right after vq_dev_flush: flags and old_* not written yet
        for e in np.flatnonzero(desc["num"]):
            if desc[e]["id"] in (pair.id_of[1], pair.id_of[2]):
                desc[e]["inflight"] = 1
        for name in ("old_free_head", "old_used_idx", "old_used_wrap_counter"):
            hdr[name] = before[name]
    else:
        desc["inflight"][[pair.id_of[1], pair.id_of[2]]] = 1
        hdr["used_idx"] = before["used_idx"]
    del hdr, desc, q, trk
    assert pair.reclaim() == [1, 2]
    q2, trk2, again = pair.device()
    assert again == 1
    assert pair.poll(q2, trk2) == [0]


def test_packed_death_before_publishing_rolls_back():
    pair = Pair(packed=True)
    try:
        q, trk, _ = pair.device()
        pair.add([0, 1, 2])
        pair.poll(q, trk)
        hdr, desc = trk.views()
        before_hdr, before_desc = hdr.copy(), desc.copy()
        ring = pair.mem.read(GPA, 16 * SIZE)
        pair.complete(q, trk, [0, 1])
        pair.mem.write(GPA, ring)           # the used descriptors never reached the ring
        desc[:] = before_desc
        for name in ("old_free_head", "old_used_idx", "old_used_wrap_counter"):
            hdr[name] = before_hdr[name]    # free list and used_idx moved, the commit point not reached
        del hdr, desc, q, trk
        assert pair.reclaim() == []
        q2, trk2, again = pair.device()
        assert again == 3
        assert pair.poll(q2, trk2) == [0, 1, 2]
    finally:
        pair.close()


def test_hostile_area_is_refused(pair):
    q, trk, _ = pair.device()
    pair.add([0, 1])
    pair.poll(q, trk)
    hdr, desc = trk.views()
    if pair.packed:
        head = int(np.flatnonzero(desc["inflight"])[0])
        desc[head]["num"] = SIZE + 1       # a chain longer than the ring
    else:
        desc[0]["inflight"] = 7
    del hdr, desc, q, trk
    with pytest.raises(InflightError):
        pair.device()


def test_area_of_the_other_ring_format_is_refused_at_the_queue_start_and_by_the_c_poll(pair):
    """Found by attack43: SET_INFLIGHT_FD fixes the area's format, and a frontend that changed RING_PACKED (or
    the ring size) afterwards had the C recovery or tracking read the ring through the pointer of the other
    format (NULL): SIGSEGV. The queue start refuses it; the C poll and flush refuse it themselves too."""
    from rings.errors import InflightMismatch
    q, trk, _ = pair.device()
    pair.add([0])
    assert pair.poll(q, trk) == [0]
    other = Pair(not pair.packed)
    try:
        q_other = DeviceQueue(other.mem, other.layout, other.features)
        with pytest.raises(InflightError, match="made for 8-entry"):
            trk.start(q_other, other.mem)
        bigger = DeviceQueue(pair.mem, QueueLayout.contiguous(pair.layout.fmt, 2 * SIZE, GPA), pair.features)
        with pytest.raises(InflightError, match=f"this vring is a {2 * SIZE}-entry"):   # same format, other size
            trk.start(bigger, pair.mem)
        other.add([0])   # what the Python check stops, given to the C side on its own
        c = pair.chains.c
        c.n = c.nsegs = 0
        assert lib.vhi_poll(_cast_dev(q_other), c, SIZE, trk.c) == -1
        err = q_other.mark_broken()
        assert isinstance(err, InflightMismatch) and "inflight area was made for" in str(err), err
        trk.c.size = SIZE // 2   # a size the region's arrays were not made for
        q.push_used([pair.id_of[0]], [0])
        lib.vhi_flush(_cast_dev(q), trk.c)
        assert q.c.error == InflightMismatch.code and q.c.shadow_count == 1   # nothing published
    finally:
        other.close()


def test_a_counter_with_no_successor_is_refused_not_an_overflow(pair):
    """Found by attack43: an entry in flight with counter 2^64-1 made the next counter overflow the C field
    (OverflowError: an untyped internal error at every later message)."""
    q, trk, _ = pair.device()
    pair.add([0])
    pair.poll(q, trk)
    hdr, desc = trk.views()
    desc["counter"][np.flatnonzero(desc["inflight"])[0]] = 2**64 - 1
    del hdr, desc, q, trk
    with pytest.raises(InflightError, match="counter 0xffffffffffffffff"):
        pair.device()


def test_area_size_checked():
    fd, size = create_area(2, SIZE, False)
    with pytest.raises(InflightError, match="cannot hold"):
        InflightArea(fd, size, 0, 2, SIZE, True)   # a packed area needs more than a split one


def test_area_is_sealed_and_an_unsealed_one_is_refused():
    """The frontend keeps the area's fd: shrunk under the backend's mapping, the next access would fault (SIGBUS,
    the backend dies). GET_INFLIGHT_FD's area cannot shrink (F_SEAL_SHRINK), and SET_INFLIGHT_FD refuses an
    area that could."""
    import os
    fd, size = create_area(2, SIZE, False)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)   # what a hostile frontend can hand over
    os.ftruncate(fd, size)
    with pytest.raises(InflightError, match="F_SEAL_SHRINK"):
        InflightArea(fd, size, 0, 2, SIZE, False)
    with pytest.raises(OSError):
        os.fstat(fd)   # closed by the refusal, as every other refusal does


def test_packed_without_the_area_a_half_published_batch_blocks_until_the_ring_is_reset():
    """A packed device writes a batch's used descriptors, the head's flags last; killed in between, it leaves
    slots that look neither available nor used. Its successor (no inflight area: DPDK net_vhost) takes the
    head's chain and stops there for good, unless the driver lays the ring out afresh and sends the buffers
    again (DriverQueue.reset: what `vring driver --reconnect` does for packed rings without the area)."""
    pair = Pair(packed=True)
    try:
        q, _, _ = pair.device(tracked=False)
        pair.add([0, 1, 2, 3])
        assert pair.poll(q, None) == [0, 1, 2, 3]
        head = pair.mem.read(GPA + 14, 2)                  # slot 0's flags, as the driver published them
        pair.complete(q, None, [0, 1, 2, 3])
        pair.mem.write(GPA + 14, head)                     # killed before the head's flags were written
        assert pair.reclaim() == []                        # the driver sees nothing used
        stuck, _, _ = pair.device(tracked=False)
        assert pair.poll(stuck, None) == [0]               # slot 1 looks used: nothing after it, ever
        pair.add([4])
        assert pair.poll(stuck, None) == []
        tokens = sorted(int(t) for t in pair.drv.reset())
        assert tokens == [0, 1, 2, 3, 4] and pair.drv.inflight == 0 and pair.drv.num_free == SIZE
        pair.add(tokens)
        fresh, _, _ = pair.device(tracked=False)           # base 0x8000 again
        assert (fresh.c.last_avail, fresh.c.avail_wrap) == (0, 1)
        assert pair.poll(fresh, None) == tokens
        pair.complete(fresh, None, tokens)
        assert pair.reclaim() == tokens
    finally:
        pair.close()


def test_get_inflight_fd_only_for_the_queues_the_device_has():
    """GET_INFLIGHT_FD makes (and touches) the whole area: 256 packed queues of 32768 would be 256 MiB of shared
    memory per request, held by the frontend's fd. Only the device's own vring count is accepted."""
    import os

    from rings import vhost_user as vu
    from rings.layout import bit
    from vhost.device import NUM_VRINGS, NetDevice, Refused, Reply

    dev = NetDevice()
    R, PF = vu.VhostUserRequest, vu.VhostUserProtocolFeature

    def handle(request, payload):
        msg = vu.Message(request, payload=payload)
        return dev.handle(msg, vu.decode(msg))
    handle(R.SET_PROTOCOL_FEATURES, vu.pack_u64(bit(PF.INFLIGHT_SHMFD)))
    with pytest.raises(Refused, match="256 queues"):
        handle(R.GET_INFLIGHT_FD, vu.Inflight(0, 0, 256, 32768).pack())
    got = handle(R.GET_INFLIGHT_FD, vu.Inflight(0, 0, NUM_VRINGS, 256).pack())
    assert isinstance(got, Reply) and vu.Inflight.unpack(got.payload).mmap_size == 2 * queue_region_size(False, 256)
    for fd in got.fds:
        os.close(fd)
    dev.close()


@contextlib.contextmanager
def _tracked_tx(variant, **options):
    """A driver (NetQueues, 64-slot rings, Rx filled) and a Datapath over its rings, the Tx queue tracked."""
    from rings.virtq import CMemory, DeviceQueue
    from vhost.datapath import Datapath, Options
    from virtio.net import NetQueues

    nq = NetQueues(variant, size=64, nbufs=512)
    packed = bool(variant & bit(VIRTIO_F_RING_PACKED))
    fd, size = create_area(2, 64, packed)
    area = InflightArea(fd, size, 0, 2, 64, packed)
    try:
        nq.rx.fill()
        cmem = CMemory(nq.mem.table)
        rxq, txq = (DeviceQueue(cmem, lay, variant) for lay in (nq.mem.rx_layout, nq.mem.tx_layout))
        trk = QueueTracking(area, 1, 64)
        assert trk.start(txq, nq.mem.table) == 0
        yield nq, Datapath(rxq, txq, variant, Options(**options), tracking=(None, trk)), trk
    finally:
        area.close()
        nq.close()


def _send(nq, count):
    idx = nq.pool.alloc(count).copy()
    for b in idx:
        nq.pool.write(b, bytes(60))
    assert nq.tx.burst(idx, np.full(count, 60, np.uint32)) == count


@pytest.mark.parametrize("used_batch", ["per-burst", "per-buffer"])
@pytest.mark.parametrize("flush", ["threshold", "timer:10000000"])
def test_tracked_tx_chains_completed_only_once_their_frames_are_delivered(variant, flush, used_batch):
    """With inflight tracking a Tx chain is completed only after its frame reached the Rx ring: a successor takes
    again what was taken and not completed, so a frame completed while it still waited in the intermediate queue
    (--txq-flush threshold / timer:US) died with the backend (kill -9). It used to be completed at the end of the
    poll iteration that took it (--used-batch per-buffer: as soon as it was copied out); now not while frames
    wait."""
    with _tracked_tx(variant, txq_flush=flush, txq_threshold=64, used_batch=used_batch) as (nq, dp, trk):
        _send(nq, 8)
        assert dp.run(max_iters=1) == {} and dp.pending == 8        # taken, waiting in the intermediate queue
        nq.tx.cleanup()
        assert nq.tx.inflight == 8                                   # not completed while they wait
        assert int(trk.c.taken) == 8 and int(trk.c.completed) == 0
        if flush.startswith("timer"):
            return                                                   # its 10 s have not passed
        assert dp.run(max_iters=1) == {}                             # threshold: the Tx ring ran dry, flushed
        assert dp.pending == 0 and dp.stats()["rx_packets"] == 8
        nq.tx.cleanup()
        assert nq.tx.inflight == 0 and int(trk.c.completed) == 8


@pytest.mark.parametrize("used_batch", ["per-burst", "per-buffer"])
def test_tracked_timer_flushes_once_the_driver_has_no_tx_descriptor_left(variant, used_batch):
    """With tracking and --txq-flush timer:US, frames wait with their Tx chains not completed. When every descriptor
    of the Tx ring is in a chain we took (a threshold larger than the ring holds), the driver cannot send the frames
    that would reach the threshold: the loop flushes at once (flush_idle) instead of leaving it stuck for the timer."""
    with _tracked_tx(variant, txq_flush="timer:10000000", txq_threshold=128, used_batch=used_batch) as (nq, dp, trk):
        _send(nq, 48)
        assert dp.run(max_iters=4) == {} and dp.pending == 48        # the driver could still send: they wait
        nq.tx.cleanup()
        assert nq.tx.inflight == 48
        _send(nq, 16)                                                # the ring's last descriptors
        assert dp.run(max_iters=4) == {}
        st = dp.stats()
        assert dp.pending == 0 and st["rx_packets"] == 64 and st["flush_idle"] == 1 and st["flush_timer"] == 0
        nq.tx.cleanup()
        assert nq.tx.inflight == 0 and int(trk.c.completed) == 64
