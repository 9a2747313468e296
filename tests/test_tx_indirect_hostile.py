"""--tx-hdr indirect against a hostile peer (96e3d6f): each defect of a two-entry indirect table offered alone and
deterministically (the hypothesis test meets some of them too rarely to kill a fast path that skips their check),
and a peer scribbling one field of a free split descriptor / one byte of a free header slot."""
import struct

import numpy as np
import pytest

from rings import reference, virtq
from rings.errors import RingError
from rings.layout import (VIRTIO_F_INDIRECT_DESC, VIRTQ_DESC_F_INDIRECT as IND, VIRTQ_DESC_F_NEXT as NXT,
                          VIRTQ_DESC_F_WRITE as WR, QueueLayout, bit)
from rings.shm import MemoryTable

BASE, MEMSIZE = 0x40000, 0x10000
TABLE, DATA = BASE + 0x8000, BASE + 0x9000
R1 = BASE + MEMSIZE           # a second region, adjacent in guest addresses, elsewhere in the host
GOOD = ((DATA, 12, NXT, 1), (DATA + 64, 64, 0, 0))
# (ring descriptor (table gpa, len, flags), the two entries): one defect each, what the walk checks
DEFECTS = {
    "good": ((TABLE, 32, IND), GOOD),
    "desc_write_ignored": ((TABLE, 32, IND | WR), GOOD),
    "desc_next": ((TABLE, 32, IND | NXT), GOOD),
    "len0": ((TABLE, 0, IND), GOOD),
    "len16": ((TABLE, 16, IND), GOOD),
    "len17": ((TABLE, 17, IND), GOOD),
    "len48": ((TABLE, 48, IND), GOOD + ((DATA + 128, 8, 0, 0),)),
    "len48_e1_next": ((TABLE, 48, IND), ((DATA, 12, NXT, 1), (DATA + 64, 64, NXT, 2), (DATA + 128, 8, 0, 0))),
    "e0_next0": ((TABLE, 32, IND), ((DATA, 12, NXT, 0), GOOD[1])),
    "e0_next2": ((TABLE, 32, IND), ((DATA, 12, NXT, 2), GOOD[1])),
    "e0_nextffff": ((TABLE, 32, IND), ((DATA, 12, NXT, 0xFFFF), GOOD[1])),
    "e0_last": ((TABLE, 32, IND), ((DATA, 12, 0, 1), GOOD[1])),
    "e0_nested": ((TABLE, 32, IND), ((DATA, 12, NXT | IND, 1), GOOD[1])),
    "e1_next": ((TABLE, 32, IND), (GOOD[0], (DATA + 64, 64, NXT, 0))),
    "e1_nested": ((TABLE, 32, IND), (GOOD[0], (DATA + 64, 64, IND, 0))),
    "order": ((TABLE, 32, IND), ((DATA, 12, NXT | WR, 1), (DATA + 64, 64, 0, 0))),
    "sum_2_32": ((TABLE, 32, IND), ((DATA, 0x80000000, NXT, 1), (DATA, 0x80000000, 0, 0))),
    "e1_outside": ((TABLE, 32, IND), (GOOD[0], (BASE + MEMSIZE - 32, 64, 0, 0))),
    "e1_across_regions": ((TABLE, 32, IND), (GOOD[0], (R1 - 8, 64, 0, 0))),
    "table_in_region1": ((R1 + 0x100, 32, IND), GOOD),
    "table_across_regions": ((R1 - 16, 32, IND), GOOD),
}


def _memory(buf0, buf1):
    # region 0's buffer runs 64 bytes past the region: a table read past its end finds well-formed entries there
    return MemoryTable([(BASE, MEMSIZE, buf0), (R1, 0x1000, buf1)])


def _put(bufs, gpa, *entry):
    buf0, buf1 = bufs
    if gpa >= R1:
        struct.pack_into("<QIHH", buf1, gpa - R1, *entry)
    else:
        struct.pack_into("<QIHH", buf0, gpa - BASE, *entry)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_split_v_14_split_d_08_two_entry_table_defects_one_by_one_match_the_reference(defect, size):
    (taddr, tlen, tflags), entries = DEFECTS[defect]
    out = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        bufs = (bytearray(MEMSIZE + 64), bytearray(0x1000))
        lay = QueueLayout.contiguous("split", size, BASE)
        dev = impl.DeviceQueue(_memory(*bufs), lay, bit(VIRTIO_F_INDIRECT_DESC))
        if defect == "table_across_regions":
            _put(bufs, taddr, *entries[0])
            _put(bufs, R1, *entries[1])
        else:
            for j, e in enumerate(entries):
                _put(bufs, taddr + 16 * j, *e)
        # past region 0's end in its host buffer: a good second entry (read only by a translation of too few bytes)
        struct.pack_into("<QIHH", bufs[0], MEMSIZE, DATA + 64, 64, 0, 0)
        # a first chain the fast path takes (so the run is under way), then the defective one
        _put(bufs, TABLE + 0x100, *GOOD[0])
        _put(bufs, TABLE + 0x110, *GOOD[1])
        _put(bufs, lay.desc, TABLE + 0x100, 32, IND, 0)
        _put(bufs, lay.desc + 16, taddr, tlen, tflags, 0)
        struct.pack_into("<HHHH", bufs[0], lay.driver - BASE, 0, 2, 0, 1)   # avail idx 2; ring = [0, 1]
        try:
            ch = dev.poll()
            out[name] = [(int(ch.id[k]), int(ch.ndesc[k]), ch.segments(k)) for k in range(ch.n)]
        except RingError as e:
            out[name] = (type(e).__name__, e.a, e.b)
        out[name + "_state"] = dev.state()
        if name == "c":
            out["c_id_ndesc"] = [int(dev.c.id_ndesc[k]) for k in range(size)]
        else:
            out["reference_id_ndesc"] = list(dev.id_ndesc[:size])
    assert out["c"] == out["reference"]
    assert {k: v for k, v in out["c_state"].items() if not k.endswith("_wrap")} \
        == {k: v for k, v in out["reference_state"].items() if not k.endswith("_wrap")}
    if isinstance(out["c"], list):   # every chain taken is one ring descriptor: the device's count says so too
        for cid, nd, _ in out["c"]:
            assert nd == 1 and out["c_id_ndesc"][cid] == 1


# ---- the driver: a peer scribbling one field of a free descriptor, one byte of a free header slot ----------

def _net(variant, **kw):
    from test_tx_variants import make
    return make(variant, hdr="indirect", **kw)


FIELDS = {"addr": (0, "<Q", 0x1234), "len": (8, "<I", 48), "flags": (12, "<H", IND | NXT), "next": (14, "<H", 1)}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_split_d_09_indirect_fast_path_restores_one_scribbled_field_of_a_free_descriptor(field):
    from conftest import NET_VARIANTS
    nq, dev = _net(NET_VARIANTS["split"])
    off, fmt, value = FIELDS[field]
    idx = nq.pool.alloc(1)
    nq.pool.write(int(idx[0]), b"\x01" * 60)
    assert nq.tx.burst(idx, np.array([60], np.uint32)) == 1
    ch = dev.poll()
    head = int(ch.id[0])
    dev.push_used([head], [0])
    dev.flush()
    assert nq.tx.cleanup(nq.size) == 1
    for _ in range(nq.size - 1):   # every id once, so that the next packet takes `head` again (FIFO free list)
        idx = nq.pool.alloc(1)
        nq.pool.write(int(idx[0]), b"\x02" * 60)
        assert nq.tx.burst(idx, np.array([60], np.uint32)) == 1
        ch = dev.poll()
        dev.push_used([int(ch.id[0])], [0])
        dev.flush()
        assert nq.tx.cleanup(nq.size) == 1
    d = nq.tx.vq.layout.desc + 16 * head
    raw = bytearray(nq.mem.table.read(d, 16))
    before = bytes(raw)
    struct.pack_into(fmt, raw, off, value)
    nq.mem.table.write(d, bytes(raw))          # the free descriptor `head`, one field changed by the peer
    idx = nq.pool.alloc(1)
    nq.pool.write(int(idx[0]), b"\x03" * 60)
    assert nq.tx.burst(idx, np.array([60], np.uint32)) == 1
    ch = dev.poll()                            # raises if the descriptor went out as scribbled
    assert ch.n == 1 and int(ch.id[0]) == head and int(ch.ndesc[0]) == 1
    assert nq.mem.table.read(d, 16) == before   # what the general path writes: (table, 32, INDIRECT, next 0)
    data = b"".join(nq.mem.table.read(a, n) for a, n, _ in ch.segments(0))
    assert data == bytes(nq.hdr_size) + b"\x03" * 60
    nq.close()


@pytest.mark.parametrize("byte", range(12))
def test_net_06_indirect_fast_path_restores_one_scribbled_byte_of_a_free_header_slot(variant, byte):
    nq, dev = _net(variant)
    hs = nq.hdr_size
    slots = nq.mem.hdr_view.reshape(-1, 16)
    slots[:, byte] = 0x5A                      # every slot, one byte: whichever id the next packet takes
    idx = nq.pool.alloc(1)
    nq.pool.write(int(idx[0]), b"\x04" * 60)
    assert nq.tx.burst(idx, np.array([60], np.uint32)) == 1
    ch = dev.poll()
    data = b"".join(nq.mem.table.read(a, n) for a, n, _ in ch.segments(0))
    assert data == bytes(hs) + b"\x04" * 60    # NET-06/07/08 whatever the peer left in the slot
    nq.close()
