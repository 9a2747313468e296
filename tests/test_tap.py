"""`vring tap` (issue 12) without DPDK: the relay passes every message and fd on unchanged, --notify-tap
counts and forwards kicks and calls, the picture follows GET_VRING_BASE and reconnects, the live dumps,
the message log and the capture; `--pcap` on `vring driver` and `vring vhost`.

Fake peers speak rings.vhost_user directly where the test needs to see bytes and fds; our own driver and
backend run as processes where a real data path is needed. Every process, socket and segment is removed
even when a test fails.
"""
import errno
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time

import dpkt
import pytest

from rings import ctl
from rings import vhost_user as vu
from rings.pcap import PcapWriter
from tap.msglog import MessageLog, decode_file
from tap.notify import NotifyRelay
from tap.picture import Picture
from tap.proxy import Endpoint, Tap
from vring import cli

from procs import Procs, wait_for

R = vu.VhostUserRequest
TSHARK = shutil.which("tshark")


# --- fake peers through a tap in a thread ----------------------------------------------------------------------

class Around:
    """A tap in a thread between a listening fake backend and a connecting fake frontend."""

    def __init__(self, tmp_path, notify=False):
        self.a, self.b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
        self.listener = vu.listen_unix(self.b)
        self.picture = Picture(notify_tap=notify)
        self.log = MessageLog(tmp_path / "tap.log")
        self.notify = NotifyRelay(self.picture, self.log) if notify else None
        self.tap = Tap(Endpoint("frontend", self.a, True), Endpoint("backend", self.b, False), self.picture,
                       self.log, self.notify, peer_timeout=5)
        self.stop = threading.Event()
        self.tap.frontend.open()
        self.thread = threading.Thread(target=self.tap.serve, args=(self.stop,), daemon=True)
        self.thread.start()
        self.fe = vu.connect_unix(self.a)
        self.be = vu.accept_unix(self.listener, timeout=5)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        for c in (self.fe, self.be):
            c.close()
        self.listener.close()
        if self.notify is not None:
            self.notify.close()
        self.log.close()


@pytest.fixture
def around(tmp_path):
    arounds = []

    def make(notify=False):
        arounds.append(Around(tmp_path, notify))
        return arounds[-1]
    yield make
    for x in arounds:
        x.close()


def same_file(fd_a, fd_b):
    """Two fds of one open file (eventfds all share one anonymous inode: compare their eventfd-id)."""
    def ident(fd):
        st = os.fstat(fd)
        info = [x for x in open(f"/proc/self/fdinfo/{fd}") if x.startswith("eventfd-id:")]
        return st.st_dev, st.st_ino, info[0].split()[1] if info else None
    return ident(fd_a) == ident(fd_b)


def test_tap_passes_every_message_and_fd_on_unchanged(around, tmp_path):
    t = around()
    # a request and its reply
    t.fe.send(vu.Message(R.GET_FEATURES, vu.VERSION))
    got = t.be.recv(5)
    assert (got.request, got.flags, got.payload, got.fds) == (R.GET_FEATURES, 0x1, b"", [])
    t.be.send(vu.reply(got, vu.pack_u64(0x150008000)))
    rep = t.fe.recv(5)
    assert (rep.request, rep.flags, rep.payload) == (R.GET_FEATURES, 0x5, vu.pack_u64(0x150008000))
    # SET_MEM_TABLE with NEED_REPLY and a memfd: the backend gets the same file, the tap maps it too
    mfd = os.memfd_create("tap-test")
    os.ftruncate(mfd, 1 << 20)
    os.pwrite(mfd, b"marker", 4096)
    region = vu.MemRegion(0x100000, 1 << 20, 0x7f0000000000, 0)
    t.fe.send(vu.Message(R.SET_MEM_TABLE, vu.VERSION | vu.NEED_REPLY, vu.pack_mem_table([region]), [mfd]))
    got = t.be.recv(5)
    assert got.flags == 0x9 and got.payload == vu.pack_mem_table([region]) and len(got.fds) == 1
    assert same_file(got.fds[0], mfd) and os.pread(got.fds[0], 6, 4096) == b"marker"
    got.close_fds()
    t.be.send(vu.ack(got))
    assert t.fe.recv(5).payload == vu.pack_u64(0)
    assert t.picture.buf_mem.read(0x100000 + 4096, 6) == b"marker"      # guest-physical space
    assert t.picture.ring_mem.read(0x7f0000000000 + 4096, 6) == b"marker"  # userspace-address space
    # a kick eventfd passes straight through by default
    efd = os.eventfd(0)
    t.fe.send(vu.Message(R.SET_VRING_KICK, vu.VERSION, vu.VringFile(1).pack(), [efd]))
    got = t.be.recv(5)
    assert same_file(got.fds[0], efd)
    got.close_fds()
    # what breaks the protocol still goes on, for the backend to judge
    for msg in (vu.Message(99, vu.VERSION | vu.NEED_REPLY, b"abc"), vu.Message(R.SET_OWNER, 0x2, b""),
                vu.Message(R.SET_FEATURES, vu.VERSION, b"\x01\x02")):
        t.fe.send(msg)
        got = t.be.recv(5, strict=False)
        assert (int(got.request), got.flags, got.payload) == (int(msg.request), msg.flags, msg.payload)
    for fd in (mfd, efd):
        os.close(fd)
    # the backend leaves: the frontend sees the connection close, as it would without the tap
    t.be.close()
    with pytest.raises(vu.PeerGone):
        t.fe.recv(5)
    t.thread.join(timeout=5)
    t.log.close()
    lines = [json.loads(x) for x in open(tmp_path / "tap.log")]
    msgs = [(x["dir"], x["request"]) for x in lines if "request" in x]
    assert msgs[:4] == [("F>B", "GET_FEATURES"), ("B>F", "GET_FEATURES"), ("F>B", "SET_MEM_TABLE"),
                        ("B>F", "SET_MEM_TABLE")]
    mem = next(x for x in lines if x.get("request") == "SET_MEM_TABLE")
    assert mem["payload"] == [{"gpa": 0x100000, "size": 1 << 20, "uaddr": 0x7f0000000000, "mmap_offset": 0}]
    assert mem["fds"][0]["what"].startswith("/memfd:tap-test") and mem["fds"][0]["size"] == 1 << 20
    assert mem["flag_names"] == ["VERSION_1", "NEED_REPLY"]
    assert next(x for x in lines if x.get("request") == "GET_FEATURES" and x["dir"] == "B>F")["payload"]["names"] == [
        "MRG_RXBUF", "INDIRECT_DESC", "PROTOCOL_FEATURES", "VERSION_1"]
    assert "error" in next(x for x in lines if x.get("request") == "UNKNOWN(99)")
    assert [x["event"] for x in lines if "event" in x] == ["connected", "disconnected"]


def test_tap_notify_tap_counts_times_and_forwards(around, tmp_path):
    t = around(notify=True)
    kick, call = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    for req, fd in ((R.SET_VRING_NUM, None), (R.SET_VRING_KICK, kick), (R.SET_VRING_CALL, call)):
        payload = vu.VringState(0, 256).pack() if fd is None else vu.VringFile(0).pack()
        t.fe.send(vu.Message(req, vu.VERSION, payload, [] if fd is None else [fd]))
    t.be.recv(5)
    be_kick, be_call = t.be.recv(5).fds[0], t.be.recv(5).fds[0]
    assert not same_file(be_kick, kick) and not same_file(be_call, call)  # the tap's own eventfds
    for _ in range(3):
        os.eventfd_write(kick, 1)
        time.sleep(0.05)
    os.eventfd_write(be_call, 2)  # the backend calls

    def read(fd):
        r, _, _ = select.select([fd], [], [], 5)
        assert r, "the notification was not passed on"
        return int.from_bytes(os.read(fd, 8), "little")

    got = 0
    while got < 3:
        got += read(be_kick)
    assert got == 3 and read(call) == 2
    deadline = time.monotonic() + 5
    while (t.picture.vrings[0].kicks, t.picture.vrings[0].calls) != (3, 2):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    v = t.picture.vrings[0]
    assert v.kick_t and v.call_t and v.kick_reads >= 1
    assert any(n.startswith("tap: kicks 3 ") for n in t.picture.meta(0)["notes"])
    for fd in (kick, call, be_kick, be_call):
        os.close(fd)
    t.log.f.flush()
    notes = [json.loads(x) for x in open(tmp_path / "tap.log") if '"notify"' in x]
    assert sum(x["count"] for x in notes if x["notify"] == "kick") == 3
    assert [x for x in notes if x["notify"] == "call"] and all(x["vring"] == 0 for x in notes)


def test_tap_notify_tap_relays_only_eventfds(around):
    """--notify-tap took any fd as a kick or call fd: a pty whose read waits for 255 bytes (a tty in raw mode,
    VMIN 255) stalled the relay with its lock held, and with it the next SET_VRING_KICK/CALL and every message
    behind it (found by review attack41). Only an eventfd is interposed now; anything else goes on as it came,
    for the backend to judge (`vring vhost` refuses it)."""
    import pty
    import tty
    t = around(notify=True)
    master, slave = pty.openpty()
    tty.setraw(slave)
    attrs = tty.tcgetattr(slave)
    attrs[6][tty.VMIN], attrs[6][tty.VTIME] = 255, 255
    tty.tcsetattr(slave, tty.TCSANOW, attrs)
    try:
        t.fe.send(vu.Message(R.SET_VRING_KICK, vu.VERSION, vu.VringFile(0).pack(), [slave]))
        be_kick = t.be.recv(5).fds[0]
        assert same_file(be_kick, slave)   # passed on, not interposed
        os.write(master, b"x")             # a relay reading it would wait for 254 more bytes
        call = os.eventfd(0, os.EFD_NONBLOCK)
        t0 = time.monotonic()
        t.fe.send(vu.Message(R.SET_VRING_CALL, vu.VERSION, vu.VringFile(0).pack(), [call]))
        be_call = t.be.recv(5).fds[0]
        assert time.monotonic() - t0 < 2 and not same_file(be_call, call)   # this one is interposed
        for fd in (be_kick, be_call, call):
            os.close(fd)
    finally:
        os.close(master)
        os.close(slave)


# --- our own driver and backend through the tap ----------------------------------------------------------------

@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def run_driver(procs, sock, *args):
    p = procs.start("driver", "--socket", sock, "--json", *args)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out)


def frames(path):
    with open(path, "rb") as f:
        return [(ts, buf) for ts, buf in dpkt.pcap.Reader(f)]


def tshark_count(path):
    out = subprocess.run([TSHARK, "-r", str(path), "-T", "fields", "-e", "eth.type"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_tap_between_our_driver_and_backend(procs, tmp_path, capsys):
    """Two sessions through one tap: packed then split rings. After each, the tap still has the rings the
    driver left behind: its dump agrees with what the driver sent and with the GET_VRING_BASE the tap
    saw; the log holds both handshakes; the capture holds the frames."""
    vh, a, tctl = str(tmp_path / "vh.sock"), str(tmp_path / "tap.sock"), str(tmp_path / "tap.ctl")
    log, pcap = tmp_path / "tap.log", tmp_path / "tap.pcap"
    backend = procs.start("vhost", "--socket", vh, "--fwd", "io", "--max-connections", "2")
    wait_for(vh, backend)
    tap = procs.start("tap", "--listen", a, "--connect", vh, "--ctl", tctl, "--log", str(log), "--pcap", str(pcap),
                      "--pcap-count", "64")
    wait_for(a, tap)
    wait_for(tctl, tap)
    for session, fmt, count in ((1, "packed", 500), (2, "split", 300)):
        res = run_driver(procs, a, f"--{fmt}", "--mode", "txonly", "--count", str(count))
        assert res["tx"]["packets"] == count
        deadline = time.monotonic() + 10
        while True:  # the session ends when the driver has gone
            raw = ctl.query(tctl, "tx")
            if raw.meta["state"] == "disconnected" and raw.meta["connection"] == session:
                break
            assert time.monotonic() < deadline, raw.meta
            time.sleep(0.1)
        snap = raw.snapshot()
        assert snap["side"] == "memory" and snap["format"] == fmt
        if fmt == "packed":  # one descriptor per frame; both wrap counters start at 1
            assert snap["indices"]["next_avail"] == count % 256
            assert snap["indices"]["avail_wrap"] == 1 ^ (count // 256) & 1
            assert snap["counts"]["available_descs"] == 0
            assert raw.meta["stopped_base"] & 0x7FFF == count % 256
            assert raw.meta["stopped_base"] >> 15 & 1 == snap["indices"]["avail_wrap"]
        else:
            assert snap["indices"] == {"avail.idx": count, "used.idx": count}
            assert raw.meta["stopped_base"] == count
        assert any("GET_VRING_BASE reply" in n for n in raw.meta["notes"])
    assert cli.main(["dump", "--ctl", tctl, "rx", "--no-descriptors"]) == 0
    out = capsys.readouterr().out
    assert "tap: vring 0 (rx), connection 2 (gone), disconnected" in out and "split memory queue" in out
    saved = str(tmp_path / "tx.raw")  # --raw and --watch work on the tap as on our own processes
    assert cli.main(["dump", "--ctl", tctl, "tx", "--raw", saved, "--watch", "0.05", "--count", "2", "--json"]) == 0
    samples = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(samples) == 2 and samples[0][0]["meta"]["vring"] == 1
    assert cli.main(["dump", "--from", saved]) == 0
    assert "tap: GET_VRING_BASE reply 300: where the backend stopped" in capsys.readouterr().out
    tap.send_signal(signal.SIGTERM)
    _, err = tap.communicate(timeout=20)
    assert tap.returncode == 0 and not os.path.exists(a) and not os.path.exists(tctl)
    # the capture is a bystander's (tap/capture.py): it may fall behind a peer as fast as ours, and says so; the
    # capture itself is tested step by step in test_tap_capture.py. Here: the limit holds, and 800 frames crossed,
    # so what was not captured is counted
    m = re.search(rf"pcap {re.escape(str(pcap))}: (\d+) frames \(limit 64, (\d+) more seen and left out\); "
                  r"not captured: lapped (\d+), lost (\d+), unreadable (\d+), not seen published (\d+)", err)
    assert m, err
    captured, _, *missed = map(int, m.groups())
    assert captured <= 64 and (captured == 64 or sum(missed) > 0), err
    lines = [json.loads(x) for x in open(log)]
    requests = [x["request"] for x in lines if x.get("dir") == "F>B"]
    for name in ("SET_OWNER", "GET_FEATURES", "SET_FEATURES", "SET_MEM_TABLE", "SET_VRING_NUM", "SET_VRING_ADDR",
                 "SET_VRING_BASE", "SET_VRING_KICK", "SET_VRING_CALL", "GET_VRING_BASE"):
        assert requests.count(name) >= 2 if "VRING" not in name else requests.count(name) >= 4, name
    assert [x["event"] for x in lines if "event" in x] == ["connected", "disconnected"] * 2
    got = frames(pcap)
    assert len(got) == captured
    assert all(len(buf) == 64 and dpkt.ethernet.Ethernet(buf).type == dpkt.ethernet.ETH_TYPE_IP for _, buf in got)
    if TSHARK:
        assert tshark_count(pcap) == ["0x0800"] * captured
    assert decode_file(log, open(os.devnull, "w")) == 0


@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_driver_and_vhost_pcap(procs, tmp_path, fmt):
    """--pcap on our own two processes: the driver writes what it sends and receives, the backend what it
    takes off the Tx ring and puts on the Rx ring, each up to its --pcap-count."""
    vh = str(tmp_path / "vh.sock")
    backend = procs.start("vhost", "--socket", vh, "--max-connections", "1", "--pcap", str(tmp_path / "b.pcap"),
                          "--pcap-count", "50")
    wait_for(vh, backend)
    res = run_driver(procs, vh, f"--{fmt}", "--mode", "macfwd", "--count", "8", "--seconds", "1",
                     "--pcap", str(tmp_path / "a.pcap"), "--pcap-count", "40")
    assert res["pcap"]["written"] == 40 and res["rx"]["packets"] > 40
    _, err = backend.communicate(timeout=20)
    assert "pcap " + str(tmp_path / "b.pcap") + ": 50 frames" in err
    a, b = frames(tmp_path / "a.pcap"), frames(tmp_path / "b.pcap")
    assert len(a) == 40 and len(b) == 50
    src = {buf[6:12] for _, buf in a + b}
    assert len(src) == 2  # the template's two MACs, swapped on every pass
    assert all(len(buf) == 64 and dpkt.ethernet.Ethernet(buf).type == dpkt.ethernet.ETH_TYPE_IP for _, buf in a + b)
    # the backend writes each frame as taken from the Tx ring, then as put on the Rx ring (MACs swapped)
    first = b[0][1]
    assert first[6:12] + first[:6] + first[12:] in [buf for _, buf in b[1:]]
    if TSHARK:
        assert len(tshark_count(tmp_path / "a.pcap")) == 40


def test_pcap_writer_limit_and_format(tmp_path):
    w = PcapWriter(tmp_path / "x.pcap", count=2)
    t = 1_700_000_000_999_999_999  # rounds down to whole microseconds, never up to a full second
    assert w.write(b"\x01" * 60, t) and w.write(b"\x02" * 60, t + 1000)
    assert not w.write(b"\x03" * 60, t) and w.full
    w.close()
    assert w.stats() == {"path": str(tmp_path / "x.pcap"), "written": 2, "limit": 2, "left_out": 1,
                          "dropped": 0, "error": None}
    got = frames(tmp_path / "x.pcap")
    assert [buf[:1] for _, buf in got] == [b"\x01", b"\x02"]
    assert got[0][0] == pytest.approx(1_700_000_000.999999, abs=1e-6)
    assert oct(os.stat(tmp_path / "x.pcap").st_mode & 0o777) == "0o600"


def test_pcap_writer_drops_whole_frames_for_a_reader_that_stopped_reading(tmp_path, monkeypatch):
    """A FIFO whose reader stopped reading never blocks the writer: past BACKLOG bytes frames are dropped and
    counted, close() gives up after CLOSE_GRACE_S, and what the reader finally gets is a pcap stream whose
    frames are whole and in order."""
    monkeypatch.setattr(PcapWriter, "BACKLOG", 1 << 16)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        w = PcapWriter(fifo)
        t0 = time.monotonic()
        taken = [w.write(i.to_bytes(4, "big") * 250, 1_700_000_000_000_000_000 + i) for i in range(2000)]
        assert taken[:50] == [True] * 50 and not all(taken)
        w.close()
        assert time.monotonic() - t0 < 5
        st = w.stats()
        assert st["dropped"] > 0 and st["written"] > 0 and st["written"] + st["dropped"] == 2000, st
        assert st["error"].startswith("the reader stopped reading"), st
        got = b""
        while chunk := os.read(r, 1 << 20):
            got += chunk
    finally:
        os.close(r)
    whole = got[:24 + st["written"] * 1016]   # file header; 16-byte record header + 1000 bytes each
    seen = [buf for _, buf in dpkt.pcap.Reader(io.BytesIO(whole))]
    assert [int.from_bytes(b[:4], "big") for b in seen] == list(range(st["written"]))
    assert all(len(b) == 1000 for b in seen)


def test_pcap_writer_close_gives_a_trickling_reader_a_second_in_all(tmp_path):
    """helper-70: close() gave up only on a reader that made no progress at all; one that trickled kept the exit
    waiting until the whole backlog was through (25 s at 100 KB/s, with every signal ignored meanwhile). It now
    stops after CLOSE_LIMIT_S in all and counts the rest as dropped."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    stop, got = threading.Event(), bytearray()

    def trickle():   # ~320 KB/s
        while not stop.is_set():
            try:
                got.extend(os.read(r, 16384))
            except BlockingIOError:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=trickle)
    try:
        w = PcapWriter(fifo)
        for i in range(4000):   # 4 MB: 12 s at that speed
            assert w.write(i.to_bytes(4, "big") * 250, 1_700_000_000_000_000_000)
        t.start()
        t0 = time.monotonic()
        w.close()
        took = time.monotonic() - t0
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        os.close(r)
    st = w.stats()
    assert took < 10, f"close() took {took:.1f} s"
    assert st["error"].startswith("the reader was too slow") and st["written"] + st["dropped"] == 4000, st


def test_pcap_writer_cuts_a_full_disk_back_to_its_last_whole_frame(tmp_path, monkeypatch):
    """helper-70: a disk that filled up in the middle of a frame left it torn at the end of the file (tshark: "cut
    short in the middle of a packet"). A regular file is cut back to its last whole frame."""
    import rings.pcap as pcap_mod
    real, room = os.write, [20_000]

    def small_disk(fd, data):
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[:room[0]]))
        room[0] -= n
        return n

    monkeypatch.setattr(pcap_mod.os, "write", small_disk)
    w = PcapWriter(tmp_path / "x.pcap")
    offered = 0
    while not w.full:
        w.write(b"\x07" * 1000, 1_700_000_000_000_000_000)
        offered += 1
    w.close()
    st = w.stats()
    assert "No space left" in st["error"] and "inside a frame" not in st["error"], st
    got = frames(tmp_path / "x.pcap")
    assert len(got) == st["written"] > 0 and all(len(b) == 1000 for _, b in got), st
    assert os.path.getsize(tmp_path / "x.pcap") == 24 + 1016 * st["written"]
    assert st["written"] + st["dropped"] == offered, (st, offered)


def test_pcap_writer_refuses_a_fifo_nobody_reads_by_saying_so(tmp_path):
    from rings.errors import ConfigError
    os.mkfifo(tmp_path / "f")
    with pytest.raises(ConfigError, match="a FIFO that nobody reads; start its reader first"):
        PcapWriter(tmp_path / "f")


def test_ctl_and_pcap_waits_take_fds_numbered_past_1024(tmp_path):
    """helper-70: the new waits used select(), which refuses fds >= 1024 (FD_SETSIZE): the --ctl accept thread died
    at once and PcapWriter.close() raised. Both wait with poll()."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = []
    try:
        while not fillers or fillers[-1] < 1030:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        srv = ctl.ControlServer(tmp_path / "c.sock").start()
        try:
            assert srv._sock.fileno() >= 1024
            reply = ctl.request(tmp_path / "c.sock", "list", timeout=5)
            assert reply["ok"], reply
        finally:
            srv.close()
        os.mkfifo(tmp_path / "f")
        r = os.open(tmp_path / "f", os.O_RDONLY | os.O_NONBLOCK)
        try:
            w = PcapWriter(tmp_path / "f")
            for i in range(2000):
                w.write(b"\x01" * 1000, 1_700_000_000_000_000_000)
            w.close()   # a reader that never reads: gives up after CLOSE_GRACE_S
            assert w.stats()["error"].startswith("the reader stopped reading")
        finally:
            os.close(r)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_tap_cli_errors_and_decode(tmp_path, capsys):
    assert cli.main(["tap", "--listen", str(tmp_path / "a")]) == 2   # usage errors: exit 2, one line
    assert "give the frontend side" in capsys.readouterr().err
    assert cli.main(["tap", "--listen", str(tmp_path / "a"), "--connect", "b", "--pcap-count", "-1"]) == 2
    assert "--pcap-count must be >= 0" in capsys.readouterr().err
    log = tmp_path / "x.log"
    m = MessageLog(log)
    m.message(1, "F>B", vu.Message(R.SET_VRING_BASE, 1, vu.VringState(1, 0x8005).pack()),
              vu.VringState(1, 0x8005), None, [], packed=True)
    m.close()
    with open(log, "a") as f:
        f.write("[[[[\n{\"t\": \"x\"}\n")
    assert cli.main(["tap", "--decode", str(log)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("F>B SET_VRING_BASE [VERSION_1] index=1 num=32773 decoded=0x8005 (avail 5 wrap 1) fds: -")
    assert out[1].startswith("line 2: not a tap log record") and out[2].startswith("line 3: not a tap log record")
    with pytest.raises(SystemExit, match="vring tap: "):
        cli.main(["tap", "--decode", str(tmp_path / "missing.log")])


def tap_before_sleeping_vhost(procs, tmp_path):
    """`vring tap --ctl --pcap` in front of `vring vhost --fwd macswap --idle sleep`: (tap, tap socket, ctl socket,
    pcap). The backend sleeps on its kick eventfd when idle: it does not meet a truncation of the frontend's
    memory itself and drop the frontend (which would end the vrings' capture first)."""
    vh, a, tctl = str(tmp_path / "vh.sock"), str(tmp_path / "tap.sock"), str(tmp_path / "tap.ctl")
    backend = procs.start("vhost", "--socket", vh, "--fwd", "macswap", "--idle", "sleep")
    wait_for(vh, backend)
    tap = procs.start("tap", "--listen", a, "--connect", vh, "--ctl", tctl, "--pcap", str(tmp_path / "tap.pcap"))
    wait_for(a, tap)
    wait_for(tctl, tap)
    return tap, a, tctl, tmp_path / "tap.pcap"


@pytest.mark.parametrize("lost", ["everything", "buffers"])
@pytest.mark.parametrize("fmt", ["split", "packed"])
def test_tap_outlives_a_frontend_that_shrinks_its_memory(procs, tmp_path, fmt, lost):
    """A frontend truncated its (unsealable: POSIX shm) memory while the tap captured and dumped its rings: the
    tap read them through views and died of SIGBUS, taking both peers' connection with it. Now the vanished
    pages read as zeros: the capture of those vrings stops with one error line (no frame made of zeros is
    written), a live dump of them is an error naming the truncation, and the tap exits cleanly when told. When
    only the buffers went (the rings' pages are all there), the rings can still be dumped."""
    from vhost.testing import MMAP_OFFSET, PKT_BASE, ScriptedFrontend, frame
    tap, a, tctl, pcap = tap_before_sleeping_vhost(procs, tmp_path)
    with ScriptedFrontend(a, packed=fmt == "packed") as fe:
        fe.connect()
        fe.negotiate()
        fe.start()
        fe.post_rx(64)
        sent = [frame(i) for i in range(16)]
        fe.send(sent)
        os.eventfd_write(fe.kickfds[1], 1)
        assert len(fe.receive_until(len(sent), timeout=10)) == len(sent)
        assert ctl.query(tctl, "tx").snapshot()["format"] == fmt   # readable before
        deadline = time.monotonic() + 10
        while not frames(pcap):   # the capture is a bystander: it may miss frames, so more go by until it has some
            assert time.monotonic() < deadline   # (it missed all of 16 sent once, in a CI run: 1 in ~30)
            time.sleep(0.05)
            if not frames(pcap):
                fe.reclaim_tx()
                fe.post_rx(len(sent))
                fe.send(sent)
                os.eventfd_write(fe.kickfds[1], 1)
                assert len(fe.receive_until(len(sent), timeout=10)) == len(sent)
        os.ftruncate(fe.shm.fileno(), 0 if lost == "everything" else MMAP_OFFSET + PKT_BASE)
        if lost == "everything":
            with pytest.raises(Exception, match="GuestMemoryFault: the frontend shrank the memory it shared"):
                ctl.query(tctl, "tx")
            with pytest.raises(Exception, match="GuestMemoryFault"):
                ctl.query(tctl, "rx")
        else:
            assert ctl.query(tctl, "tx").snapshot()["format"] == fmt
            assert ctl.query(tctl, "rx").snapshot()["format"] == fmt
        time.sleep(0.5)   # the capture thread looks at every started vring in a loop: it meets the zeros at once
        assert tap.poll() is None, tap.communicate()
    tap.send_signal(signal.SIGTERM)
    _, err = tap.communicate(timeout=20)
    assert tap.returncode == 0, err
    if lost == "everything":
        assert re.search(r"capture of vring [01] stopped: GuestMemoryFault: the frontend shrank", err), err
    looped = {f[6:12] + f[:6] + f[12:] for f in sent}   # macswap
    written = [buf for _ts, buf in frames(pcap)]
    assert written and all(buf in sent or buf in looped for buf in written), written   # none made of zeros


@pytest.mark.parametrize("truncate_old", [False, True])
def test_tap_captures_the_rings_a_new_memory_table_brings(procs, tmp_path, truncate_old):
    """A frontend replaced its memory (SET_MEM_TABLE with new memory, rings set up in it again) on the same
    connection: the capture kept reading the old mapping and captured nothing more (found by review attack40);
    and once the old memory was truncated, the vrings were never captured again. The capture now looks anew
    whenever a started vring's memory or layout changes."""
    from rings.shm import MemoryTable, ShmRegion
    from rings.virtq import DriverQueue
    from vhost.testing import GPA_BASE, MMAP_OFFSET, REGION_SIZE, ScriptedFrontend, frame
    tap, a, tctl, pcap = tap_before_sleeping_vhost(procs, tmp_path)

    def watching(frames_seen):
        """Wait until the capture follows both vrings, with ``frames_seen`` frames on each so far."""
        deadline = time.monotonic() + 10
        while [ctl.query(tctl, q).meta["capture"].get("frames") for q in ("rx", "tx")] != [frames_seen] * 2:
            assert time.monotonic() < deadline, [ctl.query(tctl, q).meta["capture"] for q in ("rx", "tx")]
            time.sleep(0.05)

    def loop(fe, first):
        sent = [frame(first + i) for i in range(16)]
        fe.post_rx(16)
        fe.send(sent)
        os.eventfd_write(fe.kickfds[1], 1)
        assert len(fe.receive_until(len(sent), timeout=10)) == len(sent)

    with ScriptedFrontend(a) as fe:
        fe.connect()
        fe.negotiate()
        fe.start()
        watching(0)
        loop(fe, 0)
        watching(16)
        old = fe.shm
        fe.shm = ShmRegion.create(MMAP_OFFSET + REGION_SIZE, prefix="vhost-test")
        fe.mem = MemoryTable([(GPA_BASE, REGION_SIZE, fe.shm.buf, MMAP_OFFSET)])
        fe.rxq = DriverQueue(fe.mem, fe.layouts[0], fe.features)
        fe.txq = DriverQueue(fe.mem, fe.layouts[1], fe.features)
        fe.rxq.enable_calls(False)
        fe.txq.enable_calls(False)
        fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
        try:
            if truncate_old:
                os.ftruncate(old.fileno(), 0)
            watching(0)   # new observers, over the new memory
            loop(fe, 100)
            watching(16)
        finally:
            old.close()
    tap.send_signal(signal.SIGTERM)
    _, err = tap.communicate(timeout=20)
    assert tap.returncode == 0, err   # (a look at the old memory racing its truncation may say GuestMemoryFault)
    assert len(frames(pcap)) == 64


def test_tap_keeps_following_buffers_in_flight_when_the_same_memory_table_comes_again(procs, tmp_path):
    """DPDK and QEMU send SET_MEM_TABLE again while running (memory events, hotplug). The capture rebuilt its
    observers on every table, and a packed observer starts from the published position: every Rx buffer posted
    before it was lost (8 of 160 frames captured; found by review attack41). The same files at the same places
    are the same memory: the observers stay."""
    from vhost.testing import ScriptedFrontend, frame
    tap, a, tctl, pcap = tap_before_sleeping_vhost(procs, tmp_path)
    looped = set()
    with ScriptedFrontend(a, packed=True) as fe:
        fe.connect()
        fe.negotiate()
        fe.start()
        deadline = time.monotonic() + 10
        while not all(ctl.query(tctl, q).meta["capture"] for q in ("rx", "tx")):   # the capture follows both
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fe.post_rx(64)
        for k in range(5):
            fe.call(R.SET_MEM_TABLE, vu.pack_mem_table([fe.mem_region()]), [fe.shm.fileno()], need_reply=True)
            time.sleep(0.05)
            sent = [frame(100 * k + i) for i in range(8)]
            looped |= {f[6:12] + f[:6] + f[12:] for f in sent}
            fe.send(sent)
            os.eventfd_write(fe.kickfds[1], 1)
            assert len(fe.receive_until(len(sent), timeout=10)) == len(sent)
        time.sleep(0.5)
    tap.send_signal(signal.SIGTERM)
    _, err = tap.communicate(timeout=20)
    assert tap.returncode == 0, err
    rx = [buf for _ts, buf in frames(pcap) if buf in looped]
    assert len(rx) == len(looped), (len(rx), err)


@pytest.mark.parametrize("mode", ["txonly", "macfwd"])
def test_a_capture_limit_counts_every_frame_it_leaves_out(tmp_path, mode):
    """`--pcap-count N`: the frames that passed after the limit are counted as left out. Both vhost and the driver
    stop offering frames to a full capture (the C data path runs on its own), so the count was of the few frames
    of the burst that filled it (helper-70): now written + left out + dropped is every frame that passed."""
    sock, vcap, dcap = (str(tmp_path / n) for n in ("vh.sock", "v.pcap", "d.pcap"))
    procs = Procs()
    try:
        vhost = procs.start("vhost", "--socket", sock, "--max-connections", "1", "--json",
                            "--pcap", vcap, "--pcap-count", "64")
        wait_for(sock, vhost)
        driver = procs.start("driver", "--socket", sock, "--seconds", "1", "--json", "--mode", mode,
                             *(["--count", "64"] if mode == "macfwd" else []),   # macfwd: 64 injected, then looped
                             "--pcap", dcap, "--pcap-count", "64")
        out, err = driver.communicate(timeout=60)
        assert driver.returncode == 0, err
        vout, verr = vhost.communicate(timeout=30)
        assert vhost.returncode == 0, verr
    finally:
        procs.close()
    report = json.loads(out)
    cap = report["pcap"]
    offered = report["tx"]["packets"] + report["rx"]["packets"]   # (txonly: what the end's drain takes back)
    assert cap["written"] == 64 and cap["written"] + cap["left_out"] + cap["dropped"] == offered, report
    stats = [json.loads(x) for x in vout.splitlines() if x.startswith("{")][-1]
    passed = stats["txq1"]["tx_packets"] + stats["rxq0"]["rx_packets"]
    m = re.search(rf"pcap {re.escape(vcap)}: (\d+) frames \(limit 64, (\d+) more left out\)", verr)
    assert m, verr
    written, left_out = map(int, m.groups())
    assert written == 64 and written + left_out == passed > 10000, (verr, stats)
    assert len(frames(vcap)) == len(frames(dcap)) == 64


def test_pcap_writer_counts_every_frame_when_the_reader_leaves_with_the_backlog_full(tmp_path, monkeypatch):
    """helper-72: the reader goes away while the backlog is full. The drain inside write() met EPIPE and closed
    the file; write() still took the frame into the dead backlog and returned True: counted nowhere. Now
    written + dropped + left_out is every frame offered."""
    monkeypatch.setattr(PcapWriter, "BACKLOG", 1 << 16)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    w = PcapWriter(fifo)
    offered = 0
    try:
        while w.dropped == 0:
            w.write(b"\x05" * 1000, 1_700_000_000_000_000_000)
            offered += 1
    finally:
        os.close(r)   # the reader leaves: the next drain meets EPIPE
    for _ in range(5):
        assert not w.write(b"\x05" * 1000, 1_700_000_000_000_000_000)
        offered += 1
    w.close()
    st = w.stats()
    assert "BrokenPipeError" in st["error"], st
    assert st["written"] + st["dropped"] + st["left_out"] == offered, (st, offered)
