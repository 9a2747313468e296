"""A kill -9 after every store the tracked data path makes (vhost/csrc/vhost_inflight.h, VHI_POINT): no frame is
lost, and no Rx buffer is filled twice.

A forked child runs one step of the C loop (8 frames from the driver's Tx queue to its Rx queue, both queues
tracked) with ``die_at = k``: it dies as a kill -9 would at the k-th store point. Guest memory and the inflight
area are shared mappings, so the parent then sees exactly what the dead backend left, and starts a successor on
both queues from it (QueueTracking.start, what `vring vhost` does for the next connection):

* every frame sent is either delivered (the driver receives it from the Rx ring) or its Tx chain is taken by the
  successor: again from the area's record, or anew from the ring (a duplicate at worst, never a loss);
* the successor takes no Rx buffer the driver has received (that buffer would be written a second time
  under the driver's feet).

k runs from 1 until a child completes the step without reaching its point. The order the module comment states
(split: the batch list, used->idx, inflight = 0, used_idx; packed: free list and used position, the used
descriptors, inflight = 0, the old_* commit) is what makes every k safe: clearing the inflight flags before the
used index is published, for one, loses the batch at the points in between.
"""
import os

import pytest

from rings.virtq import DeviceQueue
from test_vhost_datapath import HDR, SIZE, Pair
from vhost._net import lib
from vhost.datapath import Options, _cast_dev, _ChainsBuf
from vhost.inflight import QueueTracking

FRAMES = 8


def _seq(frame):
    return int.from_bytes(frame[HDR + 12:HDR + 16], "little")


def _successor_takes(p, index):
    """Buffer ids a successor on vring ``index`` takes from what memory and the area hold now: what the area says
    was in flight first (resubmitted), then what the ring still offers."""
    q = DeviceQueue(p.mem, p.layouts[index], p.features)   # where the driver put the ring: its start
    trk = QueueTracking(p.area, index, SIZE)
    trk.start(q, p.mem)
    chains = _ChainsBuf(SIZE, 4 * SIZE)
    n = lib.vhi_poll(_cast_dev(q), chains.c, SIZE, trk.c)
    assert n >= 0, q.mark_broken()
    return [int(x) for x in chains.arrays["id"][:n]]


def _step_dying_at(p, which, k):
    """Fork; the child runs one step, dying at the k-th store point of vring ``which``. True if it died there."""
    pid = os.fork()
    if pid == 0:   # the child: the C step, then out without any Python clean-up
        code = 3
        try:
            p.dp.tracking[which].c.die_at = k
            p.dp.step()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 9), f"the child ended with status {status:#x}"
    return os.WEXITSTATUS(status) == 9


def _in_flight(q):
    return [i for i in range(SIZE) if q.id_inflight[i]]


@pytest.mark.parametrize("flush", ["rx-batch", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("which", [0, 1], ids=["rx-points", "tx-points"])
def test_a_kill_at_any_store_point_loses_no_frame_and_fills_no_rx_buffer_twice(packed, flush, which):
    deaths = 0
    for k in range(1, 1000):
        p = Pair(Options(fwd="io", txq_flush=flush), packed=packed, tracked=True)
        try:
            p.post_rx(FRAMES)
            p.send(FRAMES)
            tx_seq = {i: _seq(p.mem.read(p.buf(int(p.drv[1].id_token[i])), HDR + 16)) for i in _in_flight(p.drv[1])}
            rx_id_of_token = {int(p.drv[0].id_token[i]): i for i in _in_flight(p.drv[0])}
            assert len(tx_seq) == len(rx_id_of_token) == FRAMES
            if not _step_dying_at(p, which, k):
                break
            deaths += 1
            where = f"{'packed' if packed else 'split'} --txq-flush {flush}, vring {which} store point {k}"
            tokens, lens = p.drv[0].reclaim()   # what the driver can see of the dead backend's Rx side
            delivered = {_seq(p.mem.read(p.buf(int(t)), int(n))) for t, n in zip(tokens, lens)}
            lost = set(tx_seq.values()) - delivered - {tx_seq[i] for i in _successor_takes(p, 1)}
            assert not lost, f"{where}: frames {sorted(lost)} neither delivered nor taken by the successor"
            twice = {rx_id_of_token[int(t)] for t in tokens} & set(_successor_takes(p, 0))
            assert not twice, f"{where}: Rx buffers {sorted(twice)} received and taken again"
        finally:
            p.close()
    else:
        pytest.fail("the step never completed")
    assert deaths >= 2 * FRAMES   # taken and completed: at least two points per frame were tried
