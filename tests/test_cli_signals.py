"""Signals and early errors of the `vring` command line (review attack43): SIGHUP to `vring bench`, SIGTERM /
SIGHUP / a lone SIGINT to `vring demo`, --json/--plot paths checked before a bench runs, bench's float options
refused when not finite or out of range, and a Ctrl-C while the parser is still being built.

Every process is started in a session of its own and signalled by pid (a terminal's hangup: its process group);
its descendants are collected before the signal and checked afterwards, and whatever survives (the defect) is
killed by pid and its /dev/shm segments removed, so that a failing test leaves nothing behind."""
import contextlib
import errno
import glob
import json
import os
import re
import socket
import signal
import subprocess
import sys
import threading
import time

import pytest

from vring import bench, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------- helpers

def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))


def _start(args, tmp_path, pipes=False):
    """`python -m vring.cli ARGS` (or any argv) in a session of its own, SIGINT at its default (a test run in the
    background inherits it ignored, and Python then installs no KeyboardInterrupt handler). Output to files
    (``proc.err_path``) unless ``pipes``: children that outlive it (the defects) would hold pipes open."""
    argv = args if args[0] == sys.executable else [sys.executable, "-m", "vring.cli", *args]
    if pipes:
        out = err = subprocess.PIPE
    else:
        out, err = open(tmp_path / "out.txt", "wb"), open(tmp_path / "err.txt", "wb")
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(tmp_path), stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    finally:
        if not pipes:
            out.close()
            err.close()
    proc.err_path = None if pipes else tmp_path / "err.txt"
    return proc


def _finish(proc, timeout):
    """Wait for the process; its stderr (bytes)."""
    if proc.err_path is None:
        return proc.communicate(timeout=timeout)[1]
    proc.wait(timeout)
    return proc.err_path.read_bytes()


def _children(pid):
    out = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(f) as fh:
                out += [int(x) for x in fh.read().split()]
        except OSError:
            pass
    return out


def _descendants(pid):
    seen, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def _running(pid):
    """Alive and not a zombie (an exited child that init has not reaped yet is gone for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _still_running(pids, grace=3.0):
    """The pids still running after up to ``grace`` s (a child may take a moment to notice its parent left)."""
    deadline = time.monotonic() + grace
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _shm_of(pids):
    return [p for pid in pids for p in glob.glob(f"/dev/shm/*-{pid}-*")]


def _reap(proc, pids):
    """Kill what a failed test left running (by pid: ours only) and remove their shm segments."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=10) if proc.err_path is None else proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for p in pids:
        if _running(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for path in _shm_of([proc.pid, *pids]):
        try:
            os.unlink(path)
        except OSError:
            pass


def _terminate(proc):
    """SIGTERM and a moment to exit cleanly; then ``_reap`` (SIGKILL) whatever still runs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    _reap(proc, [])


def _wait_until(cond, timeout, proc):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"exited early ({proc.returncode}): {_finish(proc, 10)[-2000:]!r}"
        assert time.monotonic() < deadline, "timed out waiting for the process to get going"
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------- 1. bench: SIGHUP

BENCH_SHORT = ["bench", "--pairs", "ours/ours", "--paths", "split-normal", "--warmup", "0", "--repeat", "1", "-q"]


def _dpdk_runtime_dirs(pid):
    from vring import dpdk
    return glob.glob(os.path.join(dpdk._runtime_base(), f"vr{pid}x*"))


@pytest.mark.parametrize("pair", ["ours/ours", "dpdk/dpdk"])
def test_bench_sighup_stops_children_and_cleans_up(tmp_path, pair):
    """The terminal closes (SIGHUP to the bench's process group): the bench's device and driver, each in its own
    session, must be stopped and the run's directory (and testpmd's runtime directories) removed, as on
    Ctrl-C/SIGTERM (exit 130). Before: the bench died at once and both kept busy-polling their CPUs, the directory
    left behind."""
    if pair != "ours/ours":
        from vring import dpdk
        why = dpdk.skip_reason()
        if why:
            pytest.skip(f"needs dpdk-testpmd: {why}")
    args = BENCH_SHORT + ["--seconds", "30"]
    args[args.index("--pairs") + 1] = pair
    proc = _start(args, tmp_path)
    kids = []
    try:
        # both processes up (ours: the driver's output file exists once it has been started)
        marker = "driver.out" if pair == "ours/ours" else ""
        _wait_until(lambda: glob.glob(str(tmp_path / "vring-bench-*" / marker)) and len(_children(proc.pid)) >= 2,
                    60, proc)
        time.sleep(0.5 if pair == "ours/ours" else 2.0)
        kids = _descendants(proc.pid)
        assert len(kids) >= 2
        os.killpg(proc.pid, signal.SIGHUP)   # what a terminal's hangup does (the bench leads its group)
        err = _finish(proc, 60)
        assert proc.returncode == 130, err
        assert b"interrupted" in err and b"Traceback" not in err
        assert not _still_running(kids)
        assert not glob.glob(str(tmp_path / "vring-bench-*"))
        assert not _shm_of([proc.pid, *kids])
        assert not _dpdk_runtime_dirs(proc.pid)
    finally:
        _reap(proc, kids)
        if pair != "ours/ours":
            import shutil
            for d in _dpdk_runtime_dirs(proc.pid):   # only those of this bench (its pid in their prefix)
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------- 2. demo

def _workers(pid):
    out = []
    for c in _children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def _start_demo(tmp_path):
    proc = _start(["demo", "--count", "50000000"], tmp_path)
    # both workers started (the parent also has multiprocessing's resource tracker), and a moment to get going
    _wait_until(lambda: len(_workers(proc.pid)) >= 2, 60, proc)
    time.sleep(1.5)
    return proc


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_demo_signal_stops_children_and_unlinks_shm(tmp_path, sig):
    """SIGTERM/SIGHUP (a supervisor, a closed terminal) and a SIGINT sent to the parent alone (kill -INT, not a
    terminal's Ctrl-C to the whole group) end `vring demo` promptly with exit 130, its two worker processes
    stopped and its shared-memory segment unlinked. Before: SIGTERM/SIGHUP killed the parent at once, leaving the
    segment and both workers busy-polling (up to 120 s); the lone SIGINT took ~10 s (join(5) per worker)."""
    proc, kids = None, []
    try:
        proc = _start_demo(tmp_path)
        kids = _descendants(proc.pid)
        t0 = time.monotonic()
        os.kill(proc.pid, getattr(signal, sig))
        err = _finish(proc, 30)
        took = time.monotonic() - t0
        assert proc.returncode == 130, err
        assert b"Traceback" not in err
        assert took < 4.0, f"{took:.1f} s to stop after {sig}"
        assert not _still_running(kids)
        assert not _shm_of([proc.pid, *kids])
    finally:
        if proc is not None:
            _reap(proc, kids)


def test_demo_sigkill_leaves_no_workers_and_no_shm(tmp_path):
    """Even a SIGKILL of `vring demo` (no handler can run) leaves nothing: the workers notice their parent is gone
    and stop, and the segment's name was removed as soon as both had it mapped."""
    proc, kids = None, []
    try:
        proc = _start_demo(tmp_path)
        kids = _descendants(proc.pid)
        assert len(_workers(proc.pid)) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert not _still_running(kids, grace=5.0)
        assert not _shm_of([proc.pid, *kids])
    finally:
        if proc is not None:
            _reap(proc, kids)


# --------------------------------------------------------------------------------------------- 3. bench --json/--plot

def _no_run(monkeypatch):
    def run_bench(*a, **kw):
        raise AssertionError("the benchmark started although its output path cannot be written")
    monkeypatch.setattr(bench, "run_bench", run_bench)


@pytest.mark.parametrize("option, where, message", [
    ("--json", "missing/x.json", "does not exist"),
    ("--json", "adir", "is a directory"),
    ("--plot", "missing/x.png", "does not exist"),
    ("--plot", "adir", "is a directory"),
    ("--plot", "x.nosuchformat", "cannot write .nosuchformat"),
    ("--json", "", "empty"),
])
def test_bench_output_paths_checked_before_the_run(tmp_path, monkeypatch, capsys, option, where, message):
    """A --json/--plot path that cannot be written is a usage error (exit 2, one line naming it, no traceback)
    before anything runs. Before: it was tried only after the whole run, which then ended with a traceback, exit 1,
    the results lost (and --json DIR left DIR.tmp behind)."""
    _no_run(monkeypatch)
    (tmp_path / "adir").mkdir()
    path = str(tmp_path / where) if where else ""
    with pytest.raises(SystemExit) as e:
        cli.main(BENCH_SHORT + ["--seconds", "0.5", option, path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["adir"]   # no DIR.tmp, nothing else


def test_bench_json_write_failure_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    """Should writing the JSON still fail after the run (disk full, the directory removed meanwhile), it is one
    line on stderr and exit 1, the table printed, and no FILE.tmp left behind."""
    def no_measurement(self):
        raise bench.BenchError("not measured (test)")
    monkeypatch.setattr(bench.Measurement, "run", no_measurement)
    from vring import cmd_bench

    def replace(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cmd_bench.os, "replace", replace)
    out = tmp_path / "r.json"
    rc = cli.main(BENCH_SHORT + ["--seconds", "0.5", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert "cannot write --json" in cap.err and "Traceback" not in cap.err, cap.err
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------- 4. bench floats

@pytest.mark.parametrize("args, message", [
    (["--seconds", "inf"], "--seconds"),
    (["--seconds", "nan"], "--seconds"),
    (["--seconds", "1e9"], "--seconds"),
    (["--seconds", "1", "--warmup", "nan"], "--warmup"),
    (["--seconds", "1", "--warmup", "inf"], "--warmup"),
    (["--seconds", "1", "--warmup", "1e9"], "--warmup"),
    (["--seconds", "1", "--interval", "nan"], "--interval"),
    (["--seconds", "1", "--idle", "nan"], "--idle"),
    (["--seconds", "1", "--idle", "inf"], "--idle"),
    (["--seconds", "1", "--rate", "nan"], "out of range"),
    (["--seconds", "1", "--rate", "inf"], "out of range"),
])
def test_bench_float_options_refused_before_the_run(monkeypatch, capsys, args, message):
    """Every float option of bench: a non-finite or out-of-range value is a usage error (exit 2) naming the
    option. Before: --seconds inf / --warmup nan passed, and the point failed later with an empty reason."""
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--paths", "split-normal", "-q", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_bench_config_validate_floats():
    for kw in (dict(seconds=float("inf")), dict(warmup=float("nan")), dict(interval=float("nan")),
               dict(idle_first=float("nan")), dict(rates=[float("nan")]), dict(startup_timeout=float("inf"))):
        with pytest.raises(ValueError):
            bench.BenchConfig(paths=["split-normal"], **kw).validate()


# --------------------------------------------------------------------------------------------- 5. early Ctrl-C

STALL_IMPORT = """
import os, runpy, sys, time
class Stall:
    def find_spec(self, name, path=None, target=None):
        if name == "vring.cmd_bench":     # imported while cli.main() builds the parser
            sys.meta_path.remove(self)
            os.write(1, b"building the parser\\n")
            time.sleep(20)                # the SIGINT arrives here
        return None
sys.meta_path.insert(0, Stall())
sys.argv = ["vring", "vhost", "--socket", sys.argv[1]]
runpy.run_module("vring.cli", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_building_the_parser_is_quiet_130(tmp_path):
    """A Ctrl-C while the parser is being built (subcommands, numpy, ... being imported) ends the command like a
    later one: exit 130, no traceback. Before: a KeyboardInterrupt traceback and death by SIGINT (-2)."""
    sock = tmp_path / "v.sock"
    proc = _start([sys.executable, "-c", STALL_IMPORT, str(sock)], tmp_path, pipes=True)
    try:
        line = proc.stdout.readline()
        assert line == b"building the parser\n", proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 130, err
        assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err
        assert not sock.exists()
    finally:
        _reap(proc, [])


def test_main_returns_130_on_keyboard_interrupt_in_parser(monkeypatch):
    import importlib

    def interrupted(name, *a):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib, "import_module", interrupted)
    try:
        rc = cli.main(["demo"])
    except KeyboardInterrupt:   # not let through: pytest would take it for a Ctrl-C of the whole session
        pytest.fail("KeyboardInterrupt raised while building the parser escaped cli.main()")
    assert rc == 130


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"])
def test_vhost_signals_that_keep_coming_end_it_with_0_and_its_socket_removed(tmp_path, sig):
    """`vring vhost` ends cleanly on a stop signal. One that comes once its clean-up is done used to meet the default
    handler that the interpreter's shutdown puts back: exit -N. Signals every ~1 ms until it exits reach every point
    of its way out."""
    sock = tmp_path / "v.sock"
    proc = _start(["vhost", "--socket", str(sock)], tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, _finish(proc, 5)
            time.sleep(0.02)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(sig)
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
        err = _finish(proc, 30)
    assert proc.returncode == 0, err
    assert not sock.exists()


@pytest.mark.parametrize("argv", [["driver", "--check", "--json"], ["driver", "--seconds", "0.1"], ["vhost"]],
                         ids=["driver-check", "driver-run", "vhost"])
def test_main_of_a_test_leaves_the_signal_handlers_alone(tmp_path, argv):
    """Only the process's own command line (argv None) ignores the stop signals at the end: a test calling in gets
    its handlers back. `vring driver` (a run that finds nobody at its socket) left SIG_IGN, and `vring vhost` (here
    refused: its socket path is a plain file) its dead server's handler."""
    path = tmp_path / "plain"
    path.write_bytes(b"")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert cli.main(argv + ["--socket", str(path)]) in (0, 2)
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("how", ["listening", "connected", "client"])
def test_vhost_a_stop_signal_ends_its_longest_wait_at_once(tmp_path, monkeypatch, how):
    """PEP 475 resumes a select() or sleep() that a signal interrupts: `vring vhost` used to wait out its idle
    timeout (0.2 s) or its --reconnect pause before it saw the stop. Its waits now include a signal wakeup pipe.
    Here every wait is 30 s long and the signal comes from another thread (as one delivered to a thread of its
    --ctl server or of numpy would): the command must end long before a wait runs out."""
    from vhost.server import Server
    monkeypatch.setattr(Server, "idle_timeout", 30.0)
    sock = tmp_path / "v.sock"
    args = ["vhost", "--socket", str(sock), "--handshake-timeout", "60"]
    if how == "client":
        args += ["--client", "--reconnect", "30"]
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    frontend = None

    def kill_soon():
        nonlocal frontend
        deadline = time.monotonic() + 20
        while how != "client" and not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if how == "connected":   # a frontend that connects and says nothing (the handshake wait is 60 s)
            frontend = socket.socket(socket.AF_UNIX)
            frontend.connect(str(sock))
        time.sleep(0.3)          # the server is inside its wait by now
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=kill_soon)
    t0 = time.monotonic()
    t.start()
    try:
        rc = cli.main(args)
    finally:
        t.join()
        took = time.monotonic() - t0
        if frontend is not None:
            frontend.close()
    assert {s: signal.getsignal(s) for s in before} == before, "a test calling in gets its handlers back"
    assert rc == 0
    assert took < 10, f"{took:.1f} s: the signal did not end the 30 s wait"
    assert not sock.exists()


@pytest.mark.parametrize("side", ["vhost", "driver"])
def test_a_pcap_fifo_whose_reader_stopped_reading_neither_blocks_the_rings_nor_the_stop(tmp_path, side):
    """`--pcap FIFO` with a reader that opened it and then stopped reading: the capture used to write to a blocking
    fd, and once the pipe was full the data path sat in write() for ever, where PEP 475 resumed it after every
    SIGTERM. The capture is a by-product: frames the reader cannot take are dropped and counted, the rings run on,
    and a SIGTERM ends the process with 0."""
    fifo, sock = tmp_path / "cap.fifo", tmp_path / "v.sock"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # open, never read
    (tmp_path / "v").mkdir()
    (tmp_path / "d").mkdir()
    vhost_args = ["vhost", "--socket", str(sock)] + (["--pcap", str(fifo), "--pcap-count", "0"] if side == "vhost" else [])
    driver_args = ["driver", "--socket", str(sock), "--seconds", "60", "--json", "--pkt-size", "1500",
                                     "--mode", "txonly"] + (
        ["--pcap", str(fifo), "--pcap-count", "0"] if side == "driver" else [])
    vhost = _start(vhost_args, tmp_path / "v")
    driver = None
    try:
        _wait_until(sock.exists, 30, vhost)
        driver = _start(driver_args, tmp_path / "d")
        time.sleep(3)   # a 64 KiB pipe is full after ~40 frames of 1500 B; the backlog after ~2800
        target = vhost if side == "vhost" else driver
        assert target.poll() is None, _finish(target, 10)
        target.send_signal(signal.SIGTERM)
        err = _finish(target, 20)
        assert target.returncode == 0, err[-3000:]
        if side == "vhost":
            assert re.search(rb"pcap .*: \d+ frames; (\d+) dropped; capture stopped: the reader stopped reading", err), err[-3000:]
            assert int(re.search(rb"; (\d+) dropped", err).group(1)) > 0, err[-3000:]
        else:
            report = json.loads((tmp_path / "d" / "out.txt").read_text())
            assert report["pcap"]["dropped"] > 0 and report["tx"]["packets"] > 10000, report
    finally:
        os.close(reader)
        for p in (driver, vhost):
            if p is not None:
                _terminate(p)


def test_vhost_a_stop_signal_ends_its_wait_for_the_directory_lock(tmp_path, monkeypatch):
    """listen_unix waits for the socket directory's flock (LISTEN_LOCK_WAIT), which another process may hold. A
    SIGTERM in that wait was seen only when it ran out (1 s). Here the wait is 30 s: the signal ends it, nothing
    is bound, and `vring vhost` exits 0 (helper-69)."""
    import fcntl

    from rings import vhost_user as vu
    monkeypatch.setattr(vu, "LISTEN_LOCK_WAIT", 30.0)
    sock = tmp_path / "v.sock"
    dfd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(dfd, fcntl.LOCK_EX)   # a peer's check-and-bind that takes long
    t = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    t.start()
    try:
        rc = cli.main(["vhost", "--socket", str(sock), "--ctl", str(tmp_path / "c.sock")])
    finally:
        t.join()
        os.close(dfd)
    took = time.monotonic() - t0
    assert rc == 0
    assert took < 10, f"{took:.1f} s: the signal did not end the 30 s wait for the lock"
    assert not sock.exists() and not (tmp_path / "c.sock").exists()


@pytest.mark.parametrize("command", ["vhost", "driver"])
def test_a_hangup_that_nohup_ignores_stays_ignored(tmp_path, command):
    """`nohup vring vhost ... &`: SIGHUP comes in ignored, and a closed terminal must not end the process. The stop
    handlers were installed over it. SIGTERM still ends it (helper-69)."""
    sock = tmp_path / "v.sock"
    args = (["vhost", "--socket", str(sock)] if command == "vhost" else
            ["driver", "--server", "--socket", str(sock), "--seconds", "60", "--json"])

    def nohup():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    with open(tmp_path / "err.txt", "wb") as err, open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vring.cli", *args], cwd=ROOT, env=_env(tmp_path),
                                stdout=out, stderr=err, start_new_session=True, preexec_fn=nohup)
    proc.err_path = tmp_path / "err.txt"
    try:
        _wait_until(sock.exists, 30, proc)
        time.sleep(0.3)   # its handlers are in place (the socket is made after them)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None, f"a SIGHUP nohup ignores ended it: {_finish(proc, 10)[-2000:]!r}"
        proc.send_signal(signal.SIGTERM)
        err = _finish(proc, 30)
        # a driver still waiting for its backend to connect ends as on Ctrl-C: 130
        assert proc.returncode == (0 if command == "vhost" else 130), err[-2000:]
    finally:
        _reap(proc, [])


def test_held_back_holds_a_signal_that_another_thread_takes():
    """rings.interrupts.held_back blocked the signals in the calling thread only: a process-directed signal that the
    kernel gave to another thread (numpy's, a --ctl server's: they do not block it) still ran the Python handler in
    the main thread inside the block, cutting the clean-up it protects short. Held signals now wait for the end of
    the block whichever thread takes them, and are then delivered to the handlers there were."""
    from rings.interrupts import held_back
    seen = []
    go, sent = threading.Event(), threading.Event()

    def other():   # started before the block: SIGTERM is not blocked in this thread
        go.wait(10)
        os.kill(os.getpid(), signal.SIGTERM)
        sent.set()

    t = threading.Thread(target=other)
    t.start()
    old = signal.signal(signal.SIGTERM, lambda signum, _f: seen.append(signum))
    try:
        with held_back():
            go.set()
            assert sent.wait(10)
            for _ in range(50):   # the handler would run at one of these
                time.sleep(0.002)
            assert seen == [], "the signal reached its handler inside the block"
        assert seen == [signal.SIGTERM]
    finally:
        t.join()
        signal.signal(signal.SIGTERM, old)


def test_a_pcap_fifo_reader_sees_the_frames_while_the_backend_runs(tmp_path):
    """helper-70: a live reader of `vring vhost --pcap FIFO` saw nothing until 8 KiB had piled up or vhost exited (a
    few frames never came while it ran). The backlog is written out within ~0.2 s."""
    fifo, sock = tmp_path / "cap.fifo", tmp_path / "v.sock"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    (tmp_path / "v").mkdir()
    vhost = _start(["vhost", "--socket", str(sock), "--pcap", str(fifo)], tmp_path / "v")
    try:
        _wait_until(sock.exists, 30, vhost)
        drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", str(sock), "--mode", "txonly",
                              "--count", "5", "--seconds", "5"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                             timeout=60)
        assert drv.returncode == 0, drv.stderr[-2000:]
        got, deadline = b"", time.monotonic() + 20
        while len(got) < 24 + 5 * (16 + 64) and time.monotonic() < deadline:   # the file header, 5 frames (Tx)
            try:
                got += os.read(reader, 1 << 16)
            except BlockingIOError:
                time.sleep(0.05)
        assert vhost.poll() is None
        assert len(got) >= 24 + 5 * (16 + 64), f"{len(got)} bytes while vhost runs"
    finally:
        os.close(reader)
        _terminate(vhost)


def test_vhost_whose_stdout_and_stderr_readers_stopped_reading_serves_on_and_stops(tmp_path):
    """helper-72: `vring vhost --stats-interval 1 | less`, or a terminal held by Ctrl-S. The stats (stdout) and the
    log (stderr) were written to blocking pipes: once the reader stopped, vhost sat in write(), the rings stopped,
    the frontend timed out, and no signal ended it. Both streams are now written by a thread of their own; what
    a stalled reader cannot take within a second at exit is dropped."""
    out_fifo, err_fifo, sock = tmp_path / "out.fifo", tmp_path / "err.fifo", tmp_path / "v.sock"
    os.mkfifo(out_fifo)
    os.mkfifo(err_fifo)
    readers = [os.open(f, os.O_RDONLY | os.O_NONBLOCK) for f in (out_fifo, err_fifo)]   # open, never read
    vhost = None
    try:
        with open(out_fifo, "wb") as out, open(err_fifo, "wb") as err:
            vhost = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", str(sock), "-v", "-v",
                                      "--stats-interval", "0.01"], cwd=ROOT, env=_env(tmp_path), stdout=out,
                                     stderr=err, start_new_session=True)
        vhost.err_path = tmp_path / "no-err.txt"   # for _wait_until/_terminate: not the FIFO (its open would wait)
        vhost.err_path.write_bytes(b"")
        _wait_until(sock.exists, 30, vhost)
        for _ in range(3):   # a 64 KiB pipe holds ~40 stats lines of 1.6 KB: full long before the last run
            drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", str(sock), "--count", "64",
                                  "--seconds", "1", "--json"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                                 timeout=60)
            assert drv.returncode == 0, drv.stderr[-2000:]
            assert json.loads(drv.stdout)["rx"]["packets"] > 64
        assert vhost.poll() is None
        vhost.send_signal(signal.SIGTERM)
        vhost.wait(15)
        assert vhost.returncode == 0
    finally:
        for r in readers:
            os.close(r)
        if vhost is not None:
            _terminate(vhost)


def test_unblocked_stream_keeps_lines_whole_drops_what_a_stalled_reader_cannot_take_and_reports_a_gone_one(tmp_path):
    """vring.stdout.Unblocked under the above: writes never wait on the reader; past its LIMIT, and at close after
    CLOSE_LIMIT_S, whole lines are dropped and counted; what the reader gets is whole lines, in order; a reader
    that went away is a BrokenPipeError at the next write."""
    from vring.stdout import Unblocked
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with open(fifo, "w") as f:
            u = Unblocked(f)
            for i in range(50_000):
                print(f"line {i:06d}", "x" * 40, file=u)   # 2.5 MB: more than the pipe and the LIMIT take
            print("no newline yet", end="", file=u)
            t0 = time.monotonic()
            u.close()
            assert time.monotonic() - t0 < u.CLOSE_LIMIT_S + 2
        got = b""
        with contextlib.suppress(BlockingIOError):   # (the writer is closed: an empty pipe reads b"")
            while chunk := os.read(r, 1 << 16):
                got += chunk
    finally:
        os.close(r)
    lines = got.decode().split("\n")
    assert lines[-1] == "" and lines[0] == "line 000000 " + "x" * 40, lines[:2]
    seen = [int(x.split()[1]) for x in lines[:-1]]
    assert seen == list(range(len(seen))) and 0 < len(seen) < 50_000
    # (the line the thread was writing when close() gave up is counted as dropped; it still reaches a reader that
    # reads before the process ends, as this one does)
    assert 50_001 <= len(seen) + u.dropped <= 50_002 and u.error is None
    a, b = os.pipe()
    with open(b, "w") as f:
        u = Unblocked(f)
        os.close(a)
        print("to nobody", file=u, flush=True)
        deadline = time.monotonic() + 10
        while u.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(BrokenPipeError):
            print("again", file=u)
        u.close()


def test_driver_whose_stderr_reader_stopped_reading_runs_and_ends(tmp_path):
    """The driver's events (--reconnect: JSON lines on stderr) and warnings go through vring.stdout.Unblocked while
    the rings run: with stderr a full pipe nobody reads, the run used to stop at its first event."""
    fifo, sock = tmp_path / "err.fifo", tmp_path / "v.sock"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # open, never read
    w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    vhost = _start(["vhost", "--socket", str(sock)], tmp_path)
    try:
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b"#" * 4096)   # the pipe full before the driver writes its first line
        os.set_blocking(w, True)
        _wait_until(sock.exists, 30, vhost)
        drv = subprocess.run([sys.executable, "-m", "vring.cli", "driver", "--socket", str(sock), "--count", "64",
                              "--seconds", "1", "--reconnect", "--json"], cwd=ROOT, env=_env(tmp_path), stderr=w,
                             stdout=subprocess.PIPE, timeout=60)
        assert drv.returncode == 0
        assert json.loads(drv.stdout)["rx"]["packets"] > 64
    finally:
        os.close(w)
        os.close(reader)
        _terminate(vhost)
