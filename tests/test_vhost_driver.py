"""`vring driver` (our virtio-net frontend) against `vring vhost`, two processes, for packed x in_order x
mrg_rxbuf, plus the driver's slow Tx path (header in its own descriptor or an indirect table) and small
buffers (chained Tx, merged Rx). Every frame comes back MAC-swapped and intact; both sides' counters agree.
"""
import json
import os
import subprocess
import sys

import pytest

from vhost.testing import VhostProcess


def _cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[-1]


CASES = [(p, i, m, []) for p in (0, 1) for i in (0, 1) for m in (0, 1)] + [
    (0, 1, 1, ["--tx-slow-path"]), (1, 0, 1, ["--tx-slow-path"]),
    (0, 0, 1, ["--buf-size", "512", "--pkt-size", "1000"]), (1, 1, 1, ["--buf-size", "512", "--pkt-size", "1000"]),
]


@pytest.mark.parametrize("packed,in_order,mrg,extra", CASES,
                         ids=[f"{'packed' if p else 'split'}-io{i}-mrg{m}{'-' + e[0].strip('-') if e else ''}"
                              for p, i, m, e in CASES])
def test_vring_driver_against_vring_vhost(tmp_path, packed, in_order, mrg, extra):
    sock = str(tmp_path / "vhost.sock")
    be_cpu, drv_cpu = _cpus()
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu, verbose=True) as be:
        be.wait_socket()
        argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--mode", "macfwd", "--count", "32",
                "--seconds", "1.5", "--verify", "--json", "--pin", str(drv_cpu),
                "--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
                "--mrg-rxbuf" if mrg else "--no-mrg-rxbuf", *extra]
        drv = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        ours = be.stop()
        log = be.stderr()
    assert drv.returncode == 0, drv.stderr[-3000:]
    res = json.loads(drv.stdout)
    assert res["verify"]["bad"] == 0 and res["verify"]["missing"] == 0, res["verify"]
    assert res["rx"]["packets"] > 1000 and res["rx"]["errors"] == 0 and res["tx"]["errors"] == 0
    assert ours["txq1"]["tx_packets"] == res["tx"]["packets"]
    assert ours["rxq0"]["rx_packets"] == res["rx"]["packets"]
    assert ours["rxq0"]["rx_dropped"] == 0 and ours["ring_errors"] == 0 and ours["refused"] == 0
    if "--buf-size" in extra and mrg:
        assert ours["rxq0"]["rx_buffers"] > ours["rxq0"]["rx_packets"]   # 1000-byte frames span buffers
    assert " ERROR " not in log, log[-3000:]
