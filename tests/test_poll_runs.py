"""The device poll's fast path over runs of one-descriptor chains (rings/csrc/virtq.h vq_dev_simple_*), against
the reference model: runs longer than one pass (VQ_RUN = 32), interrupted by chains of several descriptors and by
indirect ones, and polls capped in the middle of a run, give the same chains, ids and ring state
(SPLIT-V-04/05, PACKED-V-04/09/10/18, INORDER-02)."""
import numpy as np
import pytest

from rings import reference, virtq
from rings.layout import VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, QueueLayout, bit
from rings.shm import MemoryTable

BASE, MEMSIZE, SIZE = 0x40000, 0x80000, 256
INDIRECT, DATA = BASE + 0x20000, BASE + 0x60000


def side(impl, fmt, in_order):
    buf = bytearray(MEMSIZE)
    mem = MemoryTable([(BASE, MEMSIZE, buf)])
    lay = QueueLayout.contiguous(fmt, SIZE, BASE)
    f = bit(VIRTIO_F_INDIRECT_DESC) | (bit(VIRTIO_F_RING_PACKED) if fmt == "packed" else 0) \
        | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
    return buf, impl.DriverQueue(mem, lay, f, indirect=(INDIRECT, 4)), impl.DeviceQueue(mem, lay, f)


@pytest.mark.parametrize("fmt", ["split", "packed"])
@pytest.mark.parametrize("in_order", [False, True])
def test_runs_of_one_descriptor_chains_match_the_reference(fmt, in_order):
    # 70 one-descriptor buffers, a 3-segment chain, 5 more, a 2-segment (indirect) one, 40 more; writable mixed
    shapes = [(1, 0)] * 70 + [(1, 2)] + [(0, 1)] * 5 + [(2, 0)] + [(1, 0)] * 40
    polls = [10, 50, 200, 200]           # caps that cut runs in the middle
    out = {}
    for name, impl in (("c", virtq), ("reference", reference)):
        buf, drv, dev = side(impl, fmt, in_order)
        nread = np.array([r for r, _ in shapes], np.uint16)
        nwrite = np.array([w for _, w in shapes], np.uint16)
        nseg = int(nread.sum() + nwrite.sum())
        addrs = DATA + 64 * np.arange(nseg, dtype=np.uint64)
        lens = np.full(nseg, 64, np.uint32)
        assert drv.add(addrs, lens, nread, nwrite, np.arange(len(shapes), dtype=np.uint64)) == len(shapes)
        drv.publish()
        got = []
        for cap in polls:
            ch = dev.poll(cap)
            got.append([(int(ch.id[k]), int(ch.ndesc[k]), ch.segments(k), int(ch.rlen[k]), int(ch.wlen[k]))
                        for k in range(ch.n)])
            dev.push_used(ch.id, np.zeros(ch.n, np.uint32))
            dev.flush()
        state = dev.state()
        if fmt == "split":   # the wrap counters mean nothing there (the two models leave them apart)
            state = {k: v for k, v in state.items() if not k.endswith("_wrap")}
        out[name] = (got, bytes(buf), state)
    assert out["c"][0] == out["reference"][0]
    assert sum(len(g) for g in out["c"][0]) == len(shapes)
    assert out["c"][1] == out["reference"][1]
    assert out["c"][2] == out["reference"][2]
