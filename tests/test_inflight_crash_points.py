"""A kill -9 after every store the tracked data path makes (vhost/csrc/vhost_inflight.h, VHI_POINT): no frame is
lost, no buffer is taken again once the driver has it back, and what is taken again goes first, in the order it
was first taken.

A forked child runs the C loop (8 frames from the driver's Tx queue to its Rx queue, both queues tracked) with
``die_at = k``: it dies as a kill -9 would at the k-th store point. Guest memory and the inflight area are shared
mappings, so the parent then sees exactly what the dead backend left, and starts a successor on both queues from
it (QueueTracking.start, what `vring vhost` does for the next connection), which runs until the driver has
everything back. Checked:

* whatever a successor takes first (its resubmit list, then the ring) is in flight for the driver: an Rx buffer
  the driver has received, taken again, would be written under its feet; a Tx chain it has back may already hold
  another frame;
* every frame sent reaches the driver's Rx queue (twice at worst: delivered, its Tx chain not completed);
* each backend uses Rx buffers in the order they were posted and delivers frames in the order they were sent:
  the successor resubmits in the order the chains were first taken (their counters), then goes on with the ring;
* every Tx chain comes back to the driver (once: the driver's ring checks a second completion).

The rings are small and the first 28 frames go through before the step, so the step's batch crosses the ring's
end (packed: the wrap counters flip inside it) and the area's entries hold what earlier chains left (counters,
lengths), as on a queue that has run a while. k runs from 1 until a child completes without reaching its point.
The order the module comment states (split: the batch list, used->idx, inflight = 0, used_idx; packed: free list
and used position, the used descriptors, inflight = 0, the old_* commit) is what makes every k safe: clearing the
inflight flags before the used index is published, for one, loses the batch at the points in between.

Two deaths in a row: the successor, resubmitting, dies at each of its own points too, and a third backend
finishes (test_two_kills_in_a_row_lose_no_frame_and_take_nothing_again says after which first points).

Every k is a fork, and a fork of the pytest process costs milliseconds (the kernel copies its page tables). So the
warm-up is done once per test and each k starts from a copy of what it left, put back in place: guest memory, the
area, the driver's private state (the dead backend's own state was its child's: after the warm-up, the parent's
backends never run). A successor's first poll, tried for the first check above, is undone the same way.
"""
import os

import numpy as np
import pytest

from rings.errors import VringError
from rings.virtq import DeviceQueue
from test_vhost_datapath import HDR, Pair
from vhost._net import ffi, lib
from vhost.datapath import Datapath, Options, _cast_dev, _ChainsBuf
from vhost.inflight import QueueTracking

SIZE = 32
WARM = SIZE - 4    # the step's 8 frames cross the ring's end after 4
FRAMES = 8
STEPS = 4          # enough for a backend to forward 2 * FRAMES frames


def _seq(frame):
    return int.from_bytes(frame[HDR + 12:HDR + 16], "little")


def _arrays(obj):
    """The numpy arrays a C-backed object (DriverQueue, DeviceQueue, QueueTracking) keeps its state in."""
    for v in vars(obj).values():
        if isinstance(v, np.ndarray):
            yield v
        elif isinstance(v, dict):
            yield from (a for a in v.values() if isinstance(a, np.ndarray))


def _private(objs):
    """The private state of C-backed objects: their struct (``.c``) and their arrays, copied."""
    return [(bytes(ffi.buffer(o.c)), [a.copy() for a in _arrays(o)]) for o in objs]


def _put_back(objs, private):
    for o, (c, arrays) in zip(objs, private):
        assert getattr(o, "broken", None) is None
        ffi.buffer(o.c)[:] = c
        for a, v in zip(_arrays(o), arrays, strict=True):
            a[...] = v


def _values(objs):
    """The private state of C-backed objects as values to compare: their structs' fields that are not pointers
    (those point to their own arrays, to memory or to the area), their arrays' bytes."""
    return tuple(v for o in objs
                 for v in [getattr(o.c, name) for name, f in ffi.typeof(o.c).item.fields if f.type.kind == "primitive"]
                 + [a.tobytes() for a in _arrays(o)])


class Scene:
    """The driver's side (the Pair's driver halves, its memory, the inflight area) and what it has seen."""

    def __init__(self, packed, flush):
        self.packed, self.flush = packed, flush
        self.options = Options(fwd="io", txq_flush=flush)
        self.p = Pair(self.options, packed=packed, tracked=True, size=SIZE)
        self.posted = {}    # Rx token -> how many posts came before it
        self.delivered = []
        self.tx_back = []
        p = self.p
        try:
            for _ in range(WARM // 4):
                self.post(4)
                p.send(4)
                for _ in range(STEPS):
                    assert p.dp.step() == {}
                assert len(self.reclaim("the warm-up")) == 4 and self.tx_back[-4:]
            self.delivered, self.tx_back = [], []
            self.post(FRAMES)
            first = p.seq
            p.send(FRAMES)
            self.sent = set(range(first, p.seq))
            assert [int(q.id_inflight.sum()) for q in p.drv] == [FRAMES, FRAMES]   # all 8 in flight, both sides
        except BaseException:
            p.close()
            raise

    def where(self, which, *ks):
        return (f"{'packed' if self.packed else 'split'} --txq-flush {self.flush}, vring {which} store point"
                f"{'s' if len(ks) > 1 else ''} {' then '.join(map(str, ks))}")

    # -- the driver ------------------------------------------------------------------------------

    def post(self, n):
        p = self.p
        slots = p.free[-n:][::-1]   # Pair.post_rx pops them from the end
        p.post_rx(n)
        for s in slots:
            self.posted[s] = len(self.posted)

    def reclaim(self, where):
        """What the driver gets back from both queues now: the frames received, each backend's in order."""
        p = self.p
        tokens, lens = p.drv[0].reclaim()
        order = [self.posted.pop(int(t)) for t in tokens]
        frames = [_seq(p.mem.read(p.buf(int(t)), int(n))) for t, n in zip(tokens, lens)]
        p.free.extend(int(t) for t in tokens)
        assert order == sorted(order), f"{where}: Rx buffers used out of the order they were posted: {order}"
        assert frames == sorted(frames) and len(set(frames)) == len(frames), f"{where}: frames out of order: {frames}"
        self.delivered += frames
        tokens, _ = p.drv[1].reclaim()
        self.tx_back += [int(t) for t in tokens]
        p.free.extend(int(t) for t in tokens)
        return frames

    # -- what memory, the area and the driver hold: saved, and put back in place -----------------

    def save(self):
        p = self.p
        return (bytes(p.region.buf), bytes(p.area.shm.buf), _private(p.drv), dict(self.posted), list(self.delivered),
                list(self.tx_back), list(p.free), p.seq)

    def restore(self, saved):
        p = self.p
        region, area, drv, posted, delivered, tx_back, free, seq = saved
        p.region.buf[:] = region
        p.area.shm.buf[:] = area
        _put_back(p.drv, drv)
        self.posted, self.delivered, self.tx_back = dict(posted), list(delivered), list(tx_back)
        p.free[:] = free
        p.seq = seq

    # -- backends ----------------------------------------------------------------------------------

    def successor(self, where):
        """A backend on what memory and the area hold now (QueueTracking.start on both queues). What it would take
        first (its resubmit list, then the ring) is checked against the driver: its first poll is tried, then
        memory, the area and its own state are put back as they were."""
        p = self.p
        devs = [DeviceQueue(p.mem, lay, p.features) for lay in p.layouts]
        trks = [QueueTracking(p.area, i, SIZE) for i in range(2)]
        for q, t in zip(devs, trks):
            try:
                t.start(q, p.mem)
            except VringError as e:   # the area or the ring is left in a state no successor can start from
                raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
        region, area, private = bytes(p.region.buf), bytes(p.area.shm.buf), _private(devs + trks)
        for i, (q, t) in enumerate(zip(devs, trks)):
            chains = _ChainsBuf(SIZE, 4 * SIZE)
            n = lib.vhi_poll(_cast_dev(q), chains.c, SIZE, t.c)
            assert n >= 0, f"{where}: vring {i}: {q.mark_broken()}"
            back = [int(x) for x in chains.arrays["id"][:n] if not p.drv[i].id_inflight[int(x)]]
            assert not back, f"{where}: vring {i}: the successor takes {back} again, which the driver has back"
        p.region.buf[:] = region
        p.area.shm.buf[:] = area
        _put_back(devs + trks, private)
        self.post(FRAMES)   # room for what the dead one delivered and the successor sends again
        return Datapath(devs[0], devs[1], p.features, self.options, tracking=trks)

    def run(self, dp, which, die_at, where):
        """The backend ``dp`` for STEPS iterations, in a child dying at store point ``die_at`` of vring ``which``.
        True if it died there."""
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                dp.tracking[which].c.die_at = die_at
                for _ in range(STEPS):
                    if dp.step():
                        break
                else:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 9), f"{where}: the backend ended: {status:#x}"
        self.reclaim(where)
        return os.WEXITSTATUS(status) == 9

    def finish(self, where):
        """A last successor, run until the driver has everything back."""
        dp = self.successor(where)
        for _ in range(STEPS):
            assert dp.step() == {}, where
        self.reclaim(where + ", then the last backend")
        p = self.p
        lost = self.sent - set(self.delivered)
        assert not lost, f"{where}: frames {sorted(lost)} never delivered"
        assert not p.drv[1].id_inflight.any(), f"{where}: Tx chains never completed"

    def deaths(self, die, check):
        """For k = 1, 2, ...: from what memory, the area and the driver hold now, ``die(k)`` (True if a backend
        died at k), then ``check(k)``. Returns the number of ks a backend died at; leaves the state as it found it."""
        saved = self.save()
        try:
            for k in range(1, 1000):
                if not die(k):
                    return k - 1
                check(k)
                self.restore(saved)
            pytest.fail("never completed")
        finally:
            self.restore(saved)

    def state(self, dp):
        """Everything a run of the backend ``dp`` and the checks after it depend on: memory, the area, the private
        state of the driver's queues and of ``dp``'s queues and trackings, what the driver has seen."""
        p = self.p
        return (bytes(p.region.buf), bytes(p.area.shm.buf), _values([*p.drv, dp.rxq, dp.txq, *dp.tracking]),
                repr((sorted(self.posted.items()), self.delivered, self.tx_back, p.free, p.seq)))

    def kind(self):
        """Per vring: (chains in flight in the area: 0 none, 1 some, 2 all FRAMES; the driver has some back;
        the header says a completion was under way)."""
        p, out = self.p, []
        for i in range(2):
            hdr, desc = QueueTracking(p.area, i, SIZE).views()
            n = int((desc["inflight"] == 1).sum())
            if p.area.packed:
                mid = any(int(hdr[f]) != int(hdr["old_" + f]) for f in ("free_head", "used_idx", "used_wrap_counter"))
            else:
                mid = int.from_bytes(p.mem.read(p.layouts[i].device + 2, 2), "little") != int(hdr["used_idx"])
            del hdr, desc
            out.append((0 if n == 0 else 2 if n == FRAMES else 1, int(p.drv[i].id_inflight.sum()) < FRAMES, mid))
        return tuple(out)

    def close(self):
        self.p.close()


@pytest.fixture
def scene():
    made = []

    def make(packed, flush):
        made.append(Scene(packed, flush))
        return made[-1]
    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("which", [0, 1], ids=["rx-points", "tx-points"])
def test_a_kill_at_any_store_point_loses_no_frame_and_takes_nothing_again(scene, packed, flush, which):
    s = scene(packed, flush)
    n = s.deaths(lambda k: s.run(s.p.dp, which, k, s.where(which, k)), lambda k: s.finish(s.where(which, k)))
    assert n >= 2 * FRAMES   # taken and completed: at least two points per frame were tried


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("which", [0, 1], ids=["rx-points", "tx-points"])
def test_two_kills_in_a_row_lose_no_frame_and_take_nothing_again(scene, packed, flush, which):
    """The successor, resubmitting, dies at each of its own points on the same vring; a third backend finishes.

    Every first point times every second one would be some 11 000 forks (four minutes here), so the first point
    is one of each kind of state a death leaves. A kind is, per vring: chains in flight in the area (none, some,
    all 8), whether the driver has any back, whether the header says a completion was under way (split:
    used->idx ahead of used_idx; packed: used position or free head ahead of its old_* copy). What the successor
    has to repair and resubmit depends on the kind; the points of one kind differ in how far a per-chain loop got
    (a chain more or less taken, linked or cleared), and a point inside the run has chains on both sides of it.
    The two flush variants store the same points in this step, so each takes others: a third of the way into
    each kind (rx-batch) and two thirds (none). A successor that starts in exactly the state of one tried
    already (after a death past the publish, recovery leaves the same area whatever point it was) runs the same
    way, and is not tried again. 4 to 7 first points per variant, 1 250 pairs in all."""
    s = scene(packed, flush)
    start = s.save()
    kinds = {}

    def first(k):
        if not s.run(s.p.dp, which, k, s.where(which, k)):
            return False
        kinds.setdefault(s.kind(), []).append(k)
        return True
    assert s.deaths(first, lambda k: None) >= 2 * FRAMES
    # the dying vring was left with some chains taken, all taken, published with flags half cleared, and all
    # cleared with the header not yet committed, at the least
    assert {(1, False, False), (2, False, False), (1, True, True), (0, True, True)} <= {kd[which] for kd in kinds}
    tried = set()
    for ks in kinds.values():
        k1 = ks[len(ks) // 3] if flush == "rx-batch" else ks[2 * len(ks) // 3]
        s.restore(start)
        assert s.run(s.p.dp, which, k1, s.where(which, k1))
        dp = s.successor(s.where(which, k1))   # it never runs here: each child runs its own copy
        state = s.state(dp)
        if state in tried:
            continue
        tried.add(state)
        s.deaths(lambda k2: s.run(dp, which, k2, s.where(which, k1, k2)),
                 lambda k2: s.finish(s.where(which, k1, k2)))
    assert len(tried) >= 4
