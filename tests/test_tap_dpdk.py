"""`vring tap` between two DPDK testpmds (issue 12): virtio_user on one side, net_vhost on the other, the
tap in the middle with its default pass-through (kick and call eventfds straight through).

For split and packed rings, with and without IN_ORDER: traffic flows; with both testpmds stopped, the
tap's dump of the peers' rings agrees with what testpmd's counters imply (avail and used positions, the
buffers still in flight on the Tx ring); the message log holds DPDK's whole handshake, every request
that wants an answer followed by its reply; tshark reads the capture with the expected count of Ethernet
frames. Then the reversed roles: virtio_user as the server, net_vhost as the client, and a reconnect.

The tap's cost in packets per second is measured by benchmarks/tap_cost.py, not here.
"""
import json
import re
import shutil
import subprocess
import time

import pytest

from rings import ctl
from rings.diagnose import diagnose, format_findings
from vring import dpdk

from procs import VRING, stop, wait_for

REASON = dpdk.skip_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "dpdk-testpmd available")
TSHARK = shutil.which("tshark")
N = 256  # virtio_user's queue size


class Tap:
    def __init__(self, tmp_path, *sides, pcap_count=100):
        self.ctl, self.log, self.pcap = (str(tmp_path / x) for x in ("tap.ctl", "tap.log", "tap.pcap"))
        self.proc = subprocess.Popen(VRING + ["tap", *sides, "--ctl", self.ctl, "--log", self.log, "--pcap",
                                              self.pcap, "--pcap-count", str(pcap_count)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(self.ctl, self.proc)
        self.err = None

    def close(self):
        rc, _, self.err = stop(self.proc)
        return rc

    def records(self):
        return [json.loads(x) for x in open(self.log)]


def wrap_at(position):
    """Both packed wrap counters start at 1 and toggle every lap (PACKED-D-02, PACKED-V-01)."""
    return 1 ^ (position // N) & 1


def check_handshake(records, packed):
    """virtio_user's sequence (shared/spec/vhost-user.md 2.1), in order, each answer after its request."""
    f2b = [r for r in records if r.get("dir") == "F>B" and "request" in r]
    names = [r["request"] for r in f2b]
    expect = ["SET_OWNER", "GET_FEATURES", "GET_PROTOCOL_FEATURES", "SET_PROTOCOL_FEATURES", "SET_VRING_CALL",
              "SET_VRING_CALL", "SET_FEATURES", "SET_STATUS", "GET_STATUS", "SET_MEM_TABLE", "SET_VRING_NUM",
              "SET_VRING_BASE", "SET_VRING_ADDR", "SET_VRING_KICK", "SET_VRING_NUM", "SET_VRING_BASE",
              "SET_VRING_ADDR", "SET_VRING_KICK", "SET_VRING_ENABLE", "SET_VRING_ENABLE", "SET_STATUS",
              "SET_VRING_ENABLE", "SET_VRING_ENABLE", "GET_VRING_BASE", "GET_VRING_BASE"]
    it = iter(names)
    missing = [e for e in expect if e not in it]  # a subsequence, in this order
    assert not missing, f"not in the log in order: {missing}; log: {names}"
    msgs = [r for r in records if "request" in r]
    for i, r in enumerate(msgs):
        wants = r["dir"] == "F>B" and (r["request"].startswith("GET_") or "NEED_REPLY" in r["flag_names"])
        if wants:
            reply = next((x for x in msgs[i + 1:] if x["dir"] == "B>F"), None)
            assert reply and reply["request"] == r["request"] and reply["flags"] == 0x5, (r, reply)
    mem = next(r for r in f2b if r["request"] == "SET_MEM_TABLE")
    assert len(mem["fds"]) == len(mem["payload"]) >= 1 and "memfd:" in mem["fds"][0]["what"]
    feats = next(r for r in f2b if r["request"] == "SET_FEATURES")["payload"]["names"]
    assert ("RING_PACKED" in feats) == packed
    base = next(r for r in f2b if r["request"] == "SET_VRING_BASE")["payload"]
    assert base["num"] == (0x8000 if packed else 0)  # a fresh ring: index 0, wrap counter 1
    assert not [r for r in records if r.get("error")], "the tap found a protocol error in DPDK's messages"


def check_capture(tap, count):
    """The tap is a bystander (tap/capture.py): beside two testpmds polling flat out on this machine's cores it
    sees the rings in the moments it gets a core, and counts what it could not capture. So: some frames, at
    most the limit, either the limit or a count of what was missed; tshark reads exactly those, all testpmd's."""
    m = re.search(rf"pcap {re.escape(tap.pcap)}: (\d+) frames \(limit {count}, \d+ more seen and left out\); "
                  r"not captured: lapped (\d+), lost (\d+), unreadable (\d+), not seen published (\d+)", tap.err)
    assert m, tap.err
    captured, *missed = map(int, m.groups())
    assert 1 <= captured <= count and (captured == count or sum(missed) > 0), tap.err
    if not TSHARK:
        return
    out = subprocess.run([TSHARK, "-r", tap.pcap, "-T", "fields", "-e", "eth.type", "-e", "udp.length"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert len(rows) == captured, "tshark did not read the frames the tap says it wrote"
    assert all(r[0] == "0x0800" for r in rows), "not all Ethernet/IPv4 frames"  # testpmd's 64-byte UDP


@pytest.mark.parametrize("packed,in_order", [(False, True), (False, False), (True, True), (True, False)],
                         ids=["split-in-order", "split", "packed-in-order", "packed"])
def test_testpmd_pair_through_the_tap(tmp_path, packed, in_order):
    b, a = str(tmp_path / "vhost.sock"), str(tmp_path / "tap.sock")
    vhost = dpdk.Testpmd.vhost(b)
    virtio = dpdk.Testpmd.virtio_user(a, packed=packed, in_order=in_order, autostart=False)
    tap = None
    try:
        vhost.start()
        tap = Tap(tmp_path, "--listen", a, "--connect", b)
        virtio.start()
        vhost.wait_link_up()
        virtio.start_forwarding()
        # traffic flows with the default pass-through
        time.sleep(1.5)
        moving = virtio.stats(0)
        assert moving.rx_packets > 10000 and vhost.stats(0).rx_packets > 10000, moving
        # the tap's dump while it runs: the rings are there, read without the peers' private state
        live = ctl.query(tap.ctl, "tx")
        assert live.meta["state"] == "started" and live.snapshot()["format"] == ("packed" if packed else "split")
        # stop both (the device first: what the driver still sends stays on the Tx ring), then compare
        vhost.stop_forwarding()
        time.sleep(0.3)
        virtio.stop_forwarding()
        time.sleep(0.3)
        sv, sh = virtio.stats(0), vhost.stats(0)
        tx, rx = ctl.query(tap.ctl, "tx").snapshot(), ctl.query(tap.ctl, "rx").snapshot()
        inflight = sv.tx_packets - sh.rx_packets  # sent by the driver, not taken by the device
        assert 0 <= inflight <= N
        if packed:  # one descriptor per frame (the header in the mbuf's headroom)
            assert (tx["indices"]["next_avail"], tx["indices"]["avail_wrap"]) == (sv.tx_packets % N,
                                                                                  wrap_at(sv.tx_packets))
            c = tx["counts"]
            assert c["available_descs"] <= inflight <= c["available_descs"] + c["unknown_descs"]
            if c["unknown_descs"] == 0:  # the device's position was readable from the ring
                assert (tx["indices"]["used_idx"], tx["indices"]["used_wrap"]) == (sh.rx_packets % N,
                                                                                    wrap_at(sh.rx_packets))
            if rx["indices"]["used_idx"] is not None:
                assert (rx["indices"]["used_idx"], rx["indices"]["used_wrap"]) == (sh.tx_packets % N,
                                                                                    wrap_at(sh.tx_packets))
        else:
            assert tx["indices"] == {"avail.idx": sv.tx_packets & 0xFFFF, "used.idx": sh.rx_packets & 0xFFFF}
            assert tx["counts"]["inflight"] == inflight
            assert rx["indices"]["used.idx"] == sh.tx_packets & 0xFFFF  # one Rx buffer per 64-byte frame
            assert 0 < rx["counts"]["inflight"] <= N  # Rx buffers posted, still empty
            if in_order:
                assert sum(1 for c in tx["chains"] if c["owner"] == "device") == inflight
        for snap in (tx, rx):
            format_findings(diagnose(snap))
    finally:
        virtio.close()
        vhost.close()
        if tap is not None:
            assert tap.close() == 0, tap.err
    check_handshake(tap.records(), packed)
    check_capture(tap, 100)


def test_reversed_roles_and_a_reconnect(tmp_path):
    """virtio_user as the server (the tap connects to it), net_vhost as the client (it connects to the tap);
    then the frontend restarts: the tap makes a second pair and its picture follows (connection 2)."""
    a, b = str(tmp_path / "virtio.sock"), str(tmp_path / "tap-backend.sock")
    tap = Tap(tmp_path, "--frontend-connect", a, "--backend-listen", b, pcap_count=20)
    vhost = dpdk.Testpmd.vhost(b, client=True)
    virtios = []
    try:
        vhost.start()
        for session in (1, 2):
            virtio = dpdk.Testpmd.virtio_user(a, server=True, autostart=False)
            virtios.append(virtio)
            virtio.start()
            virtio.wait_ready(60, autostart=False)
            vhost.wait_link_up(timeout=60)
            virtio.start_forwarding()
            time.sleep(1.0)
            assert virtio.stats(0).rx_packets > 1000
            raw = ctl.query(tap.ctl, "tx")
            assert raw.meta["connection"] == session and raw.meta["state"] == "started"
            virtio.close()
            deadline = time.monotonic() + 30
            while vhost.link_up():
                assert time.monotonic() < deadline, "net_vhost never saw the frontend go"
                time.sleep(0.2)
    finally:
        for v in virtios:
            v.close()
        vhost.close()
        assert tap.close() == 0, tap.err
    events = [r["event"] for r in tap.records() if "event" in r]
    assert events[:4] == ["connected", "disconnected", "connected", "disconnected"]
    check_capture(tap, 20)
