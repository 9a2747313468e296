"""vring vhost against careless and hostile frontends (issue 8): vring bases that stop naming a slot of the
ring, a second server on a live socket, silent and competing frontends.

The frontend is scripted (vhost.testing.ScriptedFrontend) over real rings in shared memory.
"""
import logging
import os
import time

import pytest

from rings import vhost_user as vu
from rings.errors import ProtocolNack
from rings.layout import QueueLayout
from rings.virtq import DriverQueue
from vhost.datapath import Options
from vhost.testing import RING_AREA, GPA_BASE, ScriptedFrontend, ThreadedServer, frame

R = vu.VhostUserRequest


def queues(server):
    """(rx served, tx served) of the running data path, or None when it is not running."""
    dev = server.server.device
    dp = dev.datapath if dev is not None else None
    return None if dp is None else (dp.rxq is not None, dp.txq is not None)


def setup_vrings(fe, nums, bases):
    """Memory table, then per vring NUM, BASE, ADDR, KICK with the given sizes and bases; enable; DRIVER_OK.
    The frontend's layouts and driver queues follow the sizes."""
    fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
    vring_setup(fe, 0, nums[0], bases[0])
    vring_setup(fe, 1, nums[1], bases[1])
    enable_both(fe)


def enable_both(fe):
    for i in range(2):
        fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
    fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)


def vring_setup(fe, i, num, base):
    fe.layouts[i] = QueueLayout.contiguous(fe.fmt, num, GPA_BASE + i * RING_AREA)
    fe.call(R.SET_VRING_NUM, vu.VringState(i, num).pack())
    if base is not None:
        fe.call(R.SET_VRING_BASE, vu.VringState(i, base).pack())
    fe.call(R.SET_VRING_ADDR, fe.vring_addr(i).pack())
    fe.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), [fe.kickfds[i]])
    fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [fe.callfds[i]])   # GET_VRING_BASE closed it


def driver_queues(fe):
    fe.rxq = DriverQueue(fe.mem, fe.layouts[0], fe.features)
    fe.txq = DriverQueue(fe.mem, fe.layouts[1], fe.features)
    fe.mem.write(fe.layouts[0].desc, bytes(16 * fe.layouts[0].size))   # a fresh ring: no stale flags
    fe.mem.write(fe.layouts[1].desc, bytes(16 * fe.layouts[1].size))
    fe.rxq.enable_calls(False)
    fe.txq.enable_calls(False)


def roundtrip(fe, n=8):
    fe.post_rx(n)
    assert fe.send([frame(i) for i in range(n)]) == n
    return len(fe.receive_until(n))


def rebase_and_run(server, fe, index):
    """A valid base for vring `index` (slot 0, wrap 1) starts it; packets then loop."""
    fe.call(R.SET_VRING_BASE, vu.VringState(index, 0x8000).pack())
    assert server.wait(lambda s: queues(server) == (True, True)), queues(server)
    driver_queues(fe)
    assert roundtrip(fe) == 8


# -- packed vring bases (SET_VRING_BASE checked whenever it becomes effective) ---------------------------

def test_packed_base_before_num_outside_ring_does_not_start(server, sock_path, caplog):
    """SET_VRING_BASE before SET_VRING_NUM cannot be checked when it arrives; at queue start the engine
    refuses it (BaseOutOfRange) and that vring stays stopped, the other one runs."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=True).connect() as fe:
        fe.negotiate()
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.call(R.SET_VRING_BASE, vu.VringState(0, 0x8000 | 0x7FF0).pack())   # before NUM: unchecked
        vring_setup(fe, 0, 256, None)
        vring_setup(fe, 1, 256, 0x8000)
        enable_both(fe)
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        assert "after SET_VRING_NUM 256 the packed base 0xfff0" in caplog.text
        rebase_and_run(server, fe, 0)


def test_packed_base_kept_after_stop_then_smaller_num(server, sock_path, caplog):
    """A stop stores the used position as the base; a smaller SET_VRING_NUM without a new base must not make
    the engine address slot `base` past the ring."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=True).connect() as fe:
        fe.negotiate()
        setup_vrings(fe, (256, 256), (0x8000, 0x8000))
        assert server.wait(lambda s: queues(server) == (True, True))
        driver_queues(fe)
        for _ in range(5):
            assert roundtrip(fe) == 8
        bases = fe.stop()
        assert bases[0] == 0x8000 | 40
        assert server.wait(lambda s: queues(server) is None)
        setup_vrings(fe, (32, 256), (None, 0x8000))   # vring 0 shrinks to 32 and keeps base 40
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "after SET_VRING_NUM 32 the packed base 0x8028 (slot 40) is outside the ring of 32" in caplog.text
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        rebase_and_run(server, fe, 0)


def test_split_base_becomes_packed_with_set_features(server, sock_path, caplog):
    """A base stored under split features (free-running 1000) reads as packed slot 1000 once SET_FEATURES
    switches to packed: not started."""
    caplog.set_level(logging.WARNING, logger="vhost")
    with ScriptedFrontend(sock_path, packed=False).connect() as fe:
        fe.negotiate()
        fe.call(R.SET_VRING_NUM, vu.VringState(0, 256).pack())
        fe.call(R.SET_VRING_BASE, vu.VringState(0, 1000).pack())
        fe.packed, fe.fmt = True, "packed"
        fe.features = fe.features | (1 << 34)
        fe.call(R.SET_FEATURES, vu.pack_u64(fe.features), need_reply=True)
        assert "after SET_FEATURES the packed base 0x3e8 (slot 1000) is outside the ring of 256" in caplog.text
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.layouts[0] = QueueLayout.contiguous("packed", 256, GPA_BASE)
        fe.call(R.SET_VRING_ADDR, fe.vring_addr(0).pack())
        fe.call(R.SET_VRING_KICK, vu.VringFile(0).pack(), [fe.kickfds[0]])
        vring_setup(fe, 1, 256, 0x8000)
        enable_both(fe)
        assert server.wait(lambda s: queues(server) == (False, True)), queues(server)
        assert "vring 0 cannot start: BaseOutOfRange" in caplog.text
        rebase_and_run(server, fe, 0)


# -- one frontend at a time: busy refusal, silent frontends -------------------------------------------------

def test_second_frontend_gets_a_prompt_busy_refusal(server, sock_path, caplog):
    """While one frontend is served, another is refused at once (logged); our frontend's error is BackendBusy.
    The first frontend keeps its service."""
    from rings.errors import BackendBusy
    from virtio.frontend import VhostUserFrontend, want_features
    caplog.set_level(logging.INFO, logger="vhost")
    with ScriptedFrontend(sock_path).connect() as fe:
        fe.negotiate()
        for _ in range(2):
            other = VhostUserFrontend(sock_path, timeout=5.0)
            t0 = time.monotonic()
            try:
                other.connect()
                with pytest.raises(BackendBusy) as info:
                    other.negotiate(want_features(VERSION_1=True))
            finally:
                other.close()
            assert time.monotonic() - t0 < 2.0, "the refusal must be prompt, not a reply timeout"
            assert "busy" in str(info.value) and "serving another frontend" in str(info.value)
        fe.start()
        assert server.wait(lambda s: queues(server) == (True, True))
        assert roundtrip(fe) == 8
    assert server.wait(lambda s: s.conn is None)
    assert "refused a frontend: serving another frontend (connection 1)" in caplog.text
    st = server.server.stats()
    assert st["refused_busy"] == 2 and st["connections"] == 1


def test_silent_frontend_is_dropped_and_the_next_is_served(sock_path, caplog):
    """A frontend that connects and says nothing is dropped after the handshake timeout; meanwhile others get
    the busy refusal, afterwards they are served. One that asked GET_FEATURES is not dropped."""
    import socket as socketmod

    from rings.errors import BackendBusy
    from virtio.frontend import VhostUserFrontend, want_features
    caplog.set_level(logging.INFO, logger="vhost")
    srv = ThreadedServer(sock_path, Options(), handshake_timeout=0.5)
    silent = socketmod.socket(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
    try:
        silent.connect(sock_path)
        assert srv.wait(lambda s: s.conn is not None)
        fe = VhostUserFrontend(sock_path, timeout=5.0).connect()
        with pytest.raises(BackendBusy):
            fe.negotiate(want_features(VERSION_1=True))
        fe.close()
        assert srv.wait(lambda s: s.conn is None, timeout=3.0), "the silent frontend was not dropped"
        assert silent.recv(1) == b""                                    # closed by the server
        assert "sent no GET_FEATURES within 0.5s of connecting; dropping it" in caplog.text
        with VhostUserFrontend(sock_path, timeout=5.0).connect() as fe:
            assert fe.negotiate(want_features(VERSION_1=True))
            time.sleep(1.0)                                              # past the handshake timeout
            assert srv.server.conn is not None, "a frontend that negotiated must not be dropped"
            assert fe.call(R.GET_FEATURES)
    finally:
        silent.close()
        srv.close()


# -- a live socket is never taken over -------------------------------------------------------------------

def _vring(*args, timeout=20):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "vring.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_second_vring_vhost_on_a_live_socket_exits_2(tmp_path):
    """A second `vring vhost` on the socket of a running one: a clear error, exit 2; the first keeps serving.
    A stale socket file (nobody listens) is replaced."""
    from vhost.testing import VhostProcess
    sock = str(tmp_path / "vhost.sock")
    with VhostProcess(sock, "--fwd", "io") as be:
        be.wait_socket()
        ino = os.stat(sock).st_ino
        r = _vring("vhost", "--socket", sock, "--max-connections", "1")
        assert r.returncode == 2, r.stderr
        assert "a server is listening on this socket already; not taking it over" in r.stderr
        assert os.stat(sock).st_ino == ino
        with ScriptedFrontend(sock).connect() as fe:                    # still the first one's
            fe.negotiate()
        final = be.stop()
    assert final["connections"] == 1 and final["refused"] == 0
    import socket as socketmod
    stale = socketmod.socket(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
    stale.bind(sock)
    stale.close()                                                       # a socket file nobody listens on
    srv = ThreadedServer(sock, Options())
    try:
        with ScriptedFrontend(sock).connect() as fe:
            fe.negotiate()
    finally:
        srv.close()


def test_ctl_socket_is_never_taken_over(tmp_path):
    """--ctl: a live control socket makes the second process fail (exit 2) and leave the first alone; the
    vhost socket it had created is removed again."""
    from rings.ctl import ControlServer, query
    from rings.errors import ConfigError
    ctl = str(tmp_path / "ctl.sock")
    first = ControlServer(ctl).start()
    try:
        with pytest.raises(ConfigError, match="not taking it over"):
            ControlServer(ctl).start()
        sock = str(tmp_path / "vhost.sock")
        r = _vring("vhost", "--socket", sock, "--ctl", ctl)
        assert r.returncode == 2 and "not taking it over" in r.stderr, r.stderr
        assert not os.path.exists(sock)
        assert query(ctl) == []                                          # the first still answers
    finally:
        first.close()
    assert not os.path.exists(ctl)


# -- found by fuzz/ (vhost_backend): a queue that cannot start must not pin the guest memory ------------------

def _mapped_fds(path_part):
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += path_part in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.mark.parametrize("why", ["misaligned", "base"])
def test_queue_that_cannot_start_releases_the_memory_table(server, sock_path, why):
    """A vring refused at start (its ring misaligned in the backend's mapping, or its base outside the ring)
    kept the half-built queue alive through the error's frames: the region could not be unmapped when the
    memory table was replaced or the frontend left, and its fd stayed open until a garbage collection."""
    import gc
    gc.collect()
    gc.disable()
    try:
        with ScriptedFrontend(sock_path, packed=True).connect() as fe:
            name = fe.shm.name.lstrip("/")
            ours = _mapped_fds(name)            # the frontend's fd and mapping; a backend mapping adds 2 fds
            fe.negotiate()
            region = fe.mem_region()
            if why == "misaligned":   # the same memory, mapped 2 bytes off: every ring lands misaligned
                region = vu.MemRegion(region.gpa, region.size - 16, region.uaddr, region.mmap_offset + 2)
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([region]), [fe.shm.fileno()], need_reply=True)
            if why == "base":   # before SET_VRING_NUM, so that only the queue start can refuse it
                fe.call(R.SET_VRING_BASE, vu.VringState(0, 0x8000 | 300).pack())
            vring_setup(fe, 0, 256, 0x8000 if why == "misaligned" else None)
            vring_setup(fe, 1, 256, 0x8000)
            enable_both(fe)
            assert server.wait(lambda s: s.device is not None and s.device.vrings[0].broken is not None)
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            assert server.wait(lambda s: _mapped_fds(name) == ours + 2), "the replaced region is still mapped"
        assert server.wait(lambda s: s.conn is None and _mapped_fds(name) == 0), "a region outlived its connection"
    finally:
        gc.enable()


def _negotiate_with_inflight(fe, features):
    """The handshake with INFLIGHT_SHMFD, up to SET_FEATURES ``features`` (DRIVER_OK not yet)."""
    from rings.layout import bit
    PF = vu.VhostUserProtocolFeature
    fe.call(R.SET_OWNER)
    fe.call(R.GET_FEATURES)
    pf = fe.call(R.GET_PROTOCOL_FEATURES) & (bit(PF.REPLY_ACK) | bit(PF.STATUS) | bit(PF.INFLIGHT_SHMFD))
    fe.call(R.SET_PROTOCOL_FEATURES, vu.pack_u64(pf))
    for i in range(2):
        fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [fe.callfds[i]])
    fe.call(R.SET_FEATURES, vu.pack_u64(features))
    fe.features = features


@pytest.mark.parametrize("why", ["split-area-packed-rings", "packed-area-split-rings", "counter"])
def test_queue_refused_for_its_inflight_area_frees_the_memory_and_the_backend_serves_on(server, sock_path, why):
    """Found by attack43: an area laid out for one ring format (SET_INFLIGHT_FD under the features of the moment)
    and rings of the other (SET_FEATURES changed RING_PACKED afterwards) had the C tracking read the ring through
    the other format's pointer (NULL): SIGSEGV. A counter at 2^64-1 ended in an untyped OverflowError. Both are now
    an InflightError for the vring, and the refused queue no longer pins the memory table through the error's
    frames (as test_queue_that_cannot_start_releases_the_memory_table)."""
    import gc
    import mmap

    import numpy as np

    from vhost.inflight import DESC_SPLIT, HDR_SPLIT, queue_region_size
    from vhost.testing import features_for
    area_packed = why == "packed-area-split-rings"
    gc.collect()
    gc.disable()
    try:
        with ScriptedFrontend(sock_path, packed=why == "split-area-packed-rings").connect() as fe:
            name = fe.shm.name.lstrip("/")
            ours = _mapped_fds(name)
            _negotiate_with_inflight(fe, features_for(area_packed))
            rep = vu.client_call(fe.conn, R.GET_INFLIGHT_FD, vu.Inflight(0, 0, 2, fe.size).pack(), timeout=5)
            inf, fd = vu.decode(rep, reply=True), rep.take_fds()[0]
            try:
                if why == "counter":   # vring 1: version 1, head 0 in flight with the last counter there is
                    with mmap.mmap(fd, inf.mmap_size) as m:
                        off = queue_region_size(False, fe.size)
                        hdr = np.ndarray((), HDR_SPLIT, buffer=m, offset=off)
                        desc = np.ndarray(fe.size, DESC_SPLIT, buffer=m, offset=off + HDR_SPLIT.itemsize)
                        hdr["version"], hdr["desc_num"] = 1, fe.size
                        desc[0]["inflight"], desc[0]["counter"] = 1, 2**64 - 1
                        del hdr, desc
                fe.call(R.SET_INFLIGHT_FD, inf.pack(), [fd], need_reply=True)
            finally:
                os.close(fd)
            fe.features = features_for(fe.packed)
            fe.call(R.SET_FEATURES, vu.pack_u64(fe.features))
            fe.call(R.SET_STATUS, vu.pack_u64(0xB), need_reply=True)
            fe.start()
            assert server.wait(lambda s: s.device is not None and s.device.vrings[1].broken is not None)
            err = server.server.device.vrings[1].broken
            assert type(err).__name__ == "InflightError", repr(err)
            assert ("counter 0xffffffffffffffff" if why == "counter" else "inflight area was made for") in str(err)
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            assert server.wait(lambda s: _mapped_fds(name) == ours + 2), "the replaced region is still mapped"
        assert server.wait(lambda s: s.conn is None and _mapped_fds(name) == 0), "a region outlived its connection"
    finally:
        gc.enable()
    with ScriptedFrontend(sock_path).connect() as fe:   # alive, for the next frontend
        fe.negotiate()
        fe.start()
        fe.post_rx(8)
        fe.send([frame(i) for i in range(4)])
        assert len(fe.receive_until(4, timeout=5)) == 4


def test_a_frontend_that_reconnects_as_it_closes_is_not_refused_as_busy(server, sock_path):
    """Found by attack43: a frontend that closed its connection and connected again at once was refused "busy"
    about one time in three: the server looked at the listener (a second frontend: busy) before it read the old
    connection's EOF. The old connection is now read first, and one that hung up never makes a successor busy."""
    for i in range(20):
        fe = ScriptedFrontend(sock_path).connect()
        fe.negotiate()
        fe.close()
    assert server.server.refused_busy == 0
    # one that left 2000 messages unread (the server reads one per round) is no "other frontend" either
    gone = ScriptedFrontend(sock_path).connect()
    gone.conn.sock.sendall(vu.HEADER.pack(int(R.SET_OWNER), vu.VERSION, 0) * 2000)
    gone.close()
    with ScriptedFrontend(sock_path).connect() as fe:
        fe.negotiate()
    assert server.server.refused_busy == 0


def _stopped(proc):
    """SIGSTOP ``proc`` and wait until it is stopped (the signal is delivered asynchronously)."""
    import signal
    proc.send_signal(signal.SIGSTOP)
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.001)


def test_a_frontend_that_half_closes_still_gets_its_replies_and_a_newcomer_is_busy(tmp_path):
    """Found by attack45: shutdown(SHUT_WR) (POLLRDHUP alone) was taken for a hang-up: a frontend that had sent
    50 requests and still read the replies was dropped after one of them when a second frontend connected, and
    the second was served instead of told busy. Only a close (POLLHUP) makes the served frontend gone."""
    import signal
    import socket

    from vhost.testing import VhostProcess
    sock = str(tmp_path / "vh.sock")
    n = 50
    with VhostProcess(sock) as be:
        be.wait_socket()
        a = socket.socket(socket.AF_UNIX)
        a.connect(sock)
        a.settimeout(5)
        a.sendall(vu.HEADER.pack(int(R.GET_FEATURES), vu.VERSION, 0))
        assert len(a.recv(vu.HEADER.size + 8)) == vu.HEADER.size + 8   # accepted and served
        _stopped(be.proc)
        try:
            a.sendall(vu.HEADER.pack(int(R.GET_FEATURES), vu.VERSION, 0) * n)
            a.shutdown(socket.SHUT_WR)   # done asking, still reading
            b = socket.socket(socket.AF_UNIX)
            b.connect(sock)
        finally:
            be.proc.send_signal(signal.SIGCONT)
        got = b""
        while True:
            d = a.recv(65536)
            if not d:
                break
            got += d
        assert len(got) == n * (vu.HEADER.size + 8), len(got)
        b.settimeout(5)
        notice = vu.Connection(b).recv(timeout=5)
        assert vu.busy_text(notice), notice
        a.close()
        b.close()


def test_max_connections_1_serves_no_successor_that_came_in_the_same_round(tmp_path):
    """Found by attack44, a regression of the test above: the first frontend's EOF and a second connection seen in
    one round had the server attach the second at once, past --max-connections (serve() checks it between rounds).
    The successor now waits for the next round: with --max-connections 1 the server ends instead."""
    import signal

    from rings.errors import VringError
    from vhost.testing import VhostProcess
    from virtio.frontend import VhostUserFrontend
    sock = str(tmp_path / "vh.sock")
    with VhostProcess(sock, "--max-connections", "1") as be:
        be.wait_socket()
        first = VhostUserFrontend(sock, timeout=3).connect()
        first.call(R.GET_FEATURES)
        _stopped(be.proc)   # both events land in one select of the server
        try:
            first.close()
            second = VhostUserFrontend(sock, timeout=3).connect()
        finally:
            be.proc.send_signal(signal.SIGCONT)
        with pytest.raises(VringError):
            second.call(R.GET_FEATURES)
        second.close()
        assert be.proc.wait(10) == 0


def test_ring_size_left_by_the_other_format_is_refused_not_an_internal_error(server, sock_path, caplog):
    """Found by fuzz/vhost_backend: SET_VRING_NUM 75 under packed features (a valid packed size), then
    SET_FEATURES switching to split: the next SET_VRING_ADDR computed the split layout of 75 entries and the
    ConfigError escaped as an internal error. Now it is a refusal naming the size; the vring can be set again."""
    caplog.set_level(logging.ERROR, logger="vhost")
    with ScriptedFrontend(sock_path, packed=True).connect() as fe:
        fe.negotiate()
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        fe.call(R.SET_VRING_NUM, vu.VringState(0, 75).pack(), need_reply=True)
        fe.features &= ~(1 << 34)
        fe.call(R.SET_FEATURES, vu.pack_u64(fe.features), need_reply=True)
        fe.packed, fe.fmt = False, "split"
        with pytest.raises(ProtocolNack):
            fe.call(R.SET_VRING_ADDR, fe.vring_addr(0).pack(), need_reply=True)
        assert "split queue size must be a power of 2, got 75 (send SET_VRING_NUM again)" in caplog.text
        assert "internal error" not in caplog.text
        fe.call(R.SET_VRING_NUM, vu.VringState(0, 256).pack(), need_reply=True)
        fe.call(R.SET_VRING_ADDR, fe.vring_addr(0).pack(), need_reply=True)


def test_features_set_first_while_the_rings_run_restart_them_in_the_new_format(server, sock_path, caplog):
    """A frontend that started the rings without ever sending SET_FEATURES (features 0: split), then sent
    SET_FEATURES with RING_PACKED: the data path went on running split engines while the device described
    itself as packed (and would have encoded the vring base as packed at the stop). Found by an adversarial
    review. A change of features stops the data path whether or not features were set before; it restarts in
    the new format."""
    caplog.set_level(logging.INFO, logger="vhost")
    with ScriptedFrontend(sock_path, packed=False).connect() as fe:
        fe.call(R.SET_OWNER)
        fe.call(R.GET_FEATURES)
        for i in range(2):
            fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [fe.callfds[i]])
        fe.features = 0
        fe.start()
        assert server.wait(lambda s: s.device is not None and s.device.datapath is not None)
        assert not server.server.device.datapath.rxq.layout.packed
        fe.call(R.SET_FEATURES, vu.pack_u64(1 << 32 | 1 << 34), need_reply=True)   # VERSION_1 | RING_PACKED
        assert server.wait(lambda s: s.device.datapath is None or s.device.datapath.rxq.layout.packed), \
            "split engines still running under packed features"
        assert "data path stopped (features changed)" in caplog.text
