"""`vring conform` against DPDK 22.11 both ways: net_vhost (testpmd --forward-mode=io) as the device under test,
virtio_user (testpmd --forward-mode=mac) as the driver under test.

DPDK 22.11 deviates from the spec in ways the harness finds (each confirmed in DPDK's source, see
conform/README.md); these tests pin them, so that a harness that stopped seeing them, or a DPDK that fixed
them, is noticed:

* net_vhost without MRG_RXBUF never writes num_buffers (NET-28: the Rx buffer's canary stays there);
* net_vhost packed rings keep the driver's flags in a used descriptor, WRITE included (PACKED-V-12/14);
* virtio_user sends Tx headers with the num_buffers of the Rx header it received (NET-06);
* virtio_user in-order Rx reads the length of every used slot, also the ones a batch entry skipped
  (INORDER-06/09/10); with packed rings it waits forever at the first skipped slot (INORDER-11/12);
* virtio_user packed: indirect entries preset with WRITE (PACKED-D-10), ids written into the ring at setup
  (PACKED-L-05).

Not a checklist deviation but a drop the tests account for: virtio_user's split in-order Tx now and then drops a
merged (multi-segment) frame when the Tx ring is nearly full (the `ring-full` phase, more often under load),
although used descriptors it could reclaim make room (the harness never delivers more than the ring holds).
``virtio_xmit_pkts_inorder`` calls ``virtio_xmit_try_cleanup_inorder(vq, slots)``, which returns ``slots`` minus
what this cleanup freed: descriptors that were free already do not count, the packet is not sent. testpmd counts
it as TX-dropped; the harness, which cannot see that, reports a frame that never came back (NET-32 for a merged
frame). Such rows are accepted for no more frames than testpmd says it dropped.
"""
import os
import re

import pytest

from tests.test_conform import conform, failed, finish, rows, start_conform_driver, wait_socket
from vring import dpdk

REASON = dpdk.skip_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "dpdk-testpmd available")


@pytest.fixture(scope="module")
def net_vhost(tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("dpdk") / "nv.sock")
    tp = dpdk.Testpmd.vhost(sock, fwd="io", fwd_cpu=sorted(os.sched_getaffinity(0))[0])
    try:
        tp.start()
        yield tp
    finally:
        tp.close()


@pytest.mark.parametrize("args,known", [
    (["--split", "--in-order"], {"NET-28"}),
    (["--packed", "--in-order", "--mrg-rxbuf"], {"PACKED-V-12", "PACKED-V-14"}),
    (["--split", "--no-in-order", "--mrg-rxbuf", "--event-idx"], set()),
], ids=["split-inorder", "packed-inorder-mrg", "split-eventidx-mrg"])
def test_conform_device_against_dpdk_net_vhost(net_vhost, args, known):
    rc, rep, err = conform("device", "--socket", net_vhost.socket_path, "--ring-size", "64", *args)
    assert rep is not None, err
    assert rep["error"] is None, rep["error"]
    f = failed(rep)
    assert set(f) == known, f
    assert rc == (1 if known else 0)
    if "NET-28" in f:
        assert "the canary the harness filled the buffer with: not written" in f["NET-28"][0]
    if "PACKED-V-14" in f:
        assert "came back as WRITE in the used descriptor" in f["PACKED-V-14"][0]
    r = rows(rep)
    packed = "--packed" in args
    for rid in ("GEN-01", "NET-21", "NET-33", "INORDER-02" if "--in-order" in args else "INORDER-15",
                "PACKED-V-11" if packed else "SPLIT-V-15", "PACKED-V-03" if packed else "SPLIT-V-04"):
        assert r[rid]["status"] == "pass", r[rid]
    assert net_vhost.error_lines() == [], net_vhost.error_lines()


def run_against_virtio_user(tmp_path, harness_args, packed=False, in_order=True, mrg=True):
    sock = str(tmp_path / "vu.sock")
    harness = start_conform_driver(sock, "--seconds", "3", *harness_args)
    wait_socket(sock, harness)
    tp = dpdk.Testpmd.virtio_user(sock, packed=packed, in_order=in_order, mrg_rxbuf=mrg, fwd="mac",
                                  tx_first=False, fwd_cpu=sorted(os.sched_getaffinity(0))[-1])
    try:
        tp.start(60)
        rc, rep, err = finish(harness, timeout=90)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.communicate()
        final = tp.close()
    assert rep is not None, err
    fwd = final.fwd.get(0)
    assert fwd is not None, "no forward counters from testpmd"
    return rc, rep, fwd.tx_dropped + fwd.rx_dropped


def lost_frames(rep):
    return int(re.search(r" (\d+) lost", rep["context"]["traffic"]).group(1))


def failed_but_dropped(rep, dropped):
    """failed(rep) without the rows that only report frames that never came back, when testpmd's forward counters
    account for every one of them (see the module doc: in-order Tx drops a merged frame now and then)."""
    f = failed(rep)
    gone = {rid for rid, ev in f.items() if ev and all("never came back" in e for e in ev)}
    frames = {m for rid in gone for e in f[rid] for m in re.findall(r"frame (\d+) ", e)}
    assert lost_frames(rep) <= dropped and len(frames) <= dropped, (rep["context"]["traffic"], dropped, f)
    return {rid: ev for rid, ev in f.items() if rid not in gone}


NO_BATCHES = ["--phases", "per-buffer,kicks,ring-full,late,spurious-calls"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_driver_against_dpdk_virtio_user(tmp_path, packed):
    """Every device behaviour but in-order batches: the only deviations are the Tx num_buffers (and, packed,
    the ids in the ring at setup). Packed without INDIRECT_DESC (see the next test)."""
    rc, rep, dropped = run_against_virtio_user(tmp_path, NO_BATCHES + (["--no-indirect"] if packed else []),
                                               packed=packed)
    f = failed_but_dropped(rep, dropped)
    assert set(f) == ({"NET-06", "PACKED-L-05"} if packed else {"NET-06"}), f
    # DPDK's PMD leaves num_buffers as it finds it: the device's value in a header it echoes, or 1. Which frames the
    # kept evidence lines are depends on timing: in CI all of them were once frames not matched to one Rx delivery
    # (num_buffers 1, no "sent back unchanged"). Any other value, not an echo, would be a different defect.
    assert all("sent back unchanged" in e or "num_buffers 1 in the header" in e for e in f["NET-06"]), f["NET-06"]
    assert rep["error"] is None, rep["context"]
    r = rows(rep)
    for rid in (["PACKED-D-03", "PACKED-D-04", "PACKED-D-14", "EVT-24"] if packed else
                ["SPLIT-D-13", "SPLIT-D-14", "INORDER-03", "EVT-12", "EVT-11"]):
        assert r[rid]["status"] == "pass", r[rid]


def test_conform_driver_inorder_09_dpdk_reads_skipped_used_slots(tmp_path):
    """One used entry for a batch of Rx buffers: virtio_user takes a length from every used slot, so frames
    come back cut or stretched (split, in-order)."""
    rc, rep, _dropped = run_against_virtio_user(tmp_path, ["--phases", "batches"], mrg=False)
    f = failed(rep)
    assert rc == 1 and {"INORDER-06", "INORDER-09", "INORDER-10"} <= set(f), f
    assert set(f) <= {"NET-06", "INORDER-06", "INORDER-09", "INORDER-10", "SPLIT-D-15"}, f
    assert "in a batch used entry for buffers" in f["INORDER-09"][0]


def test_conform_driver_packed_d_10_dpdk_indirect_header_writable(tmp_path):
    """virtio_user presets packed indirect entries with WRITE; the header entry keeps it: writable before
    readable in a Tx buffer. The harness, a strict device, stops the data path there."""
    rc, rep, _dropped = run_against_virtio_user(tmp_path, ["--phases", "per-buffer"], packed=True)
    f = failed(rep)
    assert rc == 1 and "PACKED-D-10" in f and "WritableBeforeReadable" in f["PACKED-D-10"][0], f
    assert "broke the ring" in rep["error"]
