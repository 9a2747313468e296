"""vhost-user server: the DPDK 22.11 virtio_user sequence, malformed messages, disconnects (issue 4).

The frontend is scripted (vhost.testing.ScriptedFrontend): exact message order of shared/spec/vhost-user.md
section 2.1, real rings in shared memory driven by rings.virtq.DriverQueue.
"""
import logging
import os
import stat
import struct
import time

import pytest

from rings import vhost_user as vu
from rings.errors import PeerGone, ProtocolNack
from vhost.datapath import Options
from vhost.device import OFFERED_FEATURES, OFFERED_PROTOCOL_FEATURES
from vhost.testing import (GPA_BASE, HDR, MMAP_OFFSET, REGION_SIZE, UADDR_BASE, ScriptedFrontend,
                           ThreadedServer, frame)

R = vu.VhostUserRequest


def wait_running(server, running=True):
    assert server.wait(lambda s: bool(s.device and s.device.datapath) == running), \
        f"data path did not {'start' if running else 'stop'}"


def roundtrip(fe, n, layout="one", size=60):
    frames = [frame(i, size) for i in range(n)]
    fe.post_rx(n)
    assert fe.send(frames, layout) == n
    got = fe.receive_until(n)
    deadline = time.monotonic() + 5
    tx_done = 0
    while tx_done < n and time.monotonic() < deadline:
        tx_done += len(fe.reclaim_tx())
    return frames, got, tx_done


def macswapped(f):
    return f[6:12] + f[0:6] + f[12:]


def test_socket_mode_0600(server, sock_path):
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_dpdk_sequence_and_traffic(server, sock_path, packed):
    """Steps 1-25 of the DPDK 22.11 virtio_user sequence; packets loop macswapped; GET_VRING_BASE stops."""
    with ScriptedFrontend(sock_path, packed=packed).connect() as fe:
        assert fe.call(R.GET_FEATURES) == OFFERED_FEATURES
        assert OFFERED_FEATURES >> 30 & 1 and not OFFERED_FEATURES >> 22 & 1   # bit 30 yes, MQ no
        assert fe.call(R.GET_PROTOCOL_FEATURES) == OFFERED_PROTOCOL_FEATURES == 0x11008   # + INFLIGHT_SHMFD
        fe.negotiate()
        fe.start()
        wait_running(server)
        for layout in ("one", "split-hdr", "scattered"):   # SPLIT-V-01 / NET-21: any descriptor layout
            frames, got, tx_done = roundtrip(fe, 40, layout)
            assert tx_done == 40
            assert len(got) == 40
            for f, (data, n) in zip(frames, got):
                assert n == HDR + len(f)                                   # used len = bytes written
                assert data[:10] == bytes(10)                              # NET-33/34: no offload flags
                assert struct.unpack_from("<H", data, 10)[0] == 1          # NET-28/29: num_buffers 1
                assert data[HDR:] == macswapped(f)
        bases = fe.stop()
        wait_running(server, False)
        # 120 buffers went through each ring. Packed: slot | wrap << 15, and the Tx ring used 40 * (1 + 2 + 4)
        # = 280 descriptors, so it wrapped once (slot 24, wrap 0); split counts buffers
        assert bases == ([0x8000 | 120, 24] if packed else [120, 120])
    assert server.wait(lambda s: s.conn is None)
    st = server.server.stats()
    assert st["txq1"]["tx_packets"] == 120 and st["rxq0"]["rx_packets"] == 120
    assert st["rxq0"]["rx_dropped"] == 0 and st["refused"] == 0


def test_mergeable_spreads_over_buffers(server, sock_path):
    """NET-29/30/32: a 1514-byte frame into 256-byte buffers takes ceil(1526/256) = 6 buffers."""
    with ScriptedFrontend(sock_path, mrg_rxbuf=True).connect() as fe:
        fe.negotiate()
        fe.start()
        wait_running(server)
        fe.post_rx(12, size=256)
        f = frame(7, 1514)
        fe.send([f])
        got = fe.receive_until(6)
        assert [n for _d, n in got] == [256] * 5 + [1526 - 5 * 256]
        assert struct.unpack_from("<H", got[0][0], 10)[0] == 6
        assert b"".join(d for d, _n in got)[HDR:] == macswapped(f)


def test_no_mrg_rxbuf_header_num_buffers_1(server, sock_path):
    with ScriptedFrontend(sock_path, mrg_rxbuf=False, in_order=False).connect() as fe:
        fe.negotiate()
        fe.start()
        wait_running(server)
        frames, got, _ = roundtrip(fe, 8)
        assert [struct.unpack_from("<H", d, 10)[0] for d, _n in got] == [1] * 8   # NET-28


# -- malformed messages ---------------------------------------------------------------------------


def raw_send(conn, request, flags, payload=b"", fds=()):
    conn.send(vu.Message(request, flags, payload, list(fds)))


def expect_nack(conn, request):
    rep = conn.recv(timeout=5)
    assert rep.flags == 0x5 and rep.request == request
    assert vu.unpack_u64(rep.payload) == 1


def still_alive(fe):
    assert fe.call(R.GET_FEATURES) == OFFERED_FEATURES


def test_malformed_with_need_reply_are_nacked(server, sock_path, caplog):
    caplog.set_level(logging.ERROR, logger="vhost")
    with ScriptedFrontend(sock_path).connect() as fe:
        conn = fe.conn
        # short payload
        raw_send(conn, R.SET_VRING_NUM, 0x9, b"\0\0\0\0")
        expect_nack(conn, R.SET_VRING_NUM)
        # wrong fd count: KICK without NOFD and without an fd; CALL with two fds
        raw_send(conn, R.SET_VRING_KICK, 0x9, vu.pack_u64(0))
        expect_nack(conn, R.SET_VRING_KICK)
        raw_send(conn, R.SET_VRING_CALL, 0x9, vu.pack_u64(0), fe.callfds)
        expect_nack(conn, R.SET_VRING_CALL)
        # unknown request
        raw_send(conn, 99, 0x9)
        expect_nack(conn, 99)
        still_alive(fe)
        fe.negotiate()
        # a region that ends outside its file
        big = vu.MemRegion(GPA_BASE, REGION_SIZE + 4096, UADDR_BASE, MMAP_OFFSET)
        with pytest.raises(ProtocolNack):
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([big]), [fe.shm.fileno()], need_reply=True)
        # the good table, then a vring whose used ring lies outside it
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.call(R.SET_VRING_NUM, vu.VringState(0, 256).pack())
        bad = vu.VringAddr(0, 0, UADDR_BASE, UADDR_BASE + REGION_SIZE - 8, UADDR_BASE + 0x1000)
        raw_send(conn, R.SET_VRING_ADDR, 0x9, bad.pack())
        expect_nack(conn, R.SET_VRING_ADDR)
        # a vring that does not exist (no MQ), a feature that was not offered
        raw_send(conn, R.SET_VRING_NUM, 0x9, vu.VringState(5, 256).pack())
        expect_nack(conn, R.SET_VRING_NUM)
        raw_send(conn, R.SET_FEATURES, 0x9, vu.pack_u64(1 << 22))
        expect_nack(conn, R.SET_FEATURES)
        still_alive(fe)
    assert server.wait(lambda s: s.conn is None)
    assert server.server.refused == 8
    text = caplog.text
    for needle in ("payload is 4 bytes", "carries 0 fds, expected 1", "carries 2 fds", "unknown request 99",
                   "ends outside its file", "outside the memory table", "vring 5 does not exist",
                   "not offered"):
        assert needle in text, needle


@pytest.mark.parametrize("what", ["short", "unknown", "fds", "addr"])
def test_malformed_without_need_reply_closes_connection(server, sock_path, what):
    """DPDK closes the connection on a bad request without NEED_REPLY; the server then takes the next one."""
    with ScriptedFrontend(sock_path).connect() as fe:
        if what == "short":
            raw_send(fe.conn, R.SET_FEATURES, 0x1, b"\1\2\3")
        elif what == "unknown":
            raw_send(fe.conn, 77, 0x1)
        elif what == "fds":
            raw_send(fe.conn, R.SET_OWNER, 0x1, b"", [fe.callfds[0]])
        else:
            fe.negotiate()
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            fe.call(R.SET_VRING_NUM, vu.VringState(1, 256).pack())
            raw_send(fe.conn, R.SET_VRING_ADDR, 0x1, vu.VringAddr(1, 0, 0x1000, 0x2000, 0x3000).pack())
        with pytest.raises(PeerGone):
            fe.conn.recv(timeout=5)
    assert server.wait(lambda s: s.conn is None)
    with ScriptedFrontend(sock_path).connect() as fe:
        still_alive(fe)


@pytest.mark.parametrize("when", ["after-mem-table", "running", "half-message"])
def test_disconnect_in_the_middle(server, sock_path, when):
    fe = ScriptedFrontend(sock_path).connect()
    try:
        fe.negotiate()
        if when == "after-mem-table":
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        elif when == "running":
            fe.start()
            wait_running(server)
            fe.post_rx(16)
            fe.send([frame(i) for i in range(16)])
        else:
            fe.conn.sock.sendall(struct.pack("<III", R.SET_VRING_NUM, 1, 8) + b"\0\0")   # 2 of 8 bytes
    finally:
        fe.close()
    assert server.wait(lambda s: s.conn is None)
    with ScriptedFrontend(sock_path).connect() as fe:   # the next frontend gets the full service
        fe.negotiate()
        fe.start()
        wait_running(server)
        _frames, got, _ = roundtrip(fe, 8)
        assert len(got) == 8


def test_status_and_get_vring_base_before_setup(server, sock_path):
    """Pitfall 5: after a virtio_user server-mode reconnect, ENABLE(0) and GET_VRING_BASE come first, without
    SET_OWNER; the request's num is garbage and is ignored."""
    with ScriptedFrontend(sock_path).connect() as fe:
        for i in range(2):
            fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 0).pack())
        rep = vu.client_call(fe.conn, R.GET_VRING_BASE, vu.VringState(1, 0x55E4).pack())
        assert rep.flags == 0x5 and vu.decode(rep, reply=True) == vu.VringState(1, 0)
        fe.call(R.SET_STATUS, vu.pack_u64(0xB), need_reply=True)
        assert fe.call(R.GET_STATUS) == 0xB


def test_broken_ring_breaks_only_that_queue(server, sock_path, caplog):
    """A Tx avail idx that jumps past the ring size breaks vring 1 (typed RingError in the log); the Rx queue
    and the process survive, and the next connection is served."""
    caplog.set_level(logging.ERROR, logger="vhost")
    with ScriptedFrontend(sock_path).connect() as fe:
        fe.negotiate()
        fe.start()
        wait_running(server)
        lay = fe.layouts[1]
        fe.mem.write(lay.driver + 2, struct.pack("<H", 1000))   # avail.idx jumps by 1000 > 256
        assert server.wait(lambda s: s.ring_errors == 1)
        assert "AvailIdxJump" in caplog.text and "vring 1 broken" in caplog.text
        assert server.server.device.datapath is not None   # still running (the Rx side)
        still_alive(fe)
    assert server.wait(lambda s: s.conn is None)
    with ScriptedFrontend(sock_path).connect() as fe:
        fe.negotiate()
        fe.start()
        wait_running(server)
        _frames, got, _ = roundtrip(fe, 8)
        assert len(got) == 8


def test_client_mode_connects_out_and_reconnects(tmp_path):
    """--client: the backend connects to a listening frontend, and again after the frontend drops it."""
    path = str(tmp_path / "fe.sock")
    listener = vu.listen_unix(path)
    srv = ThreadedServer(path, Options(), client=True, reconnect_s=0.05)
    try:
        for _ in range(2):
            conn = vu.accept_unix(listener, timeout=5)
            rep = vu.client_call(conn, R.GET_FEATURES)
            assert vu.decode(rep, reply=True) == OFFERED_FEATURES
            conn.close()
        assert srv.wait(lambda s: s.connections >= 2)
    finally:
        srv.close()
        listener.close()
        os.unlink(path)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_cli_signal_exits_cleanly_with_final_counters(tmp_path, sig):
    """`vring vhost` exits 0 on SIGINT/SIGTERM, prints the final per-queue counters and removes its socket."""
    import signal

    from vhost.testing import VhostProcess
    sock = str(tmp_path / "cli.sock")
    with VhostProcess(sock, "--fwd", "io", stats_interval=0.2) as be:
        be.wait_socket()
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        with ScriptedFrontend(sock).connect() as fe:
            fe.negotiate()
            fe.start()
            deadline = time.monotonic() + 5
            fe.post_rx(8)
            fe.send([frame(i) for i in range(8)])
            got = []
            while len(got) < 8 and time.monotonic() < deadline:
                got += fe.receive()
        time.sleep(0.5)
        be.proc.send_signal(getattr(signal, sig))
        assert be.proc.wait(10) == 0
        final = be.stop()
        periodic = [x for x in be.stdout().splitlines() if '"final": false' in x]
    assert len(got) == 8
    assert final["rxq0"]["rx_packets"] == 8 and final["txq1"]["tx_packets"] == 8 and final["connections"] == 1
    assert periodic, "no periodic counters"
    assert not os.path.exists(sock)
