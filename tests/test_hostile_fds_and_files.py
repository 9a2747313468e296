"""What a hostile frontend, control socket or file, or a careless user, could do (found by an adversarial review):
unmappable memory and inflight fds, kick/call fds that are not eventfds, control replies of the wrong shape, dump
files that are not regular files, driver arguments out of range.

Each test failed before its fix: a leaked fd, a server hung in write(), a traceback instead of a one-line error.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rings import ctl, rawdump
from rings import vhost_user as vu
from rings.errors import ConfigError, VringError
from tests.procs import collect, wait_for
from vhost.device import NetDevice, Refused

R = vu.VhostUserRequest
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nfds():
    return len(os.listdir("/proc/self/fd"))


def _device(protocol_features=0):
    dev = NetDevice()
    dev.handle(vu.Message(R.SET_FEATURES, payload=vu.pack_u64(1 << 32 | 1 << 30)), 1 << 32 | 1 << 30)
    if protocol_features:
        dev.handle(vu.Message(R.SET_PROTOCOL_FEATURES, payload=vu.pack_u64(protocol_features)), protocol_features)
    return dev


def _handle(dev, request, payload, fds):
    msg = vu.Message(request, payload=payload, fds=fds)
    return dev.handle(msg, vu.decode(msg))


def test_set_inflight_fd_that_cannot_be_mapped_is_closed(tmp_path):
    """A read-only file cannot be mapped writable: the fd was leaked (one per message) before."""
    dev = _device(protocol_features=1 << vu.VhostUserProtocolFeature.INFLIGHT_SHMFD)
    path = tmp_path / "area"
    path.write_bytes(bytes(0x20000))
    before = _nfds()
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY)
        with pytest.raises(Refused, match="SET_INFLIGHT_FD"):
            _handle(dev, R.SET_INFLIGHT_FD, vu.Inflight(0x10000, 0, 2, 256).pack(), [fd])
    assert _nfds() == before
    dev.close()


def test_set_mem_table_fd_that_cannot_be_mapped_is_closed(tmp_path):
    dev = _device()
    path = tmp_path / "mem"
    path.write_bytes(bytes(0x20000))
    before = _nfds()
    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(Refused, match="SET_MEM_TABLE"):
        _handle(dev, R.SET_MEM_TABLE, vu.pack_mem_table([vu.MemRegion(0x1000, 0x10000, 0x10000000)]), [fd])
    assert _nfds() == before
    dev.close()


@pytest.mark.parametrize("request_", [R.SET_VRING_CALL, R.SET_VRING_KICK])
def test_kick_or_call_fd_that_is_not_an_eventfd_is_refused(request_):
    """A pipe the frontend never drains as call fd: the C data path's write() blocked and the whole server hung
    (SIGINT included). Only eventfds are taken now; the refused fd is closed."""
    dev = _device()
    r, w = os.pipe()
    before = _nfds()
    with pytest.raises(Refused, match="not an eventfd"):
        _handle(dev, request_, vu.VringFile(0).pack(), [os.dup(w)])
    assert _nfds() == before
    efd = os.eventfd(0)
    _handle(dev, request_, vu.VringFile(0).pack(), [efd])   # an eventfd is taken (and owned by the vring)
    dev.close()
    os.close(r)
    os.close(w)


def test_tap_capture_stats_without_any_queue_seen():
    """`vring tap --pcap` stopped before any ring was set up: KeyError 'lapped' at exit, the --ctl socket left."""
    from tap.capture import STAT_KEYS, Capture

    class Writer:
        full = False

        def stats(self):
            return {"path": "x", "written": 0, "limit": 0, "left_out": 0}

    st = Capture(picture=None, writer=Writer()).stats()
    assert all(st[k] == 0 for k in STAT_KEYS)


@pytest.mark.parametrize("replies", [
    [b"[1, 2]\n"], [b'{"ok": true}\n'], [b'{"ok": true, "queues": [1]}\n'], [b"[" * 100000 + b"\n"],
    [b'{"ok": true, "queues": [{"name": "q"}]}\n', b'{"ok": true, "raw": 5}\n'],
], ids=["list", "no-queues", "queue-int", "deep-json", "raw-int"])
def test_ctl_client_garbage_reply_is_a_control_error(tmp_path, replies):
    path = str(tmp_path / "ctl.sock")
    lst = socket.socket(socket.AF_UNIX)
    lst.bind(path)
    lst.listen(1)

    def serve():
        c, _ = lst.accept()
        f = c.makefile("rwb")
        for r in replies:
            f.readline()
            c.sendall(r)
        f.readline()
        c.close()
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        with pytest.raises(VringError), ctl.ControlClient(path, 5) as c:
            for q in c.list():
                c.raw(q["name"])
    finally:
        lst.close()
        th.join(5)


def test_rawdump_load_refuses_what_is_not_a_regular_file(tmp_path):
    """`vring dump --from /dev/zero` read until memory ran out; a FIFO blocked forever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(ConfigError, match="not a regular file"):
            rawdump.load(p)


@pytest.mark.parametrize("args", [["--count", "-5"], ["--pkt-size", "100000"], ["--timeout", "-1"],
                                  ["--dst-mac", "zz"], ["--spin", "-3"], ["--pin", "-1"], ["--seconds", "nan"]])
def test_driver_bad_argument_is_one_line_exit_2(tmp_path, args):
    """Checked before connecting (nobody listens here): one line, exit 2, no traceback."""
    p = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", str(tmp_path / "none.sock"), *args],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and args[0] in p.stderr, p.stderr


@pytest.mark.parametrize("args", [["--reconnect", "-1"], ["--stats-interval", "-1"], ["--pcap-count", "-1"],
                                  ["--slice-us", "0"], ["--handshake-timeout", "nan"], ["--pin", "-1"],
                                  ["--pin", "4096"], ["--pin", "99999999999999999999"]])
def test_vhost_bad_argument_is_one_line_exit_2(tmp_path, args):
    """Checked before anything is created (no socket, no capture file): one line, exit 2, no traceback. (--pin
    past a C long was a traceback, exit 1; a bad --pin left the capture file.)"""
    sock = tmp_path / "vh.sock"
    p = subprocess.run([sys.executable, "-m", "vring.cli", "vhost", "--socket", str(sock),
                        "--pcap", str(tmp_path / "x.pcap"), *args],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and args[0] in p.stderr, p.stderr
    assert not sock.exists() and not (tmp_path / "x.pcap").exists()


@pytest.mark.parametrize("args, words", [
    (["--burst", "0"], "burst must be 1..1024"), (["--txq-flush", "bogus"], "txq flush must be"),
    (["--pkt-size", "1"], "packet buffer size must be"), (["--snapshot-keep", "0"], "--snapshot-keep must be"),
    (["--ctl", "{tmp}/no/ctl"], "cannot listen on"), (["--socket", "{tmp}/no/vh.sock"], "cannot listen on"),
    (["--socket", "{tmp}/live.sock"], "a server is listening on this socket already"),
    (["--ctl", "{tmp}/live.sock"], "a server is listening on this socket already")])
def test_vhost_that_does_not_start_leaves_the_capture_file_alone(tmp_path, args, words):
    """`vring vhost --pcap FILE` that stops at a usage error or a taken socket neither creates FILE nor truncates
    the one there (a capture of an earlier run; the live one of the backend on that socket): it was opened, with
    O_TRUNC, before the options were checked and the sockets bound, and left behind as a 24-byte header."""
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "live.sock"))
    live.listen(1)
    try:
        for old in (None, b"an earlier capture"):
            pcap = tmp_path / "x.pcap"
            if old is not None:
                pcap.write_bytes(old)
            p = subprocess.run([sys.executable, "-m", "vring.cli", "vhost", "--socket", str(tmp_path / "vh.sock"),
                                "--pcap", str(pcap), *[a.format(tmp=tmp_path) for a in args]],
                               capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
            assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
            assert (pcap.read_bytes() if pcap.exists() else None) == old, (old, p.stderr)
            assert sorted(os.listdir(tmp_path)) == sorted(["live.sock"] + (["x.pcap"] if old else [])), p.stderr
    finally:
        live.close()


@pytest.mark.parametrize("where", ["socket", "ctl"])
def test_vhost_pcap_on_its_own_socket_is_an_error_that_leaves_nothing(tmp_path, where):
    """--pcap naming the path of --socket or --ctl: one error, exit 2, nothing left there."""
    path = str(tmp_path / "s")
    argv = ["--socket", path] if where == "socket" else ["--socket", str(tmp_path / "vh.sock"), "--ctl", path]
    p = subprocess.run([sys.executable, "-m", "vring.cli", "vhost", *argv, "--pcap", path],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert os.listdir(tmp_path) == [], p.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_vhost_ends_cleanly_on_every_stop_signal(tmp_path, sig):
    """A closed terminal (SIGHUP) stops `vring vhost` like Ctrl-C and SIGTERM: exit 0, its socket file removed
    (the default action left it behind)."""
    sock = str(tmp_path / "vh.sock")
    proc = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(sock, proc)
        proc.send_signal(sig)
        rc, _, err = collect(proc, 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert rc == 0, err
    assert not os.path.exists(sock)


def _never_read(fe, message):
    """``message`` sent until the socket is full, no reply read: the server's send of its reply blocks."""
    fe.setblocking(False)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            fe.send(message)
        except BlockingIOError:
            time.sleep(0.01)


@pytest.mark.parametrize("part", ["header", "payload", "nack", "reply"])
def test_vhost_stop_signal_is_not_held_by_a_message_stalled_half_way(tmp_path, part):
    """A frontend that stops half-way through a message: SIGTERM to `vring vhost` ended it only when the receive
    timed out (MSG_TIMEOUT, 5 s), the signal held that long. Now the exchange is abandoned at once: exit 0, socket
    file removed, well before the receive would have given up. The same for a reply or a NACK the frontend does
    not read (attack50: the NACK had it not)."""
    from vhost.server import MSG_TIMEOUT
    sock = str(tmp_path / "vh.sock")
    proc = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_for(sock, proc)
        fe.connect(sock)
        whole = vu.HEADER.pack(R.SET_FEATURES, vu.VERSION, 8) + vu.pack_u64(1 << 32)
        if part == "nack":   # malformed (a 3-byte payload), NEED_REPLY: NACKed (attack50)
            fe.sendall(vu.HEADER.pack(R.GET_FEATURES, vu.VERSION, 0))
            _never_read(fe, vu.HEADER.pack(R.SET_FEATURES, vu.VERSION | vu.NEED_REPLY, 3) + bytes(3))
        elif part == "reply":   # (attack51)
            _never_read(fe, vu.HEADER.pack(R.GET_FEATURES, vu.VERSION, 0))
        else:
            fe.sendall(whole[:6] if part == "header" else whole[:vu.HEADER_SIZE + 3])
        time.sleep(0.5)   # the server has seen the bytes and waits in its receive for the rest
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, _, err = collect(proc, 20)
        took = time.monotonic() - t0
    finally:
        fe.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert rc == 0 and "Traceback" not in err, err
    assert took < MSG_TIMEOUT / 2, f"the signal was held {took:.1f} s"
    assert not os.path.exists(sock)


def test_driver_memory_cannot_be_shrunk_by_the_backend(tmp_path, monkeypatch):
    """A backend that truncated the driver's shared memory after SET_MEM_TABLE killed `vring driver` with SIGBUS
    (exit 135). The memory is now a memfd whose size is sealed before its fd is sent: the truncation fails with
    EPERM, and the driver runs its traffic and exits 0."""
    import errno
    import fcntl
    import json
    from vhost.datapath import Options
    from vhost.testing import ThreadedServer
    from rings.shm import F_GET_SEALS, SEALS_FIXED_SIZE
    attempts = []
    honest = NetDevice._set_mem_table

    def shrink_then_map(self, msg, regions):
        for fd in msg.fds:
            seals = fcntl.fcntl(fd, F_GET_SEALS)
            try:
                os.ftruncate(fd, 0)
                attempts.append((seals, 0))
            except OSError as e:
                attempts.append((seals, e.errno))
            try:
                os.ftruncate(fd, os.fstat(fd).st_size * 2)   # growing is sealed too (the mapping would not follow)
                attempts.append((seals, 0))
            except OSError as e:
                attempts.append((seals, e.errno))
        return honest(self, msg, regions)

    monkeypatch.setattr(NetDevice, "_set_mem_table", shrink_then_map)
    sock = str(tmp_path / "evil.sock")
    with ThreadedServer(sock, Options(fwd="macswap")):
        p = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--json", "--mode",
                            "macfwd", "--count", "64", "--seconds", "1"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    assert attempts and all(seals & SEALS_FIXED_SIZE == SEALS_FIXED_SIZE and err == errno.EPERM
                            for seals, err in attempts), attempts
    res = json.loads(p.stdout)
    assert res["rx"]["packets"] > 0 and res["tx"]["packets"] > 0


def _shrink_errno(fd):
    try:
        os.ftruncate(fd, 0)
        return 0
    except OSError as e:
        return e.errno


@pytest.mark.parametrize("sealable", [True, False])
def test_received_memory_is_sealed_against_shrinking_when_the_peer_allows_it(sealable, caplog):
    """`vring vhost` (SET_MEM_TABLE, SET_INFLIGHT_FD) and `vring tap` add F_SEAL_SHRINK to a memory fd they map; a
    memory file whose creator did not allow sealing (DPDK's, QEMU's, POSIX shm) is still mapped, and the log says
    so (the C data path turns a fault there into GuestMemoryFault); an inflight area that cannot be sealed is
    refused (it is also read from Python, where nothing catches a fault)."""
    import errno
    import logging
    from rings.shm import ShmRegion
    from tap.picture import MappedRegion
    size = 0x20000
    if sealable:
        fd = os.memfd_create("peer-mem", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
    else:
        shm = ShmRegion.create(size, prefix="vring-test-unsealable")
        shm.unlink()
        fd = os.dup(shm.fileno())
        shm.close()
    try:
        region = vu.MemRegion(0x1000, size, 0x10000000)
        with caplog.at_level(logging.DEBUG, logger="rings.shm"):
            tap_region = MappedRegion(region, fd)
            dev = _device(protocol_features=1 << vu.VhostUserProtocolFeature.INFLIGHT_SHMFD)
            _handle(dev, R.SET_MEM_TABLE, vu.pack_mem_table([region]), [os.dup(fd)])
            if sealable:
                _handle(dev, R.SET_INFLIGHT_FD, vu.Inflight(0x10000, 0, 2, 256).pack(), [os.dup(fd)])
            else:
                with pytest.raises(Refused, match="not sealed against shrinking"):
                    _handle(dev, R.SET_INFLIGHT_FD, vu.Inflight(0x10000, 0, 2, 256).pack(), [os.dup(fd)])
        assert tap_region.sealed is sealable
        assert len(dev.regions) == 1 and (dev.inflight is not None) is sealable
        dev.close()
        tap_region.mm.close()
        assert _shrink_errno(fd) == (errno.EPERM if sealable else 0)
        said = "sealed against shrinking" if sealable else "did not allow sealing"
        assert sum(said in r.getMessage() for r in caplog.records) == 3, caplog.text   # tap, table, inflight
    finally:
        os.close(fd)


def test_inflight_area_we_create_is_size_sealed():
    import errno
    from vhost.inflight import create_area
    fd, size = create_area(2, 256, False)
    try:
        assert os.fstat(fd).st_size == size and _shrink_errno(fd) == errno.EPERM
    finally:
        os.close(fd)


def _assert_dropped_once_then_serves(be, sock, packed, words, ring_errors=1):
    """After a frontend whose memory shrank: the backend lives, serves the next frontend (8 frames back), stops
    cleanly with its socket gone, and logged exactly one GuestMemoryFault error containing ``words``
    (``ring_errors``: that fault and any ring the frontend broke before)."""
    from vhost.testing import ScriptedFrontend, frame
    assert be.proc.poll() is None, be.stderr()[-2000:]
    with ScriptedFrontend(sock, packed=packed) as fe:   # the next frontend is served
        fe.connect()
        fe.negotiate()
        fe.start()
        fe.post_rx(64)
        sent = [frame(i) for i in range(8)]
        fe.send(sent)
        got = fe.receive_until(len(sent))
    final = be.stop()
    log = be.stderr()
    assert be.proc.returncode == 0, log[-2000:]
    assert not os.path.exists(sock)
    assert [len(data) - 12 for data, _ in got] == [len(f) for f in sent], log[-2000:]
    faults = [line for line in log.splitlines() if "GuestMemoryFault" in line and "ERROR" in line]
    assert len(faults) == 1 and words in faults[0], log[-2000:]
    assert "Traceback" not in log
    assert final["connections"] == 2 and final["ring_errors"] == ring_errors, final


def test_vhost_survives_a_frontend_that_shrinks_its_memory_mid_traffic(tmp_path):
    """A frontend truncated its (unsealable: POSIX shm) memory file while the rings ran: `vring vhost` died of
    SIGBUS and left its socket. The C data path now catches the fault: one typed error line, the connection is
    dropped, and the next frontend is served."""
    from vhost.testing import ScriptedFrontend, VhostProcess, frame
    sock = str(tmp_path / "vh.sock")
    with VhostProcess(sock, "--fwd", "macswap", "--handshake-timeout", "5", verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock) as fe:
            fe.connect()
            fe.negotiate()
            fe.start()
            fe.post_rx(64)
            fe.send([frame(i) for i in range(16)])
            be.wait_stderr("data path started")
            os.ftruncate(fe.shm.fileno(), 0)   # every page the backend mapped is gone
            os.eventfd_write(fe.kickfds[1], 1)
            be.wait_stderr("GuestMemoryFault")
        _assert_dropped_once_then_serves(be, sock, False, "shrank under the rings")


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_vhost_survives_a_frontend_that_shrinks_its_memory_before_the_rings_start(tmp_path, packed):
    """A frontend truncated its (unsealable: POSIX shm) memory file after SET_MEM_TABLE and before DRIVER_OK:
    `vring vhost` died of SIGBUS (exit -7, socket left behind) while starting the queues (the used index read
    and the event suppression written from outside the guarded C data path). Found by an adversarial review.
    Now the start sees the shrunken file: one typed error line, the connection is dropped, the next frontend
    is served. (A check of the file's size before the start closed this first, but a truncation racing the start
    got past it; the start now reads and writes that memory through guarded C, which this test exercises.)"""
    from vhost.testing import ScriptedFrontend, VhostProcess
    sock = str(tmp_path / "vh.sock")
    with VhostProcess(sock, "--fwd", "macswap", "--handshake-timeout", "5", verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock, packed=packed) as fe:
            fe.connect()
            fe.negotiate()
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            os.ftruncate(fe.shm.fileno(), 0)   # every page the backend mapped is gone before any ring starts
            try:   # the rest of fe.start(), the memory table aside
                for i in range(2):
                    fe.call(R.SET_VRING_NUM, vu.VringState(i, fe.size).pack())
                    fe.call(R.SET_VRING_BASE, vu.VringState(i, 0x8000 if packed else 0).pack())
                    fe.call(R.SET_VRING_ADDR, fe.vring_addr(i).pack())
                    fe.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), [fe.kickfds[i]])
                for i in range(2):
                    fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
                fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)   # the rings start here
            except VringError:
                pass   # NACKed or dropped: either is fine, the backend must live on
            be.wait_stderr("GuestMemoryFault")
        _assert_dropped_once_then_serves(be, sock, packed, "shrank")


def test_vhost_survives_packed_inflight_recovery_reading_a_truncated_descriptor_ring(tmp_path):
    """Packed rings with INFLIGHT_SHMFD: the frontend's inflight area said the previous backend died inside a
    completion (used_idx != old_used_idx), and the frontend truncated the part of its memory holding the
    descriptor rings (the event suppression areas, low in the region, stayed). The recovery at the queue start
    read the batch's first descriptor flags from Python (cffi, unguarded): SIGBUS, exit -7, socket left. Found by
    adversarial review (attack33). The read is now a guarded copy: one GuestMemoryFault, the next frontend is
    served."""
    import mmap

    import numpy as np

    from rings.layout import QueueLayout, bit
    from vhost.inflight import HDR_PACKED
    from vhost.testing import GPA_BASE, MMAP_OFFSET, ScriptedFrontend, VhostProcess, features_for
    PF = vu.VhostUserProtocolFeature
    sock = str(tmp_path / "vh.sock")
    with VhostProcess(sock, "--fwd", "macswap", "--handshake-timeout", "5", verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock, packed=True) as fe:
            # event areas in the first MiB, descriptor tables at +2 MiB (a layout the spec allows)
            fe.layouts = [QueueLayout("packed", fe.size, GPA_BASE + 0x200000 + i * 0x10000, GPA_BASE + i * 0x1000,
                                      GPA_BASE + i * 0x1000 + 0x100) for i in range(2)]
            fe.connect()
            fe.call(R.SET_OWNER)
            fe.call(R.GET_FEATURES)
            pf = fe.call(R.GET_PROTOCOL_FEATURES) & (bit(PF.REPLY_ACK) | bit(PF.STATUS)
                                                     | bit(PF.INFLIGHT_SHMFD))
            fe.call(R.SET_PROTOCOL_FEATURES, vu.pack_u64(pf))
            for i in range(2):
                fe.call(R.SET_VRING_CALL, vu.VringFile(i).pack(), [fe.callfds[i]])
            fe.features = features_for(True)
            fe.call(R.SET_FEATURES, vu.pack_u64(fe.features))
            rep = vu.client_call(fe.conn, R.GET_INFLIGHT_FD, vu.Inflight(0, 0, 2, fe.size).pack(), timeout=5)
            inf, fd = vu.decode(rep, reply=True), rep.take_fds()[0]
            try:
                with mmap.mmap(fd, inf.mmap_size) as m:
                    hdr = np.ndarray((), HDR_PACKED, buffer=m, offset=0)   # vring 0's region
                    hdr["version"], hdr["desc_num"] = 1, fe.size
                    hdr["used_idx"], hdr["old_used_idx"] = 1, 0            # "died inside a completion"
                    del hdr
                fe.call(R.SET_INFLIGHT_FD, vu.Inflight(inf.mmap_size, 0, 2, fe.size).pack(), [fd], need_reply=True)
            finally:
                os.close(fd)
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            os.ftruncate(fe.shm.fileno(), MMAP_OFFSET + 0x100000)   # descriptor tables gone, event areas kept
            try:
                for i in range(2):
                    fe.call(R.SET_VRING_NUM, vu.VringState(i, fe.size).pack())
                    fe.call(R.SET_VRING_BASE, vu.VringState(i, 0x8000).pack())
                    fe.call(R.SET_VRING_ADDR, fe.vring_addr(i).pack())
                    fe.call(R.SET_VRING_KICK, vu.VringFile(i).pack(), [fe.kickfds[i]])
                for i in range(2):
                    fe.call(R.SET_VRING_ENABLE, vu.VringState(i, 1).pack())
                fe.call(R.SET_STATUS, vu.pack_u64(0xF), need_reply=True)   # the rings start here
            except VringError:
                pass   # NACKed or dropped: either is fine, the backend must live on
            be.wait_stderr("GuestMemoryFault")
        _assert_dropped_once_then_serves(be, sock, False, "shrank")


def _kicks_enabled(snap, packed):
    """The device asks for kicks (VIRTIO_F_EVENT_IDX or not): what --idle sleep does before it blocks."""
    notify = snap["notify"]
    if packed:
        return notify["device_event"]["flags"] == 0   # RING_EVENT_FLAGS_ENABLE
    return notify["used.flags"] == 0 and notify["avail_event"] == snap["indices"]["last_avail"]


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_vhost_ctl_dump_of_a_shrunken_memory_is_an_error_not_a_crash(tmp_path, packed):
    """`vring vhost --idle sleep --ctl S`: the frontend started its rings, the data path went to sleep on the kick
    eventfd, and the frontend truncated its (unsealable: POSIX shm) memory. `vring dump --ctl S` then made the
    backend copy the ring areas from Python: SIGBUS killed it (exit -7, socket left). The copy is now a guarded C
    memcpy: the dump gets a GuestMemoryFault reply, the backend lives, drops that frontend at its next kick and
    serves the next one."""
    from vhost.testing import ScriptedFrontend, VhostProcess
    sock, ctl_path = str(tmp_path / "vh.sock"), str(tmp_path / "ctl.sock")
    with VhostProcess(sock, "--fwd", "macswap", "--idle", "sleep", "--ctl", ctl_path, "--handshake-timeout", "5",
                      verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock, packed=packed) as fe:
            fe.connect()
            fe.negotiate()
            fe.start()
            be.wait_stderr("data path started")
            with ctl.ControlClient(ctl_path, 10) as c:
                for _ in range(500):   # asleep once its empty polls ran out: it enabled kicks on vring 1
                    if _kicks_enabled(c.snapshot("tx")[1], packed):
                        break
                    time.sleep(0.01)
                else:
                    pytest.fail("the data path never went to sleep")
                os.ftruncate(fe.shm.fileno(), 0)   # every page the backend mapped is gone
                for name in ("rx", "tx"):
                    with pytest.raises(ctl.ControlError, match="GuestMemoryFault"):
                        c.snapshot(name)
                    with pytest.raises(ctl.ControlError, match="GuestMemoryFault"):
                        c.raw(name)
            assert be.proc.poll() is None, be.stderr()[-2000:]
            be.wait_stderr("GuestMemoryFault")   # the server drops it: the dump's fault, or the data path's next look
        _assert_dropped_once_then_serves(be, sock, packed, "shrank under")


def test_vhost_drops_a_frontend_whose_memory_a_dump_found_shrunk_while_no_data_path_runs(tmp_path):
    """The frontend broke its Tx queue (a descriptor outside the memory table: with no Tx queue the data path
    idles), then truncated its memory. A `--ctl` dump got GuestMemoryFault as its reply, but nothing told the
    server: the frontend stayed connected and served, its mapping kept. Found by adversarial review (attack33).
    A fault any guarded access meets, in any thread, now drops the frontend at the server's next round."""
    import numpy as np

    from vhost.testing import ScriptedFrontend, VhostProcess
    sock, ctl_path = str(tmp_path / "vh.sock"), str(tmp_path / "ctl.sock")
    with VhostProcess(sock, "--fwd", "macswap", "--ctl", ctl_path, "--handshake-timeout", "5", verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock) as fe:
            fe.connect()
            fe.negotiate()
            fe.start()
            fe.post_rx(16)
            fe.txq.add_simple(np.array([0x10], np.uint64), np.array([72], np.uint32), np.array([1], np.uint64))
            fe.txq.publish()
            os.eventfd_write(fe.kickfds[1], 1)
            be.wait_stderr("vring 1 broken")
            os.ftruncate(fe.shm.fileno(), 0)
            with ctl.ControlClient(ctl_path, 10) as c, pytest.raises(ctl.ControlError, match="GuestMemoryFault"):
                c.raw("rx")
            be.wait_stderr("dropping the frontend: GuestMemoryFault")
            with pytest.raises(VringError):   # the connection is gone
                fe.call(R.GET_STATUS)
        _assert_dropped_once_then_serves(be, sock, False, "shrank under guest range", ring_errors=2)


def test_guarded_memory_table_reads_a_truncated_region_as_an_error():
    """The backend's MemoryTable: a read or write of a region whose file was truncated raises GuestMemoryFault (a
    guarded C copy), and no view can bypass it. Run in a child: without the guard, SIGBUS would kill the test process. The
    guard's jump buffer is armed in a TLS pointer the SIGBUS handler reads; a plain pointer let the compiler drop
    the arming store around a memcpy (a dead store to it), and the fault killed the child (exit -7)."""
    code = textwrap.dedent("""
        import mmap, os
        from rings.errors import GuestMemoryFault, UsageError
        from vhost.datapath import GuardedMemoryTable
        fd = os.memfd_create("guarded")
        os.ftruncate(fd, 1 << 16)
        m = mmap.mmap(fd, 1 << 16)
        t = GuardedMemoryTable([(0x1000, 0x1000, m, 0x100)])
        m[0x200:0x204] = b"ring"
        assert t.read(0x1100, 4) == b"ring"
        t.write(0x1104, b"more")
        assert m[0x200:0x208] == b"ringmore"
        from rings.errors import AddressOutOfBounds
        try:   # the range is checked before anything is allocated for it
            t.read(0x1100, 1 << 62)
            raise SystemExit("read past the table")
        except AddressOutOfBounds:
            pass
        try:
            t.view(0x1100, 4)
            raise SystemExit("a view of the frontend's memory was handed out")
        except UsageError:
            pass
        os.ftruncate(fd, 0)
        for _ in range(3):   # caught each time, not once: the handler stays armed for the next read
            try:
                t.read(0x1100, 4)
                raise SystemExit("read a truncated region")
            except GuestMemoryFault as e:
                assert "shrank" in str(e), e
            try:
                t.write(0x1100, b"x")
                raise SystemExit("wrote a truncated region")
            except GuestMemoryFault:
                pass
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("queue", ["rx", "tx"])
def test_blocking_call_eventfd_at_its_limit_does_not_hang_the_server(tmp_path, queue):
    """A frontend handed over call eventfds made without EFD_NONBLOCK and filled their counters to the limit
    (0xfffffffffffffffe): the data path's write(1) of the next call blocked for ever, and with it the whole
    single-threaded server (no reply to any message, no other frontend served) until a signal came. Found by an
    adversarial review. The backend now makes every kick/call eventfd it receives non-blocking: the call that
    cannot be added is lost (the counter is already far past "there is something"), the server goes on."""
    from vhost.testing import ScriptedFrontend, VhostProcess, frame
    sock = str(tmp_path / "vh.sock")
    with VhostProcess(sock, "--fwd", "macswap", verbose=True) as be:
        be.wait_socket()
        with ScriptedFrontend(sock) as fe:
            for i in range(2):
                os.close(fe.callfds[i])
                fe.callfds[i] = os.eventfd(0, os.EFD_CLOEXEC)            # blocking
                os.eventfd_write(fe.callfds[i], 0xfffffffffffffffe)      # one more would block
            fe.connect()
            fe.negotiate()
            fe.start()
            (fe.rxq if queue == "rx" else fe.txq).enable_calls(True)
            fe.post_rx(64)
            sent = [frame(i) for i in range(8)]
            fe.send(sent)
            got = fe.receive_until(len(sent), timeout=3.0)
            assert len(got) == len(sent)
            # the server still answers (it hung in write() before)
            assert vu.client_call(fe.conn, R.GET_FEATURES, b"", (), timeout=3.0) is not None
        final = be.stop()
    assert be.proc.returncode == 0 and final["connections"] == 1, be.stderr()[-2000:]


def test_watched_memory_table_reads_a_truncated_region_as_zeros_and_says_so():
    """Where memory must be read through views (the conformance harness's ring views and its C ring polls, the
    tap), a region whose file its owner truncated killed the reader with SIGBUS. A WatchedMemoryTable has the
    SIGBUS handler map zero pages over what vanished: the views read zeros, ``vanished()`` names the region and the
    first page, and the pages before the truncation point keep their data. A fault outside any watched mapping is
    still fatal (the handler does not swallow what is not its own), also with the backend's guarded handler (the
    other C module's copy) installed on top of it. Run in a child: without the watch the test process would die."""
    code = textwrap.dedent("""
        import mmap, os, sys
        import numpy as np
        from rings.shm import WatchedMemoryTable
        from vhost.datapath import GuardedMemoryTable
        fd = os.memfd_create("watched")
        os.ftruncate(fd, 4 * mmap.PAGESIZE)
        m = mmap.mmap(fd, 4 * mmap.PAGESIZE)
        m[0:4] = b"kept"
        m[2 * mmap.PAGESIZE:2 * mmap.PAGESIZE + 4] = b"gone"
        t = WatchedMemoryTable([(0x10000, 4 * mmap.PAGESIZE - 0x100, m, 0x100)], whose="the test driver")
        GuardedMemoryTable()   # the backend's handler, installed after (on top of) the watch's
        view = np.frombuffer(m, np.uint8)
        assert t.vanished() is None
        os.ftruncate(fd, mmap.PAGESIZE)
        assert bytes(view[2 * mmap.PAGESIZE:2 * mmap.PAGESIZE + 4]) == bytes(4), "a vanished page is not zeros"
        assert bytes(view[0:4]) == b"kept", "a page that stayed lost its data"
        e = t.vanished()
        assert e is not None and "the test driver shrank" in str(e), e
        assert e.b == 0x10000 - 0x100 + 2 * mmap.PAGESIZE, hex(e.b)   # the guest address of the first fault
        view[3 * mmap.PAGESIZE] = 7   # writable, private: the file is not grown back
        assert os.fstat(fd).st_size == mmap.PAGESIZE
        t.release()
        assert t.vanished() is None and t._watches == []
        print("ok", flush=True)
        if len(sys.argv) > 1:   # a region nobody watches: still the crash it always was
            fd2 = os.memfd_create("unwatched")
            os.ftruncate(fd2, mmap.PAGESIZE)
            m2 = mmap.mmap(fd2, mmap.PAGESIZE)
            os.ftruncate(fd2, 0)
            m2[0]
            print("survived")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])
    r = subprocess.run([sys.executable, "-c", code, "unwatched"], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGBUS and r.stdout.split() == ["ok"], (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("then", ["stays", "leaves"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_conform_driver_harness_reports_a_driver_that_shrinks_its_memory(tmp_path, packed, then):
    """`vring conform driver` reads the driver's rings through views: a driver under test that truncated its
    (unsealable: POSIX shm) memory killed the harness with SIGBUS, so the one peer that most needed a report got
    none. Now the vanished pages read as zeros, the run ends with a GuestMemoryFault naming the region (exit 2),
    and nothing read from the zeros is reported as the driver's violation (without that, split reported
    SPLIT-D-10 "avail idx moved from 8 to 0" and packed EVT-22). Also when the driver leaves right after."""
    import json
    from tests.procs import VRING
    from vhost.testing import ScriptedFrontend, frame
    sock = str(tmp_path / "conform.sock")
    p = subprocess.Popen([*VRING, "conform", "driver", "--socket", sock, "--seconds", "3", "--wait", "20",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(sock, p)
        with ScriptedFrontend(sock, packed=packed) as fe:
            fe.connect()
            fe.negotiate()
            fe.start()
            fe.post_rx(64)
            fe.send([frame(i) for i in range(8)])
            for fd in fe.kickfds:
                os.eventfd_write(fd, 1)
            time.sleep(0.3)
            os.ftruncate(fe.shm.fileno(), 0)
            for fd in fe.kickfds:
                os.eventfd_write(fd, 1)
            if then == "stays":
                rc, out, err = collect(p, 60)
        if then == "leaves":
            rc, out, err = collect(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert rc == 2, (rc, err[-2000:])
    report = json.loads(out)
    assert report["error"].startswith("GuestMemoryFault: the driver under test shrank the memory it shared: "
                                      "region gpa 0x40000000"), report["error"]
    assert [r["id"] for r in report["results"] if r["status"] != "pass" and r["fails"]] == [], report["results"]
    assert "Traceback" not in err


def test_eventfd_reads_do_not_block_when_the_peer_cleared_o_nonblock_and_took_the_count():
    """A kick or call eventfd is one file description shared with the peer: a hostile peer can clear O_NONBLOCK
    on it and read the counter itself between our select and our read. A plain read then blocked for good: `vring
    vhost`'s server thread on a kick, our driver on a call, the conformance harnesses and the tap's notify relay
    likewise. Every reader now takes the count with preadv2(RWF_NOWAIT), which ignores O_NONBLOCK. Run in a
    child: a regression hangs, and the timeout reports it."""
    code = textwrap.dedent("""
        import os, types
        from rings import vhost_user as vu
        from vhost.device import NetDevice
        from virtio.app import _eventfd_count
        from conform.device import Queue
        fd = os.eventfd(0)   # blocking, counter 0: what the peer left after taking the kick
        assert vu.eventfd_take(fd) == 0
        os.eventfd_write(fd, 3)
        assert vu.eventfd_take(fd) == 3 and vu.eventfd_take(fd) == 0
        dev = NetDevice()
        dev.vrings[1].kickfd = fd
        dev.kicked()                              # vring vhost, --idle sleep, after select said "readable"
        assert _eventfd_count(fd) == 0            # vring driver: calls nobody waited for
        q = Queue.__new__(Queue)
        q.callfd = fd
        assert q.calls() == 0                     # vring conform device
        dev.vrings[1].kickfd = -1
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_watched_memory_survives_a_ring_of_faults_and_sees_a_truncation_inside_a_page():
    """Found by review attack40. (1) Each fault replaced one page: a peer that made us touch one page in two of a
    large truncated region split the mapping until the kernel's map count (65530) ran out, and the next fault
    killed the harness or the tap (a 32768-entry ring of one-page-apart buffers was enough). A truncation takes
    the file's end, so the first fault now replaces everything from its page to the end in one mapping. (2) A
    truncation inside a page leaves that page's tail reading zeros with no SIGBUS: a region added with its file
    is compared with the file's size. (3) ``ranges``: a loss that does not reach them does not count. In a
    child: a regression dies of SIGBUS. (4) The zeros for a region larger than memory and swap are mapped
    without reserving them (found by review attack41: a 32 GiB region's fill was refused, and the fault fatal)."""
    code = textwrap.dedent("""
        import mmap, os
        from rings.shm import WatchedMemoryTable
        P = mmap.PAGESIZE
        size = 512 << 20
        fd = os.memfd_create("big")
        os.ftruncate(fd, size)   # sparse
        m = mmap.mmap(fd, size)
        t = WatchedMemoryTable([(0, size, m)], whose="the test driver")
        os.ftruncate(fd, 0)
        for off in range(0, size, 2 * P):   # 65536 faults if each replaced one page
            assert m[off] == 0
        maps = sum(1 for _ in open("/proc/self/maps"))
        assert maps < 1000, maps
        e = t.vanished()
        assert e is not None and e.b == 0, e   # from the first page on
        t.release()

        huge = 64 << 30   # a sparse file larger than our memory and swap: the zeros must not need reserving
        fd3 = os.memfd_create("sparse")
        os.ftruncate(fd3, huge)
        m3 = mmap.mmap(fd3, huge)
        t3 = WatchedMemoryTable([(0, huge, m3)], whose="the test driver")
        os.ftruncate(fd3, 0)
        assert m3[5 * P] == 0 and m3[huge - 1] == 0 and t3.vanished() is not None
        t3.release()

        fd2 = os.memfd_create("midpage")
        os.ftruncate(fd2, 4 * P)
        m2 = mmap.mmap(fd2, 4 * P)
        t2 = WatchedMemoryTable(whose="the test driver")
        t2.add(0x1000, 4 * P - 0x10, m2, 0x10, file=(fd2, 4 * P))
        assert t2.vanished() is None
        os.ftruncate(fd2, 3 * P + 100)   # inside the last page: its tail reads zeros, no SIGBUS ever
        assert m2[3 * P + 200] == 0
        e = t2.vanished()
        assert e is not None and e.b == 0x1000 + 3 * P + 100 - 0x10, (e, hex(e.b) if e else None)
        assert t2.vanished(ranges=[(0x1000, P)]) is None              # the first page is all there
        assert t2.vanished(ranges=[(0x1000 + 3 * P, 0x200)]) is not None
        t2.release()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_conform_driver_passes_read_from_vanished_memory_are_dropped():
    """Found by review attack40: fails read from zeros were dropped, but passes were kept, so a driver whose
    memory vanished before DRIVER_OK had PACKED-L-05 'pass' (zeros are a clean ring) where the same ring without
    the truncation fails it. Passes since the last step that ended with the memory intact are now dropped too."""
    from conform.driver import DriverHarness, DriverOptions
    from rings.errors import GuestMemoryFault
    h = DriverHarness(DriverOptions(socket="/nonexistent"))
    r = h.report
    r.ok("FEAT-02")
    h.dev = type("Dev", (), {"mem": type("Mem", (), {"vanished": lambda self: None})()})()
    h._end_if_memory_vanished()   # a step ended with the memory there: FEAT-02 stands
    r.ok("PACKED-L-05", 2)
    h.dev.mem.vanished = lambda: GuestMemoryFault("gone")
    r.fail("PACKED-D-03", "read from zeros")
    assert r.status("FEAT-02") == "pass" and r.status("PACKED-L-05") == "not exercised", r.as_dict()["results"]
    assert r.status("PACKED-D-03") == "not exercised"
    assert not h.memory_intact() and "gone" in str(h.memory_fault)


_PAST_1024 = textwrap.dedent("""
    import os, resource, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    while os.open(os.devnull, os.O_RDONLY) < 1030:   # every fd opened from here on is numbered past 1024
        pass
    from vring import cli
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize("notify", [False, True], ids=["polled", "notified"])
def test_vhost_and_driver_run_with_fds_numbered_past_1024(tmp_path, notify):
    """A process that embeds us may well hold a thousand fds already. select() refuses fds >= 1024: the server's
    waits, the driver's look at its socket and its --wait on the call eventfd used it, and the driver died at once
    with a ValueError. All of them wait with poll() (rings.interrupts.readable)."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1300")
    sock = str(tmp_path / "vh.sock")
    run = [sys.executable, "-c", _PAST_1024]
    env = dict(os.environ, PYTHONPATH=ROOT)
    vhost = subprocess.Popen([*run, "vhost", "--socket", sock, "--max-connections", "1", "--json",
                              *(["--idle", "sleep"] if notify else [])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(sock, vhost)
        driver = subprocess.Popen([*run, "driver", "--socket", sock, "--seconds", "1", "--json", "--count", "64",
                                   *(["--wait"] if notify else [])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        rc, out, err = collect(driver, 60)
        assert rc == 0, err[-3000:]
        report = json.loads(out)
        assert report["rx"]["packets"] > 64 and report["rx"]["errors"] == 0, report
        vrc, _, verr = collect(vhost, 30)
        assert vrc == 0 and "Traceback" not in verr, verr[-3000:]
    finally:
        if vhost.poll() is None:
            vhost.kill()
            vhost.communicate()


def test_ctl_serves_again_after_running_out_of_fds(tmp_path):
    """helper-72: the --ctl accept thread ended on any OSError, EMFILE too: a process short of fds for a moment
    lost its control socket for good (every later `vring dump --ctl` got EAGAIN). It now waits and retries; and a
    client that finds the backlog full (the clients closed here wait in it to be accepted) waits for room within
    its timeout, where it failed at once with EAGAIN."""
    import resource
    path = str(tmp_path / "c.sock")
    srv = ctl.ControlServer(path).start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while len(clients) < 100:   # until no fd is left: the server's accept fails with EMFILE as well
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                clients.append(c)
                c.settimeout(0.5)   # (a full backlog: connect would wait for good)
                c.connect(path)
        except OSError:
            pass
        time.sleep(0.5)   # the server meets EMFILE meanwhile
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for c in clients:
            c.close()
    try:
        assert srv._thread.is_alive()
        assert ctl.request(path, "list", timeout=5)["ok"]
    finally:
        srv.close()


def test_vhost_out_of_fds_says_so_once_and_serves_again(tmp_path):
    """helper-73: out of fds, the vhost-user listener's accept() failed, the listener stayed readable, and the
    server went round at full speed: 37000 "accept failed" lines in 2.5 s. It is said once, retried every 0.1 s,
    and the next frontend is served once fds are free again."""
    import resource
    sock, ctl_path = str(tmp_path / "vh.sock"), str(tmp_path / "c.sock")
    err_path = tmp_path / "err.txt"

    def few_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with open(err_path, "w") as err:
        vhost = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--ctl", ctl_path],
                                 stdout=subprocess.DEVNULL, stderr=err, preexec_fn=few_fds,
                                 env=dict(os.environ, PYTHONPATH=ROOT))
    held = []
    try:
        wait_for(sock, vhost)
        wait_for(ctl_path, vhost)
        while len(held) < 100:   # each one a thread and an fd of the vhost's, until it has none left
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            give_up = time.monotonic() + 1
            while True:
                try:
                    c.connect(ctl_path)
                    break
                except BlockingIOError:   # the backlog is full: room comes as the vhost accepts, while it can
                    if time.monotonic() > give_up:
                        break
                    time.sleep(0.01)
            held.append(c)
            if time.monotonic() > give_up:
                break
        assert len(held) < 100, "the vhost took 100 control clients with 64 fds"
        time.sleep(0.5)
        frontend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        frontend.connect(sock)   # waits in the backlog: the vhost cannot accept it
        time.sleep(1.5)
        frontend.close()
        assert vhost.poll() is None
        for c in held:
            c.close()
        held = []
        time.sleep(0.5)
        drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--count", "64",
                              "--seconds", "0.5", "--json"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=ROOT))
        assert drv.returncode == 0, drv.stderr
        assert json.loads(drv.stdout)["rx"]["packets"] > 64
    finally:
        for c in held:
            c.close()
        rc, _, _ = collect(vhost, 0) if vhost.poll() is not None else (None, None, None)
        if vhost.poll() is None:
            vhost.send_signal(signal.SIGTERM)
            vhost.wait(20)
    text = err_path.read_text()
    assert 1 <= text.count("accept failed") <= 3, text[-3000:]


def test_tap_and_conform_run_with_fds_numbered_past_1024(tmp_path):
    """helper-73: `vring tap` and `vring conform driver` still waited with select(): a traceback (exit 1) before
    the tap listened, and in the harness once a driver connected. Both wait with rings.interrupts.readable."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1300")
    run, env = [sys.executable, "-c", _PAST_1024], dict(os.environ, PYTHONPATH=ROOT)
    vsock, tsock, csock = (str(tmp_path / n) for n in ("v.sock", "t.sock", "c.sock"))

    conform = subprocess.Popen([*run, "conform", "driver", "--socket", csock, "--seconds", "2", "--wait", "20",
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    vhost = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", vsock],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    tap = subprocess.Popen([*run, "tap", "--listen", tsock, "--connect", vsock], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(csock, conform)
        drv = subprocess.Popen([sys.executable, "-m", "vring.cli", "driver", "--socket", csock, "--mode", "macfwd",
                                "--count", "32", "--seconds", "30"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)   # outlasts the harness's 2 s
        try:
            rc, out, err = collect(conform, 60)
        finally:
            drv.kill()
            drv.wait()
        assert rc == 0 and "Traceback" not in err, (out[-3000:], err[-3000:])
        assert json.loads(out)["counts"]["pass"] > 0
        wait_for(vsock, vhost)
        wait_for(tsock, tap)
        drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", tsock, "--mode", "macfwd",
                              "--count", "32", "--seconds", "1", "--json"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert drv.returncode == 0 and json.loads(drv.stdout)["rx"]["packets"] > 32, drv.stderr[-2000:]
        tap.send_signal(signal.SIGTERM)
        rc, _, err = collect(tap, 30)
        assert rc == 0 and "Traceback" not in err, err[-3000:]
    finally:
        for p in (conform, tap, vhost):
            if p.poll() is None:
                p.kill()
                p.communicate()
