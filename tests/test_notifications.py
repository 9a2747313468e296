"""Notifications end to end: `vring driver` (virtio.app.run) against a backend that sleeps until notified
(tests/notify_peer.py). Kicks arrive as counts on the kick eventfds and alone move the Tx ring; calls arrive
on the driver's call eventfd and wake it in --wait mode; with suppression on, neither is sent; and nothing is
kicked before DRIVER_OK (NOTIF-08). Split and packed rings (EVT-12, EVT-05/24)."""
import os

import pytest

from notify_peer import SleepingBackend
from virtio.app import DriverConfig, run


@pytest.fixture
def backend(tmp_path):
    made = []

    def make(**kw):
        made.append(SleepingBackend(str(tmp_path / "vhost.sock"), **kw))
        return made[-1]
    yield make
    for b in made:
        b.close()
    assert not os.path.exists(tmp_path / "vhost.sock")


def driver(path, **kw):
    cfg = DriverConfig(socket=path, ring_size=64, burst=8, drain=0.05, timeout=5.0, **kw)
    return run(cfg)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_notif_08_kicks_reach_a_sleeping_device_and_none_before_driver_ok(backend, packed):
    """NOTIF-08, EVT-12/EVT-24: every kick the driver counts arrives on the device's kick eventfd (Rx once for
    the buffers posted after DRIVER_OK, Tx per burst), the device moves Tx only when kicked and completes
    all 200 packets, and no kick was pending when DRIVER_OK arrived."""
    b = backend(kicks=True)
    res = driver(b.path, packed=packed, mode="txonly", count=200, seconds=5)
    assert b.kicks_before_driver_ok == 0
    assert res["tx"]["packets"] == 200 and res["tx"]["inflight"] == 0
    assert b.tx_done == 200
    assert res["tx"]["kicks"] > 0 and b.kicks[1] == res["tx"]["kicks"]
    assert res["rx"]["kicks"] == b.kicks[0] == 1
    assert b.kick_wakeups[1] >= 1


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_notif_08_no_kicks_while_the_device_suppresses_them(backend, packed):
    """EVT-12 / EVT-24 (DISABLE): a device that polls and suppresses kicks gets none, and still every packet."""
    b = backend(kicks=False)
    res = driver(b.path, packed=packed, mode="txonly", count=200, seconds=5)
    assert b.kicks_before_driver_ok == 0
    assert res["tx"]["packets"] == 200 and b.tx_done == 200 and res["tx"]["inflight"] == 0
    assert res["tx"]["kicks"] == res["rx"]["kicks"] == 0 and b.kicks == [0, 0]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_calls_wake_a_sleeping_driver(backend, packed):
    """EVT-05 / EVT-24: the driver in --wait mode sleeps on its Rx call eventfd with calls enabled; the device
    calls after publishing used buffers, and the driver wakes and receives all 40 frames."""
    b = backend(kicks=False, rx_frames=40)
    res = driver(b.path, packed=packed, mode="rxonly", count=40, wait=True, seconds=20)
    assert res["rx"]["packets"] == 40 and b.rx_sent == 40
    assert b.calls[0] >= res["rx"]["wakeups"] >= 1
    assert res["rx"]["waits"] >= res["rx"]["wakeups"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_no_calls_while_the_driver_suppresses_them(backend, packed):
    """EVT-05 (flags 1) / EVT-24 (DISABLE): a polling driver suppresses calls: the device sends none, and
    nothing is left on the driver's call eventfd."""
    b = backend(kicks=False, rx_frames=40)
    res = driver(b.path, packed=packed, mode="rxonly", count=40, seconds=20)
    assert res["rx"]["packets"] == 40 and b.rx_sent == 40
    assert b.calls == [0, 0] and res["calls"] == {0: 0, 1: 0}
