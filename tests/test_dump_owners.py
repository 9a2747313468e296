"""Who owns a descriptor, as the dumps say it (issue 12), against the spec's rules:

* §2.8.1 / §2.8.6-2.8.8 (packed): the flags decide; a used descriptor gives back its whole list, with
  IN_ORDER its whole batch, and both sides skip past it (PACKED-V-09, PACKED-D-15, INORDER-11..14);
* §2.7.13 / §2.7.14 (split): avail.idx hands chains to the device, used.idx hands them back;
* one vocabulary for both formats: 'device' from publication to the used entry, 'driver' otherwise
  ('unknown' only where memory alone cannot tell).

The property test drives real queues (both implementations) through random operations and checks every
snapshot (driver, device, memory only, raw round trip) against rules derived from the ring memory and the
operations performed, not against another decoder.
"""
import importlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rings import rawdump
from rings.diagnose import diagnose
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, QueueLayout, bit)
from rings.shm import MemoryTable
from rings.snapshot import format_snapshot, memory_snapshot

BASE = 0x100000
DATA = BASE + 0x40000
TABLES = BASE + 0x20000
MEMSIZE = 1 << 19


class Rings:
    """Both halves of one queue over a bytearray, plus a record of what was done to them."""

    def __init__(self, impl, fmt, size, in_order=False, batch=False, indirect=False):
        self.fmt, self.size, self.packed = fmt, size, fmt == "packed"
        self.mem = MemoryTable([(BASE, MEMSIZE, bytearray(MEMSIZE))])
        self.layout = QueueLayout.contiguous(fmt, size, BASE)
        self.features = ((bit(VIRTIO_F_RING_PACKED) if self.packed else 0) |
                         (bit(VIRTIO_F_IN_ORDER) if in_order else 0) |
                         (bit(VIRTIO_F_INDIRECT_DESC) if indirect else 0))
        self.indirect = (TABLES, 4) if indirect and size >= 4 else None
        self.drv = impl.DriverQueue(self.mem, self.layout, self.features, indirect=self.indirect)
        self.dev = impl.DeviceQueue(self.mem, self.layout, self.features, in_order_batch=batch)
        self.in_order = in_order
        self.bufs = []          # per token: dict(ndesc, pos, published, flushed, reclaimed, wlen)
        self.added_descs = 0    # packed: absolute position of the next descriptor the driver writes
        self.polled = []        # tokens polled and not completed (in poll order), with their ids
        self.completed = []     # (id, len) pushed, not flushed
        self.id_token = {}

    # -- operations --------------------------------------------------------------------------------------
    def add(self, nsegs, writable, publish):
        token0 = len(self.bufs)
        k = sum(nsegs)
        w = np.array(nsegs) if writable else np.zeros(len(nsegs), int)
        added = self.drv.add(DATA + 256 * (np.arange(k) % 256), np.full(k, 100), np.array(nsegs) - w, w,
                             np.arange(token0, token0 + len(nsegs)))
        for j in range(added):
            ndesc = 1 if self.indirect and 1 < nsegs[j] <= self.indirect[1] else nsegs[j]
            self.bufs.append({"ndesc": ndesc, "pos": self.added_descs, "avail_pos": len(self.bufs),
                              "published": False, "flushed": False, "reclaimed": False,
                              "wlen": 100 * nsegs[j] if writable else 0})
            self.added_descs += ndesc
        if publish:
            self.publish()

    def publish(self):
        self.drv.publish()
        for b in self.bufs:
            b["published"] = True

    def poll(self, k):
        ch = self.dev.poll(k)
        for id in ch.id.tolist():
            tok = next(t for t, b in enumerate(self.bufs) if b["published"] and not b.get("polled"))
            self.bufs[tok]["polled"] = True
            self.id_token[id] = tok
            self.polled.append(id)

    def complete(self, k, full, rng):
        """Push k polled buffers as used: the oldest (IN_ORDER, or rng None) or a random choice."""
        ids = self.polled[:k] if self.in_order or rng is None else [int(i) for i in rng.permutation(self.polled)[:k]]
        if not ids:
            return
        lens = [self.bufs[self.id_token[i]]["wlen"] if full else self.bufs[self.id_token[i]]["wlen"] // 2
                for i in ids]
        self.dev.push_used(ids, lens)
        for i in ids:
            self.polled.remove(i)
            self.completed.append(self.id_token[i])

    def flush(self):
        self.dev.flush()
        for tok in self.completed:
            self.bufs[tok]["flushed"] = True
        self.completed = []

    def reclaim(self, k):
        tokens, _ = self.drv.reclaim(k)
        for t in tokens.tolist():
            self.bufs[t]["reclaimed"] = True

    # -- the truth, from the operations --------------------------------------------------------------------
    def positions(self):
        """Packed: (U, A) absolute positions: the device's used position (descriptors of flushed buffers,
        whatever order) and the driver's published position."""
        used = sum(b["ndesc"] for b in self.bufs if b["flushed"])
        published = sum(b["ndesc"] for b in self.bufs if b["published"])
        return used, published

    def device_slots(self):
        """The descriptors the device owns: published and not given back."""
        n = self.size
        if self.packed:
            u, a = self.positions()
            return {p % n for p in range(u, a)}
        out = set()
        avail = self.mem.view(self.layout.driver, 4 + 2 * n)
        for b in self.bufs:
            if b["published"] and not b["flushed"]:
                head = int.from_bytes(avail[4 + 2 * (b["avail_pos"] % n):6 + 2 * (b["avail_pos"] % n)], "little")
                out.update(self._chain(head, b["ndesc"]))
        return out

    def _chain(self, head, ndesc):
        if self.in_order:
            return [(head + j) % self.size for j in range(ndesc)]
        desc, chain = self.mem.view(self.layout.desc, 16 * self.size), [head]
        for _ in range(ndesc - 1):
            chain.append(int.from_bytes(desc[16 * chain[-1] + 14:16 * chain[-1] + 16], "little"))
        return chain

    def flags(self):
        d = self.mem.view(self.layout.desc, 16 * self.size)
        return [int.from_bytes(d[16 * i + 14:16 * i + 16], "little") for i in range(self.size)]


def truth_written(r):
    """Slots the driver or device ever wrote (a zero slot never was: PACKED-L-05)."""
    return {p % r.size for p in range(r.added_descs)}


def check_rows_follow_chains(snap):
    """Every slot of a chain has the chain's owner; owners are the three words."""
    rows = snap["descriptors"]
    assert {r["owner"] for r in rows} <= {"driver", "device", "unknown"}
    for c in snap["chains"]:
        for i in c["slots"]:
            assert rows[i]["owner"] == c["owner"], (c, rows[i])


def check(r):
    n, truth = r.size, r.device_slots()
    d, v, m = r.drv.snapshot(), r.dev.snapshot(), memory_snapshot(r.mem, r.layout, r.features)
    for snap, half in ((d, r.drv), (v, r.dev), (m, None)):
        assert json.loads(json.dumps(snap)) == snap
        check_rows_follow_chains(snap)
        format_snapshot(snap)
        diagnose(snap)
        if half is not None:
            assert rawdump.loads(rawdump.capture(half).dumps()).snapshot() == snap
    # the driver and device dumps: exactly the published, not yet used descriptors are the device's
    for snap in (d, v):
        assert {i for i, row in enumerate(snap["descriptors"]) if row["owner"] == "device"} == truth, snap["side"]
        assert "unknown" not in {row["owner"] for row in snap["descriptors"]}
    flags = r.flags()
    if r.packed and r.added_descs - r.positions()[1] == n:
        return  # the whole ring rewritten and nothing published: memory reads it as published (documented)
    if r.packed:
        u, a = r.positions()
        wrap_of = lambda p: 1 ^ (p // n) & 1  # noqa: E731 - both wrap counters start at 1 (PACKED-D-02, V-01)
        # memory alone: where the driver published, and the AVAIL bits agree with it (PACKED-D-02/03)
        ix = m["indices"]
        if ix["next_avail"] is None:  # only a list kept back unpublished can make the lap ambiguous
            assert r.added_descs > a and {row["owner"] for row in m["descriptors"]} == {"unknown"}
            return
        assert (ix["next_avail"], ix["avail_wrap"]) == (a % n, wrap_of(a))
        lap = [ix["avail_wrap"] if i < ix["next_avail"] else ix["avail_wrap"] ^ 1 for i in range(n)]
        if ix["used_idx"] is not None:
            assert (ix["used_idx"], ix["used_wrap"]) == (u % n, wrap_of(u))
        for i, row in enumerate(m["descriptors"]):
            f = flags[i]
            used_in_lap = bool(f & VIRTQ_DESC_F_AVAIL) == bool(f & VIRTQ_DESC_F_USED) == lap[i]
            if row["owner"] == "device":  # flags decide: the device owns only slots available in their lap
                assert not used_in_lap and bool(f & VIRTQ_DESC_F_AVAIL) == lap[i]
                assert i in truth
            elif row["owner"] == "driver":
                assert i not in truth
            if used_in_lap:
                assert row["owner"] == "driver"
        owned = [row["owner"] for row in m["descriptors"]]
        assert m["counts"]["available_descs"] == owned.count("device")
        assert m["counts"]["unknown_descs"] == owned.count("unknown")
        # memory is unsure only of how far the newest used descriptor skipped (or, with none left in the
        # ring, an overwritten one): unknown slots come after every slot whose flags say used, oldest first;
        # with IN_ORDER the used descriptor's id says how far (INORDER-12/14)
        unpublished = {p % n for p in range(a, r.added_descs)}  # written, not published (head kept back)
        order = [i for i in ((ix["next_avail"] + k) % n for k in range(n)) if i not in unpublished]
        written_used = [k for k, i in enumerate(order) if (bool(flags[i] & VIRTQ_DESC_F_AVAIL) ==
                        bool(flags[i] & VIRTQ_DESC_F_USED) == lap[i]) and (flags[i] or i in truth_written(r))]
        unknown_at = [k for k, i in enumerate(order) if owned[i] == "unknown"]
        if unknown_at:
            assert not written_used or min(unknown_at) > max(written_used)
            assert not (r.in_order and written_used)
            assert ix["used_idx"] is None
    else:
        avail_idx = int.from_bytes(r.mem.read(r.layout.driver + 2, 2), "little")
        used_idx = int.from_bytes(r.mem.read(r.layout.device + 2, 2), "little")
        inflight = (avail_idx - used_idx) & 0xFFFF
        assert m["counts"]["inflight"] == inflight
        assert sum(1 for c in d["chains"] if c["owner"] == "device") == inflight
        if r.in_order:
            assert {i for i, row in enumerate(m["descriptors"]) if row["owner"] == "device"} == truth
            assert "unknown" not in {row["owner"] for row in m["descriptors"]}
        else:
            assert {row["owner"] for row in m["descriptors"]} == {"unknown"}


OPS = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=4), st.booleans(), st.booleans()),
    st.tuples(st.just("publish")),
    st.tuples(st.just("poll"), st.integers(1, 8)),
    st.tuples(st.just("complete"), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("flush")),
    st.tuples(st.just("reclaim"), st.integers(1, 8)),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(impl=st.sampled_from(["rings.virtq", "rings.reference"]), fmt=st.sampled_from(["split", "packed"]),
       size_exp=st.integers(0, 3), packed_size=st.integers(1, 9), in_order=st.booleans(), batch=st.booleans(),
       indirect=st.booleans(), ops=st.lists(OPS, min_size=1, max_size=40), seed=st.integers(0, 2 ** 16))
def test_random_ring_states_owners_counts_wrap(impl, fmt, size_exp, packed_size, in_order, batch, indirect, ops,
                                               seed):
    size = packed_size if fmt == "packed" else 1 << size_exp
    r = Rings(importlib.import_module(impl), fmt, size, in_order, batch and in_order, indirect)
    rng = np.random.default_rng(seed)
    for op in ops:
        if op[0] == "add":
            r.add([min(x, size) for x in op[1]], op[2], op[3])
        elif op[0] == "publish":
            r.publish()
        elif op[0] == "poll":
            r.poll(op[1])
        elif op[0] == "complete":
            r.complete(op[1], op[2], rng)
        elif op[0] == "flush":
            r.flush()
        else:
            r.reclaim(op[1])
        check(r)


# --- the three bugs, each from its rule ---------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["rings.virtq", "rings.reference"])
def test_packed_v_09_driver_dump_skipped_tail_is_the_drivers(impl):
    """PACKED-V-09/PACKED-D-15: one used descriptor for a 3-descriptor list; the device skips the other two
    slots and so does the driver: the driver dump gives all three to the driver, chain and rows alike."""
    r = Rings(importlib.import_module(impl), "packed", 8)
    r.add([3, 1], True, True)
    r.poll(2)
    r.complete(1, True, None)
    r.flush()
    d = r.drv.snapshot()
    assert [(c["slots"], c["owner"], c["state"]) for c in d["chains"]] == [
        ([0, 1, 2], "driver", "used, not reclaimed"), ([3], "device", "available")]
    assert [row["owner"] for row in d["descriptors"][:4]] == ["driver", "driver", "driver", "device"]
    assert [row["flag_names"] for row in d["descriptors"][1:3]] == ["NEXT|WRITE|AVAIL", "WRITE|AVAIL"]


@pytest.mark.parametrize("impl", ["rings.virtq", "rings.reference"])
def test_inorder_11_packed_driver_dump_batch_is_the_drivers(impl):
    """INORDER-11..13: one used descriptor (id of the batch's last buffer) at the batch's first slot gives
    back the whole batch: its slots are the driver's though all but the first still read available."""
    r = Rings(importlib.import_module(impl), "packed", 8, in_order=True, batch=True)
    r.add([1, 2, 1, 1], True, True)
    r.poll(4)
    r.complete(3, True, None)
    r.flush()
    d, m = r.drv.snapshot(), memory_snapshot(r.mem, r.layout, r.features)
    assert [row["owner"] for row in d["descriptors"][:5]] == ["driver"] * 4 + ["device"]
    assert d["chains"][0]["slots"] == [0, 1, 2, 3] and d["chains"][0]["id"] == 3
    assert [row["owner"] for row in m["descriptors"][:5]] == ["driver"] * 4 + ["device"]
    assert m["counts"] == {"available_descs": 1, "available_chains": 1, "unknown_descs": 0}


def test_packed_d_14_memory_list_never_runs_into_a_used_descriptor():
    """§2.8.6, PACKED-D-14: every descriptor of an available list carries the available flags of its lap.
    Lists A (slots 0-1), B (2-3), C (4) completed in the order C, B, A leave a used descriptor at slot 3
    right after B's stale head at slot 2 (still NEXT|AVAIL): memory decoding must not read 2-3 as an
    available list with the used descriptor's id; slot 3 is a used descriptor, and nothing is available."""
    impl = importlib.import_module("rings.reference")
    r = Rings(impl, "packed", 8)
    r.add([2, 2, 1], True, True)
    r.poll(3)
    ids = list(r.polled)
    for i in reversed(ids):
        r.dev.push_used([i], [100])
        r.dev.flush()
    flags = r.flags()
    assert flags[2] & VIRTQ_DESC_F_NEXT and flags[2] & VIRTQ_DESC_F_AVAIL and not flags[2] & VIRTQ_DESC_F_USED
    assert flags[3] & VIRTQ_DESC_F_AVAIL and flags[3] & VIRTQ_DESC_F_USED
    m = memory_snapshot(r.mem, r.layout, r.features)
    by_head = {c["head"]: c for c in m["chains"]}
    assert by_head[3]["slots"] == [3] and by_head[3]["state"] == "used" and by_head[3]["id"] == ids[0]
    assert by_head[2]["slots"] == [2] and by_head[2]["owner"] == "driver"
    assert by_head[2]["state"].startswith("available flags, list cut by a used descriptor")
    assert m["counts"]["available_descs"] == 0 and m["counts"]["available_chains"] == 0
    assert [row["owner"] for row in m["descriptors"][:4]] == ["driver"] * 4


@pytest.mark.parametrize("impl", ["rings.virtq", "rings.reference"])
@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_owner_vocabulary_split_and_packed_agree(impl, fmt):
    """The same story in both formats gives the same owners: a used, not reclaimed chain is the driver's,
    an available one the device's, one added but not published the driver's."""
    r = Rings(importlib.import_module(impl), fmt, 8)
    r.add([2, 1], True, True)
    r.poll(1)
    r.complete(1, True, None)
    r.flush()
    r.add([1], True, False)
    d = r.drv.snapshot()
    assert [(c["owner"], c["state"]) for c in d["chains"]] == [
        ("driver", "used, not reclaimed"), ("device", "available"), ("driver", "added, not published")]
    assert [row["owner"] for row in d["descriptors"][:4]] == ["driver", "driver", "device", "driver"]
    v = r.dev.snapshot()
    assert [row["owner"] for row in v["descriptors"][:4]] == ["driver", "driver", "device", "driver"]


def test_packed_memory_unpublished_list_keeps_the_lap():
    """A list written but not published (its head's flags kept back, PACKED-D-12) does not hide where the
    driver is: memory decoding finds the published position at the kept head, and gives the list to the
    driver."""
    r = Rings(importlib.import_module("rings.reference"), "packed", 8)
    r.add([1, 1], True, True)
    r.add([3], True, False)
    m = memory_snapshot(r.mem, r.layout, r.features)
    assert (m["indices"]["next_avail"], m["indices"]["avail_wrap"]) == (2, 1)
    assert m["chains"][0] == {"head": 2, "id": m["chains"][0]["id"], "slots": [2, 3, 4], "owner": "driver",
                              "state": "written, not published: the head flags at slot 2 are kept back"}
    assert [row["owner"] for row in m["descriptors"][:5]] == ["device", "device", "driver", "driver", "driver"]
