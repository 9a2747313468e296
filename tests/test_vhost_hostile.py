"""vring vhost against careless and hostile frontends (issue 8): vring bases that stop naming a slot of the
ring, a second server on a live socket, silent and competing frontends.

The frontend is scripted (vhost.testing.ScriptedFrontend) over real rings in shared memory.
"""
import logging
import os
import time

import pytest

from rings import vhost_user as vu
from rings.layout import QueueLayout
from rings.virtq import DriverQueue
from vhost.datapath import Options
from vhost.testing import RING_AREA, GPA_BASE, ScriptedFrontend, ThreadedServer, frame

R = vu.VhostUserRequest


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "vhost.sock")


@pytest.fixture
def server(sock_path):
    srv = ThreadedServer(sock_path, Options(fwd="macswap"))
    yield srv
    srv.close()
    assert not os.path.exists(sock_path), "the server must remove its socket"


def queues(server):
    """(rx served, tx served) of the running data path, or None when it is not running."""
    dev = server.server.device
    dp = dev.datapath if dev is not None else None
    return None if dp is None else (dp.rxq is not None, dp.txq is not None)


def setup_vrings(fe, nums, bases):
    """Memory table, then per vring NUM, BASE, ADDR, KICK with the given sizes and bases; enable; DRIVER_OK.
    The frontend's layouts and driver queues follow the sizes."""
    fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
    vring_setup(fe, 0, nums[0], bases[0])
    vring_setup(fe, 1, nums[1], bases[1])
    for i in range(2):
        fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
    fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)


def vring_setup(fe, i, num, base):
    fe.layouts[i] = QueueLayout.contiguous(fe.fmt, num, GPA_BASE + i * RING_AREA)
    fe.call(R.SET_VRING_NUM, vu.VringState(i, num).pack())
    if base is not None:
        fe.call(R.SET_VRING_BASE, vu.VringState(i, base).pack())
    fe.call(R.SET_VRING_ADDR, fe.vring_addr(i).pack())
    fe.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), [fe.kickfds[i]])
    fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [fe.callfds[i]])   # GET_VRING_BASE closed it


def driver_queues(fe):
    fe.rxq = DriverQueue(fe.mem, fe.layouts[0], fe.features)
    fe.txq = DriverQueue(fe.mem, fe.layouts[1], fe.features)
    fe.mem.write(fe.layouts[0].desc, bytes(16 * fe.layouts[0].size))   # a fresh ring: no stale flags
    fe.mem.write(fe.layouts[1].desc, bytes(16 * fe.layouts[1].size))
    fe.rxq.enable_calls(False)
    fe.txq.enable_calls(False)


def roundtrip(fe, n=8):
    fe.post_rx(n)
    assert fe.send([frame(i) for i in range(n)]) == n
    got = []
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        got += fe.receive()
        time.sleep(0.001)
    return len(got)


def rebase_and_run(server, fe, index):
    """A valid base for vring `index` (slot 0, wrap 1) starts it; packets then loop."""
    fe.call(R.SET_VRING_BASE, vu.VringState(index, 0x8000).pack())
    assert server.wait(lambda s: queues(server) == (True, True)), queues(server)
    driver_queues(fe)
    assert roundtrip(fe) == 8


# -- packed vring bases (SET_VRING_BASE checked whenever it becomes effective) ---------------------------

def test_packed_base_before_num_outside_ring_does_not_start(server, sock_path, caplog):
    """SET_VRING_BASE before SET_VRING_NUM cannot be checked when it arrives; at queue start the engine
    refuses it (BaseOutOfRange) and that vring stays stopped, the other one runs."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=True).connect() as fe:
        fe.negotiate()
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.call(R.SET_VRING_BASE, vu.VringState(0, 0x8000 | 0x7FF0).pack())   # before NUM: unchecked
        vring_setup(fe, 0, 256, None)
        vring_setup(fe, 1, 256, 0x8000)
        for i in range(2):
            fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
        fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        assert "after SET_VRING_NUM 256 the packed base 0xfff0" in caplog.text
        rebase_and_run(server, fe, 0)


def test_packed_base_kept_after_stop_then_smaller_num(server, sock_path, caplog):
    """A stop stores the used position as the base; a smaller SET_VRING_NUM without a new base must not make
    the engine address slot `base` past the ring."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=True).connect() as fe:
        fe.negotiate()
        setup_vrings(fe, (256, 256), (0x8000, 0x8000))
        assert server.wait(lambda s: queues(server) == (True, True))
        driver_queues(fe)
        for _ in range(5):
            assert roundtrip(fe) == 8
        bases = fe.stop()
        assert bases[0] == 0x8000 | 40
        assert server.wait(lambda s: queues(server) is None)
        setup_vrings(fe, (32, 256), (None, 0x8000))   # vring 0 shrinks to 32 and keeps base 40
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "after SET_VRING_NUM 32 the packed base 0x8028 (slot 40) is outside the ring of 32" in caplog.text
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        rebase_and_run(server, fe, 0)


def test_split_base_becomes_packed_with_set_features(server, sock_path, caplog):
    """A base stored under split features (free-running 1000) reads as packed slot 1000 once SET_FEATURES
    switches to packed: not started."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=False).connect() as fe:
        fe.negotiate()
        fe.call(R.SET_VRING_NUM, vu.VringState(0, 256).pack())
        fe.call(R.SET_VRING_BASE, vu.VringState(0, 1000).pack())
        fe.packed, fe.fmt = True, "packed"
        fe.features = fe.features | (1 << 34)
        fe.call(R.SET_FEATURES, vu.pack_u64(fe.features), need_reply=True)
        assert "after SET_FEATURES the packed base 0x3e8 (slot 1000) is outside the ring of 256" in caplog.text
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.layouts[0] = QueueLayout.contiguous("packed", 256, GPA_BASE)
        fe.call(R.SET_VRING_ADDR, fe.vring_addr(0).pack())
        fe.call(R.SET_VRING_KICK, vu.VringFile(0).pack(), [fe.kickfds[0]])
        vring_setup(fe, 1, 256, 0x8000)
        for i in range(2):
            fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
        fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        rebase_and_run(server, fe, 0)
