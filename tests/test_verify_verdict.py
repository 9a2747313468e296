"""`vring driver --verify` says whether the run passed: ``verify.ok`` / ``verify.failures`` in the report, and exit
status 1 with a ``VerifyFailed`` line when a check failed (2 stays for errors), so that a script or CI job that
points the driver at a backend under test cannot take a corrupting or lossy backend for a good one."""
import json
import os
import subprocess
import sys

import pytest

from vhost.testing import VhostProcess
from virtio.app import verify_failures


def _cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[-1]


def _report(bad=0, missing=0, absent=None, extra=0):
    v = {"bad": bad, "missing": missing}
    if absent is not None:
        v["population"] = {"copies": 32 - absent + extra, "present": 32 - absent, "absent": absent, "extra": extra}
    return v


def test_verdict_lines_name_each_failure():
    assert verify_failures(_report(absent=0)) == []
    assert verify_failures(_report()) == []   # rxonly: no sequence numbers to account for
    (line,) = verify_failures(_report(bad=3, absent=0))
    assert line.startswith("3 frame(s) bad")
    (line,) = verify_failures(_report(missing=2, absent=2))   # never seen: not also lost late
    assert line == "2 frame(s) sent never came back intact"
    never, late = verify_failures(_report(missing=2, absent=5))
    assert never.startswith("2 frame(s)") and late.startswith("3 frame(s) came back during the run but not at the end")
    assert late.endswith("(lost late, or held by the backend longer than --drain)")
    (line,) = verify_failures(dict(_report(absent=3), backend_gone=True))   # no backend left at the end to wait on
    assert line == "3 frame(s) came back during the run but not at the end (in flight in a backend that was gone at the end)"
    (line,) = verify_failures(_report(absent=0, extra=1))
    assert line.startswith("1 extra cop")
    # --drain 0: nothing is waited for at the end, so nothing is missing from it
    assert verify_failures(_report(absent=4), at_end=False) == []
    assert len(verify_failures(_report(bad=1, missing=1, absent=3, extra=1))) == 4


def _run(sock, fwd, packed):
    be_cpu, drv_cpu = _cpus()
    with VhostProcess(sock, "--fwd", fwd, pin=be_cpu, verbose=True) as be:
        be.wait_socket()
        drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--mode", "macfwd",
                              "--count", "32", "--seconds", "0.5", "--verify", "--json", "--pin", str(drv_cpu),
                              "--packed" if packed else "--split"], capture_output=True, text=True, timeout=60)
        be.stop()
    return drv.returncode, json.loads(drv.stdout), drv.stderr


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_verify_passes_exit_0_against_a_good_backend(tmp_path, packed):
    rc, res, err = _run(str(tmp_path / "vh.sock"), "macswap", packed)
    v = res["verify"]
    assert rc == 0 and v["ok"] and v["failures"] == [], (v, err[-2000:])
    assert v["population"] == {"copies": 32, "present": 32, "absent": 0, "extra": 0}, v
    assert "VerifyFailed" not in err


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_verify_fails_exit_1_when_the_backend_keeps_every_frame(tmp_path, packed):
    """--fwd rxonly takes the 32 frames and sends nothing back: each one sent never came back."""
    rc, res, err = _run(str(tmp_path / "vh.sock"), "rxonly", packed)
    v = res["verify"]
    assert rc == 1 and not v["ok"], (v, err[-2000:])
    assert v["missing"] == 32 and v["population"]["absent"] == 32, v
    assert v["failures"] == ["32 frame(s) sent never came back intact"], v
    assert "vring driver: VerifyFailed: 32 frame(s) sent never came back intact" in err


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_verify_fails_exit_1_when_the_backend_does_not_swap_macs(tmp_path, packed):
    """--fwd io sends the frames back unchanged: they arrive with their MACs not swapped (and, swapped again by
    macfwd, intact on the next lap: only every other arrival is bad)."""
    rc, res, err = _run(str(tmp_path / "vh.sock"), "io", packed)
    v = res["verify"]
    assert rc == 1 and v["bad"] > 0 and not v["ok"], (v, err[-2000:])
    assert "MACs not swapped" in v["failures"][0], v
    assert "VerifyFailed" in err


@pytest.mark.parametrize("resilient", [0, 1], ids=["plain", "reconnect"])
def test_a_second_signal_that_cuts_the_drain_is_not_a_loss(tmp_path, resilient):
    """A second SIGINT cuts the drain short (nothing more is waited for): the frames still in flight then are not
    lost, nobody waited for them. The drain's count judged them as lost late anyway: a correct backend, two Ctrl-C,
    exit 1 and 'VerifyFailed: 64 frame(s) came back during the run but not at the end'. Here the backend holds the
    frames 200 ms (its intermediate queue flushed by a timer), so that they are still there when the drain is cut."""
    import signal
    import time
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    with VhostProcess(sock, "--fwd", "macswap", "--txq-flush", "timer:200000", "--txq-threshold", "4096",
                      pin=be_cpu, verbose=True) as be:
        be.wait_socket()
        drv = subprocess.Popen([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--mode", "macfwd",
                                "--count", "64", "--verify", "--json", "--pin", str(drv_cpu),
                                *(["--reconnect"] if resilient else [])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            be.wait_stderr("data path started")
            time.sleep(0.5)   # frames circulating
            drv.send_signal(signal.SIGINT)
            time.sleep(0.05)
            drv.send_signal(signal.SIGINT)   # the drain is under way, the frames still in the backend
            out, err = drv.communicate(timeout=30)
        finally:
            if drv.poll() is None:
                drv.kill()
                drv.communicate()
        be.stop()
    v = json.loads(out)["verify"]
    assert drv.returncode == 0 and v["ok"] and v["failures"] == [], (v, err[-2000:])
    assert v["drain_cut"] is True and v["bad"] == 0 and v["missing"] == 0, v


def _checker(count, ledger=False):
    """The receive check of a macfwd --count --verify run (_Loop._check) over a pool of its own, and a function that
    puts frames there as a macswap backend returns them: (sequence field, whole u64) -> buffer index."""
    import numpy as np

    from virtio import packets
    from virtio._net import ffi
    from virtio.app import DriverConfig, _Loop
    from virtio.ledger import Ledger
    from virtio.net import HEADROOM
    from virtio.pool import BufferPool, pool_stride

    pool = BufferPool(bytearray(16 * pool_stride(2048)), 0x1000, 16, 2048, HEADROOM)
    loop = _Loop.__new__(_Loop)
    loop.cfg = DriverConfig("", mode="macfwd", count=count, verify=True)
    loop.nq = type("NQ", (), {"pool": pool})()
    loop.tmpl = packets.template(64)
    loop.plen = len(loop.tmpl)
    loop.p_tmpl = ffi.cast("uint8_t *", ffi.from_buffer(loop.tmpl))
    loop.idx, loop.lens, loop.seqs = np.zeros(16, np.uint32), np.full(16, 64, np.uint32), np.zeros(16, np.uint64)
    loop.p_idx = ffi.cast("uint32_t *", ffi.from_buffer(loop.idx))
    loop.p_lens = ffi.cast("uint32_t *", ffi.from_buffer(loop.lens))
    loop.p_seqs = ffi.cast("uint64_t *", ffi.from_buffer(loop.seqs))
    loop.bad, loop.seen, loop.ledger = 0, np.zeros(count, np.int64), Ledger(count) if ledger else None

    def back(field):
        f = bytearray(bytes(loop.tmpl))
        f[0:6], f[6:12] = bytes(loop.tmpl[6:12]), bytes(loop.tmpl[0:6])   # what macswap sends back
        f[packets.SEQ_OFF:packets.SEQ_OFF + 8] = field.to_bytes(8, "little")
        (b,) = pool.alloc(1)
        pool.write(b, bytes(f))
        return b
    return loop, back


def test_verify_counts_a_frame_whose_sequence_field_high_half_changed_as_bad():
    """Without --reconnect/--server no lap is written: the sequence field's high 32 bits stay 0 as vn_gen wrote them.
    vn_check leaves the whole field to the sequence check, which looked at the low half only: a backend that changed
    bytes 54..57 of every frame passed (ok true, exit 0). An intact frame whose field is all ones (VN_SEQ_BAD's value)
    is bad too, and counted once."""
    loop, back = _checker(8)
    frames = [back(3), back(5 | 1 << 32), back(0xFFFFFFFFFFFFFFFF), back(9)]   # good, lap changed, all ones, >= count
    loop.idx[:4] = frames
    loop._check(4)
    assert loop.bad == 3 and list(loop.seen) == [0, 0, 0, 1, 0, 0, 0, 0]
    # a resilient run writes laps: there the ledger judges them (a wrong one is a copy, dropped and counted)
    loop, back = _checker(8, ledger=True)
    loop.idx[:2] = [back(3 | 2 << 32), back(5 | 1 << 32)]
    loop._check(2)
    assert loop.bad == 0 and list(loop.seen) == [0, 0, 0, 1, 0, 1, 0, 0]
