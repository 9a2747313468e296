"""vring.dpdk: dpdk-testpmd as a managed peer (net_vhost and virtio_user), its counters and its cleanup.

The parser and discovery tests run everywhere; the ones that start testpmd are skipped with
``skip_reason()`` when dpdk-testpmd is absent (``apt-get install -y dpdk-dev``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from vring import dpdk
from vring.dpdk import FwdStats, PortStats, Testpmd, TestpmdError

REASON = dpdk.skip_reason()
needs_testpmd = pytest.mark.skipif(bool(REASON), reason=REASON or "dpdk-testpmd present")

COUNTERS = ("rx_packets", "tx_packets", "rx_missed", "rx_errors", "tx_errors", "rx_pps", "tx_pps")


# ----------------------------------------------------------------------------- helpers

def _group_alive(pgid: int) -> list[int]:
    """pids of live (non-zombie) processes in process group ``pgid``."""
    alive = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            alive.append(int(name))
    return alive


def _assert_gone(tp: Testpmd, pid: int) -> None:
    assert tp.returncode is not None
    assert _group_alive(pid) == []
    assert not os.path.exists(tp.runtime_dir), f"runtime dir {tp.runtime_dir} left behind"


@pytest.fixture
def sock(tmp_path):
    path = tmp_path / "vhost.sock"
    yield str(path)
    assert not path.exists(), "socket left behind"


# ----------------------------------------------------------------------------- no testpmd needed


def test_a_prompt_printed_in_pieces_around_log_lines_is_still_one_prompt():
    """Seen once in 30 `vring bench --pairs ours/dpdk,...` runs (and once in s19's CI): net_vhost's vhost-user thread
    printed whole VHOST_CONFIG lines while the main thread printed the prompt a few bytes at a time
    ("t" + a log line + "estpmd>" + log lines + " "). The prompt was missed, every later command waited for the
    prompt of the one before, and the bench failed with "'show port stats 0': no prompt after 10.0s"."""
    tp = Testpmd.vhost("/nonexistent/vh.sock")   # not started: only its output parser
    out = (b"EAL: Detected CPU lcores: 2\ntestpmd> show port stats 0\n  RX-packets: 5\n"
           b"tVHOST_CONFIG: (/tmp/s) read message VHOST_USER_SET_VRING_ADDR\n"
           b"estpmd>VHOST_CONFIG: (/tmp/s) read message VHOST_USER_SET_VRING_KICK\n \nPort 0: queue state event\n"
           b"show port stats 0\n  RX-packets: 9\ntestpmd> ")
    for i in range(0, len(out), 5):   # as the pty hands it over: in pieces
        tp._feed(out[i:i + 5])
    assert len(tp._prompt_ends) == 3
    # what a command gets: the text between two prompts, the interleaved prompt's log lines not in it
    assert bytes(tp._buf[tp._prompt_ends[0]:tp._prompt_starts[1]]).endswith(b"RX-packets: 5\n")
    assert bytes(tp._buf[tp._prompt_ends[1]:tp._prompt_starts[2]]).endswith(b"show port stats 0\n  RX-packets: 9\n")
    other = Testpmd.vhost("/nonexistent/vh.sock")
    other._feed(b"the test of a testpmd log: t\nestpmd> is no prompt\n")   # (a line of our own between: no log)
    assert other._prompt_ends == []

def test_skip_reason_when_absent(monkeypatch):
    monkeypatch.setenv("VRING_TESTPMD", "/nonexistent/dpdk-testpmd")
    assert dpdk.find_testpmd() is None
    assert dpdk.skip_reason() == "dpdk-testpmd not found; apt-get install -y dpdk-dev"
    monkeypatch.delenv("VRING_TESTPMD")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert dpdk.find_testpmd() is None
    with pytest.raises(TestpmdError, match="apt-get install -y dpdk-dev"):
        Testpmd.vhost("/tmp/unused.sock", testpmd=None).launch()


def test_command_lines_follow_the_reference_script():
    v = Testpmd.vhost("/tmp/a.sock", burst=64, fwd="io")
    assert v.argv[1:5] == ["-l", "1,0", "--main-lcore", "1"]
    assert (v.main_cpu, v.fwd_cpu) == (1, 0)
    for arg in ("--no-huge", "--no-pci", "-i", "--forward-mode=io", "--nb-cores=1", "--burst=64",
                "--total-num-mbufs=16384", "net_vhost0,iface=/tmp/a.sock,queues=1"):
        assert arg in v.argv
    assert v.argv[v.argv.index("-m") + 1] == "512"
    assert f"--file-prefix={v.file_prefix}" in v.argv
    assert Testpmd.vhost("/tmp/a.sock", client=True).vdev.endswith(",client=1")

    u = Testpmd.virtio_user("/tmp/a.sock", packed=True, in_order=False, mrg_rxbuf=False, queue_size=512)
    assert u.argv[1:5] == ["-l", "0,1", "--main-lcore", "0"]
    assert "--single-file-segments" in u.argv
    assert u.vdev == "virtio_user0,path=/tmp/a.sock,queues=1,in_order=0,packed_vq=1,mrg_rxbuf=0,queue_size=512"
    assert u.file_prefix != v.file_prefix
    assert Testpmd.virtio_user("/tmp/a.sock", server=True).vdev.endswith(",server=1")

    # explicit pinning; one CPU for both lcores maps two lcores onto it
    assert Testpmd.vhost("/tmp/a.sock", lcores=(0, 1)).argv[1:5] == ["-l", "0,1", "--main-lcore", "0"]
    assert Testpmd.vhost("/tmp/a.sock", lcores=(0, 0)).argv[1:5] == ["--lcores", "0@0,1@0", "--main-lcore", "0"]
    with pytest.raises(ValueError):
        Testpmd.vhost("/tmp/a.sock", fwd="bogus")


def test_parsers_on_captured_output():
    port_out = """
  ######################## NIC statistics for port 0  ########################
  RX-packets: 19651572   RX-missed: 3          RX-bytes:  1257700608
  RX-errors: 1
  RX-nombuf:  2
  TX-packets: 19651604   TX-errors: 4          TX-bytes:  1257702656

  Throughput (since last show)
  Rx-pps:      9792786          Rx-bps:   5013906728
  Tx-pps:      9792785          Tx-bps:   5013906727
  ############################################################################
"""
    s = dpdk.parse_port_stats(port_out, 1.5)[0]
    assert s == PortStats(port=0, rx_packets=19651572, rx_missed=3, rx_bytes=1257700608, rx_errors=1, rx_nombuf=2,
                          tx_packets=19651604, tx_errors=4, tx_bytes=1257702656, rx_pps=9792786, rx_bps=5013906728,
                          tx_pps=9792785, tx_bps=5013906727, time=1.5)
    fwd_out = """
  ---------------------- Forward statistics for port 0  ----------------------
  RX-packets: 29505320       RX-dropped: 7             RX-total: 29505327
  TX-packets: 29505352       TX-dropped: 9             TX-total: 29505361
  ----------------------------------------------------------------------------

  +++++++++++++++ Accumulated forward statistics for all ports+++++++++++++++
  RX-packets: 29505320       RX-dropped: 7             RX-total: 29505327
"""
    f = dpdk.parse_fwd_stats(fwd_out)
    assert f == {0: FwdStats(0, 29505320, 7, 29505327, 29505352, 9, 29505361)}
    assert dpdk._script_median([5, 1, 4, 2]) == 2  # the script's lower middle
    assert dpdk._script_median([3, 1, 2]) == 2


# ----------------------------------------------------------------------------- with testpmd

@needs_testpmd
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_vhost_and_virtio_user_forward_and_stop_cleanly(sock, packed):
    with Testpmd.vhost(sock) as vhost:
        assert os.path.exists(sock)
        assert vhost.running and vhost.forwarding
        with Testpmd.virtio_user(sock, packed=packed, in_order=True) as virtio:
            assert virtio.forwarding  # started with `start tx_first`
            assert vhost.wait_link_up(timeout=30) < 30
            assert virtio.link_up()
            vhost.stats(0)  # opens a pps window
            first = virtio.stats(0)
            time.sleep(1.5)
            v_stats, u_stats = vhost.stats(0), virtio.stats(0)
            for s in (v_stats, u_stats):
                for name in COUNTERS:
                    assert isinstance(getattr(s, name), int), name
                assert s.rx_packets > 0 and s.tx_packets > 0
                assert s.rx_pps > 0 and s.tx_pps > 0
                assert s.rx_errors == 0 and s.tx_errors == 0
            assert u_stats.rx_packets > first.rx_packets  # still flowing
            live = virtio.fwd_stats()[0]
            assert live.rx_packets > 0 and live.tx_packets > 0
            vpid, upid = vhost.pid, virtio.pid
        ufinal = virtio.final
        assert ufinal.clean and ufinal.returncode == 0
        assert ufinal.fwd[0].rx_packets > 0 and ufinal.fwd[0].rx_dropped == 0
        assert ufinal.ports[0].tx_packets >= ufinal.fwd[0].tx_packets > 0
        _assert_gone(virtio, upid)
    vfinal = vhost.final
    assert vfinal.clean and vfinal.returncode == 0
    # mac forwarding: vhost sent back all it received, except a last burst that could find no room once the
    # virtio side had stopped refilling its rx ring (counted as TX-dropped); virtio got all vhost sent
    vf = vfinal.fwd[0]
    assert vf.rx_packets == vf.tx_packets + vf.tx_dropped and vf.tx_packets > 0
    assert vf.tx_dropped <= 2 * 32
    assert ufinal.ports[0].rx_packets <= vfinal.ports[0].tx_packets
    _assert_gone(vhost, vpid)
    assert virtio.error_lines() == [] and vhost.error_lines() == []


@needs_testpmd
def test_virtio_user_server_with_vhost_client(sock):
    virtio = Testpmd.virtio_user(sock, server=True)
    vhost = Testpmd.vhost(sock, client=True)
    try:
        virtio.start()  # returns when the socket exists: probe waits in accept()
        assert os.path.exists(sock) and not virtio.forwarding
        vhost.start()
        virtio.wait_ready(timeout=60)  # the client connected; autostart ran
        assert virtio.forwarding
        vhost.wait_link_up(timeout=30)
        deadline = time.monotonic() + 10
        while vhost.stats(0).rx_packets == 0:
            assert time.monotonic() < deadline, "no packets reached net_vhost"
            time.sleep(0.1)
        # and back: stopping as soon as net_vhost had them left virtio_user at 0 received now and then (the
        # burst net_vhost forwarded was still in the ring when both stopped)
        while virtio.stats(0).rx_packets == 0:
            assert time.monotonic() < deadline, "no packets came back to virtio_user"
            time.sleep(0.1)
    finally:
        ufinal = virtio.close()
        vfinal = vhost.close()
    assert ufinal.clean and vfinal.clean
    assert vfinal.fwd[0].rx_packets > 0 and ufinal.fwd[0].rx_packets > 0
    for tp in (virtio, vhost):
        _assert_gone(tp, tp._child.proc.pid)


@needs_testpmd
def test_failed_probe_raises_and_cleans_up(tmp_path):
    missing = str(tmp_path / "nobody-listens.sock")
    virtio = Testpmd.virtio_user(missing)
    with pytest.raises(TestpmdError, match="did not come up"):
        virtio.start(timeout=60)
    _assert_gone(virtio, virtio._child.proc.pid)
    assert "virtio_user" in virtio.log


@needs_testpmd
def test_kill_leaves_nothing_behind(sock):
    vhost = Testpmd.vhost(sock, autostart=False).start()
    pid = vhost.pid
    assert os.path.isdir(vhost.runtime_dir) and os.path.exists(sock)
    assert not vhost.forwarding
    vhost.kill()
    assert vhost.final is not None and not vhost.final.clean
    _assert_gone(vhost, pid)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_sweep_removes_only_our_stale_runtime_dirs(tmp_path):
    """What a run killed -9 leaves in the runtime base (close() and the finalizer never ran) is removed when the
    next one starts: our prefix, its creator gone, no testpmd holding the config lock. A directory whose creator
    lives, one a running primary still locks (an orphaned testpmd), and names not ours stay."""
    dead, me = _dead_pid(), os.getpid()
    dirs = {name: tmp_path / name for name in (f"vr{dead}x0beef", f"vr{dead}x1beef", f"vr{me}x0beef",
                                               f"vr{dead}x2beef", "rte", f"vr{dead}x4be")}
    for name, d in dirs.items():
        d.mkdir()
        if name != f"vr{dead}x1beef":   # one stale directory has no config file yet
            (d / "config").write_bytes(bytes(4096))
    (tmp_path / f"vr{dead}x3beef").write_text("a file, not a runtime directory")
    (tmp_path / f"vr{dead}x5beef" / "config").mkdir(parents=True)   # a config that cannot be opened: cannot tell
    locked = dirs[f"vr{dead}x2beef"] / "config"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX, 1000, 136)\n"   # a byte range, as EAL locks it
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"), str(locked)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = dpdk.sweep_stale_runtime_dirs(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted(str(dirs[n]) for n in (f"vr{dead}x0beef", f"vr{dead}x1beef"))
    assert sorted(os.listdir(tmp_path)) == sorted([f"vr{me}x0beef", f"vr{dead}x2beef", "rte", f"vr{dead}x4be",
                                                   f"vr{dead}x3beef", f"vr{dead}x5beef"])
    assert dpdk.sweep_stale_runtime_dirs(str(tmp_path / "absent")) == []


def test_sweep_leaves_what_it_cannot_tell_and_never_stops_a_launch(tmp_path, monkeypatch):
    """Names like ours that _unique_prefix cannot have made (a pid no process has: os.kill raised OverflowError,
    out of sweep and out of every launch after; digits that are not ASCII), a symlink named like ours, and
    directories whose config is no regular file (a symlink to a device or a file elsewhere, a FIFO: each was
    opened read-write as root, and its directory removed) are left alone. Whatever the sweep raises, launch goes
    on."""
    dead = _dead_pid()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config").write_bytes(bytes(4096))
    (tmp_path / "target").write_bytes(bytes(4096))
    for name in ("vr99999999999999999999x0beef", "vr4194304x0beef", "vr\u0663\u0663x0beef", f"vr{dead}x0beef",
                 f"vr{dead}x1beef", f"vr{dead}x2beef"):
        (tmp_path / name).mkdir()
    (tmp_path / f"vr{dead}x0beef" / "config").symlink_to("/dev/null")
    (tmp_path / f"vr{dead}x1beef" / "config").symlink_to(tmp_path / "target")
    os.mkfifo(tmp_path / f"vr{dead}x2beef" / "config")
    (tmp_path / f"vr{dead}x3beef").symlink_to(elsewhere)
    before = sorted(os.listdir(tmp_path))
    assert dpdk.sweep_stale_runtime_dirs(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(elsewhere) == ["config"]

    monkeypatch.setattr(dpdk, "_runtime_base", lambda: str(tmp_path))
    tp = Testpmd.vhost(str(tmp_path / "a.sock"), testpmd="/bin/true").launch()   # exits at once: only the launch
    tp.close(timeout=5.0)

    def broken(base=None):
        raise RuntimeError("a sweep that fails")
    monkeypatch.setattr(dpdk, "sweep_stale_runtime_dirs", broken)
    tp = Testpmd.vhost(str(tmp_path / "a.sock"), testpmd="/bin/true").launch()
    tp.close(timeout=5.0)


@needs_testpmd
def test_runtime_dir_of_a_run_killed_minus_9_is_removed_by_the_next_start(tmp_path):
    """A process that ran testpmd is killed -9: its testpmd quits (EOF on its stdin) and leaves its runtime
    directory, which nothing of the dead process can remove. The next Testpmd started removes it."""
    code = ("import os, sys\n"
            "from vring.dpdk import Testpmd\n"
            "tp = Testpmd.vhost(sys.argv[1], autostart=False).start()\n"
            "print(tp.pid, tp.runtime_dir, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.sock")], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == -9, run.stderr
    pid, left = run.stdout.split()
    pid = int(pid)
    try:
        deadline = time.monotonic() + 30
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(pid), "testpmd outlived the process that started it"
        assert os.path.isdir(left)
        vhost = Testpmd.vhost(str(tmp_path / "b.sock"), autostart=False).start()
        try:
            assert not os.path.exists(left)
        finally:
            vhost.close()
        assert not os.path.exists(vhost.runtime_dir)
    finally:
        for p in _group_alive(pid):
            os.kill(p, 9)
        shutil.rmtree(left, ignore_errors=True)
        if (tmp_path / "a.sock").exists():   # the killed process's testpmd made it
            (tmp_path / "a.sock").unlink()


@needs_testpmd
def test_measure_dpdk_pair_short():
    r = dpdk.measure_dpdk_pair(packed=True, in_order=True, seconds=3, burst=32, period=1.0, warmup=1)
    assert len(r["all_samples"]) == 3 and len(r["samples"]) == 2
    assert all(isinstance(x, int) for x in r["samples"])
    assert r["median_rx_pps"] > 0 and r["own_median_rx_pps"] > 0
    assert r["virtio"]["clean"] and r["vhost"]["clean"]
    assert r["errors"] == {"virtio": [], "vhost": []}
