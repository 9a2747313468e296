"""`vring bench`: the two-process loopback benchmark end to end (short runs, no timing assertions), its JSON,
its cleanup (also on Ctrl-C), and its argument errors."""
import glob
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from vring import bench, dpdk
from vring.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POINT_KEYS = {"path", "pkt_size", "pair", "pps", "latency", "notifications", "retries", "drops", "loss_check_ok",
              "repeats", "vs_dpdk"}
RUN_KEYS = {"pair", "driver", "device", "path", "packed", "in_order", "pkt_size", "repeat", "rate", "latency",
            "notifications", "retries", "drops", "loss_check", "features", "counters", "notes"}
MACHINE_KEYS = {"cpu_model", "cpus", "kernel", "python", "dpdk", "loadavg"}


@pytest.fixture
def tracked(monkeypatch, tmp_path):
    """Temporary directories go under tmp_path; every child process the benchmark starts is recorded."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    procs = []
    orig = bench._Proc.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        procs.append(self)
    monkeypatch.setattr(bench._Proc, "__init__", init)
    return procs


def _assert_clean(tmp_path, procs):
    assert not glob.glob(str(tmp_path / "vring-bench-*")), "a measurement directory was left behind"
    for p in procs:
        assert p.proc.poll() is not None, f"{p.name} (pid {p.pid}) still runs"
        assert not glob.glob(f"/dev/shm/*-{p.pid}-*"), f"shared memory of pid {p.pid} left behind"


def test_ours_against_ours_all_four_paths(tmp_path, tracked, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--seconds", "1", "--warmup", "0.5", "--interval", "0.25", "--json", str(out), "-q"])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert MACHINE_KEYS <= set(res["machine"])
    assert res["config"]["pairs"] == ["ours/ours"]
    assert [p["path"] for p in res["points"]] == list(bench.PATHS)
    for p in res["points"]:
        assert POINT_KEYS <= set(p), POINT_KEYS - set(p)
        assert p["loss_check_ok"], p
        assert p["pps"]["median"] > 0 and p["pps"]["min"] <= p["pps"]["median"] <= p["pps"]["max"]
        assert set(p["pps"]) >= {"median", "min", "max", "per_repeat"}
        for pc in bench.PCTS:
            assert p["latency"][pc + "_us"] > 0
        assert p["notifications"]["kicks_per_packet"] is not None
        assert p["notifications"]["calls_per_packet"] is not None
        assert p["retries"] == 0 and p["vs_dpdk"] is None
    assert len(res["runs"]) == 4
    for r in res["runs"]:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        lc = r["loss_check"]
        assert lc["ok"] and lc["injected"] == 256 and lc["unaccounted"] == 0
        # no drops at start: 256 in flight in a 256-entry Rx ring, reposted before each burst goes back out
        assert r["drops"]["device"]["rx_dropped"] == 0
        assert lc["injected"] == lc["in_flight"] + lc["lost"]
        assert r["rate"]["samples_pps"]
        assert r["counters"]["driver"]["tx"]["packets"] == r["counters"]["device"]["txq1"]["tx_packets"]
        assert ("RING_PACKED" in r["features"]) == r["packed"]
        assert ("IN_ORDER" in r["features"]) == r["in_order"]
    for name in bench.PATHS:   # the table names every point
        assert name in text
    # where the host had put the two CPUs, probed before each measurement (none runs then)
    probes = res["placement"]["probes_ns"]
    if res["config"]["device_cpu"] != res["config"]["driver_cpu"]:
        assert len(probes) == 4 and all(x > 0 for x in probes), probes
        assert [r["line_ns_before"] for r in res["runs"]] == probes
        assert "placement: one cache line CPU" in text
    _assert_clean(tmp_path, tracked)


def test_options_reach_both_processes(tmp_path, tracked, capsys):
    """Burst, ring size, packet size, injected count, retries and mrg_rxbuf are what the two processes used."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--paths", "packed-in-order", "--pkt-size", "128,1500", "--burst", "16", "--ring-size", "512",
               "--inject", "100", "--retries", "2", "--txq-flush", "timer:50", "--no-mrg-rxbuf",
               "--seconds", "0.6", "--warmup", "0.2", "--interval", "0.2", "--json", str(out), "-q"])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert [p["pkt_size"] for p in res["points"]] == [128, 1500]
    for r in res["runs"]:
        drv = r["counters"]["driver"]
        assert "MRG_RXBUF" not in r["features"]
        assert r["loss_check"]["injected"] == 100 and r["loss_check"]["ok"]
        assert drv["tx"]["bytes"] == drv["tx"]["packets"] * r["pkt_size"]
    argv = {p.name: p.argv for p in tracked}
    assert "--retries" in argv["device"] and argv["device"][argv["device"].index("--retries") + 1] == "2"
    assert argv["device"][argv["device"].index("--txq-flush") + 1] == "timer:50"
    assert argv["driver"][argv["driver"].index("--ring-size") + 1] == "512"
    assert argv["driver"][argv["driver"].index("--burst") + 1] == "16"
    _assert_clean(tmp_path, tracked)


@pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "ok")
def test_vs_dpdk_short(tmp_path, tracked, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--vs-dpdk", "--paths", "split-in-order", "--seconds", "1", "--warmup", "0.5",
               "--interval", "0.25", "--json", str(out), "-q"])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    pts = {p["pair"]: p for p in res["points"]}
    assert set(pts) == {"ours/ours", "dpdk/dpdk"}
    assert all(p["loss_check_ok"] for p in pts.values())
    assert pts["ours/ours"]["vs_dpdk"]["ratio"] > 0
    assert pts["dpdk/dpdk"]["latency"]["p50_us"] is None and "timestamps" in pts["dpdk/dpdk"]["latency"]["reason"]
    assert pts["dpdk/dpdk"]["notifications"]["kicks_per_packet"] is None
    assert res["machine"]["dpdk"]
    assert "dpdk/dpdk" in text
    _assert_clean(tmp_path, tracked)
    assert not glob.glob(str(tmp_path / "*.sock"))


@pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "ok")
def test_mixed_pairs_short(tmp_path, tracked, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--pairs", "ours/dpdk,dpdk/ours", "--paths", "packed-normal", "--seconds", "0.6",
               "--warmup", "0.3", "--interval", "0.3", "--json", str(out), "-q"])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    pts = {p["pair"]: p for p in res["points"]}
    assert set(pts) == {"ours/dpdk", "dpdk/ours"}
    assert all(p["loss_check_ok"] for p in pts.values())
    assert pts["ours/dpdk"]["latency"]["p50_us"] > 0
    assert pts["dpdk/ours"]["notifications"]["calls_per_packet"] is not None
    _assert_clean(tmp_path, tracked)


def test_ctrl_c_stops_and_cleans_everything(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = tmp_path / "partial.json"
    proc = subprocess.Popen([sys.executable, "-m", "vring.cli", "bench", "--paths", "split-normal,packed-normal",
                             "--seconds", "60", "--json", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # Ctrl-C as a terminal sends it: a test run started in the background inherits SIGINT
                            # ignored (POSIX shells do that for asynchronous commands), and so would the bench
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not glob.glob(str(tmp_path / "vring-bench-*" / "driver.out")):
            time.sleep(0.1)
        time.sleep(1.0)   # both processes up and forwarding
        children = _processes_mentioning(str(tmp_path))
        assert len(children) >= 2, "the benchmark's device and driver should be running"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)   # a guard against a hang, not a timing (loaded CI machines)
        assert proc.returncode == 130, err
        assert b"interrupted" in err
        res = json.loads(out.read_text())   # what was measured so far (nothing here), flagged as interrupted
        assert res["interrupted"] is True and res["runs"] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not _processes_mentioning(str(tmp_path))
    assert not glob.glob(str(tmp_path / "vring-bench-*"))
    for pid in children:
        assert not glob.glob(f"/dev/shm/*-{pid}-*")


def _processes_mentioning(text):
    """pids whose command line contains ``text`` (our children: their socket path is under it)."""
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(d[6:]))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("args, message", [
    (["--paths", "split,diagonal"], "unknown path"),
    (["--pairs", "ours/qemu"], "unknown pair"),
    (["--pkt-size", "32"], "out of range"),
    (["--pkt-size", "64,abc"], "not an integer"),
    (["--burst", "0"], "--burst"),
    (["--ring-size", "100"], "power of two"),
    (["--retries", "9"], "retries"),
    (["--txq-flush", "sometimes"], "txq flush"),
    (["--seconds", "0"], "--seconds"),
    (["--repeat", "0"], "--repeat"),
    (["--interval", "5", "--seconds", "1"], "--interval"),
    (["--driver", "dpdk", "--pairs", "ours/ours"], "not both"),
    (["--cpus", "0"], "--cpus"),
    (["--cpus", "0,4096"], "not one this process may use"),
    (["--pairs", "ours/dpdk", "--pkt-size", "4000"], "mbufs"),
    (["--pkt-size", "64,4000"], "our driver, --pkt-size 4000: 256 frames injected, but the Rx ring holds 85"),
    (["--no-mrg-rxbuf", "--pkt-size", "1500,3000"], "our driver, --pkt-size 3000: a 3000-byte frame and its 12-byte "
                                                    "header do not fit one 1920-byte Rx buffer"),
    (["--driver", "qemu"], "invalid choice"),
    (["--seconds", "x"], "invalid float"),
    (["--rate", "0"], "out of range"),
    (["--rate", "fast"], "not a number"),
    (["--rate", "10k", "--pairs", "dpdk/ours"], "paces our driver"),
    (["--modes", "poll,spin"], "unknown mode"),
    (["--modes", "poll", "--notify"], "contradict"),
    (["--idle", "-1"], "--idle"),
    (["--idle-polls", "0"], "idle polls"),
    (["--study", "colours"], "invalid choice"),
    (["--study", "txq", "--vs-dpdk"], "no --vs-dpdk"),
    (["--study", "hdr-prepend", "--vs-dpdk"], "no --vs-dpdk"),
    (["--study", "hdr-prepend", "--tx-hdr", "chain"], "its variants set --tx-hdr"),
    (["--study", "hdr-init", "--tx-hdr", "indirect"], "both variants write the header into the headroom"),
    (["--study", "hdr-prepend", "--ring-size", "256"], "--ring-size must be at least 2 x --inject (512)"),
    (["--tx-hdr", "chain", "--ring-size", "128"], "--ring-size must be at least 2 x --inject (512)"),
    (["--ring-size", "0"], "power of two"),
    (["--pairs", "dpdk/dpdk,dpdk/ours", "--tx-hdr", "chain"], "no pair here runs our driver"),
    (["--pairs", "dpdk/dpdk", "--headroom", "128"], "no pair here runs our driver"),
    (["--headroom", "8"], "need 12 <= headroom <= 65535"),
    (["--headroom", "2000"], "buf_size - headroom >= 52"),
    # NET-27: 2048 - 1000 + 12 bytes for a 1514-byte frame and its header; a headroom of 534 leaves 1526
    (["--headroom", "1000", "--no-mrg-rxbuf", "--pkt-size", "1514"],
     "what it has instead: --mrg-rxbuf, --headroom 534 or less)"),
    # SPLIT-D-05: 61 buffers of 148 bytes and a header, more than 8 descriptors; 7 of 1286 bytes fit (attack64:
    # the advice named --mrg-rxbuf, which has nothing to do with Tx chains; attack65: 748, rounded, not 762)
    (["--ring-size", "8", "--inject", "1", "--pkt-size", "9000", "--headroom", "1900"],
     "what it has instead: --headroom 762 or less)"),
    # attack65: check_injected's refusal (256 frames of 2 Rx buffers each) had no advice, though 137 fits one
    (["--pkt-size", "1911"], "inject at most 128, or use a larger ring or buffer size (vring bench gives our driver "
                             "2048-byte buffers; what it has instead: --headroom 137 or less)"),
    # nothing a headroom can do (8 frames of 8000 bytes: at most 1 in an 8-entry Rx ring, whatever the headroom):
    # the driver's own words, no advice after them
    (["--ring-size", "8", "--inject", "8", "--pkt-size", "8000", "--headroom", "1000"],
     "or a buffer size of at least 2176\n"),
    (["--study", "tx-cleanup", "--pairs", "ours/dpdk"], "ours/ours only, not ours/dpdk"),
    (["--study", "hdr-prepend", "--pairs", "dpdk/ours"], "ours/ours and ours/dpdk only, not dpdk/ours"),
    (["--tx-hdr", "inline"], "invalid choice"),
    (["--study", "doorbell", "--notify"], "its own mode"),
    (["--txq-flush", "never"], "txq flush"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--plot", "x.png"])
    assert e.value.code == 2
    assert "pip install" in capsys.readouterr().err


def test_dpdk_pairs_without_testpmd_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(dpdk, "skip_reason", lambda: "dpdk-testpmd not found; apt-get install -y dpdk-dev")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--vs-dpdk"])
    assert e.value.code == 2
    assert "dpdk-testpmd" in capsys.readouterr().err


def test_path_and_pair_lists():
    assert bench.parse_paths("all") == list(bench.PATHS)
    assert bench.parse_paths("split") == ["split-normal", "split-in-order"]
    assert bench.parse_paths("in-order,packed") == ["split-in-order", "packed-in-order", "packed-normal"]
    assert bench.parse_paths("packed_inorder") == ["packed-in-order"]
    assert bench.parse_pairs("ours,dpdk,ours/dpdk") == ["ours/ours", "dpdk/dpdk", "ours/dpdk"]
    assert bench.parse_sizes("64, 1500,64") == [64, 1500]


def test_table_and_plot_from_a_result(tmp_path):
    """The table and the plot from a synthetic result."""
    cfg = bench.BenchConfig(pairs=["ours/ours", "dpdk/dpdk"], paths=["split-normal"], repeat=2)

    def rec(pair, rep, pps, lat):
        return {"pair": pair, "path": "split-normal", "pkt_size": 64, "repeat": rep,
                "rate": {"pps_median": pps, "pps_min": pps - 1, "pps_max": pps + 1, "samples_pps": [pps - 1, pps + 1]},
                "latency": {"p50_us": lat, "p99_us": lat and lat * 2, "p99.9_us": lat and lat * 3,
                            **({} if lat else {"reason": "no timestamps"})},
                "notifications": {"kicks_per_packet": 0.1 if lat else None, "calls_per_packet": 0.0 if lat else None},
                "retries": {"retries": 0 if lat else None}, "drops": {"total": 1},
                "loss_check": {"ok": True}}
    runs = [rec("ours/ours", 0, 4_000_000, 10.0), rec("dpdk/dpdk", 0, 8_000_000, None),
            rec("ours/ours", 1, 6_000_000, 12.0), rec("dpdk/dpdk", 1, 6_000_000, None)]
    pts = bench.aggregate(cfg, runs)
    ours = pts[0]
    assert ours["pps"]["median"] == 5_000_000 and ours["pps"]["min"] == 3_999_999
    assert ours["vs_dpdk"]["ratio"] == round(5 / 7, 3)
    assert ours["vs_dpdk"]["per_repeat"] == [0.5, 1.0]
    assert ours["latency"]["p50_us"] == 11.0
    assert pts[1]["latency"]["reason"] == "no timestamps" and pts[1]["retries"] is None
    result = {"points": pts, "config": {"pairs": cfg.pairs, "paths": cfg.paths, "pkt_sizes": [64], "burst": 32,
                                       "ring_size": 256, "inject": 256}, "errors": []}
    table = bench.format_table(result)
    assert "5.000" in table and "0.750" in table and "ok" in table   # vs dpdk: median of the side-by-side ratios
    bench.plot(result, tmp_path / "p.png")   # matplotlib is in the [test] extra: no skip
    assert (tmp_path / "p.png").stat().st_size > 1000


def _rec(pair, rep, samples):
    """A packed-normal run record of a pair with these rate samples (the speed-regime tests)."""
    return {"pair": pair, "path": "packed-normal", "pkt_size": 64, "repeat": rep,
            "rate": {"pps_median": statistics.median(samples), "samples_pps": samples},
            "latency": {"p50_us": None, "p99_us": None, "p99.9_us": None, "reason": "-"},
            "notifications": {}, "retries": {"retries": 0}, "drops": {"total": 0}, "loss_check": {"ok": True}}


def test_two_speed_regimes_are_compared_within_each():
    """A machine that runs at two speeds (a shared VM here: about 2x apart, switching every few seconds): a run
    that caught the fast one beside one that caught the slow one says nothing about the pairs. A pair whose own
    samples fall into two clusters is split, and compared with dpdk/dpdk within each regime when that splits too."""
    assert bench.speed_regimes([10e6, 11e6, 9.5e6, 10.5e6, 9.8e6, 10.2e6, 11.5e6, 9.1e6]) is None   # one regime
    assert bench.speed_regimes([10e6, 20e6, 10e6, 20e6]) is None                                   # too few samples
    assert bench.speed_regimes([10e6] * 9 + [5e6, 5.1e6]) is None                       # two outliers: no regime
    t = bench.speed_regimes([9.5e6, 9.6e6, 9.7e6, 10e6, 16e6, 17e6, 17.2e6, 17.4e6])
    assert 10e6 < t < 16e6
    cfg = bench.BenchConfig(pairs=["ours/dpdk", "dpdk/dpdk"], paths=["packed-normal"], repeat=2)

    # repeat 0: ours slow, dpdk fast; repeat 1: the other way round. Same-repeat ratios 0.56 and 1.79
    runs = [_rec("ours/dpdk", 0, [9.5e6, 9.6e6, 9.7e6]), _rec("dpdk/dpdk", 0, [16e6, 16e6, 16e6]),
            _rec("ours/dpdk", 1, [17.0e6, 17.2e6, 17.4e6]), _rec("dpdk/dpdk", 1, [10e6, 10e6, 10e6])]
    ours, ref = bench.aggregate(cfg, runs)
    assert ours["regimes"]["slow"] == {"samples": 3, "median": 9_600_000}
    assert ref["regimes"]["fast"] == {"samples": 3, "median": 16_000_000}
    assert ours["vs_dpdk"]["by_regime"] == {"slow": 0.96, "fast": 1.075}
    table = bench.format_table({"points": [ours, ref], "config": {}, "errors": []})
    assert "two speed regimes" in table and "0.960" in table and "1.075" in table
    # pairs that simply run at different rates, each at one speed: pooled they would look like two regimes
    runs = [_rec("ours/dpdk", 0, [29e6, 28e6, 30e6]), _rec("dpdk/dpdk", 0, [10e6, 10.5e6, 11e6]),
            _rec("ours/dpdk", 1, [28.5e6, 29.5e6, 29e6]), _rec("dpdk/dpdk", 1, [10.2e6, 10.8e6, 10.4e6])]
    ours, ref = bench.aggregate(cfg, runs)
    assert ours["regimes"] is None and ref["regimes"] is None and "by_regime" not in ours["vs_dpdk"]
    assert "two speed regimes" not in bench.format_table({"points": [ours, ref], "config": {}, "errors": []})
    # dpdk/dpdk at one speed only: which regime it was in is unknown, so no ratio within regimes
    runs = [_rec("ours/dpdk", 0, [9.5e6, 9.6e6, 9.7e6]), _rec("dpdk/dpdk", 0, [16e6, 16e6, 16e6]),
            _rec("ours/dpdk", 1, [17.0e6, 17.2e6, 17.4e6]), _rec("dpdk/dpdk", 1, [16.5e6, 16e6, 15.8e6])]
    ours, ref = bench.aggregate(cfg, runs)
    assert ours["regimes"] is not None and ref["regimes"] is None and "by_regime" not in ours["vs_dpdk"]


def test_seconds_without_traffic_are_in_no_speed_regime():
    """A second that moved nothing (0 pps: a stall) is no machine speed: speed_regimes leaves it out, and so must
    the split of the samples, where it sat in 'slow' (its count and median; a stalled dpdk/dpdk repeat made the slow
    median 0 and aggregate() die on a division by zero at the end of the run, the table and JSON lost)."""
    cfg = bench.BenchConfig(pairs=["ours/dpdk", "dpdk/dpdk"], paths=["packed-normal"], repeat=3)

    runs = [_rec("ours/dpdk", 0, [9.5e6, 9.6e6, 9.7e6]), _rec("dpdk/dpdk", 0, [0, 0, 0, 0, 0]),
            _rec("ours/dpdk", 1, [17.0e6, 17.2e6, 17.4e6]), _rec("dpdk/dpdk", 1, [10e6, 10e6, 10e6]),
            _rec("ours/dpdk", 2, [17.0e6, 9.2e6, 17.4e6]), _rec("dpdk/dpdk", 2, [16e6, 16e6, 16e6])]
    ours, ref = bench.aggregate(cfg, runs)
    assert ref["regimes"]["slow"] == {"samples": 3, "median": 10_000_000}
    assert ref["regimes"]["fast"] == {"samples": 3, "median": 16_000_000}
    assert ours["vs_dpdk"]["by_regime"] == {"slow": 0.955, "fast": 1.075}


def test_one_wide_spread_of_rates_is_not_two_speed_regimes():
    """Two-means splits any sample in two; centres REGIME_GAP apart are not enough to call that two speeds when the
    rates spread evenly in between: one point of a 3-repeat run here (packed-normal ours/dpdk, 8.7-18.3 Mpps, no
    gap anywhere) was split at 13.0 Mpps, and so is any unimodal spread of +-25% per second. Two regimes are two
    clusters each narrow beside the distance between them."""
    here = [8.72, 9.69, 12.02, 12.49, 13.15, 13.99, 14.1, 14.24, 15.0, 15.88, 16.62, 16.71, 16.81, 17.14, 17.43,
            17.6, 18.08, 18.33]
    assert bench.speed_regimes([x * 1e6 for x in here]) is None
    for sigma in (0.25, 0.3):   # log-normal quantiles: one speed, wide noise
        spread = [12e6 * math.exp(sigma * statistics.NormalDist().inv_cdf((i + 0.5) / 18)) for i in range(18)]
        assert bench.speed_regimes(spread) is None, sigma
    # two speeds from the same run, a few seconds in between (a switch inside a second): still two
    two = [9.04, 9.64, 9.72, 12.11, 15.87, 16.12, 16.3, 17.05, 17.35, 18.81, 19.36, 19.88, 19.99, 20.26, 20.59, 21.24,
           21.37, 21.5]
    assert 12.2e6 < bench.speed_regimes([x * 1e6 for x in two]) < 15.8e6
    two = [7.17, 7.34, 7.42, 7.53, 7.67, 7.8, 7.94, 7.96, 8.09, 8.24, 8.3, 10.84, 11.23, 12.56, 12.61, 13.96, 14.65,
           14.88]
    assert 8.3e6 < bench.speed_regimes([x * 1e6 for x in two]) < 10.84e6


def test_the_placement_of_the_two_cpus_is_reported_and_split():
    """The footer says where the host had put the two CPUs (one line's trip, probed before each measurement), and
    when the probes fall into two placements, how many measurements each preceded; one CPU for both sides (no
    probe) prints nothing. Near and far are split at the geometric mean of the 10th and 90th percentiles, only
    when those are 2x apart."""
    assert bench.placement_threshold([40.0, 45.0, 50.0, 60.0, 70.0]) is None
    assert bench.placement_threshold([40.0, None, 200.0]) is None
    assert abs(bench.placement_threshold([40.0] * 5 + [200.0] * 5) - 89.4427) < 1e-3
    cfg = {"device_cpu": 0, "driver_cpu": 1}
    two = bench._placement_lines({"config": cfg, "placement": {"probes_ns": [40.0, 45.0, 210.0, 200.0, 205.0],
                                                               "threshold_ns": 90.0}})
    assert two and "CPU 0 -> CPU 1 took 40-210 ns (median 200)" in two[0] and "near (< 90 ns) before 2, far before 3" in two[0]
    one = bench._placement_lines({"config": cfg, "placement": {"probes_ns": [40.0, 45.0], "threshold_ns": None}})
    assert one and "moved" not in one[0]
    assert bench._placement_lines({"config": cfg, "placement": {"probes_ns": [None, None], "threshold_ns": None}}) == []
    assert bench._placement_lines({"config": cfg}) == []


def test_points_are_split_by_placement_and_compared_within_each():
    """With two placements, each point's repeats are split by the probe before each (near below the threshold, far
    at or above, unprobed in neither), and a pair is compared with dpdk/dpdk within the same placement only: a
    near repeat of one against a far repeat of the other compares the machine."""
    cfg = bench.BenchConfig(pairs=["ours/dpdk", "dpdk/dpdk"], paths=["split-normal"], repeat=4)

    def rec(pair, rep, pps, line_ns):
        return {"pair": pair, "path": "split-normal", "pkt_size": 64, "repeat": rep, "line_ns_before": line_ns,
                "rate": {"pps_median": pps, "pps_min": pps, "pps_max": pps, "samples_pps": [pps]},
                "latency": {"p50_us": None, "p99_us": None, "p99.9_us": None, "reason": "none"},
                "notifications": {}, "retries": {"retries": 0}, "drops": {"total": 0}, "loss_check": {"ok": True}}
    # ours: near 8, 9; far 5 and an unprobed 1; dpdk: near 8, far 6, 6, 7
    runs = [rec("ours/dpdk", 0, 8e6, 40.0), rec("dpdk/dpdk", 0, 8e6, 45.0),
            rec("ours/dpdk", 1, 5e6, 210.0), rec("dpdk/dpdk", 1, 6e6, 200.0),
            rec("ours/dpdk", 2, 9e6, 42.0), rec("dpdk/dpdk", 2, 6e6, 205.0),
            rec("ours/dpdk", 3, 1e6, None), rec("dpdk/dpdk", 3, 7e6, 199.0)]
    ours, ref = bench.aggregate(cfg, runs, placement_ns=90.0)
    assert ours["placements"] == {"near": {"repeats": 2, "median": 8_500_000}, "far": {"repeats": 1, "median": 5_000_000}}
    assert ref["placements"] == {"near": {"repeats": 1, "median": 8_000_000}, "far": {"repeats": 3, "median": 6_000_000}}
    assert ours["vs_dpdk"]["by_placement"] == {"near": round(8.5 / 8, 3), "far": round(5 / 6, 3)}
    lines = bench._placement_table_lines([ours, ref], rates=False)
    assert "by placement" in lines[1] and "1.062" in lines[-2] and "0.833" in lines[-2]
    # one placement: no split, no table
    one, _ = bench.aggregate(cfg, runs)
    assert "placements" not in one and "by_placement" not in one["vs_dpdk"]
    assert bench._placement_table_lines([one], rates=False) == []


def test_rate_runs_are_checked_as_paced_not_against_inject():
    """helper-68: --rate 10k --pkt-size 4000 was refused for 256 injected frames that rate mode never injects (our
    driver's --check passes it); a closed loop of them is still refused."""
    bench.BenchConfig(pkt_sizes=[4000], rates=[10000], seconds=1).validate()
    with pytest.raises(ValueError, match="inject at most"):
        bench.BenchConfig(pkt_sizes=[4000], seconds=1).validate()
