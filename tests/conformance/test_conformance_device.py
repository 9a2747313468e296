"""Device MUSTs of the split and packed rings (SPLIT-V-*, PACKED-V-*, INORDER-02) and the driver's packed used
detection (PACKED-D-24), asserted on ring memory and on what the device reports, for the C engine and the
reference model. The peer is hand-written where the rule is about what a device must tolerate."""
import pytest

from rings.errors import AvailIdxJump, IndirectWithNext, UsageError
from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT,
                          VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, packed_desc_dtype,
                          split_desc_dtype)

from ring import BUF, DATA, SCRATCH, TABLES, Ring

PAYLOAD = bytes(range(1, 41))   # 40 bytes


def gather(r, ch, i):
    return b"".join(r.read(a, n) for a, n, _ in ch.segments(i))


def add_framed(r, pieces, base_slot=0):
    """One readable buffer whose payload PAYLOAD is cut into pieces of the given lengths (one segment each)."""
    addrs, off = [], 0
    for k, n in enumerate(pieces):
        addrs.append(DATA + BUF * (base_slot + k))
        r.write(addrs[-1], PAYLOAD[off:off + n])
        off += n
    assert off == len(PAYLOAD)
    r.token += 1
    return r.drv.add(addrs, pieces, [len(pieces)], [0], [r.token])


def complete_all(r):
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [0] * ch.n)
    r.dev.flush()
    r.drv.reclaim()
    return ch


# ---- what the device reads ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_v_01_any_arrangement_of_descriptors(impl, fmt):
    """SPLIT-V-01 (and its packed twin): the same 40-byte request framed as 1 descriptor, as 2 split inside
    a field, as 40 one-byte descriptors, and through an indirect table, reaches the device as the same bytes."""
    r = Ring(impl, fmt, 64, VIRTIO_F_INDIRECT_DESC, indirect=4)
    for pieces in ([40], [5, 35], [1] * 40, [10, 10, 10, 10]):   # the last one goes indirect
        assert add_framed(r, pieces) == 1
        r.drv.publish()
        ch = complete_all(r)
        assert ch.n == 1 and gather(r, ch, 0) == PAYLOAD and ch.rlen[0] == 40 and ch.wlen[0] == 0


def test_split_v_01_split_v_06_chain_then_indirect(impl):
    """SPLIT-V-06: zero or more chained descriptors followed by one INDIRECT descriptor: [R 10] -> [R 5] ->
    [INDIRECT -> {R 25, W 64}], and a bare INDIRECT head; the device takes them in order (SPLIT-V-01)."""
    r = Ring(impl, "split", 8, VIRTIO_F_INDIRECT_DESC, driver=False)
    r.write(DATA, PAYLOAD)
    t = r.table(SCRATCH, 32, split_desc_dtype)
    t[0] = (DATA + 15, 25, VIRTQ_DESC_F_NEXT, 1)
    t[1] = (DATA + 1024, 64, VIRTQ_DESC_F_WRITE, 0)
    r.desc[0] = (DATA, 10, VIRTQ_DESC_F_NEXT, 5)
    r.desc[5] = (DATA + 10, 5, VIRTQ_DESC_F_NEXT, 2)
    r.desc[2] = (SCRATCH, 32, VIRTQ_DESC_F_INDIRECT, 0)
    r.desc[3] = (SCRATCH, 32, VIRTQ_DESC_F_INDIRECT, 0)   # a bare INDIRECT head
    r.avail["ring"][:2] = (0, 3)
    r.avail["idx"] = 2
    ch = r.dev.poll()
    assert ch.n == 2 and ch.id.tolist() == [0, 3] and ch.ndesc.tolist() == [3, 1]
    assert ch.segments(0) == [(DATA, 10, 0), (DATA + 10, 5, 0), (DATA + 15, 25, 0), (DATA + 1024, 64, 1)]
    assert ch.segments(1) == [(DATA + 15, 25, 0), (DATA + 1024, 64, 1)]
    assert gather(r, ch, 0)[:40] == PAYLOAD and (ch.rlen[0], ch.wlen[0]) == (40, 64)
    r.dev.push_used([0, 3], [64, 7])
    r.dev.flush()
    assert r.used["idx"] == 2 and [tuple(e) for e in r.used["ring"][:2]] == [(0, 64), (3, 7)]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_v_05_packed_v_14_write_flag_on_indirect_descriptor_ignored(impl, fmt):
    """SPLIT-V-05 (PACKED-V-14): INDIRECT|WRITE on the descriptor that points to a table: the device ignores
    that WRITE, takes the readable entries as readable, and never writes the table."""
    r = Ring(impl, fmt, 8, VIRTIO_F_INDIRECT_DESC, driver=False)
    dtype = split_desc_dtype if fmt == "split" else packed_desc_dtype
    t = r.table(SCRATCH, 32, dtype)
    if fmt == "split":
        t[0], t[1] = (DATA, 64, VIRTQ_DESC_F_NEXT, 1), (DATA + 64, 64, 0, 0)
        r.desc[0] = (SCRATCH, 32, VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_WRITE, 0)
        r.avail["idx"] = 1
    else:
        t[0], t[1] = (DATA, 64, 0, 0), (DATA + 64, 64, 0, 0)
        r.desc[0] = (SCRATCH, 32, 0, VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_AVAIL)
    table = r.read(SCRATCH, 32)
    ch = r.dev.poll()
    assert ch.n == 1 and ch.segments(0) == [(DATA, 64, 0), (DATA + 64, 64, 0)]
    r.dev.push_used(ch.id, [0])
    r.dev.flush()
    assert r.read(SCRATCH, 32) == table


def test_split_v_02_split_v_04_packed_v_03_device_writes_only_used_entries(rec):
    """SPLIT-V-02 / SPLIT-V-04 / PACKED-V-03: over polls, completions (with partial lengths), flushes and
    suppression changes, every store the device makes lands in the used ring (split) or on the len/id/flags
    of a descriptor it hands back (packed), or in its own suppression field; the descriptor table, indirect
    tables, readable buffers and the driver area are never written."""
    for fmt in ("split", "packed"):
        r = Ring(rec.mod, fmt, 16, VIRTIO_F_INDIRECT_DESC, indirect=4)
        shapes = [(1, 0), (0, 1), (2, 1), (1, 3), (3, 0), (0, 2)]
        assert r.add(shapes)[0] == len(shapes)
        r.drv.publish()
        desc_gpa, desc_len = r.area("desc")
        drv_gpa, drv_len = r.area("driver")
        dev_gpa, dev_len = r.area("device")
        watched = [(desc_gpa, desc_len), (drv_gpa, drv_len), (TABLES, 16 * 16 * 4), (DATA, 512 * BUF)]
        before = [r.read(a, n) for a, n in watched]
        with rec.capture(r.mem) as log:
            r.dev.enable_kicks(False)
            ch = r.dev.poll()
            r.dev.push_used(ch.id[::-1], [w // 2 for w in ch.wlen[::-1]])
            r.dev.flush()
            r.dev.call_prepare()
            r.dev.enable_kicks(True)
        stores = [a for a in log if a.store]
        assert stores
        for a in stores:
            if a.within(dev_gpa, dev_len):
                continue
            assert fmt == "packed" and a.within(desc_gpa, desc_len), f"device store outside its area: {a}"
            assert (a.gpa - desc_gpa) % 16 >= 8, f"device store to a used descriptor's addr: {a}"
        after = [r.read(a, n) for a, n in watched]
        if fmt == "split":
            assert after == before
        else:   # only len/id/flags of the slots the device handed back changed
            assert after[1:] == before[1:]
            changed = {i // 16 for i in range(desc_len) if after[0][i] != before[0][i]}
            assert changed <= {(a.gpa - desc_gpa) // 16 for a in stores if a.within(desc_gpa, desc_len)}


def _pattern(n):
    return bytes((7 * k + 3) & 0xFF or 1 for k in range(n))


@pytest.mark.parametrize("batch", [False, True], ids=["per_buffer", "in_order_batch"])
@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_v_09_mem_07_data_written_before_used_is_published(rec, fmt, batch):
    """SPLIT-V-09 / MEM-07: at the instant used.idx (split) or a used flags write (packed) is made, every
    buffer the driver may then consider used holds the bytes it may then read: the entry's len for a named
    buffer, the whole writable size for one an IN_ORDER batch skips (INORDER-10). The device model writes
    each buffer (across descriptor boundaries) before push_used; the engine must not publish ahead of that."""
    bits = (VIRTIO_F_IN_ORDER,) if batch else ()
    r = Ring(rec.mod, fmt, 16, *bits, batch=batch)
    shapes = [(0, 2)] * 6
    assert r.add(shapes)[0] == 6
    r.drv.publish()
    ch = r.dev.poll()
    wlens = ch.wlen.tolist()
    written = [wlens[0], 7, wlens[2], wlens[3], 15, wlens[5]]   # buffers 1 and 4 are partly written
    for i in range(ch.n):   # poison: a byte the device did not write is 0xaa
        for a, k, w in ch.segments(i):
            r.write(a, b"\xaa" * k)
    dev_gpa, _ = r.area("device")
    pending = list(zip(ch.id.tolist(), ch.ndesc.tolist(), [ch.segments(i) for i in range(ch.n)], wlens))
    cursor = {"split": 0, "packed": 0}
    checked = []

    def writable_bytes(segs, n):
        data = b"".join(r.read(a, k) for a, k, w in segs if w)
        return data[:n]

    def covered(id, length):
        """Buffers an entry naming id completes, with the bytes the driver may read from each."""
        if not batch:
            k = next(i for i, p in enumerate(pending) if p[0] == id)
            return [(pending.pop(k), length)]
        out = []
        while True:
            p = pending.pop(0)
            out.append((p, length if p[0] == id else p[3]))
            if p[0] == id:
                return out

    def hook(a):
        if a.kind != "R":
            return
        if fmt == "split":
            assert a.gpa == dev_gpa + 2
            while cursor["split"] != a.value:
                e = r.used["ring"][cursor["split"] % r.size]
                bufs = covered(int(e["id"]), int(e["len"]))
                cursor["split"] += len(bufs)
                checked.extend(bufs)
        else:
            pos = cursor["packed"]
            while r.packed_used(pos % r.size, 1 ^ (pos // r.size & 1)):
                d = r.desc[pos % r.size]
                bufs = covered(int(d["id"]), int(d["len"]))
                cursor["packed"] += sum(p[1] for p, _ in bufs)
                checked.extend(bufs)
                pos = cursor["packed"]
        for (id, _, segs, wlen), n in checked:
            assert writable_bytes(segs, n) == _pattern(n), f"buffer {id}: {n} bytes published, not all written"

    with rec.capture(r.mem, hook=hook):
        for i in range(ch.n):   # the device model: data first, then push_used; one flush
            data, off = _pattern(written[i]), 0
            for a, k, w in pending[i][2]:   # across descriptor boundaries, from the first writable one
                r.write(a, data[off:off + k])
                off += k
                if off >= len(data):
                    break
        r.dev.push_used(ch.id, written)
        r.dev.flush()
    assert len(checked) == 6 and not pending


# ---- packed availability, order, ids -----------------------------------------------------------

def test_packed_v_04_zero_ring_and_stale_slots_not_available(impl):
    """PACKED-V-04 (PACKED-V-18): on the zero-initialised ring nothing is available, kicks or not; next lap,
    descriptors left from the last lap (AVAIL=1, USED=0: available for wrap 1, not for wrap 0) are not
    taken again."""
    size = 4
    r = Ring(impl, "packed", size)
    r.dev.enable_kicks(True)
    assert r.dev.poll().n == 0 and r.dev.poll().n == 0
    r.add([(3, 0), (1, 0)])   # slots 0-2 and 3; used descriptors land at 0 and 3
    r.drv.publish()
    assert complete_all(r).n == 2
    assert r.packed_avail(1, 1) and r.packed_avail(2, 1)   # stale, from lap 1
    assert r.add([(1, 0)])[0] == 1   # lap 2: slot 0, wrap 0
    r.drv.publish()
    assert r.dev.poll().n == 1
    assert r.dev.poll().n == 0, "a descriptor of the last lap was taken as available"
    assert r.dev.snapshot()["indices"]["last_avail"] == 1


def test_packed_v_04_stale_one_descriptor_slots_of_a_batch_not_available(impl):
    """PACKED-V-04 (PACKED-V-18) for one-descriptor buffers: an IN_ORDER batch of four comes back as one used
    descriptor at slot 0, so slots 1-3 keep last lap's flags (AVAIL=1, USED=0: available for wrap 1 only).
    Next lap, one buffer at slot 0 is available, and nothing after it."""
    size = 4
    r = Ring(impl, "packed", size, VIRTIO_F_IN_ORDER, batch=True)
    assert r.add([(0, 1)] * size)[0] == size
    r.drv.publish()
    ch = r.dev.poll()
    assert ch.n == size
    r.dev.push_used(ch.id, ch.wlen)   # all written in full: one batch, one used descriptor
    r.dev.flush()
    assert len(r.drv.reclaim()[0]) == size
    assert all(r.packed_avail(slot, 1) for slot in (1, 2, 3))   # stale, from lap 1
    assert r.add([(0, 1)])[0] == 1   # lap 2: slot 0, wrap 0
    r.drv.publish()
    assert r.dev.poll().n == 1
    assert r.dev.poll().n == 0, "a descriptor of the last lap was taken as available"
    assert r.dev.snapshot()["indices"]["last_avail"] == 1


def test_packed_d_24_zero_ring_and_stale_used_not_taken_as_used(impl):
    """PACKED-D-24: the driver takes a slot as used only if AVAIL == USED == its used wrap counter. Buffers
    added but not yet published sit on a zero slot (lap 1) and on a slot still holding last lap's used
    descriptor (AVAIL = USED = 1, lap 2): neither is a completion."""
    size = 4
    r = Ring(impl, "packed", size)
    assert r.add([(1, 0), (1, 0)])[0] == 2   # not published: slot 0's flags are still zero
    assert int(r.desc[0]["flags"]) == 0
    assert len(r.drv.reclaim()[0]) == 0 and r.drv.broken is None
    r.drv.publish()
    assert complete_all(r).n == 2
    r.add([(1, 0), (1, 0)])
    r.drv.publish()
    assert complete_all(r).n == 2   # slots 0..3 used in lap 1; slot 0 and 1: AVAIL = USED = 1
    assert r.packed_used(0, 1)
    assert r.add([(1, 0)])[0] == 1   # lap 2, not published: slot 0 keeps last lap's used flags
    assert len(r.drv.reclaim()[0]) == 0 and r.drv.broken is None
    r.drv.publish()
    assert complete_all(r).n == 1


def test_packed_v_06_processing_starts_in_ring_order(impl):
    """PACKED-V-06: lists are taken in the order they appear in the ring, whatever their buffer ids (ids
    come back to the free list in completion order, so they are not in slot order in the second lap)."""
    r = Ring(impl, "packed", 8)
    for completion in ([2, 0, 3, 1], [4, 5, 6, 7]):   # free list afterwards: 2, 0, 3, 1, 4, 5, 6, 7
        r.add([(1, 0)] * 4)
        r.drv.publish()
        r.dev.poll()
        r.dev.push_used(completion, [0] * 4)
        r.dev.flush()
        assert len(r.drv.reclaim()[0]) == 4
    r.add([(2, 0), (1, 0), (3, 0), (1, 0)])
    r.drv.publish()
    slot, expected = 0, []
    for _ in range(4):
        walk = r.walk_packed(slot)
        expected.append(walk[-1][3])   # the last descriptor's id (PACKED-V-10)
        slot = (slot + len(walk)) % 8
    ch = r.dev.poll()
    assert ch.id.tolist() == expected and expected != sorted(expected)
    assert ch.ndesc.tolist() == [2, 1, 3, 1]


def test_packed_v_07_used_written_in_completion_order(impl):
    """PACKED-V-07 (PACKED-V-09/11): completions B, A, C land in that order at consecutive used positions,
    each advancing by the length of the list just used, whatever slots the lists started at."""
    r = Ring(impl, "packed", 8)
    r.add([(3, 0), (1, 1), (2, 0)])   # A at 0-2, B at 3-4, C at 5-6
    r.drv.publish()
    ch = r.dev.poll()
    a, b, c = ch.id.tolist()
    r.dev.push_used([b, a, c], [0, 0, 0])
    r.dev.flush()
    assert [(int(r.desc[s]["id"]), r.packed_used(s, 1)) for s in (0, 2, 5)] == [(b, True), (a, True), (c, True)]
    assert not any(r.packed_used(s, 1) for s in (1, 3, 4, 6, 7))


def test_packed_v_08_list_used_in_ring_order_across_the_end(impl):
    """PACKED-V-08: a 3-descriptor list at slots 4, 0, 1 of a 5-slot ring: its segments in ring order."""
    r = Ring(impl, "packed", 5)
    r.add([(3, 0), (1, 0)])
    r.drv.publish()
    complete_all(r)
    assert add_framed(r, [7, 13, 20], base_slot=10) == 1
    r.drv.publish()
    assert [w[4][1] for w in r.walk_packed(4)] == [4, 0, 1]
    ch = r.dev.poll()
    assert ch.n == 1 and gather(r, ch, 0) == PAYLOAD
    assert [a for a, _, _ in ch.segments(0)] == [DATA + BUF * k for k in (10, 11, 12)]


def test_packed_v_10_buffer_id_is_last_descriptors(impl):
    """PACKED-V-10: the device returns the buffer id of the *last* descriptor of each list; the others carry
    garbage (in range or not) here, as a driver following the spec example may leave them."""
    r = Ring(impl, "packed", 16)
    r.add([(3, 0), (1, 2), (1, 0), (2, 0)])   # not published yet: rewrite the non-last ids first
    heads = [0, 3, 6, 7]
    ids = [int(r.desc[h + n - 1]["id"]) for h, n in zip(heads, (3, 3, 1, 2))]
    r.desc[0]["id"], r.desc[1]["id"] = 0xFFFF, ids[1]
    r.desc[3]["id"], r.desc[4]["id"] = 0x7FFF, ids[0]
    r.desc[7]["id"] = 5
    r.drv.publish()
    ch = r.dev.poll()
    assert ch.id.tolist() == ids and ch.ndesc.tolist() == [3, 3, 1, 2]
    r.dev.push_used(ch.id, [0] * 4)
    r.dev.flush()
    assert sorted(r.drv.reclaim()[0].tolist()) == [0, 1, 2, 3]


# ---- IN_ORDER ----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [False, True], ids=["per_buffer", "in_order_batch"])
@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_inorder_02_used_in_the_order_made_available(impl, fmt, batch):
    """INORDER-02: with IN_ORDER the device uses buffers in avail order: a completion out of that order is
    refused before anything reaches the ring, and what is published names the buffers in avail order."""
    r = Ring(impl, fmt, 8, VIRTIO_F_IN_ORDER, batch=batch)
    r.add([(0, 1), (0, 2), (0, 1), (0, 1)])
    r.drv.publish()
    ch = r.dev.poll()
    ids = ch.id.tolist()
    before = bytes(r.buf)
    with pytest.raises(UsageError):
        r.dev.push_used([ids[1]], [1])
    with pytest.raises(UsageError):
        r.dev.push_used([ids[2]], [1])
    r.dev.flush()
    assert bytes(r.buf) == before
    r.dev.push_used(ids, ch.wlen)
    r.dev.flush()
    got, _ = r.drv.reclaim()
    assert got.tolist() == sorted(got.tolist())
    if fmt == "split":
        named = [int(e["id"]) for e in r.used["ring"][:4]]
        assert named == ([ids[3], 0, 0, 0] if batch else ids)   # batched: one entry, at slot 0 (INORDER-08)
        assert r.used["idx"] == 4
    else:
        named = [int(r.desc[s]["id"]) for s in range(5) if r.packed_used(s, 1)]
        assert named == ([ids[3]] if batch else ids)


# ---- the used WRITE flag (packed) ---------------------------------------------------------------

def test_packed_v_12_used_write_flag_says_whether_data_was_written(impl):
    """PACKED-V-12 (PACKED-D-17): a used descriptor has WRITE set when the device wrote data (len > 0: len
    is then meaningful) and clear when it wrote nothing (Tx); per buffer and in IN_ORDER batches."""
    for bits, batch in (((), False), ((VIRTIO_F_IN_ORDER,), True)):
        r = Ring(impl, "packed", 8, *bits, batch=batch)
        shapes = [(1, 0), (0, 1), (0, 2)] + ([] if batch else [(1, 0)])   # a batch ends with an Rx buffer
        r.add(shapes)
        r.drv.publish()
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [int(w) for w in ch.wlen])   # Rx buffers written in full, Tx ones 0
        r.dev.flush()
        kinds = set()
        for slot in range(8):
            if r.packed_used(slot, 1):
                f, written = int(r.desc[slot]["flags"]), int(r.desc[slot]["len"])
                assert bool(f & VIRTQ_DESC_F_WRITE) == (written > 0), (slot, hex(f), written)
                kinds.add(written > 0)
        assert kinds == ({True} if batch else {True, False})
        tokens, got = r.drv.reclaim()
        assert len(tokens) == len(shapes)


# ---- IN_ORDER accounting ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_inorder_10_skipped_buffers_reported_fully_written(impl, fmt):
    """INORDER-10: one used entry for an IN_ORDER batch stands for the buffers before it too; the driver
    reports each skipped buffer with its whole writable size, and the named one with the entry's len."""
    r = Ring(impl, fmt, 8, VIRTIO_F_IN_ORDER, batch=True)
    n, tokens = r.add([(0, 1), (0, 2), (0, 1), (0, 1)], lens=[64, 32, 32, 100, 50])
    r.drv.publish()
    ch = r.dev.poll()
    wl = [int(w) for w in ch.wlen]
    assert wl == [64, 64, 100, 50]
    r.dev.push_used(ch.id, wl[:3] + [7])   # all full but the last: one batch entry
    r.dev.flush()
    if fmt == "split":
        assert int(r.used["idx"]) == 4 and int(r.used["ring"][0]["id"]) == int(ch.id[3])
    got_tokens, got_lens = r.drv.reclaim()
    assert got_tokens.tolist() == tokens and got_lens.tolist() == [64, 64, 100, 7]


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_inorder_15_no_batching_without_in_order(impl, fmt):
    """INORDER-15: without IN_ORDER there is one used entry per buffer even when the device was asked to batch
    (batching is only defined for IN_ORDER): used.idx moves by one per buffer, every id appears once."""
    r = Ring(impl, fmt, 8, batch=True)
    r.add([(0, 1)] * 4)
    r.drv.publish()
    ch = r.dev.poll()
    r.dev.push_used(ch.id, ch.wlen)
    r.dev.flush()
    if fmt == "split":
        assert int(r.used["idx"]) == 4
        assert sorted(int(e["id"]) for e in r.used["ring"][:4]) == sorted(ch.id.tolist())
    else:
        assert sum(r.packed_used(s, 1) for s in range(4)) == 4
    assert len(r.drv.reclaim()[0]) == 4


# ---- device robustness (SPLIT-V-14): hostile indices and flags ----------------------------------

def test_split_v_13_split_v_14_avail_idx_more_than_a_ring_ahead_refused(impl):
    """SPLIT-V-13 / SPLIT-V-14: an avail.idx more than QS ahead of the device's position breaks the queue
    with AvailIdxJump; nothing is consumed, nothing written."""
    r = Ring(impl, "split", 8, driver=False)
    for k in range(8):
        r.desc[k] = (DATA + 256 * k, 64, 0, 0)
        r.avail["ring"][k] = k
    r.avail["idx"] = 9
    before = bytes(r.buf)
    with pytest.raises(AvailIdxJump):
        r.dev.poll()
    assert bytes(r.buf) == before


def test_split_v_14_split_d_08_indirect_with_next_refused(impl):
    """SPLIT-V-14 (SPLIT-D-08 broken by the driver): a descriptor with INDIRECT and NEXT is refused with
    IndirectWithNext, not followed."""
    r = Ring(impl, "split", 8, VIRTIO_F_INDIRECT_DESC, driver=False)
    t = r.table(SCRATCH, 16, __import__("rings.layout", fromlist=["split_desc_dtype"]).split_desc_dtype)
    t[0] = (DATA, 64, 0, 0)
    r.desc[0] = (SCRATCH, 16, VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_NEXT, 1)
    r.desc[1] = (DATA + 256, 64, 0, 0)
    r.avail["ring"][0] = 0
    r.avail["idx"] = 1
    with pytest.raises(IndirectWithNext):
        r.dev.poll()
