"""Notification suppression MUSTs (EVT-*) of both sides, for the C engine and the reference model: the decision
to notify (kick_prepare / call_prepare) against the peer's suppression fields written by hand, and the values
each side writes into its own fields (every store recorded). Memory-ordering rules of notifications (EVT-25,
MEM-03/05/10): test_conformance_order.py. End to end through eventfds: tests/test_notifications.py."""
import os

import pytest

from rings.layout import (RING_EVENT_FLAGS_DESC, RING_EVENT_FLAGS_DISABLE, RING_EVENT_FLAGS_ENABLE,
                          VIRTIO_F_EVENT_IDX, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, bit, need_event)

from ring import Ring

OFFSETS = [-2, -1, 0, 1, 2, 3, 4, 5]   # event index relative to the old index of a batch


def publish(r, n, shape=(0, 1)):
    assert r.add([shape] * n)[0] == n
    r.drv.publish()


def complete(r, n=None):
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [0] * ch.n)
    r.dev.flush()
    return ch.n


def stores_to(log, gpa):
    return [a.value for a in log if a.store and a.gpa == gpa]


# ---- used buffer notifications (device -> driver) ----------------------------------------------

def test_evt_01_driver_writes_avail_flags_0_or_1(rec):
    """EVT-01: without EVENT_IDX every value the driver stores in avail.flags is 0 or 1 (1 to suppress)."""
    r = Ring(rec.mod, "split", 8)
    flags_gpa = r.layout.driver
    with rec.capture(r.mem) as log:
        for on in (False, True, False, False, True):
            r.drv.enable_calls(on)
            assert r.avail["flags"] == (0 if on else 1)
            publish(r, 3)
            complete(r)
            r.drv.reclaim()
    values = stores_to(log, flags_gpa)
    assert values and set(values) <= {0, 1}


def test_evt_02_driver_keeps_avail_flags_0_with_event_idx(rec):
    """EVT-02: with EVENT_IDX the driver stores only 0 in avail.flags, also while it wants no calls; it
    suppresses through used_event instead (no call within the next lap)."""
    r = Ring(rec.mod, "split", 8, VIRTIO_F_EVENT_IDX)
    flags_gpa = r.layout.driver
    used_event_gpa = r.layout.driver + 4 + 2 * 8
    with rec.capture(r.mem) as log:
        for on in (False, True, False):
            r.drv.enable_calls(on)
            publish(r, 3)
            complete(r)
            r.drv.reclaim()
            last_used = int(r.used["idx"])
            r.drv.enable_calls(on)
            gap = (int(r.avail["used_event"]) - last_used) & 0xFFFF
            assert gap == 0 if on else gap >= 8
    assert set(stores_to(log, flags_gpa)) == {0}
    assert stores_to(log, used_event_gpa)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_evt_03_driver_handles_spurious_notifications(impl, fmt):
    """EVT-03: a used buffer notification with nothing new (calls on, and calls suppressed) finds nothing,
    breaks nothing, changes no state; the next real completion comes back once."""
    r = Ring(impl, fmt, 8)
    publish(r, 4)
    ids = r.dev.poll().id.tolist()
    state = r.drv.snapshot()
    for on in (True, False):
        r.drv.enable_calls(on)
        for _ in range(3):   # what the driver does when called: reclaim
            tokens, _ = r.drv.reclaim()
            assert len(tokens) == 0 and r.drv.broken is None
    r.drv.enable_calls(True)
    assert r.drv.snapshot()["indices"] == state["indices"]
    r.dev.push_used(ids[:1], [0])
    r.dev.flush()
    assert r.drv.reclaim()[0].tolist() == [0] and len(r.drv.reclaim()[0]) == 0


def test_evt_03_spurious_call_wakes_the_net_driver_without_effect():
    """EVT-03 for the virtio-net driver: a call on its Rx eventfd with no used buffer wakes RxQueue.wait,
    which reports nothing pending; the queue delivers nothing and stays usable."""
    from virtio.net import NetQueues
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    nq = NetQueues(bit(VIRTIO_F_VERSION_1), size=16, nbufs=64, callfds=(efd, None))
    try:
        nq.rx.fill()
        os.eventfd_write(efd, 1)
        assert nq.rx.wait(1.0) is False and nq.rx.wakeups == 1
        idx, _ = nq.rx.burst(8)
        assert len(idx) == 0 and nq.rx.vq.broken is None and nq.rx.vq.inflight == 16
    finally:
        nq.close()
        os.close(efd)


@pytest.mark.parametrize("flags", [0, 1])
def test_evt_04_device_ignores_used_event_without_event_idx(impl, flags):
    """EVT-04: without EVENT_IDX used_event means nothing: whatever it holds, the call decision follows
    avail.flags alone."""
    r = Ring(impl, "split", 8)
    r.drv.enable_calls(flags == 0)
    for garbage in (0, 1, 2, 7, 0x7FFF, 0xFFFF):
        r.avail["used_event"] = garbage
        publish(r, 1)
        complete(r)
        assert r.dev.call_prepare() is (flags == 0), garbage
        r.drv.reclaim()


def test_evt_05_device_notifies_after_each_publication_when_flags_0(impl):
    """EVT-05: without EVENT_IDX, avail.flags 0: after used entries are published the device notifies
    (every publication, one batch or several flushes); flags 1: it does not (SHOULD NOT)."""
    r = Ring(impl, "split", 8)
    for n in (1, 3, 8, 2):
        publish(r, n)
        complete(r)
        assert r.dev.call_prepare() is True
        r.drv.reclaim()
    publish(r, 2)
    ch = r.dev.poll()
    for i in range(2):
        r.dev.push_used(ch.id[i:i + 1], [0])
        r.dev.flush()
    assert r.dev.call_prepare() is True
    r.drv.reclaim()
    r.drv.enable_calls(False)
    publish(r, 2)
    complete(r)
    assert r.dev.call_prepare() is False


def test_evt_06_device_ignores_flags_bit_with_event_idx(impl):
    """EVT-06: with EVENT_IDX the device ignores avail.flags bit 0: flags 1 and used_event = old index still
    calls; flags 0 and a far used_event does not."""
    r = Ring(impl, "split", 8, VIRTIO_F_EVENT_IDX)
    for flags, offset, expected in ((1, 0, True), (0, 100, False), (1, 1, True), (1, 100, False)):
        old = int(r.used["idx"])
        r.avail["flags"] = flags
        r.avail["used_event"] = (old + offset) & 0xFFFF
        publish(r, 2)
        complete(r)
        assert r.dev.call_prepare() is expected, (flags, offset)
        r.drv.reclaim()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_evt_07_device_calls_when_used_idx_passes_used_event(impl, n):
    """EVT-07: with EVENT_IDX, a flush that moves used.idx from old to new calls iff used_event lies in
    [old, new) (MUST when it does; SHOULD NOT otherwise), for batches of n."""
    r = Ring(impl, "split", 8, VIRTIO_F_EVENT_IDX)
    for off in OFFSETS:
        old = int(r.used["idx"])
        r.avail["used_event"] = used_event = (old + off) & 0xFFFF
        publish(r, n)
        complete(r)
        new = int(r.used["idx"])
        assert r.dev.call_prepare() is need_event(used_event, new, old) is (0 <= off < n), off
        r.drv.reclaim()


# ---- available buffer notifications (driver -> device) -----------------------------------------

def test_evt_10_driver_initialises_used_flags_to_0(impl):
    """EVT-10: the driver sets used.flags to 0 when it sets up the used ring (memory starts as 0xff here)."""
    r = Ring(impl, "split", 8, fill=0xFF, device=False)
    assert int(r.used["flags"]) == 0


@pytest.mark.parametrize("flags", [0, 1])
def test_evt_11_driver_ignores_avail_event_without_event_idx(impl, flags):
    """EVT-11: without EVENT_IDX avail_event means nothing: whatever it holds, the kick decision follows
    used.flags alone."""
    r = Ring(impl, "split", 8)
    r.used["flags"] = flags
    for garbage in (0, 1, 2, 7, 0x7FFF, 0xFFFF):
        r.used["avail_event"] = garbage
        publish(r, 1)
        assert r.drv.kick_prepare() is (flags == 0), garbage
        complete(r)
        r.drv.reclaim()


def test_evt_12_driver_kicks_after_each_publication_when_flags_0(impl):
    """EVT-12: without EVENT_IDX, used.flags 0: every publication is followed by a kick; 1: none."""
    r = Ring(impl, "split", 8)
    for n in (1, 4, 8):
        publish(r, n)
        assert r.drv.kick_prepare() is True
        complete(r)
        r.drv.reclaim()
    r.dev.enable_kicks(False)
    assert int(r.used["flags"]) == 1
    publish(r, 3)
    assert r.drv.kick_prepare() is False


def test_evt_13_driver_ignores_flags_bit_with_event_idx(impl):
    """EVT-13: with EVENT_IDX the driver ignores used.flags bit 0: flags 1 and avail_event = old index
    still kicks; flags 0 and a far avail_event does not."""
    r = Ring(impl, "split", 8, VIRTIO_F_EVENT_IDX)
    for flags, offset, expected in ((1, 0, True), (0, 100, False), (1, 2, True), (1, 100, False)):
        old = int(r.avail["idx"])
        r.used["flags"] = flags
        r.used["avail_event"] = (old + offset) & 0xFFFF
        publish(r, 3)
        assert r.drv.kick_prepare() is expected, (flags, offset)
        complete(r)
        r.drv.reclaim()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_evt_14_driver_kicks_when_avail_idx_passes_avail_event(impl, n):
    """EVT-14: with EVENT_IDX, a publication moving avail.idx from old to new kicks iff avail_event lies in
    [old, new) (MUST when it does; SHOULD NOT otherwise)."""
    r = Ring(impl, "split", 8, VIRTIO_F_EVENT_IDX)
    for off in OFFSETS:
        old = int(r.avail["idx"])
        r.used["avail_event"] = avail_event = (old + off) & 0xFFFF
        publish(r, n)
        new = int(r.avail["idx"])
        assert r.drv.kick_prepare() is need_event(avail_event, new, old) is (0 <= off < n), off
        complete(r)
        r.drv.reclaim()


def test_evt_15_device_writes_used_flags_0_or_1(rec):
    """EVT-15: without EVENT_IDX every value the device stores in used.flags is 0 or 1 (1 to suppress)."""
    r = Ring(rec.mod, "split", 8)
    with rec.capture(r.mem) as log:
        for on in (False, True, False, True):
            r.dev.enable_kicks(on)
            assert r.used["flags"] == (0 if on else 1)
            publish(r, 2)
            complete(r)
            r.dev.call_prepare()
            r.drv.reclaim()
    values = stores_to(log, r.layout.device)
    assert values and set(values) <= {0, 1}


def test_evt_16_device_keeps_used_flags_0_with_event_idx(rec):
    """EVT-16: with EVENT_IDX the device stores only 0 in used.flags, also while it polls and wants no kicks;
    it suppresses through avail_event (no kick within the next lap)."""
    r = Ring(rec.mod, "split", 8, VIRTIO_F_EVENT_IDX)
    avail_event_gpa = r.layout.device + 4 + 8 * 8
    with rec.capture(r.mem) as log:
        for on in (False, True, False):
            publish(r, 3)
            complete(r)
            r.dev.enable_kicks(on)
            gap = (int(r.used["avail_event"]) - int(r.avail["idx"])) & 0xFFFF
            assert gap == 0 if on else gap >= 8
            r.drv.reclaim()
    assert set(stores_to(log, r.layout.device)) == {0}
    assert stores_to(log, avail_event_gpa)


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_evt_17_device_handles_spurious_kicks(impl, fmt):
    """EVT-17: kicks with nothing new (before anything was made available, after everything was taken, after a
    publish of nothing): the device finds nothing, breaks nothing, takes nothing twice."""
    r = Ring(impl, fmt, 8)
    for _ in range(5):
        assert r.dev.poll().n == 0
    publish(r, 3)
    ids = r.dev.poll().id.tolist()   # (a poll's arrays are valid until the next poll)
    assert len(ids) == 3
    state = r.dev.snapshot()["indices"]
    for _ in range(5):
        r.drv.publish()   # nothing added: nothing new
        assert r.dev.poll().n == 0 and r.dev.broken is None
    assert r.dev.snapshot()["indices"] == state
    r.dev.push_used(ids, [0] * 3)
    r.dev.flush()
    assert sorted(r.drv.reclaim()[0].tolist()) == [0, 1, 2]


# ---- packed: the same rules through the event suppression structures ---------------------------

def test_evt_21_evt_24_packed_enable_disable(impl):
    """EVT-21/EVT-24: packed ENABLE -> a notification after every publication, DISABLE -> none; each side
    writes only ENABLE or DISABLE into its own structure without EVENT_IDX."""
    r = Ring(impl, "packed", 5)
    for on in (True, False, True):
        r.drv.enable_calls(on)
        r.dev.enable_kicks(on)
        want = RING_EVENT_FLAGS_ENABLE if on else RING_EVENT_FLAGS_DISABLE
        assert int(r.driver_event[1]) == want and int(r.device_event[1]) == want
        publish(r, 2)
        assert r.drv.kick_prepare() is on
        complete(r)
        assert r.dev.call_prepare() is on
        r.drv.reclaim()
    assert r.features & bit(VIRTIO_F_RING_PACKED)


def complete_all(r, lens=None):
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [0] * ch.n if lens is None else lens(ch))
    r.dev.flush()
    return r.drv.reclaim()


# ---- packed DESC-mode event suppression (checklist vectors) -----------------------------------

PACKED_HITS = {(3, 1), (4, 1), (0, 0)}   # checklist §0: qsize 5, descriptors at 3, 4 (wrap 1) and 0 (wrap 0)


@pytest.mark.parametrize("side", ["kick", "call"])
def test_evt_23_evt_14_evt_07_packed_desc_event_over_a_three_descriptor_list(impl, side):
    """EVT-23 (EVT-14/EVT-07 for packed): with EVENT_IDX and flags DESC, one 3-descriptor list made available
    (or used) at slots 3, 4, 0 of a 5-slot ring notifies iff off/wrap is 3/1, 4/1 or 0/0: the event counts
    descriptors, not buffers, and an off tagged with the other wrap lies in the previous lap."""
    for off in range(5):
        for wrap in (0, 1):
            r = Ring(impl, "packed", 5, VIRTIO_F_EVENT_IDX)
            assert r.add([(3, 0)])[0] == 1   # slots 0-2: both sides move to slot 3, wrap 1
            r.drv.publish()
            r.drv.kick_prepare()
            complete_all(r)
            r.dev.call_prepare()
            assert r.add([(3, 0)])[0] == 1   # slots 3, 4, 0
            r.drv.publish()
            if side == "kick":
                r.device_event[:] = (off | wrap << 15, RING_EVENT_FLAGS_DESC)
                assert r.drv.kick_prepare() is ((off, wrap) in PACKED_HITS), (off, wrap)
            else:
                complete_all(r)
                r.driver_event[:] = (off | wrap << 15, RING_EVENT_FLAGS_DESC)
                assert r.dev.call_prepare() is ((off, wrap) in PACKED_HITS), (off, wrap)
