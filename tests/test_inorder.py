"""VIRTIO_F_IN_ORDER conformance (and the normal variant beside it), for both implementations.

A real device batches: one used entry for n buffers; the driver must give back exactly those n buffers, in
order, with the skipped ones fully used. Checked through ring memory (numpy views of the spec structs),
the returned tokens and lengths, and snapshot() indices. Checklist IDs are named in each docstring.
"""
import json
from collections import deque

import numpy as np
import pytest

from rings.errors import UsedIdxJump
from rings.layout import (RING_EVENT_FLAGS_DESC, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER,
                          VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE, avail_dtype, bit, need_event, packed_desc_dtype,
                          packed_need_event, split_desc_dtype, used_dtype)
from rings.snapshot import format_snapshot

BASE = 0x100000              # guest address of the test memory
MEMSIZE = 1 << 20
INDIRECT = BASE + 0x10000    # indirect tables: size * 4 entries * 16 bytes
DATA = BASE + 0x40000        # buffers
RING_SIZES = [("split", 8), ("split", 256), ("packed", 7), ("packed", 1000)]


def features(fmt, *bits):
    return (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) | sum(bit(b) for b in bits)


class Rings:
    """Both halves of one queue, and numpy views of its areas to look behind their backs."""

    def __init__(self, impl, mem, layout, feats, batch=False, indirect=False):
        self.size, self.packed = layout.size, layout.packed
        self.drv = impl.DriverQueue(mem, layout, feats, indirect=(INDIRECT, 4) if indirect else None)
        self.dev = impl.DeviceQueue(mem, layout, feats, in_order_batch=batch)
        n = self.size
        if self.packed:
            self.desc = np.frombuffer(mem.view(layout.desc, 16 * n), packed_desc_dtype)
            self.driver_event = np.frombuffer(mem.view(layout.driver, 4), "<u2")  # off_wrap, flags
            self.device_event = np.frombuffer(mem.view(layout.device, 4), "<u2")
        else:
            self.desc = np.frombuffer(mem.view(layout.desc, 16 * n), split_desc_dtype)
            self.avail = np.frombuffer(mem.view(layout.driver, avail_dtype(n).itemsize), avail_dtype(n))[0]
            self.used = np.frombuffer(mem.view(layout.device, used_dtype(n).itemsize), used_dtype(n))[0]

    def add(self, rng, nsegs, tokens, writable_only=False):
        """Add buffers of the given segment counts (random readable/writable split, random lengths).
        Returns the writable size of each buffer that fitted."""
        nwrite = [k if writable_only else int(rng.integers(0, k + 1)) for k in nsegs]
        nread = [k - w for k, w in zip(nsegs, nwrite)]
        lens = rng.integers(1, 2049, sum(nsegs))
        addrs = DATA + 64 * (np.arange(sum(nsegs)) % 256)
        added = self.drv.add(addrs, lens, nread, nwrite, tokens)
        ends = np.cumsum(nsegs)
        return [int(lens[e - w:e].sum()) for e, w in zip(ends[:added], nwrite)]


def make_rings(impl, mem_factory, make_layout, fmt, size, *bits, batch=False, indirect=False, shm=False):
    mem = mem_factory(MEMSIZE, BASE, shm=shm)
    return Rings(impl, mem, make_layout(fmt, size, BASE), features(fmt, *bits), batch, indirect)


def chain_lengths(rng, n, room):
    """n chains of 1..3 descriptors, mixed, taking at most room descriptors in all."""
    k = [1] * n
    spare = room - n
    for i in rng.permutation(n):
        extra = min(int(rng.integers(0, 3)), spare)
        k[i] += extra
        spare -= extra
    return k


def batch_sizes(rng, size):
    """Every n in 1..size for small rings; for big ones the edges and random sizes in between."""
    if size <= 8:
        return list(range(1, size + 1)) + list(range(size, 0, -1))
    return [1, 2, size, size - 1] + rng.integers(3, size - 1, 8).tolist()


def lap_wrap(position, size):
    """The wrap counter in force at free-running descriptor position (starts 1, toggles every lap)."""
    return 1 ^ ((position // size) & 1)


def used_flags(wrap, length):
    """PACKED-V-02/12: AVAIL = USED = the device wrap counter, WRITE iff data was written."""
    return (VIRTQ_DESC_F_AVAIL | VIRTQ_DESC_F_USED if wrap else 0) | (VIRTQ_DESC_F_WRITE if length else 0)


def check_indices(r, bufs, descs):
    """Both halves agree with a ring model that knows only how many buffers/descriptors went round."""
    d, v = r.drv.snapshot(), r.dev.snapshot()
    assert d["counts"] == {"num_free": r.size, "inflight": 0}
    assert all(row["owner"] == "driver" for row in d["descriptors"])
    if r.packed:
        slot, wrap = descs % r.size, lap_wrap(descs, r.size)
        assert d["indices"] == {"next_avail": slot, "avail_wrap": wrap, "last_used": slot, "used_wrap": wrap}
        assert v["indices"] == {"last_avail": slot, "avail_wrap": wrap, "used_idx": slot, "used_wrap": wrap}
    else:
        idx = bufs & 0xFFFF
        assert d["indices"] == {"next_avail": idx, "last_used": idx, "avail.idx": idx, "used.idx": idx}
        assert v["indices"] == {"last_avail": idx, "used_idx": idx, "avail.idx": idx, "used.idx": idx}


@pytest.mark.parametrize("batch", [True, False], ids=["one_entry_per_batch", "one_entry_per_buffer"])
@pytest.mark.parametrize("fmt,size", RING_SIZES)
def test_in_order_batches_over_three_laps(impl, mem_factory, make_layout, fmt, size, batch):
    """INORDER-03/06/07/08/11/12/13/14, PACKED-V-09, PACKED-D-15: batches of 1..size buffers, chains of
    mixed lengths, >= 3 laps. Batched: one used entry at the batch's first slot, other slots untouched,
    idx += n; the driver returns the n tokens in order, skipped ones with len = wlen.
    Per buffer: one entry each, in order."""
    rng = np.random.default_rng(size)
    r = make_rings(impl, mem_factory, make_layout, fmt, size, VIRTIO_F_IN_ORDER, batch=batch)
    bufs = descs = token = 0
    sizes = batch_sizes(rng, size)
    while descs < 3 * size or sizes:
        n = sizes.pop() if sizes else int(rng.integers(1, size + 1))
        nsegs = chain_lengths(rng, n, size)
        tokens = list(range(token, token + n))
        wlens = r.add(rng, nsegs, tokens)
        r.drv.publish()
        assert len(wlens) == n
        heads = ((descs + np.cumsum([0] + nsegs[:-1])) % size).tolist()  # ring order (INORDER-03)
        chains = r.dev.poll()
        assert chains.id.tolist() == heads and chains.wlen.tolist() == wlens
        owners = [row["owner"] for row in r.drv.snapshot()["descriptors"]]
        assert owners.count("device") == sum(nsegs)
        if batch:  # skipped buffers fully written, the last one anything (INORDER-10)
            lens = wlens[:-1] + [int(rng.integers(0, wlens[-1] + 1))]
        else:
            lens = [int(rng.integers(0, w + 1)) for w in wlens]
        before = r.desc.copy() if r.packed else r.used["ring"].copy()
        r.dev.push_used(chains.id, lens)
        r.dev.flush()
        entries = [(0, n - 1)] if batch else [(k, k) for k in range(n)]  # (first, last) buffer of each entry
        if r.packed:  # INORDER-13: the used descriptor overwrites the batch's first slot
            written = {heads[first] for first, _ in entries}
            for first, last in entries:
                pos = descs + sum(nsegs[:first])
                d = r.desc[heads[first]]
                assert (d["id"], d["len"], d["flags"]) == (heads[last], lens[last],
                                                           used_flags(lap_wrap(pos, size), lens[last]))
                assert d["addr"] == before[heads[first]]["addr"]
        else:  # INORDER-08: at the used slot matching the batch's first avail slot; INORDER-07: idx += n
            written = {(bufs + first) % size for first, _ in entries}
            for first, last in entries:
                assert tuple(r.used["ring"][(bufs + first) % size]) == (heads[last], lens[last])
            assert r.used["idx"] == (bufs + n) & 0xFFFF
        untouched = [i for i in range(size) if i not in written]
        assert (r.desc if r.packed else r.used["ring"])[untouched].tobytes() == before[untouched].tobytes()
        # Used, not reclaimed: the driver's again, split and packed alike; a used entry gives back its whole
        # batch, the slots it skipped included (INORDER-06/11, §2.8.8)
        owners = [row["owner"] for row in r.drv.snapshot()["descriptors"]]
        assert owners.count("device") == 0
        assert "device" not in [row["owner"] for row in r.dev.snapshot()["descriptors"]]
        got_tokens, got_lens = r.drv.reclaim()
        assert got_tokens.tolist() == tokens
        assert got_lens.tolist() == lens
        bufs, descs, token = bufs + n, descs + sum(nsegs), token + n
        check_indices(r, bufs, descs)
    assert descs >= 3 * size


@pytest.mark.parametrize("fmt,size", [("split", 8), ("packed", 7)])
def test_inorder_10_partial_buffer_ends_a_batch(impl, mem_factory, make_layout, fmt, size):
    """INORDER-10 (device): a buffer not written completely closes its batch; the next starts after it."""
    rng = np.random.default_rng(7)
    r = make_rings(impl, mem_factory, make_layout, fmt, size, VIRTIO_F_IN_ORDER, batch=True)
    wlens = r.add(rng, [1, 2, 1, 1], [10, 11, 12, 13], writable_only=True)
    r.drv.publish()
    chains = r.dev.poll()
    lens = [wlens[0], wlens[1] - 1, wlens[2], wlens[3] - 1]
    r.dev.push_used(chains.id, lens)
    r.dev.flush()
    heads = [0, 1, 3, 4]
    if r.packed:  # batches [0, 1] at slot 0 and [2, 3] at slot 3
        assert r.desc[0]["id"] == heads[1] and r.desc[0]["len"] == lens[1]
        assert r.desc[3]["id"] == heads[3] and r.desc[3]["len"] == lens[3]
        assert [bool(f & VIRTQ_DESC_F_USED) for f in r.desc["flags"][:5]] == [True, False, False, True, False]
    else:
        assert tuple(r.used["ring"][0]) == (heads[1], lens[1])
        assert tuple(r.used["ring"][2]) == (heads[3], lens[3])
        assert tuple(r.used["ring"][1]) == tuple(r.used["ring"][3]) == (0, 0)
        assert r.used["idx"] == 4
    got_tokens, got_lens = r.drv.reclaim()
    assert got_tokens.tolist() == [10, 11, 12, 13] and got_lens.tolist() == lens


@pytest.mark.parametrize("fmt,size", [("split", 8), ("packed", 7)])
def test_in_order_driver_skips_unwritten_used_slots(impl, mem_factory, make_layout, fmt, size):
    """INORDER-06/09/10/11/12/14 (driver), against a hand-written device over 3+ laps in shared memory:
    one used entry names the batch's last buffer; the skipped used slots hold garbage the driver must not
    read; skipped buffers come back with len = their writable size."""
    rng = np.random.default_rng(3)
    r = make_rings(impl, mem_factory, make_layout, fmt, size, VIRTIO_F_IN_ORDER, shm=True)
    bufs = descs = 0
    while descs < 3 * size:
        n = int(rng.integers(1, size + 1))
        nsegs = chain_lengths(rng, n, size)
        tokens = list(range(bufs, bufs + n))
        wlens = r.add(rng, nsegs, tokens, writable_only=True)
        assert len(wlens) == n
        r.drv.publish()
        heads = ((descs + np.cumsum([0] + nsegs[:-1])) % size).tolist()
        last_len = int(rng.integers(0, wlens[-1] + 1))
        if r.packed:
            first = r.desc[heads[0]]
            first["id"], first["len"] = heads[-1], last_len
            first["flags"] = used_flags(lap_wrap(descs, size), last_len)
        else:
            r.used["ring"][:] = (0xFFFFFFFF, 0xFFFFFFFF)  # garbage: read it and the driver must fail
            r.used["ring"][bufs % size] = (heads[-1], last_len)
            r.used["idx"] = (bufs + n) & 0xFFFF
        got_tokens, got_lens = r.drv.reclaim()
        assert got_tokens.tolist() == tokens
        assert got_lens.tolist() == wlens[:-1] + [last_len]
        bufs, descs = bufs + n, descs + sum(nsegs)
        d = r.drv.snapshot()
        assert d["counts"] == {"num_free": size, "inflight": 0}
        if r.packed:
            assert d["indices"]["last_used"] == descs % size
            assert d["indices"]["used_wrap"] == lap_wrap(descs, size)
        else:
            assert d["indices"]["last_used"] == bufs


def test_in_order_entry_beyond_used_idx_breaks_the_driver(impl, mem_factory, make_layout):
    """INORDER-07, SPLIT-D-17: an entry naming buffer 3 while used.idx moved by 2: UsedIdxJump, sticky."""
    r = make_rings(impl, mem_factory, make_layout, "split", 8, VIRTIO_F_IN_ORDER)
    assert len(r.add(np.random.default_rng(0), [1, 1, 1], [0, 1, 2], writable_only=True)) == 3
    r.drv.publish()
    r.used["ring"][0] = (2, 0)
    r.used["idx"] = 2
    with pytest.raises(UsedIdxJump) as first:
        r.drv.reclaim()
    with pytest.raises(UsedIdxJump) as again:
        r.drv.reclaim()
    assert again.value is first.value is r.drv.broken
    assert r.drv.snapshot()["broken"]["error"] == "UsedIdxJump"


@pytest.mark.parametrize("indirect", [False, True], ids=["direct", "indirect"])
@pytest.mark.parametrize("fmt,size", RING_SIZES)
def test_normal_variant_random_completion_order(impl, mem_factory, make_layout, fmt, size, indirect):
    """SPLIT-D-16, PACKED-D-15/26, INORDER-15, PACKED-V-09/11: without IN_ORDER the device completes in a
    random (seeded) order; every token comes back exactly once, in completion order, with its len."""
    rng = np.random.default_rng(size + indirect)
    bits = (VIRTIO_F_INDIRECT_DESC,) if indirect else ()
    r = make_rings(impl, mem_factory, make_layout, fmt, size, *bits, indirect=indirect)
    unpolled = deque()   # (token, wlen) in avail order
    polled = {}          # buffer id -> (token, wlen)
    returned = []
    token = 0
    while token < 3 * size or unpolled or polled:
        if token < 3 * size:
            n = int(rng.integers(1, size + 1))
            tokens = list(range(token, token + n))
            wlens = r.add(rng, rng.integers(1, 4, n).tolist(), tokens)  # stops when the ring is full
            unpolled.extend(zip(tokens, wlens))
            token += len(wlens)
            r.drv.publish()
        chains = r.dev.poll()
        for id, wlen in zip(chains.id.tolist(), chains.wlen.tolist()):
            polled[id] = unpolled.popleft()
            assert polled[id][1] == wlen
        ids = rng.permutation(list(polled))[:int(rng.integers(0, len(polled) + 1))].tolist()
        lens = [int(rng.integers(0, polled[i][1] + 1)) for i in ids]
        r.dev.push_used(ids, lens)
        r.dev.flush()
        got_tokens, got_lens = r.drv.reclaim()
        expected = [(polled[i][0], length) for i, length in zip(ids, lens)]
        assert list(zip(got_tokens.tolist(), got_lens.tolist())) == expected
        returned += got_tokens.tolist()
        for i in ids:
            del polled[i]
    assert sorted(returned) == list(range(token)) and token >= 3 * size
    assert r.drv.snapshot()["counts"] == {"num_free": size, "inflight": 0}


@pytest.mark.parametrize("fmt,indices", [
    ("split", "next_avail=2 last_used=0 avail.idx=2 used.idx=0"),
    ("packed", "next_avail=3 avail_wrap=1 last_used=0 used_wrap=1")])
def test_snapshot_of_an_in_order_batch_in_flight(impl, mem_factory, make_layout, fmt, indices):
    """Snapshots while a batch of a 2-descriptor and a 1-descriptor chain is in flight: the device owns
    exactly their 3 descriptors on both sides, the dicts are JSON, the table has one row per slot; after
    the single used entry is reclaimed, the driver owns everything again."""
    r = make_rings(impl, mem_factory, make_layout, fmt, 8 if fmt == "split" else 7, VIRTIO_F_IN_ORDER,
                   batch=True)
    wlens = r.add(np.random.default_rng(1), [2, 1], [0, 1], writable_only=True)
    r.drv.publish()
    chains = r.dev.poll()
    for snap in (r.drv.snapshot(), r.dev.snapshot()):
        assert json.loads(json.dumps(snap)) == snap
        assert [row["owner"] for row in snap["descriptors"]] == ["device"] * 3 + ["driver"] * (r.size - 3)
    lines = format_snapshot(r.drv.snapshot()).splitlines()
    assert lines[0].startswith(f"{fmt} driver queue, size {r.size}, in_order, features ")
    assert lines[1] == "indices: " + indices
    assert [row.split()[:2] for row in lines[-r.size:]] == [[str(i), "device" if i < 3 else "driver"]
                                                             for i in range(r.size)]
    r.dev.push_used(chains.id, wlens)
    r.dev.flush()
    assert r.drv.reclaim()[0].tolist() == [0, 1]
    assert all(row["owner"] == "driver" for row in r.drv.snapshot()["descriptors"])


NEED_EVENT_VECTORS = [((0, 1, 0), True), ((0, 2, 1), False), ((9, 10, 0), True), ((10, 10, 0), False),
                      ((65535, 1, 65534), True), ((0, 2, 65535), True), ((65534, 2, 65535), False),
                      ((3, 3, 3), False)]
# qsize 5: 3 descriptors made available at 3, 4 (wrap 1) and 0 (wrap 0): new = 1, old = -2, wrap_at_new = 0
PACKED_EVENT_HITS = {(3, 1), (4, 1), (0, 0)}


@pytest.mark.parametrize("args,expected", NEED_EVENT_VECTORS)
def test_evt18_need_event_vectors(args, expected):
    """EVT-18: virtq_need_event, including across the 16-bit wrap."""
    assert need_event(*args) is expected


@pytest.mark.parametrize("off,wrap", [(o, w) for o in range(5) for w in (0, 1)])
def test_evt23_packed_need_event_vectors(off, wrap):
    """EVT-23: the event offset counts in the lap its wrap bit names."""
    assert packed_need_event(off | wrap << 15, 1, -2, 0, 5) is ((off, wrap) in PACKED_EVENT_HITS)


@pytest.mark.parametrize("event_idx", [True, False])
def test_evt23_kick_and_call_decisions_packed(impl, mem_factory, make_layout, event_idx):
    """EVT-21/23/24: with the driver and device both past slot 3, 4, 0 of a 5-slot ring, kick_prepare and
    call_prepare follow the DESC event (off, wrap); without EVENT_IDX, DESC counts as ENABLE."""
    rng = np.random.default_rng(5)
    bits = (VIRTIO_F_EVENT_IDX,) if event_idx else ()
    for off, wrap in [(o, w) for o in range(5) for w in (0, 1)]:
        r = make_rings(impl, mem_factory, make_layout, "packed", 5, *bits)
        for tokens in ([0, 1, 2], [3, 4, 5]):
            r.add(rng, [1, 1, 1], tokens)
            r.drv.publish()
            chains = r.dev.poll()
            r.dev.push_used(chains.id, [0, 0, 0])
            r.dev.flush()
            if tokens[0] == 0:
                r.drv.reclaim()
                r.drv.kick_prepare()
                r.dev.call_prepare()
        r.device_event[:] = (off | wrap << 15, RING_EVENT_FLAGS_DESC)
        r.driver_event[:] = (off | wrap << 15, RING_EVENT_FLAGS_DESC)
        expected = (off, wrap) in PACKED_EVENT_HITS or not event_idx
        assert r.drv.kick_prepare() is expected, (off, wrap)
        assert r.dev.call_prepare() is expected, (off, wrap)


@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
def test_split_idx_wraps_at_65536(impl, mem_factory, make_layout, in_order):
    """SPLIT-D-11/12, SPLIT-V-12, EVT-07/14 with a 4-entry split ring over > 70000 buffers: avail.idx and
    used.idx wrap 0xffff -> 0, each head sits at avail.ring[idx % 4], used.idx moves by one per buffer, and
    the EVENT_IDX decisions hold across the wrap."""
    rng = np.random.default_rng(4)
    bits = (VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER) if in_order else (VIRTIO_F_EVENT_IDX,)
    r = make_rings(impl, mem_factory, make_layout, "split", 4, *bits, batch=in_order)
    total = 0
    addrs, lens = np.full(4, DATA, np.uint64), np.full(4, 64, np.uint32)
    ones, zeros = np.ones(4, np.uint16), np.zeros(4, np.uint16)
    while total <= 70_000:
        n = int(rng.integers(1, 5))
        old, new = total & 0xFFFF, (total + n) & 0xFFFF
        tokens = np.arange(total, total + n, dtype=np.uint64)
        assert r.drv.add(addrs[:n], lens[:n], zeros[:n], ones[:n], tokens) == n
        r.drv.publish()
        assert r.avail["idx"] == new
        r.used["avail_event"] = avail_event = (old + int(rng.integers(-2, 6))) & 0xFFFF
        assert r.drv.kick_prepare() == (((avail_event - old) & 0xFFFF) < n)  # event in [old, new)
        chains = r.dev.poll()
        assert chains.id.tolist() == [r.avail["ring"][(total + k) % 4] for k in range(n)]
        r.dev.push_used(chains.id, chains.wlen)
        r.dev.flush()
        assert r.used["idx"] == new
        r.avail["used_event"] = used_event = (old + int(rng.integers(-2, 6))) & 0xFFFF
        assert r.dev.call_prepare() == (((used_event - old) & 0xFFFF) < n)
        assert r.drv.reclaim()[0].tolist() == tokens.tolist()
        total += n
    check_indices(r, total, total)
