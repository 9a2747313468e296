"""Driver MUSTs of the split and packed rings (SPLIT-D-*, PACKED-D-*, INORDER-04/05), asserted on ring memory
as the device would read it, for the C engine and the reference model. Write-order MUSTs: test_conformance_order.py.
"""
import numpy as np
import pytest

from rings.errors import ConfigError
from rings.layout import (ALIGN, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTQ_DESC_F_AVAIL,
                          VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_USED, VIRTQ_DESC_F_WRITE,
                          QueueLayout)

from ring import DATA, TABLES, Ring, segments

MIXED = [(1, 0), (0, 1), (2, 1), (1, 3), (3, 0), (0, 2), (2, 2), (1, 1)]   # (readable, writable) segments


def split_chains(r, start=0):
    return [r.walk_split(h) for h in r.published_heads_split(start)]


def packed_lists(r, start_slot, count):
    """The next `count` lists from start_slot as the device would walk them."""
    lists, slot = [], start_slot
    for _ in range(count):
        walk = r.walk_packed(slot)
        lists.append(walk)
        slot = (slot + sum(1 for *_, where in walk if where[0] == "ring")) % r.size
    return lists


def chains(r, count):
    return split_chains(r) if not r.packed else packed_lists(r, 0, count)


# ---- alignment ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_01_packed_d_01_ring_parts_aligned(impl, fmt):
    """SPLIT-D-01 / PACKED-D-01: desc % 16, driver area % 2 (split) or 4 (packed), device area % 4, for every
    layout the driver lays out; a misaligned part is refused before the queue exists; the driver's first
    publication lands at the aligned driver/descriptor area it was given."""
    sizes = [1, 2, 4, 256, 32768] if fmt == "split" else [1, 3, 5, 255, 32768]
    for size in sizes:
        for base in (0x10000, 0x10010, 0x7ff0):
            lay = QueueLayout.contiguous(fmt, size, base)
            for addr, a in zip((lay.desc, lay.driver, lay.device), ALIGN[fmt]):
                assert addr % a == 0, (size, hex(base), hex(addr), a)
        lay = QueueLayout.contiguous(fmt, size, 0x10000)
        for k, step in enumerate((8, 1, 2)):   # the smallest misalignment of each part
            parts = [lay.desc, lay.driver, lay.device]
            parts[k] += step
            with pytest.raises(ConfigError, match="aligned"):
                QueueLayout(fmt, size, *parts)
    r = Ring(impl, fmt, 8 if fmt == "split" else 5)
    assert r.add([(1, 0)])[0] == 1
    r.drv.publish()
    if fmt == "split":
        assert r.read(r.layout.driver + 2, 2) == b"\x01\x00"   # avail.idx
    else:
        assert int.from_bytes(r.read(r.layout.desc + 14, 2), "little") & VIRTQ_DESC_F_AVAIL


def test_split_d_01_packed_d_01_virtio_net_rings_aligned():
    """SPLIT-D-01 / PACKED-D-01 for the rings the virtio-net driver allocates (virtio/net.py)."""
    from virtio.net import GuestMemory
    for fmt in ("split", "packed"):
        mem = GuestMemory(fmt, 256, 64, 2048, 128, 8)
        try:
            for lay in (mem.rx_layout, mem.tx_layout):
                for addr, a in zip((lay.desc, lay.driver, lay.device), ALIGN[fmt]):
                    assert addr % a == 0
        finally:
            mem.close()


# ---- framing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("indirect", [False, True], ids=["direct", "indirect"])
@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_02_packed_d_10_writable_after_readable(impl, fmt, indirect):
    """SPLIT-D-02 / PACKED-D-10: walking every chain (and indirect table) in memory, no device-readable
    descriptor follows a device-writable one, and the WRITE flags are those of the segments given."""
    bits = (VIRTIO_F_INDIRECT_DESC,) if indirect else ()
    r = Ring(impl, fmt, 32, *bits, indirect=4 if indirect else None)
    assert r.add(MIXED)[0] == len(MIXED)
    r.drv.publish()
    for walk, (nr, nw) in zip(chains(r, len(MIXED)), MIXED):
        segs = segments(walk)
        assert [w for _, _, w in segs] == [False] * nr + [True] * nw


def test_split_d_04_chain_over_2_32_bytes_refused_and_no_loops(impl):
    """SPLIT-D-04: a buffer of 2^32 bytes or more is refused with nothing written; and after many rounds of
    out-of-order completion (free-list reuse) no chain in memory loops or reaches 2^32 bytes."""
    r = Ring(impl, "split", 8)
    before = bytes(r.buf)
    with pytest.raises(ConfigError):
        r.drv.add([DATA, DATA + 256], [0xFFFFFFFF, 1], [2], [0], [1])
    with pytest.raises(ConfigError):
        r.drv.add([DATA, DATA + 256, DATA + 512], [16, 0x80000000, 0x80000000], [1], [2], [1])
    assert bytes(r.buf) == before and r.drv.num_free == 8
    rng = np.random.default_rng(4)
    start = 0
    for _ in range(30):
        shapes = [(int(rng.integers(0, 3)), 1) for _ in range(int(rng.integers(1, 4)))]
        n, _ = r.add(shapes)
        r.drv.publish()
        for walk in split_chains(r, start):   # walk_split fails on a revisited index
            assert sum(length for _, length, *_ in walk) < 1 << 32
        start += n
        ch = r.dev.poll()
        ids = rng.permutation(ch.id.tolist()).tolist()
        r.dev.push_used(ids, [0] * len(ids))
        r.dev.flush()
        r.drv.reclaim()


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_05_packed_d_09_chain_longer_than_queue_refused(impl, fmt):
    """SPLIT-D-05 / PACKED-D-09: a buffer of QS+1 segments is refused (ConfigError, nothing written) unless it
    goes indirect; an indirect table never holds more than QS entries; a table size above QS is refused."""
    size = 4
    r = Ring(impl, fmt, size)
    before = bytes(r.buf)
    with pytest.raises(ConfigError):
        r.add([(size + 1, 0)])
    assert bytes(r.buf) == before and r.drv.num_free == size
    assert r.add([(size, 0)])[0] == 1   # exactly QS is fine
    r = Ring(impl, fmt, size, VIRTIO_F_INDIRECT_DESC, indirect=size)
    assert r.add([(2, 2), (3, 1)])[0] == 2
    r.drv.publish()
    for walk in chains(r, 2):
        assert walk[0][2] & VIRTQ_DESC_F_INDIRECT and walk[0][1] // 16 <= size
    with pytest.raises(ConfigError):
        Ring(impl, fmt, size, VIRTIO_F_INDIRECT_DESC, indirect=size + 1)


@pytest.mark.parametrize("fmt", ["packed"])
def test_packed_d_08_packed_d_19_lists_within_the_device_limit(impl, fmt):
    """PACKED-D-08 / PACKED-D-19: the device's limit is the queue size (a virtio-net device advertises no
    smaller one; our device refuses longer lists and tables): every list the driver makes, direct or through a
    table, stays within it, and the device accepts all of them."""
    size = 5
    r = Ring(impl, fmt, size, VIRTIO_F_INDIRECT_DESC, indirect=size)
    shapes = [(1, 0), (2, 3), (5, 0), (0, 1)]   # the 5-segment one goes indirect: 5 table entries
    assert r.add(shapes)[0] == 4
    r.drv.publish()
    for walk, (nr, nw) in zip(packed_lists(r, 0, 4), shapes):
        ring_descs = [w for w in walk if w[4][0] == "ring"]
        assert len(ring_descs) <= size and len(segments(walk)) == nr + nw <= size
    assert r.dev.poll().n == 4
    with pytest.raises(ConfigError):
        r.add([(size + 1, 0)])


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_06_no_indirect_flag_without_the_feature(impl, fmt):
    """SPLIT-D-06 (and PACKED-D-18's first sentence): without VIRTIO_F_INDIRECT_DESC, even with an indirect
    area handed to it, the driver sets INDIRECT on no descriptor and writes no table."""
    r = Ring(impl, fmt, 32, indirect=4)   # area given, feature not negotiated
    tables_before = r.read(TABLES, 32 * 16 * 4)
    assert r.add(MIXED)[0] == len(MIXED)
    r.drv.publish()
    assert not (r.desc["flags"] & VIRTQ_DESC_F_INDIRECT).any()
    assert r.read(TABLES, 32 * 16 * 4) == tables_before


def test_split_d_07_split_d_08_indirect_rules_split(impl):
    """SPLIT-D-07: no INDIRECT inside an indirect table; SPLIT-D-08: never INDIRECT together with NEXT
    (so an indirect descriptor ends its chain)."""
    r = Ring(impl, "split", 16, VIRTIO_F_INDIRECT_DESC, indirect=4)
    assert r.add(MIXED + [(3, 3)])[0] == len(MIXED) + 1   # (3, 3): longer than a table, goes direct
    r.drv.publish()
    saw_table = False
    for walk in split_chains(r):
        for k, (_, _, flags, _, where) in enumerate(walk):
            assert flags & (VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_NEXT) != VIRTQ_DESC_F_INDIRECT | VIRTQ_DESC_F_NEXT
            if where[0] == "table":
                saw_table = True
                assert not flags & VIRTQ_DESC_F_INDIRECT
    assert saw_table
    assert not ((r.desc["flags"] & 5) == 5).any()


def test_packed_d_18_packed_d_20_indirect_rules_packed(impl):
    """PACKED-D-18: inside an indirect table no flag but WRITE (no NEXT, AVAIL, USED, INDIRECT);
    PACKED-D-20: a descriptor with INDIRECT stands alone: no NEXT on it, no NEXT on the one before it."""
    r = Ring(impl, "packed", 16, VIRTIO_F_INDIRECT_DESC, indirect=4)
    assert r.add(MIXED + [(3, 3)])[0] == len(MIXED) + 1
    r.drv.publish()
    saw_table = False
    for walk in packed_lists(r, 0, len(MIXED) + 1):
        ring_descs = [w for w in walk if w[4][0] == "ring"]
        for _, _, flags, _, where in walk:
            if where[0] == "table":
                saw_table = True
                assert flags & ~VIRTQ_DESC_F_WRITE == 0, f"indirect entry flags {flags:#x}"
        if any(f & VIRTQ_DESC_F_INDIRECT for _, _, f, _, _ in ring_descs):
            assert len(ring_descs) == 1 and not ring_descs[0][2] & VIRTQ_DESC_F_NEXT
    assert saw_table


# ---- exposure and reuse ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_split_d_15_used_len_is_taken_as_given(impl, fmt):
    """SPLIT-D-15: the driver reports exactly the used len (bytes written) and nothing past it, whatever the
    buffer holds beyond; a len beyond the writable part is an error, not data."""
    from rings.errors import UsedLenTooLarge
    r = Ring(impl, fmt, 8)
    n, tokens = r.add([(0, 1), (0, 2), (1, 1)], lens=[200, 100, 100, 16, 200])
    r.drv.publish()
    ch = r.dev.poll()
    written = [37, 150, 1]
    for i, (s, k) in enumerate(zip(ch.seg_start, ch.nseg)):   # garbage past len in every writable byte
        for j in range(s, s + k):
            if ch.seg_write[j]:
                r.write(int(ch.seg_addr[j]), b"\xee" * int(ch.seg_len[j]))
    r.dev.push_used(ch.id, written)
    r.dev.flush()
    got_tokens, got_lens = r.drv.reclaim()
    assert dict(zip(got_tokens.tolist(), got_lens.tolist())) == dict(zip(tokens, written))
    r.add([(0, 1)])
    r.drv.publish()
    ch = r.dev.poll()
    r.dev.push_used(ch.id, [64])
    r.dev.flush()
    if fmt == "split":
        r.used["ring"][int(r.used["idx"] - 1) % 8]["len"] = 65
    else:
        slot = int(np.flatnonzero(r.desc["len"] == 64)[-1])
        r.desc[slot]["len"] = 65
    with pytest.raises(UsedLenTooLarge):
        r.drv.reclaim()


@pytest.mark.parametrize("fmt", ["packed"])
def test_packed_d_11_whole_list_fits_or_nothing(impl, fmt):
    """PACKED-D-11: with 2 free descriptors a 3-descriptor list is not started (nothing written, nothing
    made available); a 2-descriptor list then fits."""
    r = Ring(impl, fmt, 5)
    assert r.add([(3, 0)])[0] == 1
    r.drv.publish()
    before = bytes(r.buf)
    assert r.add([(0, 3)])[0] == 0
    assert bytes(r.buf) == before and r.drv.num_free == 2
    r.drv.publish()
    assert bytes(r.buf) == before
    assert r.add([(0, 2)])[0] == 1
    r.drv.publish()
    assert r.dev.poll().n == 2


# ---- IN_ORDER descriptor order (split) ---------------------------------------------------------

def test_inorder_04_next_is_x_plus_1_wrapping_at_the_table_end(impl):
    """INORDER-04: with IN_ORDER a descriptor at x with NEXT has next = x+1, and 0 at x = QS-1; chains that
    straddle the end of the table included."""
    size = 8
    r = Ring(impl, "split", size, VIRTIO_F_IN_ORDER)
    start = checked = 0
    for shapes in ([(1, 2)], [(2, 1)], [(2, 2)], [(1, 0), (1, 1)], [(3, 2)]):   # 3,3,4 then 1,2 then 5
        n, _ = r.add(shapes)
        r.drv.publish()
        for walk in split_chains(r, start):
            for _, _, flags, nxt, (_, x) in walk:
                if flags & VIRTQ_DESC_F_NEXT:
                    assert nxt == (x + 1) % size, (x, nxt)
                    checked += x == size - 1
        start += n
        ch = r.dev.poll()
        r.dev.push_used(ch.id, [0] * ch.n)
        r.dev.flush()
        r.drv.reclaim()
    assert checked, "no chain straddled the end of the table"


def test_inorder_05_indirect_entries_sequential(impl):
    """INORDER-05: with IN_ORDER, entry i of an indirect table that has NEXT chains to i+1."""
    r = Ring(impl, "split", 8, VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, indirect=4)
    assert r.add([(2, 2), (3, 0), (1, 2)])[0] == 3
    r.drv.publish()
    tables = 0
    for walk in split_chains(r):
        entries = [w for w in walk if w[4][0] == "table"]
        tables += bool(entries)
        for _, _, flags, nxt, (_, _, j) in entries:
            assert (nxt == j + 1) if flags & VIRTQ_DESC_F_NEXT else True
        assert [w[4][2] for w in entries] == list(range(len(entries)))
    assert tables == 3


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
