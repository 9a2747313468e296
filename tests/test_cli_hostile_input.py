"""Wrong input and signals at the command line (found by attack43): every one ends in one line and the documented
exit status, nothing left behind, no traceback.

* `vring tap --decode` reads only regular files (a FIFO hung it, /dev/zero filled memory) and stops at a line
  no tap log has (a sparse file of no newlines was read into one string);
* `vring conform` refuses durations that are not finite and positive (NaN turned the stall detector off, inf
  and -1 were tracebacks from settimeout);
* `vring dump` checks its arguments before the first sample (an empty --ctl/--shm was a TypeError, --watch inf
  an OverflowError after one sample), and `| head` is no error;
* `vring vhost --slice-us` has an upper bound (past 2^64 ns every frontend was dropped as an internal error),
  an empty --ctl (ignored) or one equal to --socket is refused, and a --pcap file that fails (disk full) ends the capture, not the connection or the exit status;
* `rings.vhost_user.listen_unix`: two servers starting on one stale path never both listen (the second used to
  unlink the first one's fresh socket);
* `vring conform driver` on SIGTERM / SIGHUP cleans up as on Ctrl-C (its socket file was left);
* `vring driver`: Ctrl-C while a backend does not answer the set-up ends it at once (it waited out --timeout);
* `vring tap --max-sessions 0` is refused (it served nobody and exited 0);
* a usage error exits 2 in every command (dump, tap and demo exited 1, demo took any --ring-size), also with
  stderr closed, and `vring demo | head -1`, `vring tap --decode LOG | head`, a closed stdout are no error;
* and what attack44 found in those fixes: a control socket's EPIPE is an error (only our stdout closing is
  quiet), a directory lock held elsewhere delays listen_unix a second at most, `vring driver --pcap` reports an
  error that shows only at close.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rings import rawdump
from rings.errors import ConfigError
from rings.layout import QueueLayout
from rings.shm import MemoryTable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _vring(*args, timeout=60, cwd=ROOT, **kw):
    return subprocess.run([sys.executable, "-m", "vring.cli", *args], capture_output=True, text=True, env=_env(),
                          cwd=cwd, timeout=timeout, **kw)


def _start(*args):
    """`vring ARGS` in a session of its own, stderr kept (``_reap``)."""
    return subprocess.Popen([sys.executable, "-m", "vring.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True)


def _wait_path(path, proc, timeout=20):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end and proc.poll() is None, f"no {path}"
        time.sleep(0.02)


def _reap(proc):
    """Kill ``proc`` if it still runs; its stderr."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    err = proc.stderr.read()
    proc.stderr.close()
    return err


def _one_line(p, rc, start):
    assert p.returncode == rc, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and p.stderr.count("\n") <= 1 and p.stderr.startswith(start), p.stderr


def test_tap_decode_reads_regular_files_only_and_stops_at_an_endless_line(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        p = _vring("tap", "--decode", path, timeout=20)
        assert p.returncode == 1 and "not a regular file" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr, p.stderr
    sparse = tmp_path / "sparse.log"
    with open(sparse, "wb") as f:
        f.truncate(1 << 34)   # 16 GiB of holes: no newline anywhere
    p = _vring("tap", "--decode", str(sparse), timeout=60,
               preexec_fn=lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_AS,
                                                                   (2 << 30, 2 << 30)))
    assert p.returncode == 1 and p.stdout.startswith("line 1: longer than") and "decoding stopped" in p.stdout, p
    assert "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("args", [
    ["driver", "--wait", "nan"], ["driver", "--wait", "-1"], ["driver", "--timeout", "inf"],
    ["driver", "--seconds", "nan"], ["device", "--timeout", "nan"], ["device", "--stall", "nan"],
    ["device", "--stall", "inf"], ["device", "--rx-wait", "-1"]], ids=" ".join)
def test_conform_refuses_durations_that_are_not_finite_and_positive(tmp_path, args):
    p = _vring("conform", args[0], "--socket", str(tmp_path / "x.sock"), *args[1:])
    _one_line(p, 2, f"vring conform: ConfigError: --{args[1].lstrip('-')} must be a number of seconds")
    assert not os.path.exists(tmp_path / "x.sock")


def _snapshot_file(tmp_path):
    lay = QueueLayout.contiguous("split", 8, 0x1000)
    mem = MemoryTable([(0x1000, 0x4000, bytearray(0x4000))])
    path = tmp_path / "q.raw"
    path.write_bytes(rawdump.capture_memory(mem, lay, 0).dumps())
    return str(path)


@pytest.mark.parametrize("args", [["--ctl", ""], ["--shm", "", "--fmt", "split", "--size", "8"],
                                  ["--from", "F", "--watch", "inf"], ["--from", "F", "--watch", "-1"],
                                  ["--from", "F", "--watch", "nan"], ["--from", "F", "--count", "-1"]], ids=" ".join)
def test_dump_checks_its_arguments_before_the_first_sample(tmp_path, args):
    f = _snapshot_file(tmp_path)
    p = _vring("dump", *[f if a == "F" else a for a in args])
    _one_line(p, 2, "vring dump: --")
    assert p.stdout == "", p.stdout   # nothing sampled first


def test_dump_into_a_closed_pipe_is_no_error(tmp_path):
    import numpy as np

    from rings.virtq import DeviceQueue, DriverQueue
    f = _snapshot_file(tmp_path)
    base, size = 0x100000, 1024   # --diff too (attack45: it printed outside the quiet path), a diff past a pipe's
    mem = MemoryTable([(base, 1 << 20, bytearray(1 << 20))])   # buffer: 1000 chains made available
    lay = QueueLayout.contiguous("split", size, base)
    drv, dev = DriverQueue(mem, lay, 0), DeviceQueue(mem, lay, 0)
    rawdump.save(dev, str(tmp_path / "a.raw"))
    k = 1000
    drv.add(base + 0x40000 + 128 * np.arange(k), np.full(k, 100), np.zeros(k, int), np.ones(k, int), np.arange(k))
    drv.publish()
    rawdump.save(dev, str(tmp_path / "b.raw"))
    for args in (["--from", f], ["--diff", str(tmp_path / "a.raw"), str(tmp_path / "b.raw")]):
        r, w = os.pipe()
        os.close(r)   # `| head` that read nothing
        p = subprocess.run([sys.executable, "-m", "vring.cli", "dump", *args], stdout=w, stderr=subprocess.PIPE,
                           text=True, env=_env(), cwd=ROOT, timeout=60)
        os.close(w)
        assert p.returncode == 0 and p.stderr == "", (args, p.stderr)


@pytest.mark.parametrize("args,says", [(["--slice-us", str(10**17)], "--slice-us must be at most"),
                                       (["--ctl", ""], "--ctl needs a path of its own"),
                                       (["--ctl", "SOCK"], "--ctl needs a path of its own")],
                         ids=["slice", "ctl-empty", "ctl-is-socket"])
def test_vhost_refuses_a_slice_past_what_the_c_loop_counts_and_a_ctl_path_that_is_none(tmp_path, args, says):
    sock = str(tmp_path / "v.sock")
    p = _vring("vhost", "--socket", sock, *[sock if a == "SOCK" else a for a in args])
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(sock)


def test_pcap_file_that_fails_ends_the_capture_not_the_run(tmp_path):
    """`vring vhost --pcap /dev/full` (a full disk): the frontend was dropped as an internal error at each burst
    and the exit at Ctrl-C was an OSError traceback. Now the capture stops with one error line; traffic, the
    summary and exit 0 are as without --pcap."""
    from rings.pcap import PcapWriter
    w = PcapWriter("/dev/full")
    assert all(w.write(b"\x00" * 200, time.time_ns()) or w.full for _ in range(200))
    assert w.full and "No space left" in w.error and w.left_out > 0
    w.close()   # no second error
    sock = str(tmp_path / "v.sock")
    be = _start("vhost", "--socket", sock, "--pcap", "/dev/full")
    try:
        _wait_path(sock, be)
        drv = _vring("driver", "--socket", sock, "--count", "64", "--seconds", "1", "--verify", "--json",
                     "--pcap", "/dev/full", timeout=60)
        assert drv.returncode == 0, drv.stderr[-2000:]
        # the driver's report has the error, also one that shows only when the last frames reach the file
        import json
        assert "No space left" in json.loads(drv.stdout)["pcap"]["error"], drv.stdout[-2000:]
    finally:
        be.send_signal(signal.SIGINT)
        try:
            be.wait(20)
        finally:
            err = _reap(be)
    assert be.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    assert "capture stopped" in err and "No space left on device" in err, err[-3000:]


def test_two_servers_starting_on_one_stale_path_never_both_listen(tmp_path):
    from rings import vhost_user as vu
    path = str(tmp_path / "s.sock")
    for _ in range(60):
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)   # a stale socket file
        s.close()
        go_r, go_w = os.pipe()
        kids = []
        for _k in range(2):
            pid = os.fork()
            if pid == 0:   # child: listen, then see whether a connection to the path reaches our listener
                code = 4
                try:
                    os.read(go_r, 1)
                    listener = vu.listen_unix(path)
                    time.sleep(0.05)
                    c = socket.socket(socket.AF_UNIX)
                    c.settimeout(0.2)
                    try:
                        c.connect(path)
                    except OSError:
                        pass
                    listener.settimeout(0.2)
                    try:
                        listener.accept()
                        code = 0       # reachable at the path
                    except OSError:
                        code = 3       # listening where nobody can reach it
                except ConfigError:
                    code = 1           # refused: the other one listens
                finally:
                    os._exit(code)
            kids.append(pid)
        os.write(go_w, b"xx")
        codes = sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids)
        os.close(go_r)
        os.close(go_w)
        os.unlink(path)
        assert codes == [0, 1], codes


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_conform_driver_cleans_up_on_sigterm_and_sighup(tmp_path, sig):
    sock = str(tmp_path / "cf.sock")
    p = _start("conform", "driver", "--socket", sock, "--wait", "20")
    try:
        _wait_path(sock, p)
        p.send_signal(sig)
        assert p.wait(20) == 130
    finally:
        err = _reap(p)
    assert "Traceback" not in err, err
    assert not os.path.exists(sock), "the socket file was left"


def test_driver_ctrl_c_while_a_backend_does_not_answer_ends_it_at_once(tmp_path):
    """The driver's handler only set a flag, and the wait for a reply (PEP 475) went on to --timeout (20 s here)
    and ended in ProtocolTimeout. While the rings are being set up a signal now interrupts at once (exit 130)."""
    sock = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock)
    listener.listen(1)
    drv = _start("driver", "--socket", sock, "--timeout", "20")
    try:
        listener.settimeout(20)
        _conn, _ = listener.accept()   # and never answers
        time.sleep(0.5)
        t0 = time.monotonic()
        drv.send_signal(signal.SIGINT)
        assert drv.wait(10) == 130
        assert time.monotonic() - t0 < 3
    finally:
        err = _reap(drv)
        listener.close()
    assert "Traceback" not in err and "ProtocolTimeout" not in err, err


def test_tap_refuses_to_serve_no_session(tmp_path):
    """`--max-sessions 0` exited 0 at once, having served nobody (`vring vhost --max-connections 0` is refused)."""
    p = _vring("tap", "--listen", str(tmp_path / "a.sock"), "--connect", str(tmp_path / "b.sock"),
               "--max-sessions", "0")
    _one_line(p, 2, "vring tap: --max-sessions must be >= 1")
    assert not os.path.exists(tmp_path / "a.sock")


_USAGE_ERRORS = [
    (["dump", "--from", "F", "--count", "-1"], "vring dump: --count must be >= 0"),
    (["dump", "--shm", "x"], "vring dump: --shm needs --fmt and --size"),
    (["dump", "--shm", "x", "--fmt", "split", "--size", "8", "--desc", "0"], "vring dump: give all of --desc"),
    (["tap", "--listen", "A", "--connect", "B", "--pcap-count", "-1"], "vring tap: --pcap-count must be >= 0"),
    (["tap", "--listen", "A", "--connect", "B", "--peer-timeout", "nan"], "vring tap: --peer-timeout must be"),
    (["tap", "--listen", "A"], "vring tap: give the frontend side"),
    (["demo", "--count", "0"], "vring demo: --count must be in 1..2^63-1 and --burst in"),
    (["demo", "--ring-size", "100"], "vring demo: --ring-size: split queue size must be a power of 2"),
    (["demo", "--ring-size", "40000"], "vring demo: --ring-size: queue size must be 1..32768"),
    # found by attack50: exit 1, or a run that failed, or a dump whose --raw it could not read back
    (["dump", "--shm", "x", "--fmt", "split", "--size", "3"], "vring dump: split queue size must be a power of 2"),
    (["dump", "--shm", "x", "--fmt", "split", "--size", "8", "--gpa", "-16"], "vring dump: --gpa must be in"),
    (["dump", "--shm", "x", "--fmt", "split", "--size", "8", "--features", "-1"], "vring dump: --features must be"),
    (["dump", "--from", "F", "--raw", ""], "vring dump: --raw needs a non-empty value"),
    (["demo", "--burst", "99999999999"], "vring demo: --count must be in 1..2^63-1 and --burst in 1..32768"),
    (["tap", "--listen", "A", "--backend-listen", "A"], "vring tap: the frontend's, the backend's and the --ctl"),
    (["tap", "--listen", "A", "--connect", "B", "--ctl", "A"], "vring tap: the frontend's, the backend's and the"),
    (["tap", "--listen", "A", "--connect", "B", "--ctl", ""], "vring tap: a socket or file option needs a non-empty"),
    # found by attack51: no test held these bounds, or one file under two names
    (["dump", "--shm", "x", "--fmt", "split", "--size", "8", "--desc", str(1 << 64), "--driver", "0", "--device",
      "0"], "vring dump: --desc must be in 0..2^64-1"),
    (["demo", "--count", str(1 << 63)], "vring demo: --count must be in 1..2^63-1"),
    (["tap", "--listen", "A", "--connect", "B", "--peer-timeout", "86401"], "vring tap: --peer-timeout must be"),
    (["tap", "--listen", "s.sock", "--backend-listen", "A"], "vring tap: the frontend's, the backend's"),
    (["tap", "--listen", "A", "--connect", "B", "--log", "L/x", "--pcap", "R/x"], "vring tap: the frontend's"),
]


@pytest.mark.parametrize("args,says", _USAGE_ERRORS, ids=[" ".join(a) for a, _ in _USAGE_ERRORS])
def test_a_usage_error_exits_2_in_every_command(tmp_path, args, says):
    """driver, vhost, conform and bench exited 2 on a usage error; dump, tap and demo exited 1, the status of a
    run that failed, and demo ran --ring-size 100 until its first split variant failed."""
    f = _snapshot_file(tmp_path)
    os.mkdir(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    names = {"F": f, "A": str(tmp_path / "s.sock"), "B": str(tmp_path / "b.sock"), "L/x": str(tmp_path / "link/x"),
             "R/x": str(tmp_path / "real/x")}   # (s.sock: A, relative to the cwd below)
    p = _vring(*[names.get(a, a) for a in args], cwd=tmp_path)
    _one_line(p, 2, says)
    assert p.stdout == "", p.stdout
    assert not {"s.sock", "b.sock"} & set(os.listdir(tmp_path)) and not os.listdir(tmp_path / "real")


def _stderr_unwritable():
    """What `2>&-` through a shell script (pyenv's shim) leaves: fd 2 open, but not for writing."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 2)


@pytest.mark.parametrize("how", [_stderr_unwritable, lambda: os.close(2)], ids=["unwritable", "closed"])
def test_a_usage_error_with_stderr_closed_still_exits_2(tmp_path, how):
    """Found by attack50: `2>&-` made the usage error's line an OSError (EBADF), exit 1; and by attack51: with
    fd 2 really closed (sys.stderr None) the line went to stdout."""
    for args in (["demo", "--count", "0"], ["dump", "--from", "x", "--count", "-1"], ["tap", "--listen", "A"]):
        p = subprocess.run([sys.executable, "-m", "vring.cli", *args], stdout=subprocess.PIPE, env=_env(),
                           cwd=tmp_path, timeout=60, preexec_fn=how)
        assert p.returncode == 2 and p.stdout == b"", (args, p.returncode, p.stdout)


@pytest.mark.parametrize("how", ["closed", "full"])
def test_output_that_cannot_be_written_is_one_line_or_quiet(tmp_path, how):
    """Found by attack50: with stdout closed (`>&-`) demo and dump ended in an AttributeError traceback (exit 1);
    on a full disk (/dev/full) demo did in an OSError one. Now a closed stdout is quiet as a closed pipe (0), a
    full one a one-line error (1)."""
    f = _snapshot_file(tmp_path)
    for args in (["demo", "--count", "2000"], ["demo", "--count", "2000", "--json"], ["dump", "--from", f]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-m", "vring.cli", *args], stderr=subprocess.PIPE, text=True,
                               env=_env(), cwd=ROOT, timeout=120,
                               **({"preexec_fn": lambda: os.close(1)} if how == "closed" else {"stdout": full}))
        if how == "closed":
            assert p.returncode == 0 and p.stderr == "", (args, p.returncode, p.stderr)
        else:
            _one_line(p, 1, f"vring {args[0]}: ")
            assert "cannot write the output: No space left on device" in p.stderr, p.stderr


def test_tap_decode_with_stdout_closed_still_reads_the_log(tmp_path):
    """Found by attack51: with no stdout (`>&-`) `tap --decode` exited 0 without reading the log, a missing file
    or a bad line included."""
    good, bad = tmp_path / "good.log", tmp_path / "bad.log"
    good.write_text('{"t": 1.0, "seq": 0, "conn": 1, "event": "connected"}\n')
    bad.write_text("garbage\n")
    for path, rc in ((good, 0), (bad, 1), (tmp_path / "missing.log", 1)):
        p = subprocess.run([sys.executable, "-m", "vring.cli", "tap", "--decode", str(path)], stderr=subprocess.PIPE,
                           text=True, env=_env(), cwd=ROOT, timeout=60, preexec_fn=lambda: os.close(1))
        assert p.returncode == rc and "Traceback" not in p.stderr, (path, p.returncode, p.stderr)


def test_tap_decode_into_a_closed_pipe_is_no_error(tmp_path):
    """Found by attack50: `vring tap --decode LOG | head -1` said "[Errno 32] Broken pipe", exit 1."""
    log = tmp_path / "t.log"
    log.write_text("".join(f'{{"t": 1.0, "seq": {n}, "conn": 1, "event": "connected"}}\n' for n in range(20000)))
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "vring.cli", "tap", "--decode", str(log)], stdout=w,
                       stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, timeout=60)
    os.close(w)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_demo_into_a_closed_pipe_is_no_error():
    """`vring demo | head -1`: the pipe closes after the first variant; the demo ends quietly with 0 (it printed
    a BrokenPipeError traceback, exit 1)."""
    p = subprocess.Popen([sys.executable, "-m", "vring.cli", "demo", "--count", "20000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        first = p.stdout.readline()
        p.stdout.close()   # `head -1` read its line and left
        err = p.stderr.read()
        rc = p.wait(120)
    finally:
        _reap(p)
    assert first.startswith("split/normal") and rc == 0 and err == "", (first, rc, err)


def _closed_pipe():
    """A pipe whose reader has gone: its write end, for a child's stdout (the parent's copy closed)."""
    r, w = os.pipe()
    os.close(r)
    return w


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_driver_report_into_a_closed_pipe_is_no_error(tmp_path, check, json_out):
    """`vring driver ... | head -0`: the report's reader has gone. The run ends with the status it would have had,
    0 here, and no BrokenPipeError traceback (it was exit 1; helper-69)."""
    sock = str(tmp_path / "v.sock")
    backend = None if check else _start("vhost", "--socket", sock)
    w = _closed_pipe()
    try:
        if backend is not None:
            deadline = time.monotonic() + 30
            while not os.path.exists(sock):
                assert backend.poll() is None and time.monotonic() < deadline, _reap(backend)
                time.sleep(0.02)
        args = ["driver", "--socket", sock, "--seconds", "0.3"] + ["--check"] * check + ["--json"] * json_out
        p = subprocess.run([sys.executable, "-m", "vring.cli", *args], stdout=w, stderr=subprocess.PIPE,
                           text=True, env=_env(), cwd=ROOT, timeout=60)
    finally:
        os.close(w)
        if backend is not None:
            backend.send_signal(signal.SIGTERM)
            try:
                backend.wait(20)
            finally:
                _reap(backend)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


@pytest.mark.parametrize("argv, rc", [
    (["bench", "--pairs", "ours/ours", "--paths", "split-normal", "--seconds", "1", "--repeat", "1", "--warmup",
      "0", "--json", "-"], 0),
    (["conform", "device", "--socket", "nobody.sock", "--json"], 2)], ids=["bench", "conform"])
def test_bench_and_conform_results_into_a_closed_pipe_keep_their_status(tmp_path, argv, rc):
    """`vring bench ... | head -0`, `vring conform ... | head -0`: the table or JSON's reader has gone. The status
    is the run's own (bench 0, a conform that found nobody 2) with no BrokenPipeError traceback (bench: exit 1)."""
    w = _closed_pipe()
    try:
        p = subprocess.run([sys.executable, "-m", "vring.cli", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                           env=_env(), cwd=tmp_path, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == rc and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_vhost_stats_into_a_closed_pipe_end_the_stats_not_the_server(tmp_path):
    """`vring vhost --stats-interval 0.1 | head -0`: the stats stop, with one warning; the server goes on serving
    and a SIGTERM ends it with 0 (its final stats were a BrokenPipeError traceback, exit 1; helper-69)."""
    sock = str(tmp_path / "v.sock")
    w = _closed_pipe()
    try:
        p = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--stats-interval", "0.1"],
                             stdout=w, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                             start_new_session=True)
    finally:
        os.close(w)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert p.poll() is None and time.monotonic() < deadline, _reap(p)
            time.sleep(0.02)
        d = _vring("driver", "--socket", sock, "--seconds", "0.5", "--json", "--mode", "txonly")   # served after
        # the stats failed
        assert d.returncode == 0 and json.loads(d.stdout)["tx"]["packets"] > 0, d.stderr
        p.send_signal(signal.SIGTERM)
        rc = p.wait(20)
    finally:
        err = _reap(p)
    assert rc == 0 and "Traceback" not in err, err
    assert err.count("stats output failed (BrokenPipeError") == 1, err


def test_vhost_stats_on_a_full_disk_end_with_exit_2(tmp_path):
    """helper-70: `vring vhost --json --stats-interval 0.2 > /dev/full` exited 0, where the driver, --check and
    conform exit 2 on a stdout they cannot write. A reader that went away stays exit 0 (test above)."""
    sock = str(tmp_path / "v.sock")
    with open("/dev/full", "w") as full:
        p = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--json",
                              "--stats-interval", "0.2"], stdout=full, stderr=subprocess.PIPE, text=True, env=_env(),
                             cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert p.poll() is None and time.monotonic() < deadline, _reap(p)
            time.sleep(0.02)
        time.sleep(0.5)   # a stats line or two
        p.send_signal(signal.SIGTERM)
        rc = p.wait(20)
    finally:
        err = _reap(p)
    assert rc == 2 and "Traceback" not in err and "stats output failed (OSError" in err, (rc, err)


def test_dump_of_a_control_socket_whose_process_left_is_an_error(monkeypatch):
    """Found by attack44, a regression of the closed-pipe fix: the EPIPE of a control socket that closed on us was
    taken for `| head` and the dump ended silently with 0. Only our own stdout closing is quiet."""
    from vring import cmd_dump
    from vring.cli import build_parser

    class GoneSource:
        live = True

        def sample(self):
            raise BrokenPipeError(32, "Broken pipe")   # what sendall to a closed control socket raises

        def close(self):
            pass
    monkeypatch.setattr(cmd_dump, "_source", lambda args: GoneSource())
    args = build_parser().parse_args(["dump", "--ctl", "/nonexistent/ctl.sock"])
    with pytest.raises(SystemExit, match="vring dump: .*Broken pipe"):
        cmd_dump.run(args)


def test_listen_unix_goes_on_when_someone_else_holds_the_directory_lock(tmp_path):
    """Found by attack44: `flock DIR vring vhost --socket DIR/s` (or any holder of the directory's flock) had
    listen_unix wait for ever, deaf to Ctrl-C. The lock is asked for a second at most."""
    import fcntl

    from rings import vhost_user as vu
    dfd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        listener = vu.listen_unix(str(tmp_path / "s.sock"))
        assert time.monotonic() - t0 < vu.LISTEN_LOCK_WAIT + 1
        listener.close()
    finally:
        os.close(dfd)
