"""`vring driver` at the end of a run (issue 8): --wait honours signals, --seconds and the loss of the backend
within 100 ms; Tx buffers the backend never completed are reported (warning + tx_unfinished), and are an
error with --strict."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rings.layout import VIRTIO_F_VERSION_1, bit
from rings.interrupts import SignalWakeup
from vhost.datapath import Options
from virtio.app import DriverConfig, _Loop, _Stop, run
from virtio.net import NetQueues
from vhost.testing import ThreadedServer

from tests.procs import Procs, collect, wait_for


def driver(sock, *args):
    argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--json", *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def running(srv, timeout=20.0):
    assert srv.wait(lambda s: bool(s.device and s.device.datapath), timeout), "the driver did not start"
    time.sleep(0.3)   # well into the idle --wait sleeps


@contextlib.contextmanager
def no_survivors(*procs):
    """Whatever the test did, none of ``procs`` outlives it (SIGKILL: a stopped one too)."""
    try:
        yield
    finally:
        for p in procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()


def finish(proc, timeout=30):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "vhost.sock")


@pytest.fixture
def server(sock):
    srv = ThreadedServer(sock, Options())
    yield srv
    srv.close()


@pytest.mark.parametrize("mode", ["rxonly", "macfwd"])
def test_wait_stops_on_sigterm_within_100ms(server, sock, mode):
    proc = driver(sock, "--mode", mode, "--wait", "--drain", "0")
    try:
        running(server)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["stop"]["signal"] == signal.SIGTERM
    assert res["stop"]["latency_s"] < 0.1, res["stop"]
    assert took < 5.0, f"exit took {took:.2f}s after SIGTERM"   # was ~23 s


def test_a_stop_signal_found_in_the_wakeup_pipe_ends_the_loop_before_its_handler_runs():
    """The race behind a 100.3 ms stop in CI: the signal landed between _done's look at the stop flag and its
    drain of the wakeup pipe. The drain took the byte, the Python handler set the flag just after, and the next
    --wait sleep ran its full 0.1 s. Here the C-level handler's byte is in the pipe and the Python handler has not
    run: _done must stop on the byte. A byte of another signal is taken and ignored (no busy wake-ups)."""
    nq = NetQueues(bit(VIRTIO_F_VERSION_1), size=8, nbufs=32, buf_size=2048)
    wakeup = SignalWakeup()
    try:
        stop = _Stop()
        stop.setup = False   # the rings are up
        loop = _Loop(DriverConfig("", ring_size=8, mode="rxonly", wait=True), nq, stop, wakeup=wakeup)
        os.write(wakeup.wfd, bytes([signal.SIGUSR1]))
        assert not loop._done(float("inf"), watch=True) and not stop.flag
        assert wakeup.drain() == set(), "the other signal's byte was left to wake every sleep"
        os.write(wakeup.wfd, bytes([signal.SIGTERM]))
        assert loop._done(float("inf"), watch=True)
        assert stop.flag and stop.signum == signal.SIGTERM and stop.count == 0   # the handler counts it, later
        stop(signal.SIGTERM)                                                       # ... which it then does
        assert stop.count == 1 and stop.signum == signal.SIGTERM
    finally:
        wakeup.close()
        nq.close()


def test_a_signal_while_the_handlers_are_installed_still_puts_them_back(tmp_path, monkeypatch):
    """helper-68: a stop signal landing after run() installed its handlers but before its try raised
    KeyboardInterrupt where no finally would put the caller's handlers back. Here the signal comes half-way
    through the install itself: the caller's handlers must all be back when KeyboardInterrupt leaves run()."""
    from rings import interrupts
    real = interrupts.install

    def install_and_be_signalled(handler, sigs=interrupts.ENDING, into=None):
        real(handler, sigs[:1], into)           # SIGINT: the signal comes half-way through
        os.kill(os.getpid(), signal.SIGINT)
        return real(handler, sigs[1:], into)

    monkeypatch.setattr(interrupts, "install", install_and_be_signalled)
    before = {s: signal.getsignal(s) for s in interrupts.ENDING}
    with pytest.raises(KeyboardInterrupt):
        run(DriverConfig(str(tmp_path / "nobody.sock"), seconds=1.0))
    assert {s: signal.getsignal(s) for s in interrupts.ENDING} == before


def test_a_signal_after_the_loop_ended_is_not_its_stop_reason():
    """helper-68: a signal between the loop's end (t_end) and stop_info() was reported as the reason the loop
    stopped, with a negative latency. The loop ended on --seconds; the signal only counts for the drain."""
    nq = NetQueues(bit(VIRTIO_F_VERSION_1), size=8, nbufs=32, buf_size=2048)
    try:
        stop = _Stop()
        stop.setup = False
        loop = _Loop(DriverConfig("", ring_size=8, mode="rxonly", seconds=1.0), nq, stop)
        loop.deadline = time.monotonic() - 0.01
        loop.t_end = loop.deadline + 0.002
        stop(signal.SIGTERM)                      # after t_end
        assert loop.stop_info() == {"reason": "seconds", "latency_s": 0.002}
        stop.when = loop.t_end - 0.001            # before it: the signal ended the loop
        info = loop.stop_info()
        assert info["reason"] == "signal" and info["signal"] == signal.SIGTERM and info["latency_s"] >= 0, info
    finally:
        nq.close()


def test_wait_honours_seconds_within_100ms(server, sock):
    proc = driver(sock, "--mode", "rxonly", "--wait", "--seconds", "0.7", "--drain", "0")
    rc, out, err = finish(proc)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "seconds" and res["stop"]["latency_s"] < 0.1, res["stop"]
    assert res["elapsed_s"] < 0.8, res["elapsed_s"]                   # was overrunning by ~20 s


SPIN = 1 << 31   # the largest --spin: about 100 s of empty polls


@pytest.mark.parametrize("mode", [("macfwd",), ("macfwd", "--count", 32), ("rxonly",), ("macfwd", "--wait")],
                         ids=["macfwd", "macfwd-traffic", "rxonly", "macfwd-wait"])
def test_polling_honours_seconds_within_100ms_whatever_the_spin(server, sock, mode):
    """The C loops spin at most POLL_SLICE_NS before Python looks at the clock and its stop flag: polled macfwd
    used to stop 64 x --spin empty polls late (2.9 s at --spin 1000000), rxonly 256 x. With --wait, a spin the
    slice cuts short goes on at the next call: it does not turn into an early sleep."""
    rc, out, err = collect(driver(sock, "--mode", *mode, "--spin", SPIN, "--seconds", 0.5, "--drain", 0), timeout=20)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "seconds" and res["stop"]["latency_s"] < 0.1, res["stop"]
    assert res["rx"]["waits"] == 0                                    # 0.5 s is far from the end of the spin
    if "--count" in mode:
        assert res["rx"]["packets"] > 32


def test_macfwd_injection_honours_seconds(server, sock):
    """macfwd --count injects its frames first (tx_first): once --seconds is up, it stops injecting instead of
    building every frame left only to free it as a Tx failure (200 ms late at --count 1000000, linear in --count).
    What it did inject is accounted: sent, or a Tx failure. (--count 1000000 is refused at start since 4718d1c:
    a ring cannot hold them. A ring of 4096 holds 4096, injected one a burst: some ms of Python, past 5 ms.)"""
    count = 4096
    rc, out, err = collect(driver(sock, "--count", count, "--ring-size", count, "--burst", 1, "--seconds", 0.005,
                                  "--drain", 0), timeout=30)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "seconds" and res["stop"]["latency_s"] < 0.1, res["stop"]
    assert res["injected"] + res["tx_fail"] < count, res                 # frames past the deadline never built
    assert res["tx"]["packets"] >= res["injected"] > 0


def test_polled_macfwd_stops_on_sigterm_within_100ms_whatever_the_spin(server, sock):
    proc = driver(sock, "--mode", "macfwd", "--spin", SPIN, "--drain", "0")
    with no_survivors(proc):
        running(server)
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, timeout=20)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["stop"]["latency_s"] < 0.1, res["stop"]


@pytest.mark.parametrize("mode", ["rxonly", "macfwd"])
def test_wait_notices_the_backend_leaving_within_100ms(sock, mode):
    srv = ThreadedServer(sock, Options())
    proc = driver(sock, "--mode", mode, "--wait", "--drain", "0")
    try:
        running(srv)
        t0 = time.monotonic()
        srv.close()                                                   # the backend goes away
        rc, out, err = finish(proc)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert rc == 2 and "PeerGone" in err and "closed the vhost-user connection" in err, err
    assert took < 2.0, f"the driver noticed after {took:.2f}s"        # was 5-24 s; ~0.1 s is process exit


@pytest.fixture
def silent_tx_server(sock, monkeypatch):
    """A backend that answers every message but never runs its data path: Tx buffers are never completed."""
    from vhost.device import NetDevice

    def no_datapath(self, budget_us):
        time.sleep(0.001)
        return {}
    monkeypatch.setattr(NetDevice, "run", no_datapath)
    srv = ThreadedServer(sock, Options())
    yield srv
    srv.close()


@pytest.mark.parametrize("strict", [False, True])
def test_unfinished_tx_is_reported(silent_tx_server, sock, strict):
    proc = driver(sock, "--mode", "txonly", "--count", "10", "--drain", "0.05", *(["--strict"] if strict else []))
    rc, out, err = finish(proc)
    res = json.loads(out)
    assert res["tx_unfinished"] == 10 and res["tx"]["inflight"] == 10
    if strict:
        assert rc == 2 and "vring driver: TxUnfinished: 10 Tx buffers still in flight at exit" in err, err
    else:
        assert rc == 0 and "vring driver: warning: 10 Tx buffers still in flight at exit" in err, err


def test_completed_tx_is_not_reported(server, sock):
    proc = driver(sock, "--mode", "txonly", "--count", "100", "--strict")
    rc, out, err = finish(proc)
    assert rc == 0 and "still in flight" not in err, err
    assert json.loads(out)["tx_unfinished"] == 0


def test_a_backend_frozen_at_the_stop_still_gets_the_report(tmp_path):
    """A real `vring vhost` frozen (SIGSTOP) while the driver runs: SET_VRING_ENABLE 0 at the stop times out. The
    driver still prints its JSON report, the ProtocolTimeout recorded in it, and exits 2 with the error's message
    (it used to exit with the message and no report)."""
    sock, procs, frozen = str(tmp_path / "vh.sock"), Procs(), None
    try:
        backend = procs.start("vhost", "--socket", sock, "--fwd", "macswap")
        wait_for(sock, backend)
        proc = driver(sock, "--count", 32, "--idle-first", 0.2, "--seconds", 0.5, "--timeout", 1, "--drain", 0)
        procs.procs.append(proc)
        t0 = time.monotonic()
        while "idle for" not in proc.stderr.readline():                 # the device is started
            assert proc.poll() is None and time.monotonic() - t0 < 30, "the driver did not start"
        os.kill(backend.pid, signal.SIGSTOP)
        frozen = backend.pid
        rc, out, err = finish(proc)
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        procs.close()
    assert rc == 2, err
    assert "vring driver: ProtocolTimeout: backend at" in err and "did not answer SET_VRING_ENABLE" in err, err
    res = json.loads(out)
    assert res["error"]["type"] == "ProtocolTimeout" and "SET_VRING_ENABLE" in res["error"]["message"], res["error"]
    assert res["stop"]["reason"] == "seconds" and res["injected"] == 32
    assert res["tx_unfinished"] == 32 and "vring_bases" not in res     # never completed, and no base came back


def test_a_backend_killed_mid_run_reports_only_the_tx_it_never_completed(tmp_path):
    """A real `vring vhost` killed (SIGKILL) while the driver forwards 8 frames: the report that comes with the
    PeerGone counts as unfinished only Tx buffers the backend never completed, at most the 8 frames there are.
    What it completed is in the used ring (our memory, there after it died) and is reclaimed first; the driver
    reclaims lazily, so before that up to a cleanup threshold of completed buffers were counted as well (72 of 8
    frames)."""
    sock, procs = str(tmp_path / "vh.sock"), Procs()
    try:
        backend = procs.start("vhost", "--socket", sock, "--fwd", "macswap")
        wait_for(sock, backend)
        proc = driver(sock, "--count", 8, "--idle-first", 0.1, "--seconds", 30, "--drain", 0)
        procs.procs.append(proc)
        t0 = time.monotonic()
        while "idle for" not in proc.stderr.readline():                 # the device is started
            assert proc.poll() is None and time.monotonic() - t0 < 30, "the driver did not start"
        time.sleep(0.5)                                                 # forwarding
        backend.kill()
        rc, out, err = finish(proc)
    finally:
        procs.close()
    assert rc == 2 and "PeerGone" in err, err
    res = json.loads(out)
    # forwarded before the kill: every frame came back at least once more (a count, not a rate: on a loaded
    # machine 0.5 s may be a few hundred laps or a few)
    assert res["error"]["type"] == "PeerGone" and res["injected"] == 8 and res["rx"]["packets"] > 8, res
    assert res["tx_unfinished"] <= 8, res


@pytest.mark.parametrize("mode", [("macfwd", "--count", 32), ("txonly",), ("rate", "--rate", 1000)],
                         ids=["macfwd", "txonly", "rate"])
@pytest.mark.parametrize("wait", [(), ("--wait",)], ids=["polled", "wait"])
def test_a_signal_ends_idle_first(server, sock, wait, mode):
    """--idle-first is not counted in --seconds: a signal is what ends a long one, as it ends the run. txonly sent
    a burst of 256 after such a signal (helper-68): its loop sends before its first look at the stop flag."""
    proc = driver(sock, "--mode", *mode, "--idle-first", 600, "--seconds", 1, "--drain", 0, *wait)
    with no_survivors(proc):
        running(server)
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["stop"]["latency_s"] < 0.1, res["stop"]
    assert res["tx"]["packets"] == 0, "the signal ended the idle phase, and nothing was sent after it"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"])
def test_signals_that_keep_coming_do_not_cut_the_clean_up_or_the_report_short(server, sock, sig):
    """A second signal cuts the drain short; it must not kill the process once the run is over: the handlers used
    to be put back before the clean-up (closing the session, the pcap, the queues) and before the report was
    printed, so a late signal ended the process with -N (the report possibly half-written). Signals every ~1 ms
    until it exits cover every point of its way out."""
    proc = driver(sock, "--mode", "macfwd", "--wait", "--drain", "0.2")
    with no_survivors(proc):
        running(server)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(sig)
            time.sleep(0.001)
        rc, out, err = finish(proc)
    assert rc == 0, (rc, err)
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["stop"]["signal"] == sig, res["stop"]


def test_run_leaves_the_handlers_it_was_asked_to(server, sock):
    """run() puts the stop signals' handlers back when it is done, or installs ``after_signals`` (the CLI: SIG_IGN)."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for after, want in ((None, old), (signal.SIG_IGN, {s: signal.SIG_IGN for s in old})):
            run(DriverConfig(sock, mode="rxonly", seconds=0.2, drain=0), after_signals=after)
            assert {s: signal.getsignal(s) for s in old} == want
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_signal_after_the_backend_is_lost_ends_the_run_without_waiting_on_the_drain(sock):
    """--reconnect with the backend gone and none back: a SIGTERM used to wait out the Tx drain (--drain + 1 s)
    and then the Rx drain (--drain) for completions that no backend can deliver. Nothing waits on a backend
    that is not there; the report still counts the Tx buffers it never completed."""
    srv = ThreadedServer(sock, Options())
    proc = driver(sock, "--mode", "macfwd", "--count", 32, "--reconnect", "--drain", 30, "--seconds", 120)
    try:
        running(srv)
        srv.close()                                                   # the backend goes away, and stays away
        t0 = time.monotonic()
        while '"backend_gone"' not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() - t0 < 30, "the driver did not see the backend go"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, 90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["reconnects"][0].get("down_s") is None, res["reconnects"]
    assert 0 <= res["tx_unfinished"] <= 32, res
    assert took < 20, f"exit took {took:.1f} s: the drains waited for a backend that is not there"   # was 61 s


def test_verify_names_a_backend_gone_at_the_end_as_where_the_frames_in_flight_went(sock):
    """--verify --reconnect, the backend gone and none back: the frames it held are not back at the end. The
    verdict said "held by the backend longer than --drain", which points at a slow backend; it now says they
    were in flight in a backend that was gone (helper-70)."""
    srv = ThreadedServer(sock, Options())
    proc = driver(sock, "--mode", "macfwd", "--count", 32, "--reconnect", "--verify", "--seconds", 120)
    try:
        running(srv)
        srv.close()
        t0 = time.monotonic()
        while '"backend_gone"' not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() - t0 < 30, "the driver did not see the backend go"
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, 90)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    v = json.loads(out)["verify"]
    assert rc == 1 and v["backend_gone"] and not v["ok"], (v, err[-2000:])
    late = [f for f in v["failures"] if "not at the end" in f]
    assert late and late[0].endswith("(in flight in a backend that was gone at the end)"), v["failures"]


def test_a_signal_after_a_run_that_ended_by_itself_cuts_the_drain_short(server, sock):
    """helper-72: the run ended by --seconds, the Rx drain (--drain 60) is under way, and one SIGTERM comes. Only a
    second signal cut the drain, so this one waited the whole drain out. After a loop that ended by itself, the
    first signal cuts; the stop reason stays the run's."""
    proc = driver(sock, "--mode", "macfwd", "--count", 32, "--seconds", 1, "--drain", 60)
    with no_survivors(proc):
        running(server)
        time.sleep(1.5)   # past --seconds: in the drain
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, 20)   # was 60 s
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "seconds" and res["rx"]["packets"] > 32, res["stop"]


@pytest.mark.parametrize("stderr", ["read", "stalled"])
def test_a_second_signal_ends_the_wait_for_a_frozen_backends_answer_to_the_stop(tmp_path, sock, stderr):
    """helper-72: a backend that stops answering (here: SIGSTOP) while the driver stops its rings. The driver
    waited out --timeout for SET_VRING_ENABLE whatever signals came. A second signal ends that wait: exit 0, the
    vring bases unknown, a warning. helper-73: with a stderr nobody reads, the warnings printed after the run
    (Tx buffers in flight) then blocked the exit for good, every stop signal ignored."""
    vhost = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--socket", sock],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    fifo = tmp_path / "err.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # open, never read
    stalled = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    with contextlib.suppress(BlockingIOError):
        while stderr == "stalled":
            os.write(stalled, b"#" * 4096)   # full before the driver writes a line
    os.set_blocking(stalled, True)
    try:
        with no_survivors(vhost):
            wait_for(sock, vhost)
            argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--json", "--mode", "macfwd",
                    "--count", "32", "--seconds", "60", "--drain", "0", "--timeout", "60"]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                    stderr=subprocess.PIPE if stderr == "read" else stalled)
            with no_survivors(proc):
                time.sleep(2)
                assert proc.poll() is None, finish(proc)
                vhost.send_signal(signal.SIGSTOP)
                proc.send_signal(signal.SIGTERM)   # ends the loop; the Tx drain gives up after ~1 s; the exchange
                time.sleep(2.5)
                assert proc.poll() is None, finish(proc)
                proc.send_signal(signal.SIGTERM)
                rc, out, err = finish(proc, 20)   # was --timeout: 60 s
    finally:
        os.close(stalled)
        os.close(reader)
    assert rc == 0, err
    res = json.loads(out)
    assert res["stop"]["reason"] == "signal" and res["vring_bases"] == {}, res
    assert any("vring bases are unknown" in w for w in res["warnings"]), res["warnings"]   # (helper-73)
    if stderr == "read":
        assert "before a stop signal cut the wait short: the vring bases are unknown" in err, err


def test_a_quick_second_signal_still_asks_a_healthy_backend_for_the_vring_bases(server, sock):
    """helper-73: a second signal during the drain made the stop exchange be skipped, healthy backend or not: the
    vring bases were lost and the warning blamed a wait that never happened. The exchange still runs; only a
    backend that takes longer than CUT_STOP_ANSWER_S per answer is given up on."""
    proc = driver(sock, "--mode", "macfwd", "--count", 32, "--seconds", 60)
    with no_survivors(proc):
        running(server)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)   # in the drain (--drain 0.3)
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc)
    assert rc == 0, err
    res = json.loads(out)
    assert sorted(res["vring_bases"]) == ["0", "1"] and "unknown" not in err, (res["vring_bases"], err)
