"""Notifications for real: the backend's --idle sleep and the driver's --wait (issue 11).

EVT-24 / EVT-12: while the backend polls, kicks are suppressed; once it goes to sleep they are enabled, so the
driver's next publication is followed by a kick.
EVT-09 / MEM-09: a side that stops polling enables notifications first, then re-checks the ring, and blocks only
if that re-check finds nothing.
Two processes: an idle queue costs (almost) no CPU on either side, and the first packets wake both.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rings.virtq import CMemory, DeviceQueue
from vhost.datapath import Datapath, Options
from virtio import packets
from virtio.net import NetQueues
from vring.bench import proc_cpu_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDLE_POLLS = 8


class Loop:
    """Our driver's queues and our backend's data path over the same memory, in one process."""

    def __init__(self, features):
        self.nq = NetQueues(features, size=64, nbufs=1024, burst=8)
        self.nq.rx.fill()
        cmem = CMemory(self.nq.mem.table)
        self.dev = [DeviceQueue(cmem, lay, features) for lay in (self.nq.mem.rx_layout, self.nq.mem.tx_layout)]
        for q in self.dev:
            q.enable_kicks(False)   # as NetDevice starts them: polling
        self.dp = Datapath(self.dev[0], self.dev[1], features, Options(idle="sleep", idle_polls=IDLE_POLLS))
        self.tmpl = packets.template(64)

    def send(self, n=1):
        idx = self.nq.pool.alloc(n)
        for b in idx:
            self.nq.pool.write(b, self.tmpl.tobytes())
        assert self.nq.tx.burst(idx, np.full(n, 64, np.uint32)) == n

    def run(self, iters):
        assert self.dp.run(budget_us=1_000_000, max_iters=iters) == {}

    def close(self):
        self.nq.close()


@pytest.fixture
def loop(variant):
    lp = Loop(variant)
    yield lp
    lp.close()


def test_evt_24_sleeping_backend_asks_for_kicks_polling_one_does_not(loop):
    loop.send(1)
    loop.run(1)                                     # busy: the packet goes through, kicks stay off
    assert loop.dp.stats()["tx_packets"] == 1 and not loop.dp.sleeping
    kicks = loop.nq.tx.kicks
    loop.send(1)                                    # the device polls: no kick wanted (EVT-12 flags / DISABLE)
    assert loop.nq.tx.kicks == kicks
    loop.run(1)
    loop.run(10 * IDLE_POLLS)                       # idle: it enables kicks, re-checks, and sleeps
    assert loop.dp.sleeping and loop.dp.stats()["sleeps"] == 1
    loop.send(1)                                    # now the driver must kick
    assert loop.nq.tx.kicks == kicks + 1
    loop.run(1)                                     # woken: the packet is found, kicks off again
    assert not loop.dp.sleeping and loop.dp.stats()["tx_packets"] == 3
    loop.send(1)
    assert loop.nq.tx.kicks == kicks + 1


def test_evt_09_buffer_made_available_while_enabling_is_found_before_sleeping(loop):
    loop.run(IDLE_POLLS)                            # IDLE_POLLS empty polls: kicks enabled, not asleep yet
    assert not loop.dp.sleeping
    loop.send(1)                                    # a buffer appears right then (its kick may be lost or late)
    loop.run(1)                                     # the re-check after enabling finds it: no sleep
    assert not loop.dp.sleeping
    assert loop.dp.stats()["tx_packets"] == 1 and loop.dp.stats()["rx_packets"] == 1
    idx, _ = loop.nq.rx.burst(8)
    assert len(idx) == 1
    loop.nq.pool.free(idx)


def _wait_for(path, text, proc, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(path) as f:
                if text in f.read():
                    return
        except OSError:
            pass
        assert proc.poll() is None, f"{proc.args[3]} exited early ({proc.returncode})"
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not seen in {path}")


def test_idle_queue_costs_no_cpu_and_traffic_wakes_both(tmp_path):
    """vring vhost --idle sleep and vring driver --wait, queues up and idle: over 1 s neither process uses more
    than a small fraction of a CPU (from /proc; a loose bound, not a timing); then the injected packets wake both
    and loop, with kicks and calls counted."""
    sock = str(tmp_path / "vh.sock")
    env = dict(os.environ, PYTHONPATH=ROOT)
    outs = {f"{n}.{k}": open(tmp_path / f"{n}.{k}", "w") for n in ("vhost", "driver") for k in ("out", "err")}
    procs = []
    try:
        vh = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--idle", "sleep",
                               "--json", "--max-connections", "1"], cwd=ROOT, env=env,
                              stdout=outs["vhost.out"], stderr=outs["vhost.err"])
        procs.append(vh)
        _wait_for(tmp_path / "vhost.err", "listening", vh)
        drv = subprocess.Popen([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--packed",
                                "--mode", "macfwd", "--count", "64", "--wait", "--idle-first", "2.5",
                                "--seconds", "1", "--json"], cwd=ROOT, env=env,
                               stdout=outs["driver.out"], stderr=outs["driver.err"])
        procs.append(drv)
        _wait_for(tmp_path / "driver.err", "idle for", drv)
        time.sleep(0.5)
        before = [proc_cpu_seconds(p.pid) for p in procs]
        time.sleep(1.0)
        used = [proc_cpu_seconds(p.pid) - b for p, b in zip(procs, before)]
        assert drv.wait(60) == 0 and vh.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for f in outs.values():
            f.close()
    assert used[0] < 0.2 and used[1] < 0.2, f"CPU seconds over 1 s idle: backend {used[0]:.3f}, driver {used[1]:.3f}"
    res = json.loads((tmp_path / "driver.out").read_text())
    final = [json.loads(x) for x in (tmp_path / "vhost.out").read_text().splitlines() if x.startswith("{")][-1]
    assert res["rx"]["packets"] > 64 and res["rx"]["errors"] == 0
    assert final["txq1"]["tx_kicks"] > 0, "the sleeping backend was never kicked awake"
    assert final["intermediate"]["sleeps"] > 0
    assert res["tx"]["kicks"] > 0 and res["rx"]["wakeups"] > 0, "the waiting driver was never called awake"
    assert final["rxq0"]["rx_dropped"] == 0
    assert not os.path.exists(sock)
