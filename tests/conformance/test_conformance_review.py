"""Rules a reviewer's mutants broke without a conformance test failing (review-b): packed wrap bits on every
descriptor of a list, the packed DESC-mode event decisions, acquire loads at the consumption points, the fence
after re-enabling notifications, the used WRITE flag, IN_ORDER batch accounting, and the device's refusal of
an avail idx jump and of INDIRECT|NEXT. Asserted on ring memory or the recorded accesses, for both
implementations."""
import pytest

from rings.errors import AvailIdxJump, IndirectWithNext
from rings.layout import (RING_EVENT_FLAGS_DESC, VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC,
                          VIRTQ_DESC_F_AVAIL, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED,
                          VIRTQ_DESC_F_WRITE)

from ring import DATA, SCRATCH, Ring


def complete_all(r, lens=None):
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [0] * ch.n if lens is None else lens(ch))
    r.dev.flush()
    return r.drv.reclaim()


# ---- packed driver: every descriptor of a list carries the wrap of its own slot ----------------

def test_packed_d_02_packed_d_03_every_descriptor_marked_with_its_slots_wrap(impl):
    """PACKED-D-02/03 (PACKED-D-14): each descriptor of a list is made available with AVAIL = the driver wrap
    counter at its own slot and USED = its inverse, also when the list straddles the end of the ring (the
    tail after the end belongs to the next lap)."""
    size = 5
    r = Ring(impl, "packed", size)
    pos = 0   # free-running descriptor position
    straddled = 0
    for shape in [(3, 0), (2, 1), (1, 2), (3, 0), (0, 3), (2, 2), (1, 0)] * 3:
        assert r.add([shape])[0] == 1
        r.drv.publish()
        for k in range(sum(shape)):
            p = pos + k
            slot, wrap = p % size, 1 ^ (p // size & 1)
            f = int(r.desc[slot]["flags"])
            assert bool(f & VIRTQ_DESC_F_AVAIL) == bool(wrap) and bool(f & VIRTQ_DESC_F_USED) != bool(wrap), \
                f"descriptor {k} of the list at {pos % size} (slot {slot}, wrap {wrap}): flags {f:#x}"
        straddled += (pos % size) + sum(shape) > size
        pos += sum(shape)
        complete_all(r)
    assert straddled


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


# ---- consumption points are acquire loads, before what they cover --------------------------------

ACQUIRE = {"c": "A", "reference": "L"}   # the reference model logs every 16-bit load as 'L' (no acquire kind)


def test_split_v_13_mem_08_mem_11_device_acquires_avail_idx_before_the_slots(rec):
    """SPLIT-V-13 / MEM-11 (MEM-08): the device reads avail.idx with an acquire load, before any avail.ring
    slot or descriptor it covers (a relaxed load lets those reads be satisfied before idx on a weak CPU)."""
    r = Ring(rec.mod, "split", 8)
    idx_gpa = r.layout.driver + 2
    desc_gpa, desc_len = r.area("desc")
    for shapes in ([(1, 0)] * 3, [(2, 1), (0, 1)]):
        r.add(shapes)
        r.drv.publish()
        with rec.capture(r.mem) as log:
            ch = r.dev.poll()
        assert ch.n == len(shapes)
        idx = [i for i, a in enumerate(log) if a.load and a.gpa == idx_gpa]
        covered = [i for i, a in enumerate(log) if a.load and (a.within(r.layout.driver + 4, 2 * 8)
                                                                or a.within(desc_gpa, desc_len))]
        assert idx and log[idx[0]].kind == ACQUIRE[rec.name], "avail.idx must be read with an acquire load"
        assert covered and idx[0] < min(covered)
        r.dev.push_used(ch.id, [0] * ch.n)
        r.dev.flush()
        r.drv.reclaim()


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_packed_d_24_mem_08_driver_acquires_the_used_mark_before_id_and_len(rec, fmt):
    """PACKED-D-24 / MEM-08: the driver reads used.idx (split) or a used descriptor's flags (packed) with an
    acquire load before it reads the id and len that mark covers, on its fast path and its general walk."""
    r = Ring(rec.mod, fmt, 8)
    desc_gpa, _ = r.area("desc")
    for shapes in ([(0, 1)] * 3, [(1, 2), (0, 1)]):
        r.add(shapes)
        r.drv.publish()
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [1] * ch.n)
        r.dev.flush()
        with rec.capture(r.mem) as log:
            got, _ = r.drv.reclaim()
        assert len(got) == len(shapes)
        if fmt == "split":
            marks = [i for i, a in enumerate(log) if a.load and a.gpa == r.layout.device + 2]
            bodies = [i for i, a in enumerate(log) if a.load and a.within(r.layout.device + 4, 8 * 8)]
            assert marks and all(log[i].kind == ACQUIRE[rec.name] for i in marks)
            if rec.name == "c":   # the reference model logs 16-bit loads only (not the le32 id/len)
                assert bodies and marks[0] < min(bodies)
        else:
            for i, a in enumerate(log):
                if a.load and a.within(desc_gpa, 16 * 8) and (a.gpa - desc_gpa) % 16 in (8, 12):
                    slot = (a.gpa - desc_gpa) // 16
                    flags = [j for j in range(i) if log[j].load and log[j].gpa == desc_gpa + 16 * slot + 14]
                    assert flags and log[flags[-1]].kind == ACQUIRE[rec.name], f"slot {slot}: id/len read without acquiring flags"


# ---- re-enabling notifications: store, then a full fence (the caller re-checks after it) ----------

@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("event_idx", [False, True], ids=["flags", "event_idx"])
def test_mem_10_mem_09_evt_09_enable_stores_then_fence(rec, fmt, event_idx):
    """MEM-10 (device, kicks) / MEM-09, EVT-09 (driver, calls): re-enabling notifications stores the
    suppression field(s) and then a full fence, so that the re-check of the ring that follows cannot be
    satisfied before the peer can see the enable (else: the peer skips the notification, we sleep)."""
    bits = (VIRTIO_F_EVENT_IDX,) if event_idx else ()
    r = Ring(rec.mod, fmt, 8, *bits)
    for side in ("drv", "dev"):
        q = getattr(r, side)
        enable = q.enable_calls if side == "drv" else q.enable_kicks
        enable(False)
        with rec.capture(r.mem) as log:
            enable(True)
        stores = [i for i, a in enumerate(log) if a.store]
        fences = [i for i, a in enumerate(log) if a.fence]
        assert stores, side
        assert fences and max(fences) > max(stores), f"{side}: no fence after the enabling store"


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
