"""The tap's passive capture (tap/capture.py) on rings driven step by step: the frames it writes are the
bytes of each buffer at the time its used entry appears, header stripped, in used order; IN_ORDER batches
(INORDER-06/11), mergeable Rx buffers joined by num_buffers (NET-29..32); and what it cannot see is counted
instead of guessed (a split ring lapped between two looks; packed cursors out of step)."""
import struct

import numpy as np
import pytest

from rings import reference
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF,
                          QueueLayout, bit)
from rings.shm import MemoryTable
from tap.capture import MAX_FRAME, PackedObserver, SplitObserver

BASE, DATA, MEMSIZE = 0x100000, 0x140000, 1 << 20
HDR = 12


class Sink:
    def __init__(self):
        self.frames, self.full = [], False

    def write(self, frame, when):
        self.frames.append(bytes(frame))
        return True


def rings(fmt, size, *bits, batch=False):
    mem = MemoryTable([(BASE, MEMSIZE, bytearray(MEMSIZE))])
    feats = bit(VIRTIO_F_VERSION_1) | (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | sum(bit(b) for b in bits)
    lay = QueueLayout.contiguous(fmt, size, BASE)
    drv = reference.DriverQueue(mem, lay, feats)
    dev = reference.DeviceQueue(mem, lay, feats, in_order_batch=batch)
    return mem, lay, feats, drv, dev


def frame(k):
    return bytes([k]) * 6 + bytes([0xEE]) * 6 + b"\x08\x00" + bytes(range(k, k + 46))


def send(mem, drv, frames, slot0=0):
    """Tx: each frame behind a 12-byte header, one readable descriptor each."""
    addrs = []
    for j, f in enumerate(frames):
        addr = DATA + 2048 * (slot0 + j)
        mem.write(addr, bytes(HDR) + f)
        addrs.append(addr)
    n = len(frames)
    drv.add(np.array(addrs), np.array([HDR + len(f) for f in frames]), np.ones(n, int), np.zeros(n, int),
            np.arange(slot0, slot0 + n))
    drv.publish()


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True])
def test_tx_frames_as_used_entries_appear(fmt, in_order):
    mem, lay, feats, drv, dev = rings(fmt, 8, *([VIRTIO_F_IN_ORDER] if in_order else []), batch=in_order)
    obs = (PackedObserver if fmt == "packed" else SplitObserver)(lay, mem, mem, feats, False)
    out = Sink()
    sent = [frame(k) for k in range(1, 6)]
    send(mem, drv, sent)
    assert obs.poll(out) == 5 and out.frames == []  # available, not used: nothing yet (but not idle)
    ch = dev.poll()
    order = list(ch.id) if in_order else [ch.id[2], ch.id[0], ch.id[4], ch.id[1], ch.id[3]]
    dev.push_used(order[:3], [0] * 3)
    dev.flush()
    obs.poll(out)
    dev.push_used(order[3:], [0] * 2)
    dev.flush()
    obs.poll(out)
    assert out.frames == [sent[int(i)] for i in order]  # in used order, header stripped
    assert obs.stats == {"frames": 5, "lapped": 0, "lost": 0, "unreadable": 0, "not_seen_published": 0}


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_rx_mergeable_frame_over_two_buffers(fmt):
    mem, lay, feats, drv, dev = rings(fmt, 8, VIRTIO_NET_F_MRG_RXBUF)
    obs = (PackedObserver if fmt == "packed" else SplitObserver)(lay, mem, mem, feats, True)
    out = Sink()
    drv.add(DATA + 2048 * np.arange(3), np.full(3, 40), np.zeros(3, int), np.ones(3, int), np.arange(3))
    drv.publish()
    obs.poll(out)
    ch = dev.poll()
    whole = frame(7)  # 60 bytes + 12 header = 72: 40 in the first buffer, 32 in the second (NET-30)
    data = bytearray(HDR) + whole
    data[10:12] = (2).to_bytes(2, "little")  # num_buffers
    mem.write(DATA, bytes(data[:40]))
    mem.write(DATA + 2048, bytes(data[40:]))
    dev.push_used(ch.id[:2], [40, 32])
    dev.flush()
    obs.poll(out)
    assert out.frames == [whole]


@pytest.mark.parametrize("in_order", [False, True])
def test_split_lapped_is_counted_not_guessed(in_order):
    mem, lay, feats, drv, dev = rings("split", 4, *([VIRTIO_F_IN_ORDER] if in_order else []), batch=in_order)
    obs = SplitObserver(lay, mem, mem, feats, False)
    out = Sink()
    for k in range(3):  # 12 buffers go round a ring of 4 between two looks
        send(mem, drv, [frame(4 * k + j) for j in range(4)])
        ch = dev.poll()
        dev.push_used(ch.id, [0] * 4)
        dev.flush()
        drv.reclaim()
    send(mem, drv, [frame(20), frame(21)], slot0=12)  # and two more in flight when it looks
    obs.poll(out)
    assert out.frames == [] and obs.stats["lost"] == 1  # the lap: counted, nothing guessed
    ch = dev.poll()
    dev.push_used(ch.id, [0, 0])
    dev.flush()
    send(mem, drv, [frame(99)], slot0=14)  # from there it follows the ring again
    ch = dev.poll()
    dev.push_used(ch.id, [0])
    dev.flush()
    obs.poll(out)
    obs.poll(out)
    assert out.frames == [frame(20), frame(21), frame(99)]  # the two in flight at the lap are followed too
    assert obs.stats["lost"] == 1 and obs.stats["not_seen_published"] == 0


class Racing(SplitObserver):
    """An observer whose peers move between any two of its reads of avail.idx and used.idx: after each,
    the driver publishes one frame and the device uses everything available (in one batch with IN_ORDER)."""

    def __init__(self, step, *args):
        self.step = None
        super().__init__(*args)
        self.step = step

    def u16(self, view, off):
        value = super().u16(view, off)
        if off == 2 and self.step is not None:
            self.step()
        return value


@pytest.mark.parametrize("in_order", [False, True])
def test_split_peers_moving_between_the_index_reads_lose_nothing(in_order):
    """Used before avail (INORDER-06..08): a buffer the driver publishes and the device uses while the tap
    reads the two indices is captured on the next look, not taken for one it never saw published."""
    mem, lay, feats, drv, dev = rings("split", 8, *([VIRTIO_F_IN_ORDER] if in_order else []), batch=in_order)
    sent = []

    def step():
        drv.reclaim()
        sent.append(frame(len(sent) % 200))
        send(mem, drv, [sent[-1]], slot0=len(sent) % 8)
        ch = dev.poll()
        dev.push_used(ch.id, [0] * len(ch.id))
        dev.flush()

    obs = Racing(step, lay, mem, mem, feats, False)
    out = Sink()
    for _ in range(50):
        obs.poll(out)
    obs.step = None
    obs.poll(out)
    assert len(sent) >= 100 and out.frames == sent  # at least two index reads a look
    assert obs.stats == {"frames": len(sent), "lapped": 0, "lost": 0, "unreadable": 0, "not_seen_published": 0}


def test_packed_out_of_step_starts_again():
    mem, lay, feats, drv, dev = rings("packed", 4)
    obs = PackedObserver(lay, mem, mem, feats, False)
    out = Sink()
    for k in range(3):  # three laps between two looks: the wrap counter alone cannot tell
        send(mem, drv, [frame(4 * k + j) for j in range(4)])
        ch = dev.poll()
        dev.push_used(ch.id, [0] * 4)
        dev.flush()
        drv.reclaim()
    obs.poll(out)
    send(mem, drv, [frame(50), frame(51)])
    obs.poll(out)
    ch = dev.poll()
    dev.push_used(ch.id, [0, 0])
    dev.flush()
    obs.poll(out)
    assert obs.stats["lost"] >= 1  # it saw used descriptors where it expected the driver's next ones
    assert out.frames[-2:] == [frame(50), frame(51)]
    assert all(f in [frame(x) for x in range(12)] + [frame(50), frame(51)] for f in out.frames)


@pytest.mark.parametrize("in_order", [False, True])
def test_split_inorder_06_entries_overwritten_while_the_tap_looks_make_no_frame(in_order):
    """Rx, ring of 2: the tap reads used.idx (2 entries to take); before it reads the entries, the driver
    reposts a buffer and the device uses it, writing position 2 over position 0's entry. Read entry by entry,
    the tap took position 2's (id, len) for position 0 and wrote the first frame cut to the third's length,
    bytes nobody sent. The entries are copied at once now and checked (INORDER-06..08: one entry a buffer
    here, each partly written, INORDER-10)."""
    mem, lay, feats, drv, dev = rings("split", 2, *([VIRTIO_F_IN_ORDER] if in_order else []), batch=in_order)
    sent, polled = [], []

    def post(slot):
        drv.add(np.array([DATA + 2048 * slot]), np.array([200]), np.zeros(1, int), np.ones(1, int), np.array([slot]))
        drv.publish()

    def receive(f):
        ch = dev.poll()
        polled.extend((int(ch.id[i]), ch.segments(i)[0][0]) for i in range(len(ch.id)))
        id, addr = polled.pop(0)
        mem.write(addr, bytes(HDR) + f)
        dev.push_used([id], [HDR + len(f)])
        dev.flush()
        sent.append(f)

    obs = RacingAvail(lay, mem, mem, feats, True)
    out = Sink()
    post(0)
    post(1)
    obs.poll(out)
    receive(frame(1) + b"a" * 40)
    receive(frame(2))

    def peers():  # between the tap's reads of used.idx and avail.idx
        drv.reclaim()
        post(2)
        receive(frame(3))

    obs.step = peers
    obs.poll(out)
    obs.step = None
    obs.poll(out)
    assert out.frames == sent  # all three, whole
    assert obs.stats == {"frames": 3, "lapped": 0, "lost": 0, "unreadable": 0, "not_seen_published": 0}


class RacingAvail(SplitObserver):
    """An observer whose peers run ``step`` once, as it reads avail.idx."""

    step = None

    def u16(self, view, off):
        if view is self.avail and off == 2 and self.step is not None:
            step, self.step = self.step, None
            step()
        return super().u16(view, off)


def test_packed_v_01_slot_made_available_again_while_the_tap_waits_is_a_loss():
    """Packed, ring of 4: the tap follows two lists; the ring then goes round once (their slots used and made
    available again in the next lap) before it looks. It used to wait on at the first slot, and two laps on took
    the used descriptor there for its old list: a frame of the old length read where a later, longer one
    lies. The AVAIL bit of the slot where the device's next used descriptor goes (PACKED-V-01/02) says the lap."""
    mem, lay, feats, drv, dev = rings("packed", 4)
    obs = PackedObserver(lay, mem, mem, feats, False)
    out, sent = Sink(), []

    def tx(*ks):  # frames of growing length, at the address of slot k % 4: reused every lap
        fs = [frame(k) + bytes(k) for k in ks]
        for k, f in zip(ks, fs):
            mem.write(DATA + 2048 * (k % 4), bytes(HDR) + f)
        drv.add(np.array([DATA + 2048 * (k % 4) for k in ks]), np.array([HDR + len(f) for f in fs]),
                np.ones(len(ks), int), np.zeros(len(ks), int), np.array(ks))
        drv.publish()
        sent.extend(fs)

    def use():
        ch = dev.poll()
        dev.push_used(ch.id, [0] * len(ch.id))
        dev.flush()
        drv.reclaim()

    tx(0, 1)
    obs.poll(out)  # follows slots 0 and 1
    use(), tx(2, 3), use(), tx(4, 5)  # slots 0 and 1 available again, in the next lap
    obs.poll(out)
    assert obs.stats["lost"] == 1 and out.frames == []
    use(), tx(6, 7), use(), tx(8, 9), use()  # and round once more
    for _ in range(3):
        obs.poll(out)
    assert all(f in sent for f in out.frames)


def test_net_30_packed_tap_started_inside_a_mergeable_frame_writes_no_piece_of_it():
    """Mergeable Rx, packed ring of 4 full of 40-byte buffers when the tap starts: it follows from the driver's
    position, and the device's next frame begins in the buffer in flight before it (slot 3) and ends in the
    first the tap follows. That buffer has no header (NET-32); the tap took its frame bytes for one. It waits
    now for a buffer used short of its length, the last of a frame (NET-30), and writes the frames after."""
    mem, lay, feats, drv, dev = rings("packed", 4, VIRTIO_NET_F_MRG_RXBUF)
    polled = []

    def post(slots):
        drv.add(DATA + 2048 * np.array(slots), np.full(len(slots), 40), np.zeros(len(slots), int),
                np.ones(len(slots), int), np.array(slots))
        drv.publish()

    def receive(f):  # into as many polled buffers as it takes, num_buffers set (NET-29)
        ch = dev.poll()
        polled.extend((int(ch.id[i]), ch.segments(i)[0][0]) for i in range(len(ch.id)))
        data = bytearray(HDR) + f
        nb = -(-len(data) // 40)
        data[10:12] = nb.to_bytes(2, "little")
        ids, lens = [], []
        for j in range(nb):
            id, addr = polled.pop(0)
            mem.write(addr, bytes(data[40 * j:40 * j + 40]))
            ids.append(id)
            lens.append(len(data[40 * j:40 * j + 40]))
        dev.push_used(ids, lens)
        dev.flush()

    post([0, 1, 2, 3])
    obs = PackedObserver(lay, mem, mem, feats, True)  # starts at slot 0 of the next lap; slot 3 in flight
    out = Sink()
    for k in range(3):
        receive(frame(k)[:20])  # one buffer each: slots 0..2
    drv.reclaim()
    post([4, 5, 6])  # slots 0..2 of the next lap, followed by the tap
    obs.poll(out)
    receive(frame(3))  # 72 bytes: slot 3, then slot 0 (the tap's first)
    receive(frame(4)[:20])  # slot 1
    obs.poll(out)
    assert out.frames == [frame(4)[:20]]
    assert obs.stats["lost"] == 1 and obs.stats["frames"] == 1


def test_net_29_mergeable_frame_with_a_buffer_never_seen_published_is_not_written():
    """Split Rx, mergeable: a frame announced over 3 buffers (num_buffers 3), whose second used entry names a
    head the tap never saw made available (a hostile device). The tap used to join the first and third into
    one frame; it writes none of it now, and the next frame whole."""
    mem, lay, feats, drv, dev = rings("split", 8, VIRTIO_NET_F_MRG_RXBUF)
    obs = SplitObserver(lay, mem, mem, feats, True)
    out = Sink()
    drv.add(DATA + 2048 * np.arange(3), np.full(3, 40), np.zeros(3, int), np.ones(3, int), np.arange(3))
    drv.publish()
    obs.poll(out)
    whole = frame(5)  # 72 bytes with its header: 40 + 32
    data = bytearray(HDR) + whole
    data[10:12] = (3).to_bytes(2, "little")
    mem.write(DATA, bytes(data[:40]))
    mem.write(DATA + 2048, bytes(data[40:]))
    single = bytearray(HDR) + frame(6)[:20]
    single[10:12] = (1).to_bytes(2, "little")
    mem.write(DATA + 4096, bytes(single))
    for j, (id, length) in enumerate([(0, 40), (7, 40), (1, 32), (2, len(single))]):  # the device's used entries
        mem.write(lay.device + 4 + 8 * j, struct.pack("<II", id, length))
    mem.write(lay.device + 2, struct.pack("<H", 4))
    obs.poll(out)
    assert out.frames == [frame(6)[:20]]
    assert obs.stats["not_seen_published"] == 1 and obs.stats["frames"] == 1


@pytest.mark.parametrize("rx", [False, True])
def test_a_chain_of_long_segments_makes_at_most_one_frames_worth(rx):
    """A hostile peer's buffer of 16 segments of 64 KiB each (Tx), or a mergeable Rx frame announced over 16
    such buffers: the tap read all of it (1 MiB, and a ring of 32768 entries makes it 2 GiB a frame, whose
    MemoryError the capture thread does not catch). At most MAX_FRAME bytes are kept."""
    mem, lay, feats, drv, dev = rings("split", 16, *([VIRTIO_NET_F_MRG_RXBUF] if rx else []))
    obs = SplitObserver(lay, mem, mem, feats, rx)
    out = Sink()
    big = 1 << 16
    head = bytearray(HDR) + frame(1)
    head[10:12] = (16).to_bytes(2, "little")
    mem.write(DATA, bytes(head))
    if rx:
        drv.add(np.full(16, DATA), np.full(16, big), np.zeros(16, int), np.ones(16, int), np.arange(16))
    else:
        drv.add(np.full(16, DATA), np.full(16, big), np.array([16]), np.array([0]), np.array([0]))
    drv.publish()
    obs.poll(out)
    ch = dev.poll()
    dev.push_used(ch.id, [big] * (len(ch.id) - 1) + [big - 1] if rx else [0])
    dev.flush()
    obs.poll(out)
    assert len(out.frames) == 1 and len(out.frames[0]) <= MAX_FRAME


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_buffers_the_frontend_truncated_away_are_not_written_as_frames(fmt):
    """The frontend truncated its memory (the buffers' pages) after the tap saw the buffers published and before
    their used entries: the bytes read as zeros now (WatchedMemoryTable), and the observer raises GuestMemoryFault
    instead of writing frames of zeros. In a child process: a regression would be SIGBUS."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import mmap, os
        from rings.errors import GuestMemoryFault
        from rings.shm import WatchedMemoryTable
        from tests.test_tap_capture import (BASE, DATA, MEMSIZE, PackedObserver, Sink, SplitObserver, frame,
                                            send, rings)
        import tests.test_tap_capture as t
        fd = os.memfd_create("tap-capture")
        os.ftruncate(fd, MEMSIZE)
        m = mmap.mmap(fd, MEMSIZE)
        t.MemoryTable = lambda regions: WatchedMemoryTable([(BASE, MEMSIZE, m)], whose="the frontend")
        mem, lay, feats, drv, dev = rings({fmt!r}, 8)
        obs = (PackedObserver if {fmt!r} == "packed" else SplitObserver)(lay, mem, mem, feats, False)
        out = Sink()
        send(mem, drv, [frame(k) for k in range(1, 4)])
        obs.poll(out)                        # published: seen
        ch = dev.poll()
        dev.push_used(list(ch.id), [0] * 3)
        dev.flush()
        os.ftruncate(fd, DATA - BASE)        # the rings stay, the buffers go
        try:
            obs.poll(out)
            raise SystemExit(f"no error; frames {{out.frames}}")
        except GuestMemoryFault as e:
            assert "the frontend shrank" in str(e), e
        assert out.frames == [], out.frames
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])
