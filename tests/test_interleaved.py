"""benchmarks/interleaved.py as a tool: it refuses what it cannot run before starting anything, says why a pair
did not come up, and leaves no process, stopped or not, and no work directory behind, however it ends (found by an
adversarial review: a SIGTERM left stopped testpmds, a driver that exited at start gave no cause, plain ``ours``
ran whatever tree was installed). Runs with our device only: no DPDK needed. Rates are not asserted."""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from vring import dpdk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "benchmarks", "interleaved.py")
CPUS = sorted(os.sched_getaffinity(0))
CPU_ARG = f"{CPUS[0]},{CPUS[-1]}"
SHORT = ["--device", "ours", "--path", "split", "--rounds", "2", "--slice", "0.2", "--warmup", "0.5",
         "--cpus", CPU_ARG]


def _env(tmp_path):
    # the work directory (sockets, outputs) goes under tmp_path: what is left there, and who still runs with a
    # path under it in its argv, is what the tool failed to clean
    return {**os.environ, "TMPDIR": str(tmp_path)}


def _ours_under(tmp_path):
    """(pid, state) of every process whose command line names a path under tmp_path."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(tmp_path).encode() in cmd and state != "Z":
            found.append((int(pid), state))
    return found


def _assert_clean(tmp_path):
    deadline = time.monotonic() + 10
    while _ours_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _ours_under(tmp_path)
    for pid, _ in left:   # a leak fails the test, and is not left running (a driver with --seconds 86400)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    assert left == []
    assert [p for p in os.listdir(tmp_path) if p.startswith("vring-interleaved-")] == []


def _run(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(tmp_path))


@pytest.mark.parametrize("args,says", [
    (["--cpus", "0,4096"], "may run on CPUs"),
    (["--cpus", "0"], "--cpus: DEVICE,DRIVER"),
    (["--variants", "dpdk --burst 8"], "DPDK's driver takes --no-mrg-rxbuf only"),
    (["--variants", "dpdk --no-mrg-rxbuf --burst 8"], "other arguments are for our driver"),
    (["--variants", "ours;testpmd"], "dpdk, ours, ours@TREE or DRIVER/DEVICE"),
    (["--variants", "ours/vhost"], "dpdk, ours, ours@TREE or DRIVER/DEVICE"),
    (["--variants", "ours@/"], "is not a checkout of this project"),
    (["--device", "ours@/nonexistent"], "is not a checkout of this project"),
    (["--rounds", "0"], "must be positive"),
    (["--variants", " ; "], "no variant"),
    (["--variants", "ours;ours --tx-publish 0;ours"], "'ours' more than once"),
    (["--variants", "ours@"], "no tree after '@'"),
    (["--slice", "nan"], "--slice 0 < S <= 3600"),
    (["--warmup", "inf"], "--warmup 0 <= S <= 3600"),
    (["--inject", "257"], "at most 256"),
    (["--json", "/nonexistent/dir/r.json"], "cannot write there"),
    (["--instances", "0"], "--instances: 1 to 8"),
    (["--instances", "9"], "--instances: 1 to 8"),
])
def test_refuses_before_starting_anything(tmp_path, args, says):
    r = _run(tmp_path, *args, timeout=30)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    _assert_clean(tmp_path)


def test_an_unbuilt_tree_is_refused(tmp_path):
    """attack54: a tree with no C modules built imported the installed checkout's: an A/B of nothing."""
    tree = tmp_path / "tree"
    for d in ("vring", "virtio", "rings", "vhost"):
        (tree / d).mkdir(parents=True)
    r = _run(tmp_path, "--variants", f"ours;ours@{tree}", timeout=30)
    assert r.returncode == 2 and "is not built" in r.stderr and "Traceback" not in r.stderr, r.stderr
    _assert_clean(tmp_path)


def test_json_to_a_directory_is_refused(tmp_path):
    r = _run(tmp_path, "--variants", "ours", "--json", str(tmp_path), timeout=30)
    assert r.returncode == 2 and "cannot write there" in r.stderr


@pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "DPDK present")
def test_dpdk_driver_needs_whole_bursts(tmp_path):
    r = _run(tmp_path, "--variants", "dpdk;ours", "--inject", "40", timeout=30)
    assert r.returncode == 2 and "whole bursts of 32" in r.stderr
    _assert_clean(tmp_path)


def test_a_short_run_measures_every_variant_and_cleans_up(tmp_path):
    out = tmp_path / "r.json"
    r = _run(tmp_path, *SHORT, "--variants", "ours/ours;ours --tx-publish 0", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert list(doc["variants"]) == ["ours/ours", "ours --tx-publish 0"]
    for v in doc["variants"].values():
        assert len(v["rates"]) == 2 and min(v["rates"]) > 0
        assert v["ratio_q1"] <= v["ratio_median"] <= v["ratio_q3"]
    assert doc["variants"]["ours/ours"]["ratio_median"] == 1.0
    assert "ours --tx-publish 0" in r.stdout
    _assert_clean(tmp_path)


@pytest.mark.parametrize("variant, says", [
    ("ours --ring-size 7", "must be a power of 2, got 7"),
    ("ours --frobnicate", "unrecognized arguments: --frobnicate"),
    ("ours --headroom 2000", "headroom"),
    ("ours --no-mrg-rxbuf --headroom 1990", "FrameDoesNotFit"),   # a 64-byte frame and its header in 70 bytes
])
def test_our_drivers_arguments_are_checked_before_any_pair_starts(tmp_path, variant, says):
    """s36: a variant our driver refuses used to fail at its pair's start, every earlier pair started and stopped
    again; `vring driver --check` now says so first, in the driver's own words."""
    r = _run(tmp_path, *SHORT, "--variants", f"ours;{variant}", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"variant {variant!r}: our driver refuses it" in r.stderr and says in r.stderr, r.stderr
    assert "round" not in r.stdout, r.stdout
    _assert_clean(tmp_path)


@pytest.mark.parametrize("extra", ["--check", "--server", "--seconds 0.1", "--socket /tmp/elsewhere.sock",
                                   "--mode=txonly", "--sec 5", "--pin 0", "-h", "--hel"])
def test_options_this_tool_sets_are_refused_in_a_variant(tmp_path, extra):
    """attack64: each of these passed --check, then took the pair out of the tool's hands at its start (a --check
    run as the driver, a driver listening on the device's socket, one that stops by itself or talks to another
    socket). Abbreviations too: argparse takes any unambiguous prefix."""
    r = _run(tmp_path, *SHORT, "--variants", f"ours;ours {extra}", timeout=60)
    helps = extra.startswith(("-h", "--hel"))
    says = "did not check it (it printed: usage:" if helps else "which this tool sets itself"
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "round" not in r.stdout, r.stdout
    _assert_clean(tmp_path)


def test_a_driver_that_exits_at_start_is_reported_with_its_own_words(tmp_path):
    """What --check does not see (a --pcap where nothing can be created: it does not try) still ends the run with
    the driver's words; the device, which serves one connection, exits after it and is reported too."""
    r = _run(tmp_path, *SHORT, "--variants", "ours;ours --no-mrg --pcap /proc/vring-x.pcap")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "ours --no-mrg --pcap /proc/vring-x.pcap: both sides exited." in r.stderr, r.stderr
    assert "the driver exited (2)" in r.stderr and "/proc/vring-x.pcap" in r.stderr, r.stderr
    assert "the device exited:\n(exit status 0)" in r.stderr, r.stderr
    _assert_clean(tmp_path)


def test_every_child_runs_python_minus_capital_p(tmp_path, monkeypatch):
    """attack65: the cwd test above passed with PYTHON right and the argv built without it."""
    m, seen = _tool(), []

    class Started(Exception):
        pass

    def popen(argv, **kw):
        seen.append(argv)
        raise Started

    monkeypatch.setattr(m.subprocess, "Popen", popen)
    with pytest.raises(Started):
        m.OurDevice("ours", str(tmp_path / "s.sock"), str(tmp_path), [0, 1])
    args = SimpleNamespace(path="split", cpus=[0, 1], inject=32)
    assert seen[0][:4] == list(m.PYTHON) == m._driver_argv(args, "s.sock", [])[:4] == [sys.executable, "-P", "-m",
                                                                                         "vring.cli"]


def _fake_tree(tmp_path, cli):
    tree = tmp_path / "tree"
    for d in ("vring", "virtio", "rings", "vhost"):
        (tree / d).mkdir(parents=True, exist_ok=True)
        (tree / d / "__init__.py").write_text("")
    for built in _tool().BUILT:
        (tree / (built + ".abi3.so")).write_text("")
    (tree / "vring" / "cli.py").write_text(cli)
    return tree


@pytest.mark.parametrize("cli, refused", [
    # a tree from before --check: its help does not name it, its refusals come at its pair's start
    ("import sys\nprint('usage: vring driver --socket S [--json]')\nsys.exit(0 if '--help' in sys.argv else 2)\n",
     None),
    # attack65: a tree whose driver does not even import was skipped as one without --check
    ("import no_such_module_at_all\n", "our driver does not start: ModuleNotFoundError"),
])
def test_a_tree_without_check_is_told_by_its_help(tmp_path, cli, refused):
    m = _tool()
    tree = _fake_tree(tmp_path, cli)
    args = SimpleNamespace(path="split", cpus=[0, 1], inject=32)
    if refused is None:
        assert m._check_driver("ours@x", args, f"ours@{tree}", [], str(tmp_path / "s.sock")) is None
    else:
        with pytest.raises(m.Failure, match=refused):
            m._check_driver("ours@x", args, f"ours@{tree}", [], str(tmp_path / "s.sock"))


def test_ours_at_tree_runs_that_trees_code_from_a_checkout(tmp_path):
    """attack64: `python -m` puts the current directory ahead of PYTHONPATH, so run from a checkout (as the
    docstring's examples are), ours@TREE ran that checkout's code. A tree whose `vring.cli` only says who it is."""
    m, tree = _tool(), _fake_tree(tmp_path, "print('the tree, not the checkout')\n")
    r = subprocess.run([*m.PYTHON], env=m._tree_env(f"ours@{tree}"), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "the tree, not the checkout\n", (r.stdout, r.stderr[-300:])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_continues_and_stops_every_pair(tmp_path, sig):
    p = subprocess.Popen([sys.executable, TOOL, *SHORT[:-8], "--rounds", "1000", "--slice", "0.2",
                          "--warmup", "0.5", "--cpus", CPU_ARG, "--variants", "ours;ours --tx-publish 8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(_ours_under(tmp_path)) < 4:   # both pairs up: two devices, two drivers
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.1)
        time.sleep(1.0)   # into the rounds: one pair running, the other stopped
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    try:
        assert p.returncode == 1 and "interrupted" in err and "Traceback" not in err
    finally:   # whatever failed above, what the tool left behind is reported and stopped
        _assert_clean(tmp_path)


def _cpus_of(pid):
    """{thread name: the CPUs it may run on} of a process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                allowed = next(ln for ln in f if ln.startswith("Cpus_allowed_list:")).split()[1]
        except (OSError, StopIteration):
            continue
        out[f"{name}/{tid}" if name in out else name] = allowed
    return out


def _pair_states(tmp_path):
    """{pair index: {pid: state}} of the processes interleaved.py started (their argv names p<k>.sock)."""
    pairs = {}
    for pid, state in _ours_under(tmp_path):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        for k in range(4):
            if f"p{k}.sock".encode() in cmd:
                pairs.setdefault(k, {})[pid] = state
    return pairs


def _stretches(samples, inside):
    """(first, last) index of every run of consecutive samples for which inside(sample) holds."""
    out, i = [], 0
    while i < len(samples):
        if inside(samples[i]):
            j = i
            while j + 1 < len(samples) and inside(samples[j + 1]):
                j += 1
            out.append((i, j))
            i = j + 1
        else:
            i += 1
    return out


def _rounds(samples, slice_s):
    """From samples (time, the pairs out of the stopped state, the pairs with every process stopped), in order:
    ({pair: its turns}, [the stretches in which two pairs ran at once during the rounds, as (samples, seconds)]).

    The rounds end at the last sample that saw a pair stopped: the clean-up continues every pair and never stops
    one again. Two pairs seen running at once before that are a signal on its way (the next pair is continued as
    soon as the last one is sent SIGSTOP, and a process waiting for the CPU stops only once it gets it: on a busy
    machine tens of ms, several samples), unless it lasts half a slice (and three samples: not one sampler late).
    A turn is a pair's run of samples out of the stopped state, started before the rounds end; two runs less than
    a slice apart are one turn (the same pair's two slices across a round boundary, the stop seen in between)."""
    stopped_at = [i for i, (_, _, stopped) in enumerate(samples) if stopped]
    end = stopped_at[-1] if stopped_at else 0
    overlaps = [(j - i + 1, samples[j][0] - samples[i][0])
                for i, j in _stretches(samples, lambda s: len(s[1]) > 1) if i < end]
    overlaps = [(n, seconds) for n, seconds in overlaps if n >= 3 and seconds >= slice_s / 2]
    turns = {}
    for k in sorted({k for _, running, _ in samples for k in running}):
        merged = []
        for i, j in _stretches(samples, lambda s: k in s[1]):
            # no other pair seen running in between: whatever the gap (the line probe, a busy machine)
            if merged and not any(s[1] - {k} for s in samples[merged[-1][1] + 1:i]):
                merged[-1] = (merged[-1][0], j)
            else:
                merged.append((i, j))
        turns[k] = sum(1 for i, _ in merged if i < end)
    return turns, overlaps


def _timeline(*slices, period=0.02):
    """Samples every `period` s for slices (seconds, running pairs, stopped pairs), as the test below takes them."""
    out, t = [], 0.0
    for seconds, running, stopped in slices:
        for _ in range(max(1, round(seconds / period))):
            out.append((round(t, 3), set(running), set(stopped)))
            t += period
    return out


def _tool_timeline(rounds=6, slice_s=0.3, order=lambda r: (0, 1) if r % 2 == 0 else (1, 0), stop_lag=0.0,
                   both=False):
    """What interleaved.py's run looks like from /proc: two warm-ups, rounds + 1 rounds of slices in `order`, the
    clean-up (every pair continued, then closed). stop_lag: how long a stopped pair is still seen running after
    the next one is continued. both: every slice continues both pairs."""
    slices = [(0.1, set(), set()), (0.6, {0}, set()), (0.6, {1}, {0})]
    prev = 1
    for k in (k for r in range(rounds + 1) for k in order(r)):
        if both:
            slices.append((slice_s + 0.15, {0, 1}, set()))
        else:
            if k != prev and stop_lag:
                slices.append((stop_lag, {0, 1}, set()))
            slices.append((slice_s + 0.15 - (stop_lag if k != prev else 0), {k}, {1 - k}))
        slices.append((0.001, set(), {0, 1}))   # the one stopped, the next not yet continued: rarely seen
        prev = k
    slices.append((0.5, {0, 1}, set()))
    return _timeline(*slices)


def test_rounds_verdict_on_made_up_timelines():
    """The verdict of the test below on timelines made up to look like the tool's: a run on a busy machine (the
    stopped pair seen running for 40 ms after the next one was continued: two samples; the check before, two
    samples in a row, failed such runs) passes; both pairs continued in every slice, the order not alternated, a
    pair left out of the rounds, each pair's stop late by 0.2 s do not. (A pair left out of some rounds only is
    test_a_short_run_measures_every_variant_and_cleans_up's: a rate missing.)"""
    for lag in (0.0, 0.04, 0.1):
        assert _rounds(_tool_timeline(stop_lag=lag), 0.3) == ({0: 5, 1: 5}, []), lag
    turns, overlaps = _rounds(_tool_timeline(both=True), 0.3)
    assert min(turns.values()) < 5
    assert _rounds(_tool_timeline(order=lambda r: (0, 1)), 0.3)[0] == {0: 8, 1: 8}
    assert _rounds(_tool_timeline(order=lambda r: (0,)), 0.3)[0] == {0: 2, 1: 1}
    assert _rounds(_tool_timeline(stop_lag=0.2), 0.3)[1]


@pytest.mark.parametrize("variants", ["ours;ours --tx-publish 8", "dpdk/dpdk;ours/dpdk"])
def test_one_pair_runs_at_a_time_each_side_on_its_cpu(tmp_path, variants):
    """What a measurement alone cannot show (attack54's surviving mutants: SIGSTOP dropped, pins swapped): while the
    tool runs, the processes of at most one pair are ever out of the stopped state (but for a signal on its way),
    each pair gets its turns in alternating order, and the device forwards on the first CPU of --cpus, the driver
    on the second (given here the other way round from the default)."""
    if "dpdk" in variants and dpdk.skip_reason():
        pytest.skip(dpdk.skip_reason())
    dev_cpu, drv_cpu = CPUS[-1], CPUS[0]
    slice_s = 0.3
    p = subprocess.Popen([sys.executable, TOOL, "--device", "ours", "--path", "split", "--rounds", "6", "--slice",
                          str(slice_s), "--warmup", "0.5", "--cpus", f"{dev_cpu},{drv_cpu}", "--variants", variants],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    samples, pins = [], {}   # samples: (time, pairs running, pairs stopped)
    try:
        while p.poll() is None:
            pairs = _pair_states(tmp_path)
            samples.append((time.monotonic(),
                            {k for k, states in pairs.items() if any(st != "T" for st in states.values())},
                            {k for k, states in pairs.items() if all(st == "T" for st in states.values())}))
            for k, states in pairs.items():
                for pid in states:
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            cmd = f.read().split(b"\0")
                    except OSError:
                        continue
                    role = ("device" if b"vhost" in cmd or any(a.startswith(b"net_vhost") for a in cmd)
                            else "driver")
                    pins.setdefault((k, role), {}).update(_cpus_of(pid))
            time.sleep(0.01)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        _assert_clean(tmp_path)
    assert p.returncode == 0, err
    turns, overlaps = _rounds(samples, slice_s)
    assert overlaps == [], f"two pairs ran at once during the rounds: {overlaps} (samples, seconds)"
    # the order alternates (0 1, 1 0, 0 1, ...): with the warm-ups, 7 rounds are 5 turns each (8 in order 0 1, 0 1,
    # ...); one more for pair 0 if the clean-up is seen continuing it a sample before pair 1
    assert set(turns) == {0, 1} and all(5 <= t <= 6 for t in turns.values()), turns
    for (k, role), threads in pins.items():
        want = str(dev_cpu if role == "device" else drv_cpu)
        # ours: every thread (--pin pins them all); testpmd: its forwarding lcore's thread
        fwd = [c for name, c in threads.items() if name.startswith(("rte-worker", "lcore-worker", "python"))]
        assert fwd and all(c == want for c in fwd), f"pair {k} {role}: {threads}, wanted {want}"


def _tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("interleaved", TOOL)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


class _P:
    """A pair as the summary sees it: rates, dequeue stats (None: our device) and line probes, one per round."""

    def __init__(self, name, rates, dequeues=None, probes=None):
        self.name, self.rates = name, rates
        self.dequeues = list(dequeues) if dequeues is not None else [None] * len(rates)
        self.probes = list(probes) if probes is not None else [50.0] * len(rates)


def test_summary_arithmetic_on_recorded_slices():
    """attack54's surviving mutants in the summary: a ratio inverted, the median taken as a mean, the quartiles by
    the exclusive method (outside the data), the dequeue medians per column swapped."""
    m = _tool()
    base = _P("dpdk", [10.0, 10.0, 10.0, 10.0, 10.0])
    other = _P("ours", [10.0, 20.0, 30.0, 40.0, 100.0],
               [(0.1, 1.0, 300.0), None, (0.2, 3.0, 500.0), None, (0.9, 2.0, 400.0)])
    s = m.summary([base, other])
    assert list(s) == ["dpdk", "ours"]
    assert s["dpdk"]["ratio_median"] == 1.0 and s["dpdk"]["empty_dequeue_share"] is None
    o = s["ours"]
    assert (o["ratio_q1"], o["ratio_median"], o["ratio_q3"]) == (2.0, 3.0, 4.0)   # ratios 1, 2, 3, 4, 10
    assert (o["empty_dequeue_share"], o["dequeues_per_32"], o["device_cycles_per_packet"]) == (0.2, 2.0, 400.0)
    one = m.summary([_P("a", [5.0]), _P("b", [10.0])])["b"]
    assert (one["ratio_q1"], one["ratio_median"], one["ratio_q3"]) == (2.0, 2.0, 2.0)


def test_instances_are_averaged_per_round_and_reported_each():
    """--instances: a variant's rate in a round is the mean over its instances (not the first, not the median of
    two), its ratio is taken against the first variant's mean, and each instance keeps its own median."""
    m = _tool()
    pairs = [_P("dpdk", [10.0, 10.0, 10.0]), _P("ours", [10.0, 30.0, 12.0]),
             _P("dpdk", [20.0, 30.0, 10.0]), _P("ours", [20.0, 50.0, 18.0])]
    s = m.summary(pairs)
    assert s["dpdk"]["rates"] == [15.0, 20.0, 10.0] and s["ours"]["rates"] == [15.0, 40.0, 15.0]
    assert s["ours"]["ratio_median"] == 1.5   # ratios 1, 2, 1.5
    assert s["ours"]["instance_rates"] == [12.0, 20.0]
    only = m.summary(pairs, rounds=[1])
    assert only["ours"]["rates"] == [40.0] and only["ours"]["ratio_median"] == 2.0


def test_rounds_are_split_by_where_the_two_cpus_were():
    """The placement split: one placement when the probes stay within 2x of each other; else the threshold at the
    geometric mean of the 10th and 90th percentiles, and a round is near or far only when every slice of it saw
    the same placement (a round whose slices saw both, or one with no probe, is neither)."""
    m = _tool()
    assert m.placement_threshold([40.0, 45.0, 50.0, 60.0, 70.0]) is None
    assert m.placement_threshold([40.0, 200.0]) is None   # too few to say
    t = m.placement_threshold([40.0] * 5 + [200.0] * 5)
    assert abs(t - (40.0 * 200.0) ** 0.5) < 1e-9
    a = _P("dpdk", [1.0] * 4, probes=[40.0, 210.0, 45.0, 200.0])
    b = _P("ours", [1.0] * 4, probes=[42.0, 205.0, 190.0, 220.0])
    split = m.by_placement([a, b])
    assert (split["near"], split["far"], split["mixed"]) == ([0], [1, 3], [2])
    # probes_ns in the order the slices ran: kept round 0 is loop round 1, which runs the pairs reversed
    assert split["probes_ns"] == [42.0, 40.0, 210.0, 205.0, 190.0, 45.0, 200.0, 220.0]
    assert [p.name for p in m.run_order([a, b], 1)] == ["ours", "dpdk"] and m.run_order([a, b], 2) == [a, b]
    # a slice whose probe could not run (a CPU held by something else) has no label: its round is neither
    c = _P("ours2", [1.0] * 4, probes=[41.0, None, 44.0, 215.0])
    split = m.by_placement([a, c])
    assert (split["near"], split["far"], split["mixed"]) == ([0, 2], [3], [1])
    flat = m.by_placement([_P("x", [1.0] * 4, probes=[40.0, 41.0, 42.0, 43.0])])
    assert flat["threshold_ns"] is None and flat["near"] == flat["far"] == flat["mixed"] == []


def test_a_run_prints_where_the_cpus_were(tmp_path):
    """Each slice is preceded by a line probe on --cpus (all pairs stopped); the run says what it found."""
    r = _run(tmp_path, *SHORT, "--variants", "ours", "--instances", "2", "--json", str(tmp_path / "r.json"))
    _assert_clean(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "one cache line CPU" in r.stdout and "2 instances of each variant" in r.stdout
    out = json.load(open(tmp_path / "r.json"))
    assert len(out["placement"]["probes_ns"]) == 2 * 2 and all(x > 0 for x in out["placement"]["probes_ns"])
    assert len(out["variants"]["ours"]["instance_rates"]) == 2


# --- attack-61 additions --------------------------------------------------------------------------------------

_PROBE_SHIM = '''
import itertools, os, json
import rings.affinity as a
from rings.errors import VringError
_real, _n, _log = a.line_transfer_ns, itertools.count(), os.environ["PROBE_SHIM_LOG"]
def _children():
    me, out = os.getpid(), {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[1]) == me:
                out[int(pid)] = rest[0]
    return out
def shim(cpu_a, cpu_b, seconds=0.02):
    n = next(_n)
    states = _children()
    if n == int(os.environ.get("PROBE_SHIM_FAIL", "-1")):
        ns = None
    else:
        _real(cpu_a, cpu_b, seconds)
        ns = 1000.0 + n   # recognisable: the JSON must carry exactly these
    with open(_log, "a") as f:
        f.write(json.dumps({"n": n, "cpus": [cpu_a, cpu_b], "states": states, "ns": ns}) + "\\n")
    if ns is None:
        raise VringError("line_transfer_ns: CPU 1 never answered (the shim)")
    return ns
a.line_transfer_ns = shim
'''


def _shimmed(tmp_path, fail=-1):
    d = tmp_path / "shim"
    d.mkdir()
    (d / "sitecustomize.py").write_text(_PROBE_SHIM)
    log = tmp_path / "probes.jsonl"
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join([str(d), ROOT]), "PROBE_SHIM_LOG": str(log),
           "PROBE_SHIM_FAIL": str(fail)}
    return env, log


def test_each_probe_runs_with_every_pair_stopped_and_labels_its_slice(tmp_path):
    """The probe comes before SIGCONT (every process of every pair stopped), on --cpus, and what it returned is what
    the JSON holds (kills: the probe moved after SIGCONT, a constant instead of the probe, the CPUs swapped)."""
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    env, log = _shimmed(tmp_path)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, TOOL, *SHORT, "--variants", "ours;ours --tx-publish 8", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    _assert_clean(tmp_path)
    assert r.returncode == 0, r.stderr
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 2 * 2
    for c in calls:
        assert c["cpus"] == [CPUS[0], CPUS[-1]]
        assert len(c["states"]) == 4 and set(c["states"].values()) == {"T"}, c
    assert sorted(json.loads(out.read_text())["placement"]["probes_ns"]) == sorted(c["ns"] for c in calls)


def test_a_probe_that_fails_costs_its_label_not_the_run(tmp_path):
    env, log = _shimmed(tmp_path, fail=1)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, TOOL, *SHORT, "--variants", "ours", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    _assert_clean(tmp_path)
    assert r.returncode == 0 and "no line probe before ours's slice" in r.stderr, r.stderr
    assert json.loads(out.read_text())["placement"]["probes_ns"] == [1000.0, None]


def test_one_cpu_for_both_sides_runs_without_a_probe(tmp_path):
    out = tmp_path / "r.json"
    args = [a for a in SHORT if a not in ("--cpus", CPU_ARG)] + ["--cpus", f"{CPUS[0]},{CPUS[0]}"]
    r = _run(tmp_path, *args, "--variants", "ours", "--json", str(out))
    _assert_clean(tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "line probe" not in r.stderr, r.stderr
    assert "one cache line" not in r.stdout and "rounds only" not in r.stdout
    assert json.loads(out.read_text())["placement"] == {"threshold_ns": None, "probes_ns": [None, None], "near": [],
                                                        "far": [], "mixed": []}


def test_sigint_ends_the_run_even_when_started_ignoring_it(tmp_path):
    """A CI run started in the background (`cmd &`) gives its children SIGINT ignored; Python then installs no
    handler, and the SIGINT of test_a_signal_mid_run_continue_and_stops_every_pair left every pair running."""
    import signal as sg
    p = subprocess.Popen([sys.executable, TOOL, *SHORT[:-8], "--rounds", "1000", "--slice", "0.2", "--warmup", "0.5",
                          "--cpus", CPU_ARG, "--variants", "ours"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(tmp_path), preexec_fn=lambda: sg.signal(sg.SIGINT, sg.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while len(_ours_under(tmp_path)) < 2:
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)
        p.send_signal(sg.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.send_signal(sg.SIGTERM)   # the tool's own clean-up first, then the hard way
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        _assert_clean(tmp_path)
    assert p.returncode == 1 and "interrupted" in err


def test_instances_mean_not_median_and_placement_needs_two_probes_a_side():
    m = _tool()
    pairs = [_P("a", [10.0, 10.0]), _P("b", [10.0, 10.0]), _P("a", [10.0, 10.0]), _P("b", [10.0, 10.0]),
             _P("a", [10.0, 10.0]), _P("b", [40.0, 70.0])]
    s = m.summary(pairs)
    assert s["b"]["rates"] == [20.0, 30.0]   # means of (10, 10, 40) and (10, 10, 70); the medians would be 10, 10
    assert m.placement_threshold([40.0] * 19 + [400.0]) is None      # one outlier is not a placement (min/max: it was)
    assert m.placement_threshold([50.0] * 7 + [400.0]) is None       # nor with fewer than 10 probes
    assert m.placement_threshold([40.0] * 8 + [100.0] * 8) is not None   # 2.5x apart: two
    assert m.placement_threshold([40.0] * 5 + [80.0] * 5) is not None    # exactly 2x: two


def test_a_tmpdir_too_long_for_the_pairs_sockets_is_the_tools_refusal_not_a_variants(tmp_path):
    """helper-68: with a long TMPDIR the check of `ours` failed on the tool's own check socket, blamed on the
    variant; a TMPDIR a few bytes shorter passed the check and the first pair failed at start."""
    deep = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))
    deep.mkdir()
    r = subprocess.run([sys.executable, TOOL, "--variants", "ours", "--device", "ours"], capture_output=True,
                       text=True, timeout=60, env=dict(_env(tmp_path), TMPDIR=str(deep)))
    assert r.returncode == 2 and "set a shorter TMPDIR" in r.stderr and "variant 'ours'" not in r.stderr, r.stderr
    assert os.listdir(deep) == []
