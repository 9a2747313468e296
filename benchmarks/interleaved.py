"""Rates measured side by side on a machine whose speed changes from one second to the next.

Several driver/device pairs are alive at once, on the same two CPUs, and run in turn: all but one are stopped
(SIGSTOP), the running one is measured for a short slice (--slice, 0.4 s) and stopped, the next one continued
(SIGCONT). Every round measures each pair once, in alternating order, so the rates compared were measured within
a second or so of each other; the per-round ratios to the first variant cancel the machine's slow drifts. That is
what `vring bench --repeat` cannot do: there each point starts its processes anew, seconds apart, and on this
2-vCPU VM the speed swings 2x between regimes (see vring.bench.speed_regimes). A first round before --rounds is
run and not counted: a pair continued for the first time runs far below its rate.

A variant is the driver side: ``dpdk`` (testpmd virtio_user, mac forwarding, ``start tx_first``) or ``ours``
(``vring driver --mode macfwd --latency``, as `vring bench` runs it), followed by extra arguments for our driver
(``dpdk --no-mrg-rxbuf``: virtio_user without MRG_RXBUF, the only argument DPDK's driver takes); ``ours`` runs this
checkout's driver and ``ours@TREE`` that of another, built in place (PYTHONPATH=TREE: an A/B of a code change). Our
driver is asked first (`vring driver --check`) whether it takes a variant's arguments, and the options this tool
sets itself (OWNED: --socket, --seconds, --mode, ...) are refused, so that a bad variant stops the run before any
pair starts; what depends on the peer shows at its pair's start. Each variant at most once; --inject at most the
rings' 256 (a multiple of 32 with DPDK's driver). Its device is ``--device``: ``dpdk`` (testpmd net_vhost, macswap,
with --record-burst-stats and --record-core-cycles: the share of its dequeues that found nothing and its busy cycles
per packet, medians over slices, per variant) or ``ours`` / ``ours@TREE`` (`vring vhost --fwd macswap`). A variant
may name both sides as `vring bench --pairs` does, ``dpdk/ours``: then the four pairs of that matrix are compared
side by side. The rate is the device's: RX packets of the net_vhost port, or rx_packets of our backend's
--stats-interval lines, over the slice.

    python3 benchmarks/interleaved.py --path packed --inject 32 --variants 'dpdk;ours;ours --tx-publish 8'
    python3 benchmarks/interleaved.py --device ours --path split --variants 'ours;ours@/tmp/other-checkout'
    python3 benchmarks/interleaved.py --path packed-inorder --variants 'dpdk/dpdk;ours/ours;ours/dpdk;dpdk/ours'

Where the host has put the two CPUs matters as much as any code change: on this VM a cache line takes ~35-50 ns
to move between them in one placement and ~200-240 ns in the other, and the host switches every few seconds. So
before each slice, with every pair stopped, one line is bounced between the two CPUs for 20 ms
(rings.affinity.line_transfer_ns), and when the probes show two placements the table is printed again for the
rounds that ran wholly in each (near / far). How fast one instance of a pair runs also depends on where its memory
landed: --instances K starts K pairs per variant, all measured every round, and takes their mean per round.

Prints a table (median rate, median and quartiles of the per-round ratio to the first variant, net_vhost's
empty-dequeue share, dequeues per 32 packets and busy TSC cycles per packet, each instance's median rate) and,
with --json, every slice. Not a test: run it alone on the machine.

    python3 benchmarks/interleaved.py --path split-inorder --inject 256 --variants 'dpdk;ours' --instances 2
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rings.affinity import line_transfer_ns  # noqa: E402
from rings.errors import ConfigError, VringError  # noqa: E402
from rings.vhost_user import check_unix_path  # noqa: E402
from vring import dpdk  # noqa: E402
from vring.bench import placement_threshold  # noqa: E402

PATHS = ("split", "split-inorder", "packed", "packed-inorder")
STATS_INTERVAL = 0.05   # our backend's stats lines: several per slice
RING = 256              # both drivers' queue size
BUILT = ("rings/_virtq", "virtio/_net", "vhost/_net")   # the C modules a checkout must have built
# `vring` of the checkout _tree_env names: -P, or `python -m` puts the current directory (this checkout, when run
# from it) ahead of PYTHONPATH and an ours@TREE would run this checkout's code
PYTHON = (sys.executable, "-P", "-m", "vring.cli")
#: our driver's options this tool sets itself: a variant giving one would take the pair out of its hands
OWNED = ("--socket", "--server", "--reconnect", "--seconds", "--mode", "--count", "--pin", "--check", "--split",
         "--packed", "--in-order", "--no-in-order")


def _writable(path):
    """Can `path` be written as a file (checked before the run, not after it)?"""
    if os.path.isdir(path):
        return False
    d = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(d) and os.access(d, os.W_OK) and (not os.path.exists(path) or os.access(path, os.W_OK))


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_stopped(pids, timeout=2.0):
    """SIGSTOP takes effect when a thread next runs: until then it may still hold a CPU, and the line probe that
    follows would measure it. Wait (bounded) until every thread of every process is stopped, or gone."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            while time.monotonic() < deadline:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X"):
                            break
                except OSError:
                    break
                time.sleep(0.001)


def _stop(proc):
    """SIGINT, as Ctrl-C would, then SIGKILL after 10 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Failure(Exception):
    """A pair that could not start or stopped forwarding; the message says why."""


def _tree(spec):
    """'ours' -> this checkout; 'ours@TREE' -> TREE, which must be a checkout (vring/ and virtio/ built in it)."""
    if "@" not in spec:
        return REPO
    given = spec.split("@", 1)[1]
    if not given:
        raise Failure(f"{spec!r}: no tree after '@'")
    tree = os.path.abspath(given)
    if not (os.path.isdir(os.path.join(tree, "vring")) and os.path.isdir(os.path.join(tree, "virtio"))):
        raise Failure(f"{spec!r}: {tree} is not a checkout of this project (no vring/ and virtio/ in it)")
    # an unbuilt tree would import the C modules of whatever checkout is installed: the A/B would be void
    unbuilt = [m for m in BUILT if not glob.glob(os.path.join(tree, m + ".*.so"))]
    if unbuilt:
        raise Failure(f"{spec!r}: {tree} is not built (no {', '.join(unbuilt)}; "
                      f"`python3 setup.py build_ext --inplace` there)")
    return tree


def _tree_env(spec):
    """An environment importing the checkout `spec` names first, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_tree(spec), env.get("PYTHONPATH")) if p)
    return env


def _tail(path, lines=12):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


class OurDevice:
    """`vring vhost` with its stats lines going to a file; the rate from the last line at each end of a slice."""

    def __init__(self, spec, sock, workdir, cpus):
        self.out = os.path.join(workdir, os.path.basename(sock) + "-device.jsonl")
        self.err = os.path.join(workdir, os.path.basename(sock) + "-device.err")
        argv = [*PYTHON, "vhost", "--socket", sock, "--json", "--stats-interval",
                str(STATS_INTERVAL), "--pin", str(cpus[0]), "--max-connections", "1", "--fwd", "macswap",
                "--burst", "32"]
        with open(self.out, "w") as f, open(self.err, "w") as e:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=e, env=_tree_env(spec))
        self.pid = self.proc.pid
        try:  # whatever ends the wait (a signal included), the backend must not outlive us
            deadline = time.monotonic() + 30
            while not os.path.exists(sock):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise Failure(f"vring vhost did not listen on {sock}:\n{self.why()}")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    def why(self):
        rc = self.proc.poll()
        status = "" if rc is None else f"(exit status {rc})\n" if rc >= 0 else f"(killed by signal {-rc})\n"
        return status + (_tail(self.err) or _tail(self.out) or "(it printed nothing)")

    def count(self):
        """(rx packets, the backend's own time stamp) of its latest stats line, once a fresh one is out."""
        time.sleep(STATS_INTERVAL * 1.5)
        last = None
        with open(self.out) as f:
            for line in f:
                if line.startswith("{"):
                    last = line
        if last is None:
            raise Failure(f"vring vhost wrote no stats line:\n{self.why()}")
        d = json.loads(last)
        return d["rxq0"]["rx_packets"], d["time"]

    def clear(self):
        pass

    def dequeues(self):
        return None

    def alive(self):
        return self.proc.poll() is None

    def close(self):
        _stop(self.proc)


class DpdkDevice:
    """testpmd net_vhost, macswap, recording its burst sizes."""

    def __init__(self, sock, workdir, cpus):
        self.tp = dpdk.Testpmd.vhost(sock, burst=32, fwd="macswap", lcores=(cpus[1], cpus[0]),
                                     extra=["--record-burst-stats", "--record-core-cycles"],
                                     log_path=os.path.join(workdir, os.path.basename(sock) + "-device.log"))
        self.tp.start(60)
        self.pid = self.tp.pid

    def why(self):
        return "\n".join(self.tp.log.rstrip().splitlines()[-12:])

    def alive(self):
        return self.tp.running

    def count(self):
        s = self.tp.stats(0)
        return s.rx_packets, s.time

    def clear(self):
        self.tp.command("clear fwd stats all")

    def dequeues(self):
        """Since clear(): the share of its dequeues (RX bursts) that found nothing, dequeues per 32 packets, and
        its busy TSC cycles per packet (--record-core-cycles: the cycles of the forwarding calls that received
        something, over the packets; the device's own cost per packet, idle polls left out)."""
        out = self.tp.command("show fwd stats all")
        m = re.search(r"RX-bursts\s*:\s*(\d+)\s*\[([^\]]*)\]", out)
        rx = re.search(r"RX-packets:\s*(\d+)", out)
        if not m or not rx or not int(rx.group(1)):
            return None
        empty = re.search(r"(\d+)% of 0 pkts", m.group(2))
        cyc = re.search(r"CPU cycles/packet=([\d.]+)", out)
        return ((int(empty.group(1)) / 100 if empty else 0.0), int(m.group(1)) * 32 / int(rx.group(1)),
                float(cyc.group(1)) if cyc else float("nan"))

    def close(self):
        self.tp.close()


def _sides(variant, device):
    """'DRIVER [ARGS]' -> (DRIVER, device, ARGS); 'ours/dpdk [ARGS]' (vring bench's driver/device) -> its own."""
    head, *rest = variant.split()
    m = re.fullmatch(r"(dpdk|ours)/(dpdk|ours)", head)
    return (m.group(1), m.group(2), rest) if m else (head, device, rest)


def _driver_argv(args, sock, extra, check=False):
    """Our driver's command line for a variant's extra arguments (macfwd, as `vring bench` runs it); with ``check``,
    `vring driver --check`: the arguments and what the queues could carry, checked without connecting."""
    packed, in_order = args.path.startswith("packed"), args.path.endswith("inorder")
    return [*PYTHON, "driver", "--socket", sock, "--pin", str(args.cpus[1]),
            "--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
            # a variant may turn it off (argparse takes a prefix: --no-mrg)
            *(() if any(len(a) > 5 and "--no-mrg-rxbuf".startswith(a) for a in extra) else ("--mrg-rxbuf",)),
            "--burst", "32", "--ring-size", str(RING), "--pkt-size", "64",
            "--seconds", "86400",
            "--mode", "macfwd", "--count", str(args.inject), "--latency", *extra, *(("--check",) if check else ())]


def _longest_socket(args, nvariants):
    """A path as long as the longest socket path a pair will have (workdir from mkdtemp: the prefix and 8
    characters), for the checks; c<k>, not a pair's p<k>, so that nobody takes the check for a pair."""
    return os.path.join(tempfile.gettempdir(), "vring-interleaved-" + "x" * 8,
                        f"c{nvariants * args.instances - 1}.sock")


def _check_driver(variant, args, driver, extra, sock):
    """Failure, with our driver's own message, when it would refuse the variant's arguments: said before any pair
    starts, not at the first pair's start with every earlier pair left to stop."""
    env = _tree_env(driver)
    helps = subprocess.run([*PYTHON, "driver", "--help"], env=env, capture_output=True, text=True, timeout=120)
    if helps.returncode != 0:   # a tree whose driver does not even start
        raise Failure(f"variant {variant!r}: our driver does not start: {_last_line(helps)}")
    if "--check" not in helps.stdout:   # a tree from before --check: its refusals come at its pair's start
        return
    r = subprocess.run(_driver_argv(args, sock, [*extra, "--json"], check=True), env=env, capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        raise Failure(f"variant {variant!r}: our driver refuses it: {_last_line(r)}")
    try:   # exit 0 is not enough: `-h` among the arguments prints the help and exits 0 too
        checked = json.loads(r.stdout).get("checked") is True
    except (ValueError, AttributeError):
        checked = False
    if not checked:
        raise Failure(f"variant {variant!r}: our driver did not check it (it printed: "
                      f"{(r.stdout.strip().splitlines() or ['nothing'])[0]})")


def _last_line(r):
    why = (r.stderr.strip() or r.stdout.strip()).splitlines()
    return why[-1] if why else f"exit {r.returncode}"


class Pair:
    def __init__(self, variant):
        self.name = variant
        self.device = self.driver = self.driver_out = None
        self.pids, self.rates, self.dequeues, self.probes = [], [], [], []

    def start(self, k, args, workdir):
        variant = self.name
        sock = os.path.join(workdir, f"p{k}.sock")
        packed, in_order = args.path.startswith("packed"), args.path.endswith("inorder")
        driver, device, extra = _sides(variant, args.device)
        self.device = (DpdkDevice(sock, workdir, args.cpus) if device == "dpdk"
                       else OurDevice(device, sock, workdir, args.cpus))
        if driver == "dpdk":
            self.driver = dpdk.Testpmd.virtio_user(
                sock, packed=packed, in_order=in_order, mrg_rxbuf=not extra, queue_size=RING, burst=32, fwd="mac",
                tx_first=True, autostart=False, lcores=(args.cpus[0], args.cpus[1]), extra=["--txpkts=64"],
                log_path=os.path.join(workdir, f"p{k}-driver.log"))
            self.driver.start(60)
            bursts = max(1, args.inject // 32)
            self.driver.command(f"start tx_first {bursts}" if bursts > 1 else "start tx_first")
            self.driver_pid = self.driver.pid
        else:
            argv = _driver_argv(args, sock, extra)
            self.driver_out = os.path.join(workdir, f"p{k}-driver.out")
            with open(self.driver_out, "w") as f:
                self.driver = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=_tree_env(driver))
            self.driver_pid = self.driver.pid
        self.pids = [self.device.pid, self.driver_pid]

    def _driver_gone(self):
        """What the driver printed last, if it exited (None while it runs)."""
        if isinstance(self.driver, subprocess.Popen):
            if self.driver.poll() is not None:
                return f"the driver exited ({self.driver.returncode}):\n{_tail(self.driver_out)}"
        elif not self.driver.running:
            return (f"testpmd virtio_user exited (status {self.driver.returncode}):\n"
                    + "\n".join(self.driver.log.splitlines()[-12:]))
        return None

    def check(self):
        """Raise, with the tail of what the dead one printed, if the device or the driver exited. Both, when both
        did: a driver whose device died exits too (PeerGone), and a device that serves one connection exits when
        its driver did (a --pcap path the driver could not write); each one's words say which was first."""
        driver = self._driver_gone()
        if not self.device.alive():
            if driver is None and isinstance(self.driver, subprocess.Popen):
                try:   # a driver that failed may close its socket (the device then exits) before it is gone
                    self.driver.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                driver = self._driver_gone()
            if driver:   # which went first is in their words: PeerGone, or the device's "frontend gone"
                raise Failure(f"{self.name}: both sides exited.\n{self.name}: {driver}\n{self.name}: the device "
                              f"exited:\n{self.device.why()}")
            raise Failure(f"{self.name}: the device exited:\n{self.device.why()}")
        if driver:
            raise Failure(f"{self.name}: {driver}")

    def slice(self, seconds, cpus, keep=True):
        """Run the pair for `seconds`; its rate and net_vhost's dequeue counts over that time.  Those counts are
        per slice, read while both sides run: a device running alone, or while a command to one testpmd takes the
        CPU the other's loop runs on, finds nothing for milliseconds, and a cumulative count would keep that."""
        probe = None
        if keep and cpus[0] != cpus[1]:   # every pair stopped: both CPUs free
            try:
                probe = line_transfer_ns(*cpus)
            except VringError as e:   # it only labels the slice: a busy moment must not cost the run
                print(f"interleaved: no line probe before {self.name}'s slice: {e}", file=sys.stderr)
        _signal(self.pids, signal.SIGCONT)
        self.device.clear()
        n0, t0 = self.device.count()
        time.sleep(seconds)
        n1, t1 = self.device.count()
        if n1 <= n0:  # a loop that lost its packets, or a machine too busy to run it: look once more, longer
            time.sleep(2.0)
            n1, t1 = self.device.count()
        d = self.device.dequeues()
        _signal(self.pids, signal.SIGSTOP)
        _wait_stopped(self.pids)
        self.check()
        if n1 <= n0:  # no rate to compare (and none to divide by)
            raise Failure(f"{self.name}: the device received nothing in {seconds + 2} s")
        if keep:
            self.dequeues.append(d)
            self.probes.append(probe)
            self.rates.append((n1 - n0) / (t1 - t0))

    def close(self):
        """Continue, then stop both sides; the device even if stopping the driver failed."""
        _signal(self.pids, signal.SIGCONT)
        try:
            if isinstance(self.driver, subprocess.Popen):
                _stop(self.driver)
            elif self.driver is not None:
                self.driver.close()
        finally:
            if self.device is not None:
                self.device.close()


def summary(pairs, rounds=None):
    """Per variant (name -> dict): its rate in each round (the mean over its instances), the median and quartiles
    (inclusive) of its per-round ratios to the first variant's rate in the same round, each instance's median
    rate, and the medians over slices of net_vhost's empty-dequeue share, dequeues per 32 packets and busy cycles
    per packet (None with our device). ``rounds``: only those (indices), e.g. the rounds of one placement."""
    groups = {}
    for pair in pairs:
        groups.setdefault(pair.name, []).append(pair)
    keep = range(len(pairs[0].rates)) if rounds is None else rounds
    per_round = {name: [statistics.fmean(group[k].rates[r] for k in range(len(group))) for r in keep]
                 for name, group in groups.items()}
    base, out = per_round[pairs[0].name], {}
    for name, group in groups.items():
        rates = per_round[name]
        ratios = [x / y for x, y in zip(rates, base)]
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        slices = [p.dequeues[r] for p in group for r in keep if p.dequeues[r] is not None]
        e = [statistics.median(x) for x in zip(*slices)] if slices else None
        out[name] = {"rates": rates, "ratio_median": statistics.median(ratios),
                     "ratio_q1": q[0], "ratio_q3": q[2],
                     "instance_rates": [statistics.median(p.rates[r] for r in keep) for p in group],
                     "instance_slices": [[p.rates[r] for r in keep] for p in group],   # every slice (--json)
                     "empty_dequeue_share": None if e is None else e[0],
                     "dequeues_per_32": None if e is None else e[1],
                     "device_cycles_per_packet": None if e is None else e[2],
                     "dequeues_per_slice": slices}
    return out


def run_order(pairs, r):
    """The pairs in the order loop round r runs them: every other round reversed, so that none always goes first.
    Kept round i (the rates' and probes' index) is loop round i + 1: round 0 is not counted."""
    return pairs if r % 2 == 0 else pairs[::-1]


def by_placement(pairs):
    """The rounds split by where the host had put the two CPUs (line_transfer_ns before each slice): {"threshold_ns",
    "probes_ns" (in the order they were taken), "near": [round indices], "far": [...], "mixed": [...]}. A mixed
    round's slices saw both, or one had no probe (None: its CPUs were not free). The lists are empty and the
    threshold None when the probes show one placement only."""
    probes = [p.probes[r] for r in range(len(pairs[0].rates)) for p in run_order(pairs, r + 1)]   # in time order
    t = placement_threshold(probes)   # None: one placement, or no probes (one CPU for both sides)
    out = {"threshold_ns": t, "probes_ns": probes, "near": [], "far": [], "mixed": []}
    if t is not None:
        for r in range(len(pairs[0].rates)):
            near = {None if p.probes[r] is None else p.probes[r] < t for p in pairs}   # None: not probed
            out["near" if near == {True} else "far" if near == {False} else "mixed"].append(r)
    return out


def print_table(variants, instances, w, base):
    print(f"{'driver':{w}} {'Mpps':>6} {'vs ' + base:>14} {'q1':>6} {'q3':>6} {'empty deq':>10} {'deq/32':>7} "
          f"{'dev cyc/pkt':>11}" + ("  instances, Mpps" if instances > 1 else ""))
    for name, v in variants.items():
        e, d, c = v["empty_dequeue_share"], v["dequeues_per_32"], v["device_cycles_per_packet"]
        print(f"{name:{w}} {statistics.median(v['rates']) / 1e6:6.2f} {v['ratio_median']:14.3f} "
              f"{v['ratio_q1']:6.3f} {v['ratio_q3']:6.3f} {'' if e is None else f'{e:.0%}':>10} "
              f"{'' if d is None else f'{d:.2f}':>7} {'' if c is None else f'{c:.0f}':>11}"
              + ("  " + " ".join(f"{r / 1e6:.2f}" for r in v["instance_rates"]) if instances > 1 else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=PATHS, default="packed")
    ap.add_argument("--variants", default="dpdk;ours",
                    help="';'-separated drivers, or DRIVER/DEVICE pairs as vring bench names them (default: dpdk;ours)")
    ap.add_argument("--device", default="dpdk", help="dpdk, ours or ours@TREE: the device of a variant that names "
                                                     "none (default dpdk)")
    ap.add_argument("--inject", type=int, default=32, help="packets in the loop (DPDK: whole bursts of 32)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--slice", type=float, default=0.4, help="seconds each pair runs per round")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds each pair runs alone after it starts")
    ap.add_argument("--cpus", default="0,1", help="DEVICE,DRIVER (default 0,1)")
    ap.add_argument("--instances", type=int, default=1,
                    help="pairs started per variant, each measured every round; a variant's rate in a round is the "
                         "mean over its instances (how fast one instance runs depends on where its memory landed)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if args.device != "dpdk" and args.device.split("@")[0] != "ours":
        ap.error("--device: dpdk, ours or ours@TREE")
    allowed = sorted(os.sched_getaffinity(0))
    try:
        args.cpus = [int(c) for c in args.cpus.split(",")]
        if len(args.cpus) != 2:
            raise ValueError
    except ValueError:
        ap.error("--cpus: DEVICE,DRIVER")
    if not set(args.cpus) <= set(allowed):
        ap.error(f"--cpus {args.cpus[0]},{args.cpus[1]}: this process may run on CPUs {allowed} only")
    if not 1 <= args.instances <= 8:
        ap.error("--instances: 1 to 8")
    if args.rounds < 1 or args.inject < 1 or not 0 < args.slice <= 3600 or not 0 <= args.warmup <= 3600:
        ap.error("--rounds and --inject must be positive, --slice 0 < S <= 3600, --warmup 0 <= S <= 3600")
    if args.inject > RING:
        ap.error(f"--inject {args.inject}: at most {RING} (both drivers' rings hold {RING})")
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if not variants:
        ap.error("--variants: no variant")
    twice = sorted({v for v in variants if variants.count(v) > 1})
    if twice:
        ap.error(f"--variants: {', '.join(map(repr, twice))} more than once (the results are keyed by variant)")
    if args.json and not _writable(args.json):
        ap.error(f"--json {args.json}: cannot write there")
    sock = _longest_socket(args, len(variants))
    try:   # the tool's own paths, not a variant's fault
        check_unix_path(sock)
    except ConfigError as e:
        ap.error(f"the pairs' sockets under TMPDIR {tempfile.gettempdir()} would be too long ({e}); "
                 f"set a shorter TMPDIR")
    try:  # every variant checked before anything starts
        sides = [_sides(v, args.device) for v in variants]
        for v, (driver, device, extra) in zip(variants, sides):
            if driver == "dpdk" and extra not in ([], ["--no-mrg-rxbuf"]):
                raise Failure(f"variant {v!r}: DPDK's driver takes --no-mrg-rxbuf only (virtio_user mrg_rxbuf=0); "
                              f"other arguments are for our driver")
            if driver != "dpdk" and driver.split("@")[0] != "ours":
                raise Failure(f"variant {v!r}: dpdk, ours, ours@TREE or DRIVER/DEVICE, then our driver's arguments")
            for a in extra:
                name = a.split("=", 1)[0]
                owned = [o for o in OWNED if len(name) > 2 and o.startswith(name)] if a.startswith("--") else []
                if owned:
                    raise Failure(f"variant {v!r}: {a} names {' or '.join(owned)}, which this tool sets itself ("
                                  f"{', '.join(OWNED)})")
            for side in (driver, device):
                if side != "dpdk":
                    _tree(side)
            if driver != "dpdk":
                _check_driver(v, args, driver, extra, sock)
    except Failure as e:
        ap.error(str(e))
    if any("dpdk" in s[:2] for s in sides) and dpdk.skip_reason():
        ap.error(dpdk.skip_reason())
    if any(s[0] == "dpdk" for s in sides) and args.inject % 32:
        ap.error(f"--inject {args.inject}: DPDK's driver injects whole bursts of 32 (start tx_first N)")

    # SIGTERM ends the run as Ctrl-C does: through the clean-up below (no stopped testpmd left behind)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # and so does SIGINT, even when this process was started with it ignored (a CI run in the background: Python
    # then keeps it ignored, and a SIGINT left every pair running until killed)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    workdir = tempfile.mkdtemp(prefix="vring-interleaved-")
    pairs = []
    try:
        at = None   # the pair a testpmd error comes from
        for k, v in enumerate(v for _ in range(args.instances) for v in variants):
            pair = at = Pair(v)
            pairs.append(pair)
            pair.start(k, args, workdir)
            time.sleep(args.warmup)
            pair.check()
            _signal(pair.pids, signal.SIGSTOP)
            _wait_stopped(pair.pids)
        # round 0 is not counted: a pair continued for the first time after its warm-up ran far below its rate
        # (attack54: 0.03-0.4 Mpps against 2-4.6 in later rounds with --warmup 0.2)
        for r in range(args.rounds + 1):
            for pair in run_order(pairs, r):
                at = pair
                pair.slice(args.slice, args.cpus, keep=r > 0)
    except Failure as e:
        sys.exit(f"interleaved: {e}")
    except dpdk.TestpmdError as e:
        sys.exit(f"interleaved: {at.name if at else ''}: {e}")
    except KeyboardInterrupt:
        sys.exit("interleaved: interrupted")
    finally:
        # a second Ctrl-C or SIGTERM must not leave pairs stopped: continue them all first, ignore both meanwhile
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for pair in pairs:
            _signal(pair.pids, signal.SIGCONT)
        for pair in pairs:
            try:
                pair.close()
            except Exception as e:  # noqa: BLE001 - the others still get closed
                print(f"interleaved: closing {pair.name}: {e}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)

    each = f", {args.instances} instances of each variant" if args.instances > 1 else ""
    print(f"{args.path}, {args.inject} in flight, device {args.device} unless the variant names one: {args.rounds} "
          f"rounds of {args.slice} s slices{each}")
    w = max(34, *(len(p.name) + 1 for p in pairs))
    out = {"config": vars(args), "variants": summary(pairs)}
    print_table(out["variants"], args.instances, w, pairs[0].name)
    split = out["placement"] = by_placement(pairs)
    t = split["threshold_ns"]
    labelled = [x for x in split["probes_ns"] if x is not None]
    if labelled:
        print(f"\none cache line CPU {args.cpus[0]} -> CPU {args.cpus[1]}, before each slice: median "
              f"{statistics.median(labelled):.0f} ns, " + (
                  "one placement" if t is None else
                  f"two placements: near (< {t:.0f} ns) in {len(split['near'])} rounds, far in {len(split['far'])}, "
                  f"both in {len(split['mixed'])}")
              + (f" ({len(split['probes_ns']) - len(labelled)} slices unlabelled: a CPU was not free)"
                 if len(labelled) < len(split["probes_ns"]) else ""))
    for where in ("near", "far"):
        if split[where]:
            out[where] = summary(pairs, split[where])
            print(f"\n{where} rounds only ({len(split[where])}):")
            print_table(out[where], args.instances, w, pairs[0].name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
