"""Rates measured side by side on a machine whose speed changes from one second to the next.

Several driver/device pairs are alive at once, on the same two CPUs, and run in turn: all but one are stopped
(SIGSTOP), the running one is measured for a short slice (--slice, 0.4 s) and stopped, the next one continued
(SIGCONT). Every round measures each pair once, in alternating order, so the rates compared were measured within
a second or so of each other; the per-round ratios to the first variant cancel the machine's slow drifts. That is
what `vring bench --repeat` cannot do: there each point starts its processes anew, seconds apart, and on this
2-vCPU VM the speed swings 2x between regimes (see vring.bench.speed_regimes).

A variant is the driver side: ``dpdk`` (testpmd virtio_user, mac forwarding, ``start tx_first``) or ``ours``
(``vring driver --mode macfwd --latency``, as `vring bench` runs it), followed by extra arguments for our driver;
``ours@TREE`` runs the driver of another checkout (PYTHONPATH=TREE: an A/B of a code change). The device side is the
same for all pairs: ``--device dpdk`` (testpmd net_vhost, macswap, with --record-burst-stats: its dequeues that
found nothing are reported per variant) or ``ours`` / ``ours@TREE`` (`vring vhost --fwd macswap`). The rate is the
device's: RX packets of the net_vhost port, or rx_packets of our backend's --stats-interval lines, over the slice.

    python3 benchmarks/interleaved.py --path packed --inject 32 --variants 'dpdk;ours;ours --tx-publish 8'
    python3 benchmarks/interleaved.py --device ours --path split --variants 'ours;ours@/tmp/other-checkout'

Prints a table (median rate, median and quartiles of the per-round ratio to the first variant) and, with --json,
every slice. Not a test: run it alone on the machine.
"""
import argparse
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vring import dpdk  # noqa: E402

PATHS = ("split", "split-inorder", "packed", "packed-inorder")
STATS_INTERVAL = 0.05   # our backend's stats lines: several per slice


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(proc):
    """SIGINT, as Ctrl-C would, then SIGKILL after 10 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tree_env(spec):
    """'ours@TREE' -> an environment importing that checkout first; 'ours' -> this one's."""
    env = dict(os.environ)
    if "@" in spec:
        env["PYTHONPATH"] = spec.split("@", 1)[1]
    return env


class OurDevice:
    """`vring vhost` with its stats lines going to a file; the rate from the last line at each end of a slice."""

    def __init__(self, spec, sock, workdir, cpus):
        self.out = os.path.join(workdir, os.path.basename(sock) + "-device.jsonl")
        argv = [sys.executable, "-m", "vring.cli", "vhost", "--socket", sock, "--json", "--stats-interval",
                str(STATS_INTERVAL), "--pin", str(cpus[0]), "--max-connections", "1", "--fwd", "macswap",
                "--burst", "32"]
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.DEVNULL, env=_tree_env(spec))
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vring vhost did not listen on {sock}")
            time.sleep(0.05)

    def count(self):
        """(rx packets, the backend's own time stamp) of its latest stats line, once a fresh one is out."""
        time.sleep(STATS_INTERVAL * 1.5)
        last = None
        with open(self.out) as f:
            for line in f:
                if line.startswith("{"):
                    last = line
        if last is None:
            raise SystemExit("vring vhost wrote no stats line")
        d = json.loads(last)
        return d["rxq0"]["rx_packets"], d["time"]

    def empty_dequeues(self):
        return None

    def close(self):
        _stop(self.proc)


class DpdkDevice:
    """testpmd net_vhost, macswap, recording its burst sizes."""

    def __init__(self, sock, workdir, cpus):
        self.tp = dpdk.Testpmd.vhost(sock, burst=32, fwd="macswap", lcores=(cpus[1], cpus[0]),
                                     extra=["--record-burst-stats"],
                                     log_path=os.path.join(workdir, os.path.basename(sock) + "-device.log"))
        self.tp.start(60)
        self.pid = self.tp.pid

    def count(self):
        s = self.tp.stats(0)
        return s.rx_packets, s.time

    def clear(self):
        self.tp.command("clear fwd stats all")

    def empty_dequeues(self):
        """The share of its dequeues (RX bursts) that found nothing, and dequeues per 32 packets."""
        out = self.tp.command("show fwd stats all")
        m = re.search(r"RX-bursts\s*:\s*(\d+)\s*\[([^\]]*)\]", out)
        rx = re.search(r"RX-packets:\s*(\d+)", out)
        if not m or not rx or not int(rx.group(1)):
            return None
        empty = re.search(r"(\d+)% of 0 pkts", m.group(2))
        return (int(empty.group(1)) / 100 if empty else 0.0), int(m.group(1)) * 32 / int(rx.group(1))

    def close(self):
        self.tp.close()


class Pair:
    def __init__(self, variant):
        self.name = variant
        self.device = self.driver = None
        self.pids, self.rates, self.packets = [], [], 0

    def start(self, k, args, workdir):
        variant = self.name
        sock = os.path.join(workdir, f"p{k}.sock")
        packed, in_order = args.path.startswith("packed"), args.path.endswith("inorder")
        self.device = (DpdkDevice(sock, workdir, args.cpus) if args.device == "dpdk"
                       else OurDevice(args.device, sock, workdir, args.cpus))
        words = variant.split()
        if words[0] == "dpdk":
            if len(words) > 1:
                raise SystemExit(f"variant {variant!r}: extra arguments are for our driver only")
            self.driver = dpdk.Testpmd.virtio_user(
                sock, packed=packed, in_order=in_order, mrg_rxbuf=True, queue_size=256, burst=32, fwd="mac",
                tx_first=True, autostart=False, lcores=(args.cpus[0], args.cpus[1]), extra=["--txpkts=64"],
                log_path=os.path.join(workdir, f"p{k}-driver.log"))
            self.driver.start(60)
            bursts = max(1, args.inject // 32)
            self.driver.command(f"start tx_first {bursts}" if bursts > 1 else "start tx_first")
            self.driver_pid = self.driver.pid
        elif words[0].split("@")[0] == "ours":
            argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", sock, "--pin", str(args.cpus[1]),
                    "--packed" if packed else "--split", "--in-order" if in_order else "--no-in-order",
                    "--mrg-rxbuf", "--burst", "32", "--ring-size", "256", "--pkt-size", "64", "--seconds", "86400",
                    "--mode", "macfwd", "--count", str(args.inject), "--latency", *words[1:]]
            with open(os.path.join(workdir, f"p{k}-driver.out"), "w") as f:
                self.driver = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=_tree_env(words[0]))
            self.driver_pid = self.driver.pid
        else:
            raise SystemExit(f"variant {variant!r}: dpdk, ours or ours@TREE, then our driver's arguments")
        self.pids = [self.device.pid, self.driver_pid]

    def alive(self):
        if isinstance(self.driver, subprocess.Popen):
            return self.driver.poll() is None
        return self.driver.running

    def slice(self, seconds, first):
        _signal(self.pids, signal.SIGCONT)
        if first and isinstance(self.device, DpdkDevice):
            self.device.clear()
        n0, t0 = self.device.count()
        time.sleep(seconds)
        n1, t1 = self.device.count()
        _signal(self.pids, signal.SIGSTOP)
        if not self.alive():
            raise SystemExit(f"{self.name}: the driver exited")
        self.rates.append((n1 - n0) / (t1 - t0))
        self.packets += n1 - n0

    def close(self):
        _signal(self.pids, signal.SIGCONT)
        if self.driver is None:
            pass
        elif isinstance(self.driver, subprocess.Popen):
            _stop(self.driver)
        else:
            self.driver.close()
        if self.device is not None:
            self.device.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=PATHS, default="packed")
    ap.add_argument("--variants", default="dpdk;ours", help="';'-separated drivers (default: dpdk;ours)")
    ap.add_argument("--device", default="dpdk", help="dpdk, ours or ours@TREE (default dpdk)")
    ap.add_argument("--inject", type=int, default=32, help="packets in the loop (DPDK: whole bursts of 32)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--slice", type=float, default=0.4, help="seconds each pair runs per round")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds each pair runs alone after it starts")
    ap.add_argument("--cpus", default="0,1", help="DEVICE,DRIVER (default 0,1)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if args.device != "dpdk" and args.device.split("@")[0] != "ours":
        ap.error("--device: dpdk, ours or ours@TREE")
    try:
        args.cpus = [int(c) for c in args.cpus.split(",")]
        if len(args.cpus) != 2:
            raise ValueError
    except ValueError:
        ap.error("--cpus: DEVICE,DRIVER")
    if args.rounds < 1 or args.slice <= 0 or args.inject < 1:
        ap.error("--rounds, --slice and --inject must be positive")
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if not variants or ("dpdk" in variants or args.device == "dpdk") and dpdk.skip_reason():
        ap.error(dpdk.skip_reason() or "no variant")

    workdir = tempfile.mkdtemp(prefix="vring-interleaved-")
    pairs = []
    try:
        for k, v in enumerate(variants):
            pair = Pair(v)
            pairs.append(pair)
            pair.start(k, args, workdir)
            time.sleep(args.warmup)
            _signal(pair.pids, signal.SIGSTOP)
        for r in range(args.rounds):
            for pair in (pairs if r % 2 == 0 else pairs[::-1]):
                pair.slice(args.slice, r == 0)
        empties = {}
        for pair in pairs:
            _signal([pair.device.pid], signal.SIGCONT)
            empties[pair.name] = pair.device.empty_dequeues()
            _signal([pair.device.pid], signal.SIGSTOP)
    finally:
        for pair in pairs:
            pair.close()
        shutil.rmtree(workdir, ignore_errors=True)

    base = pairs[0]
    print(f"{args.path}, {args.inject} in flight, device {args.device}: {args.rounds} rounds of {args.slice} s slices")
    print(f"{'driver':34} {'Mpps':>6} {'vs ' + base.name:>14} {'q1':>6} {'q3':>6} {'empty deq':>10} {'deq/32':>7}")
    out = {"config": vars(args), "variants": {}}
    for pair in pairs:
        ratios = [x / y for x, y in zip(pair.rates, base.rates)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        e = empties[pair.name]
        print(f"{pair.name:34} {statistics.median(pair.rates) / 1e6:6.2f} {statistics.median(ratios):14.3f} "
              f"{q[0]:6.3f} {q[2]:6.3f} {'' if e is None else f'{e[0]:.0%}':>10} "
              f"{'' if e is None else f'{e[1]:.2f}':>7}")
        out["variants"][pair.name] = {"rates": pair.rates, "ratio_median": statistics.median(ratios),
                                      "ratio_q1": q[0], "ratio_q3": q[2],
                                      "empty_dequeue_share": None if e is None else e[0],
                                      "dequeues_per_32": None if e is None else e[1]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
