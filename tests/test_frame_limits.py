"""Frames the queues can never carry are refused when the run is configured, with the reason, never retried.

SPLIT-D-05 / PACKED-D-09: no descriptor chain longer than the queue size, an indirect table's entries included. What
one frame of the driver takes (virtio.net.tx_descs) depends on the Tx header placement and on
VIRTIO_F_INDIRECT_DESC; the driver's arithmetic must agree with what its C engine accepts.
"""
import json
import subprocess
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rings.errors import ConfigError, FrameDoesNotFit
from rings.layout import (VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF,
                          align_up, bit)
from virtio import packets
from virtio._net import ffi, lib
from virtio.app import DriverConfig, _Loop, _Stop
from virtio.net import (HEADROOM, INDIRECT_MAX, TX_HDR, NetQueues, check_injected, check_rx_frame, check_tx_frame,
                         tx_descs)
from virtio.pool import MIN_ROOM, check_geometry

from tests.procs import VRING, collect

BUF = 256                        # 116 data bytes a buffer after the 140-byte headroom
ROOM = BUF - HEADROOM
JUMBO_DESCS = -(-9000 // ROOM) + 1   # a 9000-byte frame's segments + a header descriptor: 79


def driver(sock, *args):
    """`vring driver --json` to its end: (returncode, stdout, stderr)."""
    return collect(subprocess.Popen(VRING + ["driver", "--socket", sock, "--json", *map(str, args)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def gen(nq, frame_len):
    """One driver-built frame of frame_len bytes (vn_gen, as the driver injects it): (indices, lengths)."""
    tmpl = packets.template(frame_len)
    idx = np.zeros(1, np.uint32)
    assert lib.vn_gen(nq.pool.c, ffi.cast("uint32_t *", ffi.from_buffer(idx)), 1,
                      ffi.cast("uint8_t *", ffi.from_buffer(tmpl)), len(tmpl), 0, packets.SEQ_OFF, 0, 0) == 1
    return idx, np.full(1, len(tmpl), np.uint32)


@pytest.mark.parametrize("size", [4, 16])
@pytest.mark.parametrize("hdr, indirect", [(h, i) for h in TX_HDR for i in (False, True) if i or h != "indirect"])
def test_split_d_05_packed_d_09_tx_descs_agree_with_the_engine(variant, hdr, indirect, size):
    """A frame whose chain is exactly the queue size goes out and occupies the ring slots tx_descs says (one for
    a chain that fits an indirect table); one segment more is refused by the engine and by check_tx_frame."""
    features = variant | (bit(VIRTIO_F_INDIRECT_DESC) if indirect else 0)
    for frame_len, fits in (((size - 1) * ROOM, True), (size * ROOM, False)):
        nq = NetQueues(features, size=size, nbufs=256, buf_size=BUF, hdr=hdr)
        try:
            chain, slots = tx_descs(frame_len, features, BUF, hdr=hdr)
            assert chain == (size if fits else size + 1)
            idx, lens = gen(nq, frame_len)
            sent = nq.tx.burst(idx, lens)
            if fits:
                assert check_tx_frame(frame_len, features, size, BUF, hdr=hdr) == (chain, slots)
                assert sent == 1 and nq.tx.vq.num_free == size - slots
                assert slots == (1 if indirect and hdr != "chain" and chain <= INDIRECT_MAX else chain)
            else:
                with pytest.raises(ConfigError, match=f"takes {size + 1} descriptors.*queue size {size}"):
                    check_tx_frame(frame_len, features, size, BUF, hdr=hdr)
                assert sent == 0 and nq.tx.counters()["errors"] == 1 and nq.tx.vq.num_free == size
                nq.pool.free(idx)
        finally:
            nq.close()


def test_tx_descs_one_descriptor_only_on_the_headroom_fast_path():
    ind = bit(VIRTIO_F_INDIRECT_DESC)
    assert tx_descs(60, 0, 2048) == (1, 1)
    assert tx_descs(60, ind, 2048, force_slow=True) == (2, 1)        # --tx-slow-path: header descriptor, indirect
    assert tx_descs(60, ind, 2048, hdr="chain") == (2, 2)            # chain never uses an indirect table
    assert tx_descs(60, ind, 2048, hdr="indirect") == (2, 1)
    assert tx_descs(9000, ind, 2048) == (6, 1)                       # 5 segments + header, in one table
    assert tx_descs(9000, 0, 2048) == (6, 6)


@pytest.mark.parametrize("args", [
    ("--tx-hdr", "chain", "--mode", "macfwd", "--count", 8),
    ("--tx-hdr", "headroom", "--mode", "txonly", "--count", 8),              # indirect negotiated: 79 > 8, direct
    ("--tx-hdr", "indirect", "--mode", "rate", "--rate", 1000),
    ("--tx-hdr", "chain", "--mode", "macfwd", "--count", 8, "--no-indirect"),
], ids=["chain-macfwd", "headroom-txonly", "indirect-rate", "chain-no-indirect"])
def test_split_d_05_driver_refuses_a_frame_longer_than_the_ring_at_start(server, sock_path, args):
    """vring driver --pkt-size 9000 --buf-size 256 --ring-size 64: 78 segments + a header descriptor = 79 > 64. It
    used to connect and retry the injection until --timeout (1.7 M counted errors) and exit 0; now it says why
    before connecting."""
    t0 = time.monotonic()
    rc, out, err = driver(sock_path, "--pkt-size", 9000, "--buf-size", BUF, "--ring-size", 64, "--seconds", 1,
                          "--timeout", 5, *args)
    assert rc == 2 and out == "", (rc, out[-300:], err)
    assert f"vring driver: FrameDoesNotFit: a 9000-byte frame takes {JUMBO_DESCS} descriptors on transmitq" in err, err
    assert "more than the queue size 64" in err and "ring size of at least 128" in err, err
    assert server.server.connections == 0, "refused before connecting"
    assert time.monotonic() - t0 < 30


def test_driver_forwarding_without_count_is_not_refused_for_pkt_size(server, sock_path):
    """macfwd without --count forwards what it receives: --pkt-size says nothing about those frames."""
    rc, out, err = driver(sock_path, "--pkt-size", 9000, "--buf-size", BUF, "--ring-size", 64, "--seconds", 0.3,
                          "--drain", 0)
    assert rc == 0, err
    assert json.loads(out)["tx"]["errors"] == 0


def test_a_refused_injection_is_not_retried():
    """A frame the Tx queue refuses (it can never fit) ends the injection at once: one error counted, the frame
    freed and counted as a Tx failure, not retried until the deadline (it was, 1.7 M times)."""
    cfg = DriverConfig("", ring_size=8, buf_size=BUF, pkt_size=9 * ROOM, mode="macfwd", count=1, timeout=10)
    nq = NetQueues(bit(VIRTIO_F_INDIRECT_DESC), size=8, nbufs=64, buf_size=BUF)
    try:
        loop = _Loop(cfg, nq, _Stop())
        assert loop._gen(1) == 1
        free = nq.pool.available
        assert loop._send_all(1, time.monotonic() + cfg.timeout) == 0
        assert nq.tx.counters()["errors"] == 1 and loop.tx_fail == 1
        assert nq.pool.available == free + 9
    finally:
        nq.close()


@pytest.mark.parametrize("mode", [("--mode", "macfwd", "--count", 8), ("--mode", "rate", "--rate", 1000),
                                  ("--mode", "rxonly", "--verify")], ids=["macfwd", "rate", "rxonly-verify"])
def test_net_27_without_mrg_rxbuf_a_frame_larger_than_an_rx_buffer_is_refused(server, sock_path, mode):
    """Without MRG_RXBUF the device puts each frame into one Rx buffer (1920 bytes: 2048 - 140 headroom + the
    12-byte header) and drops what does not fit: the run used to lose every frame and exit 0."""
    rc, out, err = driver(sock_path, "--no-mrg-rxbuf", "--pkt-size", 1909, "--seconds", 1, *mode)
    assert rc == 2 and out == "", (rc, out[-300:], err)
    assert ("vring driver: FrameDoesNotFit: a 1909-byte frame and its 12-byte header do not fit one 1920-byte Rx "
            "buffer") in err and "NET-27" in err and "buffer size of at least 2112" in err, err
    assert server.server.connections == 0, "refused before connecting"


def test_net_30_macfwd_count_beyond_what_the_rx_ring_holds_is_refused(server, sock_path):
    """--buf-size 192: 64 bytes a posted Rx buffer, so a 64-byte frame and its header take 2 (NET-30) and a
    256-entry Rx ring holds 128 frames. --count 256 used to run, the device dropped 128 at once, and the run
    exited 0 (only --verify said so). Refused before connecting; 128 forward with nothing missing."""
    rc, out, err = driver(sock_path, "--buf-size", 192, "--count", 256, "--seconds", 1)
    assert rc == 2 and out == "", (rc, out[-300:], err)
    assert ("vring driver: ConfigError: 256 frames injected, but the Rx ring holds 128 (256 entries, 2 Rx buffers "
            "a 64-byte frame, buffer size 192): the device would drop 128 of them; inject at most 128") in err, err
    assert server.server.connections == 0, "refused before connecting"
    rc, out, err = driver(sock_path, "--buf-size", 192, "--count", 128, "--verify", "--seconds", 0.5, "--drain", 0.5)
    assert rc == 0, err
    res = json.loads(out)
    assert res["verify"]["missing"] == 0 and res["verify"]["bad"] == 0 and res["tx"]["dropped"] == 0, res



def test_macfwd_count_beyond_what_the_tx_ring_holds_is_refused(server, sock_path):
    """--tx-hdr chain: 2 descriptors a frame, so a 256-entry Tx ring holds 128 frames. --count 256 passed the Rx
    check, ran, and the driver dropped 128 at once when they all came back to go out (tx dropped 128, exit 0,
    --verify quiet: every frame had been seen once). Refused before connecting; 128 forward with none dropped."""
    rc, out, err = driver(sock_path, "--tx-hdr", "chain", "--count", 256, "--seconds", 1)
    assert rc == 2 and out == "", (rc, out[-300:], err)
    assert ("vring driver: ConfigError: 256 frames injected, but the Tx ring holds 128 (256 entries, 2 descriptors "
            "a 64-byte frame): the driver would drop 128 of them") in err, err
    assert server.server.connections == 0, "refused before connecting"
    rc, out, err = driver(sock_path, "--tx-hdr", "chain", "--count", 128, "--verify", "--seconds", 0.5,
                          "--drain", 0.5)
    assert rc == 0, err
    res = json.loads(out)
    assert res["verify"]["missing"] == 0 and res["verify"]["bad"] == 0 and res["tx"]["dropped"] == 0, res
    assert res["drained"] == 128, res


@pytest.mark.parametrize("indirect, count, refused", [(True, 128, False), (False, 85, False), (False, 86, True)])
def test_check_injected_counts_tx_descriptors_a_frame(indirect, count, refused):
    """--buf-size 192: a 64-byte frame in 2 pool buffers, a chain of 3 with its header: one indirect descriptor
    (the Rx ring's 128 frames fit a 256-entry Tx ring), or 3 ring descriptors without VIRTIO_F_INDIRECT_DESC (85
    fit)."""
    cfg = DriverConfig("", mode="macfwd", count=count, buf_size=192, indirect=indirect)
    if refused:
        with pytest.raises(ConfigError, match=f"{count} frames injected, but the Tx ring holds 85 .256 entries, 3 "):
            cfg.check()
    else:
        cfg.check()


@pytest.mark.parametrize("mrg, count, refused", [(True, 64, False), (True, 65, True), (False, 64, False),
                                                  (False, 65, True)])
def test_check_injected_counts_rx_buffers_a_frame(mrg, count, refused):
    """Ring of 64: with MRG_RXBUF a 1000-byte frame in 2048-byte buffers takes 1 (64 fit), without it one buffer
    a frame (check_rx_frame refuses frames larger than one)."""
    features = bit(VIRTIO_NET_F_MRG_RXBUF) if mrg else 0
    if refused:
        with pytest.raises(ConfigError, match=f"{count} frames injected, but the Rx ring holds 64"):
            check_injected(count, 1000, features, 64)
    else:
        check_injected(count, 1000, features, 64)
    with pytest.raises(ConfigError, match="Rx ring holds 9 .*3 Rx buffers a 1000-byte frame, buffer size 512"):
        check_injected(10, 1000, bit(VIRTIO_NET_F_MRG_RXBUF), 27, buf_size=512)  # 384 bytes a buffer


def test_net_27_without_mrg_rxbuf_a_frame_that_fills_an_rx_buffer_arrives(server, sock_path):
    rc, out, err = driver(sock_path, "--no-mrg-rxbuf", "--pkt-size", 1908, "--count", 8, "--seconds", 0.5,
                          "--verify")
    res = json.loads(out)
    assert rc == 0 and res["warnings"] == [], err
    assert res["rx"]["packets"] >= 8 and res["rx"]["merged"] == 0
    assert res["verify"]["bad"] == 0 and res["verify"]["missing"] == 0, res["verify"]


@pytest.mark.parametrize("mrg", [False, True], ids=["no_mrg_rxbuf", "mrg_rxbuf"])
def test_net_24_small_rx_buffers_without_mrg_rxbuf_are_a_warning(server, sock_path, mrg):
    """128-byte Rx buffers: below NET-24's 1526 without MRG_RXBUF (a SHOULD): the run goes on, the frames fit and
    arrive, and the report says so. With MRG_RXBUF larger frames would span buffers: no warning."""
    rc, out, err = driver(sock_path, "--mrg-rxbuf" if mrg else "--no-mrg-rxbuf", "--buf-size", BUF, "--pkt-size",
                          64, "--count", 8, "--seconds", 0.5, "--verify")
    res = json.loads(out)
    assert rc == 0, err
    assert res["rx"]["packets"] >= 8 and res["verify"]["missing"] == 0 and res["verify"]["bad"] == 0
    if mrg:
        assert res["warnings"] == [] and "warning" not in err, err
    else:
        want = f"Rx buffers of {ROOM + 12} bytes without VIRTIO_NET_F_MRG_RXBUF: NET-24 asks for at least 1526"
        assert len(res["warnings"]) == 1 and res["warnings"][0].startswith(want), res["warnings"]
        assert f"vring driver: warning: {want}" in err, err


@pytest.mark.parametrize("fmt", ["--split", "--packed"])
def test_split_l_06_packed_l_04_queue_size_1_runs_with_indirect_negotiated(server, sock_path, fmt):
    """SPLIT-L-06 / PACKED-L-04: a queue of one entry is a valid queue. With VIRTIO_F_INDIRECT_DESC negotiated (the
    default) the driver has no indirect table to give it (a table holds 2..queue size entries): its one-descriptor
    frames go directly into the ring. It used to fail at start with "indirect tables must hold 2..1 entries"."""
    rc, out, err = driver(sock_path, fmt, "--ring-size", 1, "--count", 1, "--seconds", 0.3, "--drain", 0)
    assert rc == 0, err
    res = json.loads(out)
    assert "INDIRECT_DESC" in res["feature_names"] and res["injected"] == 1 and res["rx"]["packets"] > 1, res


@pytest.mark.parametrize("fmt", ["--split", "--packed"])
def test_net_26_macfwd_verify_reposts_rx_before_it_forwards(server, sock_path, fmt):
    """NET-26: a 360-byte frame and its header take 6 of the 8 Rx buffers (64 bytes each, MRG_RXBUF) and, sent back,
    8 Tx descriptors (7 segments of 52 data bytes + the header). macfwd --verify (Python once per burst) received it
    and sent it back before reposting: the backend found two buffers and dropped the frame, and the run went on with
    nothing in flight (1 frame seen, 1 missing). The C loop reposts before every send; so must this one. End to end:
    the receive's own refill often hides the defect here; the deterministic guard is
    test_virtio_rx.py::test_net_26_python_macfwd_reposts_rx_before_it_sends."""
    rc, out, err = driver(sock_path, fmt, "--ring-size", 8, "--buf-size", 192, "--pkt-size", 360, "--count", 1,
                          "--verify", "--seconds", 0.3, "--drain", 0)
    assert rc == 0, err
    res = json.loads(out)
    assert res["verify"]["missing"] == 0 and res["verify"]["bad"] == 0, res["verify"]
    assert res["rx"]["packets"] > 10, res["rx"]


@pytest.mark.parametrize("ring, refused", [(72, False), (71, False), (70, True)])
def test_net_30_rxonly_verify_refuses_a_frame_longer_than_the_rx_ring_holds(ring, refused):
    """rxonly --verify expects --pkt-size frames: with MRG_RXBUF a 9000-byte frame and its header take ceil(9012 /
    128) = 71 buffers of a 256-byte pool (NET-30; each holds 128 bytes of header and frame), all at once. A ring of
    70 could never receive one, and the run waited for frames that never came; now it is refused before connecting.
    A ring of exactly 71 is one DPDK's net_vhost cannot fill (see below): a warning."""
    cfg = DriverConfig("", ring_size=ring, buf_size=BUF, pkt_size=9000, mode="rxonly", verify=True)
    if refused:
        with pytest.raises(FrameDoesNotFit, match="9000-byte frame and its 12-byte header take 71 Rx buffers of "
                                                  "128 bytes .NET-30., more than the Rx ring's 70 entries") as e:
            cfg.check()
        # ceil(9012 / 70) = 129 bytes a buffer: 129 - 12 + 140 = 257, a pool buffer of 320
        assert e.value.fit_buf_size == 320 and "buffer size of at least 320" in str(e.value)
        DriverConfig("", ring_size=ring, buf_size=320, pkt_size=9000, mode="rxonly", verify=True).check()
    else:
        assert (cfg.check() == []) == (ring == 72)
    DriverConfig("", ring_size=ring, buf_size=BUF, pkt_size=9000, mode="rxonly").check()   # sizes not known


@pytest.mark.parametrize("ring, frame_len, warned", [
    (16, 2036, True), (32, 2036, False),             # 16 buffers: the ring's size (DPDK reserves at most size - 1)
    (512, 32756, False), (512, 32884, True),         # 256 / 257 buffers (DPDK: at most 256 descriptors a frame)
    (1024, 65535, True),
])
def test_net_30_a_frame_dpdk_net_vhost_can_never_deliver_is_a_warning(ring, frame_len, warned):
    """DPDK's vhost (lib/vhost/virtio_net.c, reserve_avail_buf_split/_packed, BUF_VECTOR_MAX) takes at most ring
    size - 1 mergeable Rx buffers for one frame, and at most 256 descriptors: measured with dpdk-testpmd txonly
    --txpkts and vring driver --mode rxonly --buf-size 256, a 2036-byte frame (16 buffers) never arrives through a
    ring of 16 and does through 32; a 32884-byte one (257) never arrives through a ring of 512, a 32756-byte one
    (256) does. Our device and the kernel's fill the whole ring, so these are warnings, not refusals."""
    cfgs = [DriverConfig("", ring_size=ring, buf_size=BUF, pkt_size=frame_len, mode="rxonly", verify=True)]
    if ring >= 512:   # our own frames coming back (the Tx chain fits the ring)
        cfgs.append(DriverConfig("", ring_size=ring, buf_size=BUF, pkt_size=frame_len, mode="macfwd", count=1))
    for cfg in cfgs:
        warnings = cfg.check()
        assert bool([w for w in warnings if "DPDK's net_vhost" in w]) == warned, warnings


@pytest.mark.parametrize("args, warned", [
    (dict(pkt_size=9000, count=48, reconnect=True), True),     # 48 + 48 copies: 96 frames, the Rx ring holds 51
    (dict(pkt_size=9000, count=25, reconnect=True), False),    # 50 frames fit
    (dict(pkt_size=9000, count=48, server=True), True),
    (dict(pkt_size=9000, count=48, reconnect=True, inflight=False), False),   # nothing taken again
    (dict(pkt_size=9000, count=48), False),                    # no restart
    (dict(pkt_size=1500, count=256, reconnect=True), False)])  # one Rx buffer a frame: the Tx ring bounds the copies
def test_net_30_macfwd_count_a_restart_overflows_with_its_copies_is_a_warning(args, warned):
    """A restarted backend takes again the Tx chains its predecessor delivered and did not complete (inflight
    tracking): up to --count copies, one Tx descriptor each. When a frame takes more Rx buffers than Tx slots
    (a 9000-byte frame: 5 buffers of 2048, 1 indirect descriptor) injected frames and copies overflow the Rx ring
    and the device drops injected frames (measured: --count 48, crash-after 50, 13 absent, verify missing 0)."""
    ws = DriverConfig("", mode="macfwd", **args).check()
    hit = [w for w in ws if "taken again" in w]
    assert bool(hit) == warned, ws
    if warned:
        assert "inject at most 25" in hit[0], hit


@pytest.mark.parametrize("fmt", ["--split", "--packed"])
def test_net_06_net_29_headroom_128_forwards_every_frame(server, sock_path, fmt):
    """--headroom 128 (each frame on a cache line, its header in the line before, where the Tx header goes and the
    Rx header lands): 128 frames forward through our backend with nothing missing or bad; with --buf-size 192 a
    posted Rx buffer (76 bytes) holds a 64-byte frame and its header exactly. A headroom the header does not fit,
    or one that leaves no data room, is refused before connecting."""
    rc, out, err = driver(sock_path, fmt, "--headroom", 128, "--count", 128, "--verify", "--seconds", 0.5,
                          "--drain", 0.5)
    assert rc == 0, err
    res = json.loads(out)
    assert res["config"]["headroom"] == 128
    assert res["verify"]["missing"] == 0 and res["verify"]["bad"] == 0 and res["tx"]["dropped"] == 0, res
    assert res["tx"]["fast_path"] > 0 and res["tx"]["slow_path"] == 0, res["tx"]
    rc, out, err = driver(sock_path, fmt, "--headroom", 128, "--buf-size", 192, "--count", 64, "--verify",
                          "--seconds", 0.5, "--drain", 0.5)
    assert rc == 0, err
    assert json.loads(out)["rx"]["merged"] == 0
    connections = server.server.connections
    # attack63: beyond data_off's 16 bits a traceback after connecting; under 12 data bytes the MAC swap went past
    # the first buffer's frame bytes, under 50 the timestamp went unwritten (latency silently not measured)
    for bad in ((8, 2048), (2048, 2048), (192, 192), (65600, 65664), (2040, 2048), (2000, 2048), (141, 192)):
        rc, out, err = driver(sock_path, "--headroom", bad[0], "--buf-size", bad[1], "--seconds", 1)
        assert rc == 2 and out == "", (bad, rc, out[-300:], err)
        assert "need 12 <= headroom <= 65535, buf_size - headroom >= 52 (a frame's MACs and timestamp in its first " \
               f"buffer) and buf_size a multiple of 64 (headroom={bad[0]}, buf_size={bad[1]})" in err, err
    assert server.server.connections == connections, "refused before connecting"


def _carries(check, buf):
    try:
        check(buf)
        return True
    except FrameDoesNotFit:
        return False


def _assert_fit_buf_size(check, headroom, buf0):
    """FrameDoesNotFit.fit_buf_size, when the check refuses buf0: a pool geometry that carries the frame, whose
    64 bytes less do not; None only when no buffer size up to 128 KiB carries it."""
    try:
        check(buf0)
        return
    except FrameDoesNotFit as e:
        fit = e.fit_buf_size
        if fit is None:
            assert not any(_carries(check, b) for b in range(align_up(headroom + MIN_ROOM, 64), 131073, 64)), e
            return
        check_geometry(fit, headroom)
        assert f"buffer size of at least {fit}" in str(e), e
        assert _carries(check, fit), (fit, e)
        assert fit - headroom - 64 < MIN_ROOM or not _carries(check, fit - 64), (fit, e)


def _features(version_1, mrg, indirect, packed):
    return ((version_1 << VIRTIO_F_VERSION_1) | (mrg << VIRTIO_NET_F_MRG_RXBUF) | (indirect << VIRTIO_F_INDIRECT_DESC)
            | (packed << VIRTIO_F_RING_PACKED))


_ring_sizes = st.one_of(st.integers(0, 15).map(lambda k: 1 << k), st.integers(1, 32768))


@settings(max_examples=300, deadline=None)
@given(frame=st.integers(60, 65523), headroom=st.integers(12, 2000), size=_ring_sizes, extra=st.integers(0, 40),
       flags=st.tuples(*[st.booleans()] * 5), hdr=st.sampled_from(TX_HDR))
@example(frame=1000, headroom=140, size=1, extra=0, flags=(True, True, True, False, False), hdr="headroom")
def test_split_d_05_fit_buf_size_is_the_smallest_buffer_a_tx_frame_fits(frame, headroom, size, extra, flags, hdr):
    """attack64: a ring of one entry carries a frame in one descriptor (the header in its headroom), and said no
    buffer size would."""
    v1, mrg, ind, packed, slow = flags
    features = _features(v1, mrg, ind, packed)
    buf0 = align_up(headroom + MIN_ROOM, 64) + 64 * extra
    _assert_fit_buf_size(lambda b: check_tx_frame(frame, features, size, buf_size=b, headroom=headroom, hdr=hdr,
                                                  force_slow=slow), headroom, buf0)


@settings(max_examples=300, deadline=None)
@given(frame=st.integers(60, 65523), headroom=st.integers(12, 2000), size=_ring_sizes, extra=st.integers(0, 40),
       flags=st.tuples(*[st.booleans()] * 3))
def test_net_27_net_30_fit_buf_size_is_the_smallest_buffer_an_rx_frame_fits(frame, headroom, size, extra, flags):
    v1, mrg, packed = flags
    features = _features(v1, mrg, False, packed)
    buf0 = align_up(headroom + MIN_ROOM, 64) + 64 * extra
    _assert_fit_buf_size(lambda b: check_rx_frame(frame, features, buf_size=b, headroom=headroom, ring_size=size),
                         headroom, buf0)


@pytest.mark.parametrize("packed, advice", [(False, "ring size of at least 256"), (True, "ring size of at least 141")])
def test_split_l_06_ring_size_advice_is_a_size_the_layout_takes(packed, advice):
    """attack64: a split ring's advice was 141 (not a power of 2, refused in turn); a packed ring's Tx advice was
    rounded up to one."""
    features = _features(True, True, False, packed)
    with pytest.raises(FrameDoesNotFit, match=advice):
        check_rx_frame(9000, features, buf_size=192, headroom=140, ring_size=128)
    with pytest.raises(FrameDoesNotFit, match="ring size of at least " + ("79" if packed else "128")):
        check_tx_frame(9000, features, 64, buf_size=256, headroom=140)
