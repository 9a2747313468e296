"""`vring dump` against hostile sources (attack24): files whose size, not their header, is the attack, and a
control socket that picks the names `--raw` writes under."""
import base64
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from rings import errors, rawdump
from rings.ctl import ControlClient
from rings.layout import QueueLayout
from rings.shm import MemoryTable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _memory_file(meta=None):
    lay = QueueLayout.contiguous("split", 8, 0x1000)
    mem = MemoryTable([(0x1000, 0x4000, bytearray(0x4000))])
    return rawdump.capture_memory(mem, lay, 0, meta=meta).dumps()


def _limited(gib):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return limit


def _dump(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "vring.cli", "dump"] + args, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60, **kw)


@pytest.mark.parametrize("head", [b"", b"header"], ids=["bad_header", "valid_header"])
def test_sparse_huge_file_is_not_read_into_memory(tmp_path, head):
    """A raw snapshot file of 8 GiB (sparse: 4 KiB on disk) was read whole before its header was looked at:
    MemoryError and a traceback under a 1 GiB address-space limit, gigabytes allocated without one."""
    path = tmp_path / "huge.raw"
    with open(path, "wb") as f:
        f.write(_memory_file() if head else rawdump.MAGIC + b"{}\n")
        f.truncate(8 << 30)
    with pytest.raises(errors.ConfigError):
        rawdump.load(str(path))
    r = _dump(["--from", str(path)], preexec_fn=_limited(1))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("vring dump: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_header_line_without_end_is_bounded(tmp_path):
    path = tmp_path / "long.raw"
    with open(path, "wb") as f:
        f.write(rawdump.MAGIC + b"{" + b" " * (rawdump.MAX_HEADER + 10))
    with pytest.raises(errors.ConfigError, match="longer than"):
        rawdump.load(str(path))


def test_load_still_reads_a_good_file_and_reports_damage(tmp_path):
    data = _memory_file()
    path = tmp_path / "ok.raw"
    path.write_bytes(data)
    assert rawdump.load(str(path)).dumps() == data
    path.write_bytes(data + b"xyz")
    with pytest.raises(errors.ConfigError, match="3 bytes after the last blob"):
        rawdump.load(str(path))
    path.write_bytes(data[:-5])
    with pytest.raises(errors.ConfigError, match="truncated"):
        rawdump.load(str(path))


class _LyingControlServer(threading.Thread):
    """A control socket that lists queues under the names given, each one a valid raw snapshot."""

    def __init__(self, path, names, meta=None):
        super().__init__(daemon=True)
        self.names, self.raw = names, base64.b64encode(_memory_file(meta)).decode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.sock.settimeout(20)
        self.start()

    def run(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn, conn.makefile("rwb") as f:
            for line in f:
                req = json.loads(line)
                rep = ({"ok": True, "queues": [{"name": n} for n in self.names]} if req["cmd"] == "list"
                       else {"ok": True, "raw": self.raw})
                f.write(json.dumps(rep).encode() + b"\n")
                f.flush()

    def close(self):
        self.sock.close()
        self.join(5)


def test_ctl_queue_names_never_lead_raw_files_elsewhere(tmp_path):
    """`vring dump --ctl S --raw FILE` with several queues wrote FILE-NAME, NAME as the control server sent it:
    a server listing "x/../../escaped" had the snapshot written outside FILE's directory (over whatever was
    there)."""
    out = tmp_path / "out"
    (out / "snap-x").mkdir(parents=True)
    srv = _LyingControlServer(tmp_path / "c.ctl", ["x/../../escaped", "b"])
    try:
        r = _dump(["--ctl", str(tmp_path / "c.ctl"), "--raw", str(out / "snap")])
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "escaped").exists()
    written = sorted(p.name for p in out.iterdir() if p.is_file())
    assert written == ["snap-b", "snap-x_.._.._escaped"], written


def test_ctl_queue_names_and_notes_never_reach_the_terminal_raw(tmp_path):
    """The queue names a control server lists and the notes of its snapshots were printed as sent: a
    server could write terminal escape sequences (colours, a new window title, a cleared screen) into the
    user's terminal. Control characters are now printed escaped."""
    meta = {"notes": ["note \x1b]0;owned\x07 end"], "name": "ignored over --ctl"}
    srv = _LyingControlServer(tmp_path / "c.ctl", ["\x1b[31mred", "b\nfake line"], meta)
    try:
        r = _dump(["--ctl", str(tmp_path / "c.ctl")])
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout, r.stdout[:500]
    assert "== \\x1b[31mred at " in r.stdout and "== b\\nfake line at " in r.stdout, r.stdout[:500]
    assert "note \\x1b]0;owned\\x07 end" in r.stdout


def test_ctl_reply_trickled_a_byte_at_a_time_times_out_as_a_whole(tmp_path):
    """ControlClient's timeout applied to each read: a server that sent its reply a byte every 0.2 s (never a
    newline) kept `vring dump --ctl` waiting for ever. The timeout is now for the whole reply."""
    path = str(tmp_path / "slow.ctl")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    stop = threading.Event()

    def serve():
        conn, _ = lst.accept()
        with conn:
            conn.recv(1 << 16)
            for _ in range(40):   # 8 s, then the line is cut: a client without a whole-reply timeout fails, not hangs
                if stop.wait(0.2):
                    return
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no whole reply within 1 s"), ControlClient(path, 1.0) as c:
            c.list()
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        lst.close()
        th.join(5)


def test_shm_truncated_by_its_owner_while_watched_is_one_error_line():
    """`vring dump --shm NAME --watch`: the owner truncated its region between two samples, and the next copy of
    the ring areas killed the dump with SIGBUS ("Bus error", exit -7). The copy is now guarded: one line naming
    the shared memory, exit 1."""
    from rings.shm import ShmRegion
    region = ShmRegion.create(0x4000)
    try:
        args = ["--shm", region.name, "--fmt", "split", "--size", "8", "--gpa", "0x1000", "--watch", "0.02",
                "--json"]
        proc = subprocess.Popen([sys.executable, "-m", "vring.cli", "dump"] + args, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
        try:
            assert json.loads(proc.stdout.readline())["snapshot"]["format"] == "split"   # one good sample first
            os.ftruncate(region.fileno(), 0)
            _out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, (proc.returncode, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vring dump: ") and "shrank" in lines[0] and \
            region.name in lines[0] and "its owner truncated it" in lines[0], err
    finally:
        region.close()
