"""Restarts without loss, two processes: `vring driver --reconnect` / `--server` against `vring vhost`.

* A backend killed inside its data path (`vring vhost --crash-after N`: right after it delivered a burst into
  the driver's Rx ring and before it completed the Tx chains those packets came from) is relaunched: its
  successor takes those chains again (inflight area), the driver resumes at its own ring positions, traffic
  is back within 1 s, every injected frame is there at the end exactly once, and the copies the restart made
  are counted (``duplicates``) and equal to what the successor re-took; no ring error anywhere.
* The same through benchmarks/kill9.py's loop (vring/restarts.py), short, with `--txq-flush none` (no staging
  copy): random kills and deaths inside a burst; and its --vhost-arg refused before anything runs.
* `vring driver --server`: the backend connects (`vring vhost --client`), is killed, a new one connects.
* A killed DRIVER: the backend serves the next frontend.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import collect
from vhost.testing import VhostProcess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PATHS = [pytest.param(p, i, id=f"{'packed' if p else 'split'}-{'inorder' if i else 'normal'}")
         for p in (0, 1) for i in (0, 1)]


def _cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[-1]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _driver(sock, *args, pin=None):
    argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--json", *args]
    if pin is not None:
        argv += ["--pin", str(pin)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _finish(proc, timeout=60):
    rc, out, err = collect(proc, timeout)
    events = [json.loads(x) for x in err.splitlines() if x.startswith('{"event"')]
    assert rc == 0, err[-3000:]
    return json.loads(out), events, err


def _wait_socket(path, timeout=10.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"no socket {path}"
        time.sleep(0.01)


@contextlib.contextmanager
def _crashing_backend(sock, be_cpu):
    """`vring vhost --crash-after 50` on ``sock``: the block starts the driver; the backend must then die by itself
    (SIGKILL, mid-burst). Killed and reaped whatever happens."""
    crash = subprocess.Popen([sys.executable, "-m", "vring.cli", "vhost", "--crash-after", "50", "--socket", sock,
                              "--pin", str(be_cpu)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        _wait_socket(sock)
        yield
        assert crash.wait(20) == 9, crash.stderr.read()[-2000:]   # died by itself, mid-burst
    finally:
        if crash.poll() is None:
            crash.kill()
            crash.wait()
        crash.stderr.close()


@pytest.mark.parametrize("packed,in_order", PATHS)
def test_kill9_inside_a_burst_loses_nothing(tmp_path, packed, in_order):
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    with _crashing_backend(sock, be_cpu):
        drv = _driver(sock, "--reconnect", "--verify", "--mode", "macfwd", "--count", "256", "--seconds", "2.5",
                      "--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
                      pin=drv_cpu)
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu, verbose=True) as be:
        res, events, err = _finish(drv)
        ours = be.stop()
        log = be.stderr()
    v = res["verify"]
    info = f"{v}\n{res['reconnects']}\n{ours}\n{err[-1500:]}\n{log[-1500:]}"
    assert v["bad"] == 0 and v["missing"] == 0, info
    pop = v["population"]
    assert pop["present"] == 256 and pop["absent"] == 0 and pop["extra"] == 0, info   # each frame once
    assert pop["tx_inflight"] == 0 and pop["held"] == 0, info
    # the successor took again the Tx chains its predecessor had delivered and not completed: those copies
    # are the duplicates the driver counted and dropped
    assert ours["txq1"]["tx_resubmitted"] > 0, info
    assert v["duplicates"] == ours["txq1"]["tx_resubmitted"], info
    assert res["rx"]["errors"] == 0 and res["tx"]["errors"] == 0 and res["tx"]["dropped"] == 0, info
    assert ours["ring_errors"] == 0 and ours["refused"] == 0, info
    assert [e["event"] for e in events].count("resumed") == 1, info
    (rec,) = res["reconnects"]
    assert rec.get("traffic_s") is not None, info   # how soon: benchmarks/kill9.py
    assert "chains taken by the previous backend and not completed" in log, info


@pytest.mark.parametrize("packed,in_order", [(0, 0), (1, 1)], ids=["split-normal", "packed-inorder"])
def test_kill9_loop_in_direct_mode_with_tracking_loses_nothing(packed, in_order):
    """benchmarks/kill9.py's loop, short, with `vring vhost --txq-flush none` (no staging copy: the enqueue reads the
    Tx buffers) and inflight tracking: two kill -9 at random moments and two deaths inside a burst (--crash-after:
    Rx used entries published, the Tx chains they came from not completed). Every frame is there at the end exactly
    once, and each death inside a burst made copies, no more than its successor took chains again. Tx completed
    before the Rx publish (the untracked order) the crash would come after both stores: no copies, and a kill -9
    between the two would lose the burst."""
    from vring.restarts import kill_loop
    r = kill_loop(packed, in_order, kills=4, mid_burst=True, vhost_args=["--txq-flush", "none"])
    info = f"{r}"
    assert [row["how"] for row in r["rows"]] == ["kill -9", "crash mid-burst"] * 2, info
    assert r["all_resumed"] and r["ring_errors_driver"] == 0 and r["bad_frames"] == 0, info
    assert r["lost"] == 0 and r["absent_at_end"] == 0 and r["present_at_end"] == r["injected"] == 256, info
    assert r["in_flight_at_end"] == 0 and r["held_at_end"] == 0 and sum(r["dropped"].values()) == 0, info
    assert r["duplicates"] == sum(row["duplicated"] for row in r["rows"]), info
    for row in r["rows"][1::2]:   # the successor of a death inside a burst took its Tx chains again
        assert 0 < row["duplicated"] <= row["resubmitted"], info


def test_kill9_vhost_args_refused_before_anything_runs():
    """benchmarks/kill9.py --vhost-arg: what `vring vhost` would refuse, and what the loop sets on every backend
    itself, is a ConfigError before the first backend starts (not a relaunch that never comes back mid-run)."""
    from rings.errors import ConfigError
    from vring.restarts import check_vhost_args
    for args, says in ((["--txq-flush=bogus"], "txq flush must be"), (["--retries", "-1"], "--retries must be"),
                       (["--nonsense"], "unrecognized arguments"), (["--crash=5"], "--crash-after: set by the kill"),
                       (["--fwd", "io", "--pin=0"], "--fwd, --pin: set by the kill loop")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            check_vhost_args(args)
    check_vhost_args(["--txq-flush=none", "--retries", "2"])


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_kill9_while_frames_wait_for_the_timer_loses_nothing(tmp_path, packed):
    """--txq-flush timer:US with inflight tracking: frames wait in the intermediate queue (a 3 s timer, a threshold
    the 64 frames never reach, a ring they do not fill) with their Tx chains not completed; a kill -9 then loses
    none of them: the successor takes every one again (they were never delivered: no duplicates)."""
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    with VhostProcess(sock, "--txq-flush", "timer:3000000", "--txq-threshold", "4096", pin=be_cpu,
                      verbose=True) as be:
        be.wait_socket()
        drv = _driver(sock, "--reconnect", "--verify", "--mode", "macfwd", "--count", "64", "--seconds", "4",
                      "--ring-size", "256", "--packed" if packed else "--split", pin=drv_cpu)
        be.wait_stderr("data path started")
        time.sleep(0.5)   # the 64 frames taken, waiting for the timer
        be.proc.send_signal(signal.SIGKILL)
        be.proc.wait(10)
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu) as be2:
        res, _, err = _finish(drv)
        ours = be2.stop()
    v = res["verify"]
    info = f"{v}\n{res['reconnects']}\n{ours}\n{err[-1500:]}"
    pop = v["population"]
    assert v["bad"] == 0 and v["missing"] == 0 and v["duplicates"] == 0, info
    assert pop["present"] == 64 and pop["absent"] == 0 and pop["extra"] == 0, info
    assert ours["txq1"]["tx_resubmitted"] == 64 and ours["ring_errors"] == 0, info


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_kill9_inside_a_burst_of_jumbo_frames_loses_nothing(tmp_path, packed):
    """9000-byte frames (longer than the backend's 2048-byte staging slot: its long-frame area) through a kill -9
    inside a burst: the successor takes the undelivered chains again; --count 25 leaves the Rx ring (51 such frames)
    room for a copy of each (check_injected warns past it: with 48, 13 were dropped on the restart)."""
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    with _crashing_backend(sock, be_cpu):
        drv = _driver(sock, "--reconnect", "--verify", "--mode", "macfwd", "--count", "25", "--pkt-size", "9000",
                      "--seconds", "2.5", "--packed" if packed else "--split", pin=drv_cpu)
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu) as be:
        res, _, err = _finish(drv)
        ours = be.stop()
    v = res["verify"]
    info = f"{v}\n{res['reconnects']}\n{ours}\n{err[-1500:]}"
    pop = v["population"]
    assert res["warnings"] == [], info
    assert v["bad"] == 0 and v["missing"] == 0, info
    assert pop["present"] == 25 and pop["absent"] == 0 and pop["extra"] == 0, info
    assert ours["txq1"]["tx_resubmitted"] > 0 and v["duplicates"] == ours["txq1"]["tx_resubmitted"], info
    assert ours["rxq0"]["rx_dropped"] == 0 and ours["txq1"]["tx_oversize"] == 0 and ours["ring_errors"] == 0, info


def test_driver_server_mode_backend_killed_and_relaunched(tmp_path):
    """`vring driver --server` listens; `vring vhost --client` connects, is killed -9, a new one connects."""
    sock = str(tmp_path / "drv.sock")
    be_cpu, drv_cpu = _cpus()
    drv = _driver(sock, "--server", "--verify", "--packed", "--mode", "macfwd", "--count", "256",
                  "--seconds", "5", pin=drv_cpu)
    _wait_socket(sock)
    be = VhostProcess(sock, "--client", "--reconnect", "0.1", "--fwd", "macswap", pin=be_cpu, verbose=True)
    try:
        be.wait_stderr("frontend connected (connection 1)")
        time.sleep(0.5)   # into its traffic
        be.proc.send_signal(signal.SIGKILL)
        be.proc.wait(10)
    finally:
        be.__exit__()
    with VhostProcess(sock, "--client", "--reconnect", "0.1", "--fwd", "macswap", pin=be_cpu) as be2:
        res, events, err = _finish(drv)
        ours = be2.stop()
    info = f"{res['verify']}\n{res['reconnects']}\n{ours}\n{err[-2000:]}"
    assert res["connections"] == 2, info
    assert res["verify"]["bad"] == 0 and res["verify"]["population"]["absent"] == 0, info
    assert res["reconnects"][0].get("traffic_s") is not None, info   # how soon: benchmarks/dts_server_mode.py
    assert ours["txq1"]["tx_packets"] > 1000 and ours["ring_errors"] == 0, info
    assert not os.path.exists(sock), "the driver left its socket behind"


def test_kill9_of_the_driver_backend_serves_the_next(tmp_path):
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu, verbose=True) as be:
        be.wait_socket()
        first = _driver(sock, "--mode", "macfwd", "--count", "256", pin=drv_cpu)
        be.wait_stderr("frontend connected (connection 1)")
        time.sleep(0.5)   # into its traffic
        assert first.poll() is None, first.stderr.read()
        first.kill()
        first.communicate()
        second = _driver(sock, "--verify", "--mode", "macfwd", "--count", "256", "--seconds", "1", pin=drv_cpu)
        res, _, _ = _finish(second)
        ours = be.stop()
        log = be.stderr()
    assert res["verify"]["bad"] == 0 and res["verify"]["missing"] == 0, res["verify"]
    assert res["rx"]["packets"] > 1000
    assert ours["connections"] == 2 and ours["ring_errors"] == 0 and ours["refused"] == 0, ours
    assert " ERROR " not in log, log[-3000:]


def _dies_at(monkeypatch, method, calls):
    """The backend is gone when the driver's ``method`` runs for the ``calls``-th time (the connection is shut
    down just before the message goes out: what a kill -9 at that moment looks like to the driver)."""
    import socket

    from virtio.frontend import VhostUserFrontend
    orig, seen = getattr(VhostUserFrontend, method), []

    def dying(self, *a, **kw):
        seen.append(1)
        if len(seen) in calls:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        return orig(self, *a, **kw)
    monkeypatch.setattr(VhostUserFrontend, method, dying)
    return seen


def _driver_while(backends_change, sock, packed, seconds):
    """`vring driver --reconnect --verify` (in this process, macfwd, 64 frames) while ``backends_change()`` runs
    in a thread; the thread is joined whatever happens. Returns the driver's counters. (A drain of 1 s: ample
    on a loaded machine, for frames still on their way when the run ends.)"""
    import threading

    from virtio.app import DriverConfig, run
    changer = threading.Thread(target=backends_change)
    changer.start()
    try:
        return run(DriverConfig(socket=sock, reconnect=True, verify=True, mode="macfwd", count=64, seconds=seconds,
                                packed=bool(packed), drain=1.0))
    finally:
        changer.join(20)


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_backend_gone_before_the_rings_are_up_is_replaced(tmp_path, monkeypatch, packed):
    """--reconnect: a backend lost after the handshake and before the rings are started (SET_MEM_TABLE ..
    DRIVER_OK) is replaced like one lost during the handshake, on the first connection and on a reconnect
    (the driver used to exit with PeerGone); every frame is there at the end."""
    sock = str(tmp_path / "vh.sock")
    seen = _dies_at(monkeypatch, "set_mem_table", calls={1, 3})   # the first start, and the first restart's
    backends = [VhostProcess(sock, "--fwd", "macswap")]
    try:
        backends[0].wait_socket()

        def kill_and_relaunch():
            time.sleep(1.0)
            backends[-1].proc.send_signal(signal.SIGKILL)
            backends[-1].proc.wait(10)
            os.unlink(sock)
            backends.append(VhostProcess(sock, "--fwd", "macswap"))
        res = _driver_while(kill_and_relaunch, sock, packed, seconds=4)
    finally:
        for be in backends:
            be.__exit__()
    pop = res["verify"]["population"]
    assert len(seen) >= 4, seen
    assert res["connections"] == 4, res["reconnects"]   # two lost before the rings were up, two that served
    assert pop["present"] == 64 and pop["absent"] == 0 and res["verify"]["bad"] == 0, res["verify"]
    assert res["rx"]["errors"] == res["tx"]["errors"] == 0


_UNTRACKED_BACKEND = """import json, signal, sys
from rings import vhost_user as vu
from rings.layout import bit
from vhost.datapath import Options
from vhost.server import Server
PF = vu.VhostUserProtocolFeature
server = Server(sys.argv[1], Options(fwd="macswap"), out=sys.stderr,
                device_kw={"protocol_features": bit(PF.REPLY_ACK) | bit(PF.STATUS)})
signal.signal(signal.SIGTERM, server.stop)
print(json.dumps(server.serve()), flush=True)
"""


@pytest.mark.parametrize("packed", [0, 1], ids=["split", "packed"])
def test_an_area_no_backend_kept_in_between_is_not_handed_to_the_next(tmp_path, monkeypatch, packed):
    """Found by attack43: --reconnect through a tracking backend, one without INFLIGHT_SHMFD (DPDK net_vhost), and
    a tracking one again. The driver handed the third the first one's area, untouched since it died: split, both
    vrings refused ("used->idx ... past the region's used_idx"); packed, the third resumed at the area's stale
    position and traffic stopped. The area is dropped when a backend that will not keep it runs the rings; the
    next gets a fresh one (packed: the ring laid out afresh, as with no area)."""
    sock = str(tmp_path / "vh.sock")
    backends = [VhostProcess(sock, "--fwd", "macswap", verbose=True)]
    untracked = None
    try:
        backends[0].wait_socket()

        def kill_and_relaunch():
            nonlocal untracked
            time.sleep(1.0)
            backends[0].proc.send_signal(signal.SIGKILL)
            backends[0].proc.wait(10)
            os.unlink(sock)
            untracked = subprocess.Popen([sys.executable, "-c", _UNTRACKED_BACKEND, sock], env=_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(1.5)
            # stopped, not killed: a backend without an inflight area loses the frames it holds however it goes;
            # its counters say how many (the driver cannot get them back), so the check below is exact
            untracked.send_signal(signal.SIGTERM)
            held.append(json.loads(untracked.communicate(timeout=20)[0])["rxq0"]["rx_dropped"])
            backends.append(VhostProcess(sock, "--fwd", "macswap", verbose=True))
        held = []
        res = _driver_while(kill_and_relaunch, sock, packed, seconds=5)
    finally:
        if untracked is not None and untracked.poll() is None:
            untracked.kill()
            untracked.wait()
        logs = [be.stderr() for be in backends]
        for be in backends:
            be.__exit__()
    pop = res["verify"]["population"]
    assert res["connections"] == 3, res["reconnects"]
    assert held and pop["present"] == 64 - held[0] and pop["absent"] == held[0], (held, res["verify"], logs[-1])
    assert res["verify"]["bad"] == 0, res["verify"]
    assert "cannot start" not in logs[-1] and "inflight region says" not in logs[-1], logs[-1][-3000:]
    if packed:   # the fresh area knows no chain in flight: the ring is laid out afresh both times
        assert [r.get("ring_reset") for r in res["reconnects"]] == [True, True], res["reconnects"]


@pytest.mark.parametrize("comes_back", [True, False], ids=["replaced", "gone"])
def test_a_backend_lost_during_idle_first_is_replaced(tmp_path, comes_back):
    """--reconnect --idle-first: the idle loop ran outside the run's resume loop, so a backend lost while the
    driver idled ended it with PeerGone (exit 2; helper-68). Now the next backend is waited for and the run goes
    on with it. With none coming, the run ends when its time would have, with the reason, exit 0."""
    sock = str(tmp_path / "vh.sock")
    be_cpu, drv_cpu = _cpus()
    be = VhostProcess(sock, "--fwd", "macswap", pin=be_cpu, verbose=True)
    drv = None
    try:
        drv = _driver(sock, "--reconnect", "--idle-first", "3", "--mode", "macfwd", "--count", "32", "--verify",
                      "--seconds", "2" if comes_back else "1", pin=drv_cpu)
        be.wait_stderr("frontend connected (connection 1)")
        time.sleep(0.5)   # idling
        be.proc.send_signal(signal.SIGKILL)
        be.proc.wait(10)
    finally:
        be.__exit__()
    if comes_back:
        with VhostProcess(sock, "--fwd", "macswap", pin=be_cpu):
            res, events, err = _finish(drv)
    else:
        res, events, err = _finish(drv)
    info = f"{res['stop']}\n{res['reconnects']}\n{err[-2000:]}"
    names = [e["event"] for e in events]
    if comes_back:
        assert res["connections"] == 2 and "resumed" in names, info
        assert res["injected"] == 32 and res["rx"]["packets"] > 32 and res["verify"]["bad"] == 0, info
        assert res["stop"]["reason"] == "seconds", info
    else:
        assert res["connections"] == 1 and names[-1] == "ended_without_backend", info
        assert res["stop"]["reason"] == "no backend" and res["injected"] == 0, info
