"""Interop: DPDK 22.11 virtio_user (dpdk-testpmd --forward-mode=mac, start tx_first) against
`vring vhost --fwd macswap`, for packed_vq x in_order x mrg_rxbuf. Packets loop for a few seconds; testpmd's
counters and ours agree; nobody logs an error. testpmd forwards on one CPU, the backend is pinned to the other.
"""
import os
import time

import pytest

from vhost.testing import VhostProcess
from vring import dpdk

pytestmark = pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "ok")

SECONDS = 2.5


def _cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[-1]) if len(cpus) > 1 else (cpus[0], cpus[0])


@pytest.mark.parametrize("mrg_rxbuf", [0, 1], ids=["mrg0", "mrg1"])
@pytest.mark.parametrize("in_order", [0, 1], ids=["inorder0", "inorder1"])
@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_virtio_user_loops_through_vring_vhost(tmp_path, packed, in_order, mrg_rxbuf):
    sock = str(tmp_path / "vhost.sock")
    be_cpu, tp_cpu = _cpus()
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu, verbose=True) as be:
        be.wait_socket()
        tp = dpdk.Testpmd.virtio_user(sock, packed=bool(packed), in_order=bool(in_order),
                                      mrg_rxbuf=bool(mrg_rxbuf), fwd="mac", tx_first=True, fwd_cpu=tp_cpu)
        try:
            tp.start(60)
            first = tp.stats(0)
            time.sleep(SECONDS)
            mid = tp.stats(0)
        finally:
            fin = tp.close()
        ours = be.stop()
        log = be.stderr()
    info = f"testpmd final {fin.as_dict()}\nours {ours}\nbackend log tail:\n{log[-2000:]}"
    assert fin.clean, tp.log[-3000:] + info
    assert tp.error_lines() == [], tp.error_lines()
    port = fin.ports[0]
    assert ours is not None, log[-3000:]
    assert mid.rx_packets - first.rx_packets > 10_000, "packets did not loop\n" + info
    rxq, txq = ours["rxq0"], ours["txq1"]
    # everything testpmd sent we dequeued, but for its last burst when the queues were disabled (SET_VRING_ENABLE 0
    # stops our data path at once, as DPDK's vhost does); everything we dequeued went back (none dropped)
    left = port.tx_packets - txq["tx_packets"]
    assert 0 <= left <= 32 and port.tx_bytes - txq["tx_bytes"] == 64 * left, info
    assert rxq["rx_packets"] == txq["tx_packets"] and rxq["rx_dropped"] == 0, info
    # testpmd received all of it but what was still in its Rx ring when it stopped (one burst in flight)
    assert 0 <= rxq["rx_packets"] - port.rx_packets <= 32, info
    assert port.rx_errors == 0 and port.tx_errors == 0 and port.rx_nombuf == 0, info
    assert ours["refused"] == 0 and ours["ring_errors"] == 0 and ours["connections"] == 1, info
    assert " ERROR " not in log, log[-3000:]
    expect = "packed" if packed else "split"
    assert f"data path started: {expect} rings, {'in-order' if in_order else 'normal'}" in log
    assert ("MRG_RXBUF" in log.split("data path started")[1].splitlines()[0]) == bool(mrg_rxbuf)


def test_client_mode_against_virtio_user_server(tmp_path):
    """`vring vhost --client` connects to virtio_user in server mode (virtio_user's probe blocks in accept()
    until the backend comes); packets loop; counters agree."""
    sock = str(tmp_path / "fe.sock")
    be_cpu, tp_cpu = _cpus()
    tp = dpdk.Testpmd.virtio_user(sock, packed=False, in_order=True, mrg_rxbuf=True, server=True, fwd="mac",
                                  tx_first=True, fwd_cpu=tp_cpu)
    try:
        tp.start(60)
        with VhostProcess(sock, "--client", "--fwd", "macswap", pin=be_cpu, verbose=True) as be:
            tp.wait_ready(60)
            first = tp.stats(0)
            time.sleep(SECONDS)
            mid = tp.stats(0)
            fin = tp.close()
            ours = be.stop()
            log = be.stderr()
    finally:
        tp.close()
    info = f"testpmd final {fin.as_dict()}\nours {ours}\nbackend log tail:\n{log[-2000:]}"
    assert mid.rx_packets - first.rx_packets > 10_000, info
    # all testpmd sent, but for a last burst still in the Tx ring when it disabled the queues (as above)
    left = fin.ports[0].tx_packets - ours["txq1"]["tx_packets"]
    assert 0 <= left <= 32 and fin.ports[0].tx_bytes - ours["txq1"]["tx_bytes"] == 64 * left, info
    assert ours["rxq0"]["rx_dropped"] == 0 and ours["refused"] == 0 and ours["ring_errors"] == 0, info
    assert " ERROR " not in log, info
