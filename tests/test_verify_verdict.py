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
