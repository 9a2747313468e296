"""Write order (MEM-*, SPLIT-D-10, SPLIT-V-08, PACKED-D-04/05/12/22, PACKED-V-05/16, EVT-25), asserted on the
recorded sequence of ring accesses of both implementations (recording.py): what a peer on another CPU could see
between any two stores, which a single-threaded run and x86 would hide."""
import pytest

from rings.layout import VIRTIO_F_EVENT_IDX, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC

from ring import BUF, DATA, TABLES, Ring

SHAPES = [(1, 0), (0, 1), (2, 1), (1, 3), (3, 0), (0, 2), (2, 2), (1, 1)]   # (readable, writable)


def index_of_last(log, pred):
    return max(i for i, a in enumerate(log) if pred(a))


def slot_of(r, a):
    desc, n = r.area("desc")
    return (a.gpa - desc) // 16 if a.within(desc, n) else None


# ---- split driver --------------------------------------------------------------------------------

@pytest.mark.parametrize("indirect", [False, True], ids=["direct", "indirect"])
def test_mem_02_split_d_18_descriptors_and_ring_before_avail_idx(rec, indirect):
    """MEM-02 / MEM-01 / SPLIT-D-18: 8 chains added as one batch are published by a single store to avail.idx,
    a release store, made after every descriptor, indirect table and avail.ring store of the batch."""
    bits = (VIRTIO_F_INDIRECT_DESC,) if indirect else ()
    r = Ring(rec.mod, "split", 32, *bits, indirect=4 if indirect else None)
    idx_gpa = r.layout.driver + 2
    for _round in range(3):
        with rec.capture(r.mem) as log:
            assert r.add(SHAPES)[0] == 8
            r.drv.publish()
        publishing = [i for i, a in enumerate(log) if a.store and a.gpa == idx_gpa]
        assert len(publishing) == 1, "one avail.idx store per batch"
        p = publishing[0]
        assert log[p].kind == "R", "avail.idx must be published with a release store"
        assert p == index_of_last(log, lambda a: a.store), "a store after avail.idx was published"
        ring_stores = [a for a in log if a.store and a.within(r.layout.driver + 4, 2 * 32)]
        assert 0 < len(ring_stores) <= 8   # an entry already holding its head is not stored again (below)
        if indirect:
            assert any(a.within(TABLES, 32 * 4 * 16) for a in log[:p])
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [0] * ch.n)
        r.dev.flush()
        r.drv.reclaim()


@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
def test_split_d_18_mem_02_avail_ring_entry_stored_only_when_it_changes(rec, in_order):
    """SPLIT-D-18 / MEM-02: each avail.ring entry of a batch holds its head before avail.idx is published: stored
    there, unless it held that head already (then left alone, so that its line stays shared with the device).
    Slots holding anything else are written; lap after lap of in-order one-descriptor buffers the heads come
    back to their slots, and the ring is not stored to at all."""
    bits = (VIRTIO_F_IN_ORDER,) if in_order else ()
    r = Ring(rec.mod, "split", 8, *bits, fill=0xEE)   # every entry starts as 0xEEEE: no head
    ring_gpa, idx_gpa = r.layout.driver + 4, r.layout.driver + 2
    for lap in range(4):
        with rec.capture(r.mem) as log:
            assert r.add([(1, 0)] * 8, base_slot=8 * lap)[0] == 8
            r.drv.publish()
        stores = [i for i, a in enumerate(log) if a.store and a.within(ring_gpa, 2 * 8)]
        p = [i for i, a in enumerate(log) if a.store and a.gpa == idx_gpa]
        assert len(p) == 1 and all(i < p[0] for i in stores)
        heads = r.published_heads_split(8 * lap)
        assert sorted(heads) == list(range(8))
        for h in heads:
            assert [s[0] for s in r.walk_split(h)] == [DATA + BUF * (8 * lap + heads.index(h))]
        if lap == 0:
            assert len(stores) == 8
        elif in_order:
            assert stores == [] and heads == list(range(8))
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [0] * ch.n)
        r.dev.flush()
        assert len(r.drv.reclaim()[0]) == 8


def test_split_d_10_avail_idx_never_decreases(rec):
    """SPLIT-D-10 (SPLIT-D-12): over batches of 0..4 buffers through a 4-entry ring for many laps, every store
    to avail.idx moves it forward by the number of heads added since the last one (0..QS), never back."""
    r = Ring(rec.mod, "split", 4)
    idx_gpa = r.layout.driver + 2
    last, added = 0, 0
    with rec.capture(r.mem) as log:
        for k in range(60):
            n = k % 5
            got = r.add([(0, 1)] * n)[0] if n else 0
            r.drv.publish()
            added += got
            ch = r.dev.poll()
            r.dev.push_used(ch.id, [0] * ch.n)
            r.dev.flush()
            r.drv.reclaim()
    values = [a.value for a in log if a.store and a.gpa == idx_gpa]
    assert values
    for v in values:
        step = (v - last) & 0xFFFF
        assert 0 <= step <= 4, f"avail.idx went from {last} to {v}"
        last = v
    assert last == added & 0xFFFF


def test_mem_03_split_publish_then_fence_then_suppression_read(rec):
    """MEM-03: the driver's avail.idx store comes before its read of used.flags (or avail_event with
    EVENT_IDX), with a full fence between them; a device that clears NO_NOTIFY between publish and
    kick_prepare (its own stores and fence are left out of the driver's log) gets its kick."""
    for bits, field in (((), 0), ((VIRTIO_F_EVENT_IDX,), 4 + 8 * 8)):
        r = Ring(rec.mod, "split", 8, *bits)
        r.dev.enable_kicks(False)
        with rec.capture(r.mem) as published:
            r.add([(1, 0)])
            r.drv.publish()
        r.dev.enable_kicks(True)   # the device changes its mind right after the publication
        with rec.capture(r.mem) as log:
            kick = r.drv.kick_prepare()
        assert kick is True
        assert published[-1].kind == "R" and published[-1].gpa == r.layout.driver + 2
        reads = [i for i, a in enumerate(log) if a.load and a.gpa == r.layout.device + field]
        assert reads and any(a.fence for a in log[:reads[0]]), "no fence between publish and read"


# ---- packed driver -------------------------------------------------------------------------------

@pytest.mark.parametrize("indirect", [False, True], ids=["direct", "indirect"])
def test_packed_d_12_packed_d_22_mem_04_bodies_then_flags_head_last(rec, indirect):
    """PACKED-D-22 / MEM-04: each descriptor's addr, len and id (and its indirect table) are stored before its
    flags; PACKED-D-12 / MEM-06: each list's head flags after every other store of the list; the batch's first
    head flags are the last store, a release store. Over batches that wrap the ring."""
    bits = (VIRTIO_F_INDIRECT_DESC,) if indirect else ()
    r = Ring(rec.mod, "packed", 13, *bits, indirect=4 if indirect else None)
    for _round in range(4):
        pos = r.drv.snapshot()["indices"]["next_avail"]
        with rec.capture(r.mem) as log:
            n = r.add(SHAPES[:5])[0]
            r.drv.publish()
        stores = [(i, a) for i, a in enumerate(log) if a.store]
        by_slot = {}
        for i, a in stores:
            s = slot_of(r, a)
            if s is not None:
                by_slot.setdefault(s, []).append((i, a))
        flag_store = {s: [i for i, a in acc if (a.gpa - r.layout.desc) % 16 == 14] for s, acc in by_slot.items()}
        for s, acc in by_slot.items():   # body, then one flags store, nothing after it
            assert len(flag_store[s]) == 1, f"slot {s}: {len(flag_store[s])} flags stores"
            assert acc[-1][0] == flag_store[s][0], f"slot {s}: stored after its flags"
        table_stores = [i for i, a in stores if a.within(TABLES, 13 * 4 * 16)]
        assert bool(table_stores) == indirect
        slot = pos
        first_head = None
        for _ in range(n):
            walk = r.walk_packed(slot)
            slots = [w[4][1] for w in walk if w[4][0] == "ring"]
            head_flags = flag_store[slots[0]][0]
            first_head = head_flags if first_head is None else first_head
            table = (walk[0][0], walk[0][1]) if len(walk) > len(slots) else (0, 0)   # an indirect list's table
            others = [i for s in slots[1:] for i, _ in by_slot[s]] + \
                [i for i in table_stores if log[i].within(*table)]
            assert all(i < head_flags for i in others), f"list at {slots[0]}: head made available before the rest"
            slot = (slot + len(slots)) % 13
        assert log[first_head].kind == "R" and first_head == stores[-1][0]
        ch = r.dev.poll()
        assert ch.n == n
        r.dev.push_used(ch.id, [0] * n)
        r.dev.flush()
        r.drv.reclaim()


@pytest.mark.parametrize("writable", [False, True], ids=["readable", "writable"])
def test_packed_d_12_packed_d_22_one_descriptor_buffers_head_last(rec, writable):
    """The same rules for one-descriptor buffers added with add_simple (the C engine's fast path): per slot the
    body, then one flags store; the batch's first head flags are the last store, a release store. Over batches
    that wrap the ring."""
    r = Ring(rec.mod, "packed", 13)
    for rnd in range(4):
        pos = r.drv.snapshot()["indices"]["next_avail"]
        n = 5
        with rec.capture(r.mem) as log:
            assert r.drv.add_simple([DATA + BUF * k for k in range(n)], [64] * n,
                                    list(range(rnd * n, rnd * n + n)), writable=writable) == n
            r.drv.publish()
        stores = [(i, a) for i, a in enumerate(log) if a.store]
        for k in range(n):
            slot = (pos + k) % 13
            acc = [(i, a) for i, a in stores if slot_of(r, a) == slot]
            flags = [i for i, a in acc if (a.gpa - r.layout.desc) % 16 == 14]
            assert len(flags) == 1 and acc[-1][0] == flags[0], f"slot {slot}: stored after its flags"
        last = stores[-1][1]
        assert slot_of(r, last) == pos and (last.gpa - r.layout.desc) % 16 == 14 and last.kind == "R", \
            "the batch's first head was made available before the rest of the batch"
        ch = r.dev.poll()
        assert ch.n == n
        r.dev.push_used(ch.id, [0] * n)
        r.dev.flush()
        r.drv.reclaim()


@pytest.mark.parametrize("in_order", [False, True], ids=["normal", "in_order"])
def test_packed_d_04_packed_d_05_no_store_to_device_owned_descriptors(rec, in_order):
    """PACKED-D-04 / PACKED-D-05: the driver stores nothing to a slot it has made available (flags stored)
    until the used descriptor that covers it has been taken: the slots between its used cursor and its avail
    cursor stay untouched, over rounds that fill the ring, keep buffers in flight, complete out of order and
    wrap; and within a round nothing is stored to a slot after its flags."""
    bits = (VIRTIO_F_IN_ORDER,) if in_order else ()
    size = 7
    r = Ring(rec.mod, "packed", size, *bits, batch=in_order)
    ndesc_of, inflight = {}, []
    published = reclaimed = 0   # free-running descriptor positions
    for k in range(14):
        shapes = [(1, 1), (1, 0), (0, 2), (1, 0)][k % 3:]
        owned = {p % size for p in range(reclaimed, published)}
        with rec.capture(r.mem) as log:
            n, tokens = r.add(shapes)
            r.drv.publish()
        flagged = set()
        for a in log:
            s = slot_of(r, a)
            if not a.store or s is None:
                continue
            assert s not in owned, f"round {k}: store to slot {s}, which the device owns"
            assert s not in flagged, f"round {k}: store to slot {s} after its flags"
            if (a.gpa - r.layout.desc) % 16 == 14:
                flagged.add(s)
        for t, shape in zip(tokens, shapes):
            ndesc_of[t] = sum(shape)
        published += sum(ndesc_of[t] for t in tokens)
        inflight += r.dev.poll().id.tolist()
        m = (len(inflight) + 1) // 2   # complete half, keep the rest in flight for a round
        done, inflight = inflight[:m], inflight[m:]
        order = done if in_order else done[::-1]
        r.dev.push_used(order, [0] * len(order))
        r.dev.flush()
        got, _ = r.drv.reclaim()
        reclaimed += sum(ndesc_of[t] for t in got.tolist())
    assert published > 3 * size


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_packed_d_04_packed_d_05_publish_with_nothing_added_stores_nothing(rec, fmt):
    """PACKED-D-04 / PACKED-D-05: a publish with nothing added since the last one stores nothing. The batch's
    first head flags written again would land in a slot the device has since used: that buffer available a
    second time, its completion hidden. Split: avail.idx is not stored again (the same count, kept for both)."""
    r = Ring(rec.mod, fmt, 8)
    r.add([(1, 0), (1, 0)])
    r.drv.publish()
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [0] * ch.n)
    r.dev.flush()
    with rec.capture(r.mem) as log:
        r.drv.publish()
    assert [a for a in log if a.store] == []
    assert len(r.drv.reclaim()[0]) == 2 and r.dev.poll().n == 0


def test_evt_25_mem_05_packed_publish_then_fence_then_event_read(rec):
    """EVT-25 / MEM-05: the packed driver's publishing flags store comes before its read of the Device Event
    Suppression structure, with a full fence between; a device that flips DISABLE -> ENABLE between the two
    (its own stores and fence are left out of the driver's log) gets its kick."""
    r = Ring(rec.mod, "packed", 5)
    r.dev.enable_kicks(False)
    dev_gpa, dev_len = r.area("device")
    with rec.capture(r.mem) as published:
        r.add([(2, 0)])
        r.drv.publish()
    r.dev.enable_kicks(True)
    with rec.capture(r.mem) as log:
        kick = r.drv.kick_prepare()
    assert kick is True
    assert published[-1].kind == "R" and slot_of(r, published[-1]) == 0
    reads = [i for i, a in enumerate(log) if a.load and a.within(dev_gpa, dev_len)]
    assert reads and any(a.fence for a in log[:reads[0]]), "no fence before the event structure read"


def test_mem_10_device_publish_then_fence_then_suppression_read(rec):
    """MEM-10: the device's used publication comes before its read of the driver's suppression fields
    (avail.flags / used_event, or the Driver Event Suppression structure), with a full fence between."""
    for fmt in ("split", "packed"):
        r = Ring(rec.mod, fmt, 8)
        r.add([(0, 1)])
        r.drv.publish()
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [1])
        drv_gpa, drv_len = r.area("driver")
        with rec.capture(r.mem) as log:
            r.dev.flush()
            r.dev.call_prepare()
        publish = index_of_last(log, lambda a: a.kind == "R")
        reads = [i for i, a in enumerate(log) if a.load and a.within(drv_gpa, drv_len)]
        assert reads and reads[0] > publish
        assert any(log[i].fence for i in range(publish + 1, reads[0]))


# ---- device used writes --------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [False, True], ids=["per_buffer", "in_order_batch"])
def test_split_v_08_mem_07_used_elements_before_used_idx(rec, batch):
    """SPLIT-V-08 / MEM-07: every used element (id and len) of a flush is stored before used.idx, and used.idx
    is stored once, last, with a release store."""
    bits = (VIRTIO_F_IN_ORDER,) if batch else ()
    r = Ring(rec.mod, "split", 8, *bits, batch=batch)
    idx_gpa = r.layout.device + 2
    for n in (3, 8, 5, 1):
        r.add([(0, 1)] * n)
        r.drv.publish()
        ch = r.dev.poll()
        lens = ch.wlen.tolist()
        lens[n // 2] //= 2   # a partial one ends an in-order batch
        ids = ch.id.tolist()
        with rec.capture(r.mem) as log:
            r.dev.push_used(ids if batch else ids[::-1], lens if batch else lens[::-1])
            r.dev.flush()
        stores = [i for i, a in enumerate(log) if a.store]
        elems = [i for i in stores if log[i].within(r.layout.device + 4, 8 * 8)]
        idx = [i for i in stores if log[i].gpa == idx_gpa]
        assert elems and len(idx) == 1 and log[idx[0]].kind == "R"
        assert idx[0] == stores[-1] and max(elems) < idx[0]
        assert {log[i].size for i in elems} == {4}   # id and len, le32 each
        r.drv.reclaim()


@pytest.mark.parametrize("batch", [False, True], ids=["per_buffer", "in_order_batch"])
def test_packed_v_05_mem_07_packed_v_16_used_body_before_flags_first_last(rec, batch):
    """PACKED-V-05 / MEM-07: a used descriptor's id and len are stored before its flags, and nothing is stored
    to that slot after its flags; PACKED-V-16: the first used descriptor's flags are stored last (release)."""
    bits = (VIRTIO_F_IN_ORDER,) if batch else ()
    size = 11
    r = Ring(rec.mod, "packed", size, *bits, batch=batch)
    for shapes in ([(0, 1), (0, 2), (0, 1)], [(0, 3), (0, 1)] * 2, [(0, 1)] * 5, [(0, 2)] * 3):
        r.add(shapes)
        r.drv.publish()
        ch = r.dev.poll()
        lens = ch.wlen.tolist()
        lens[-2] //= 2
        ids = ch.id.tolist()
        with rec.capture(r.mem) as log:
            r.dev.push_used(ids if batch else ids[::-1], lens if batch else lens[::-1])
            r.dev.flush()
        stores = [(i, a) for i, a in enumerate(log) if a.store]
        slots = {}
        for i, a in stores:
            slots.setdefault(slot_of(r, a), []).append((i, (a.gpa - r.layout.desc) % 16))
        assert None not in slots
        flags_idx = []
        for s, acc in slots.items():
            offs = [o for _, o in acc]
            assert offs.count(14) == 1 and offs[-1] == 14, f"slot {s}: {offs}: body after flags or twice"
            assert set(offs) == {8, 12, 14}
            flags_idx.append(acc[-1][0])
        last = stores[-1][0]
        assert log[last].kind == "R" and last == max(flags_idx)
        first_used = min(slots, key=lambda s: slots[s][0][0])   # the slot written first
        assert slots[first_used][-1][0] == last, "the first used descriptor's flags must be stored last"
        r.drv.reclaim()


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
