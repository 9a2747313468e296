"""Packets/s of `vring driver --mode macfwd` against DPDK net_vhost, and of DPDK's own virtio_user against the
same net_vhost, in one run.

Four paths (split/packed x normal/in-order), 64-byte frames, burst 32, mergeable Rx buffers on (virtio_user's
default). net_vhost (testpmd ``--forward-mode=mac``) forwards on CPU 0; the driver side (ours, or virtio_user's
testpmd) forwards on CPU 1 and primes the loop with one burst (``--count 32`` / ``start tx_first``; more with
``--tx-first-bursts N``). Both are
measured the same way, at the net_vhost port: its RX-packets counter sampled every PERIOD seconds, the first
WARMUP samples dropped, the median of the rest reported. With ``--rounds N`` each path is measured N times
(alternating ours / DPDK) and the median of the per-round medians is reported. On a machine that runs at two
speeds (vring.bench.speed_regimes), each driver's 1-second samples over all rounds are split into its slow and fast
regime, and the two drivers are compared within each (``regimes``): many short rounds (``--rounds 8 --seconds 4``)
catch both.

Which side limits the loop: net_vhost runs with ``--record-burst-stats``; its forwarding statistics are cleared after
the warm-up, and the share of its polls that found nothing (``net_vhost_bursts``: RX = dequeues from the driver's Tx
ring, TX = enqueues into its Rx ring) is reported per driver. A device that rarely polls empty is the bottleneck; the
same share of empty polls with both drivers and fewer packets with ours means more device time per packet. It is a
share of polls, not of time: an empty poll costs far less than a full burst. The two drivers run one after the other,
so on a machine whose speed changes between runs compare them with `vring bench --pairs ours/dpdk,dpdk/dpdk`.

Where net_vhost's time goes (``--perf``): ``perf record -e cpu-clock`` on its forwarding CPU over each measurement
(a software clock: no PMU is needed, so it works in a VM; only net_vhost's samples are counted, and
``other_processes_share`` says how much of the CPU went to other processes), reported per driver as the share of
samples and the nanoseconds per forwarded packet in each shared object (the core's time over the packets it
forwarded: a cost per packet only while net_vhost is saturated, i.e. few empty dequeues; otherwise it includes
its empty polling), and the hottest instructions (Debian's DPDK has no symbols for its static functions: those show as addresses;
``objdump -d`` of the library shows them, and ``readelf --debug-dump=frames`` its functions' bounds). ``--perf-keep
DIR`` keeps each window's perf.data there (``PATH-ours-HHMMSS.data``, ``PATH-dpdk-...``) for ``perf report`` /
``perf annotate``.

    python benchmarks/driver_vs_dpdk.py [--seconds 8] [--period 1] [--warmup 2] [--rounds 1] [--paths split,packed]
    python benchmarks/driver_vs_dpdk.py --paths split --driver-arg=--tx-hdr=chain    # our header in its own descriptor
    python benchmarks/driver_vs_dpdk.py --rounds 2 --tx-first-bursts 8 --perf         # net_vhost's profile per driver
    python benchmarks/driver_vs_dpdk.py --paths packed --tx-first-bursts 8 --perf --perf-keep /tmp/pk

Prints one JSON document. Not a test.
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
from vring.bench import by_regime, speed_regimes  # noqa: E402

PATHS = {"split": (False, False), "split-inorder": (False, True), "packed": (True, False),
         "packed-inorder": (True, True)}


def parse_bursts(text):
    """testpmd's `show fwd stats all` burst lines (--record-burst-stats) -> {"RX": {...}, "TX": {...}}: the polls
    counted, and the share of them per burst size ("0": found nothing). Sizes testpmd folds into "other" are left
    out, so the shares may sum to less than 1."""
    out = {}
    for m in re.finditer(r"(RX|TX)-bursts\s*:\s*(\d+)\s*\[([^\]]*)\]", text):
        sizes = {n: int(pct) / 100 for pct, n in re.findall(r"(\d+)% of (\d+) pkts", m.group(3))}
        out[m.group(1)] = {"polls": int(m.group(2)), "share_by_size": sizes}
    return out


def device_bursts(tp, warmup_s):
    """After warmup_s seconds: clear net_vhost's forwarding statistics (so that the polls made while it waited for the
    driver do not count) and return a function reading them."""
    time.sleep(warmup_s)
    tp.command("clear fwd stats all")
    return lambda: parse_bursts(tp.command("show fwd stats all"))


def _writable_dir(d):
    """Can a file be created in directory `d`? (tried, not guessed from its mode: root passes every mode check)"""
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".perf-keep-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def perf_skip_reason():
    """Why --perf cannot run here ('' when it can): perf missing, or not allowed to sample a CPU."""
    if shutil.which("perf") is None:
        return "--perf needs perf (apt-get install -y linux-perf)"
    with tempfile.TemporaryDirectory(prefix="vring-perf-") as tmp:
        p = subprocess.run(["perf", "record", "-q", "-C", "0", "-e", "cpu-clock", "-o", os.path.join(tmp, "probe"),
                            "--", "true"], capture_output=True, text=True)
    return f"--perf: perf cannot sample CPU 0: {p.stderr.strip()[-300:]}" if p.returncode else ""


class DeviceProfile:
    """cpu-clock samples of net_vhost's forwarding CPU (``perf record -C``) while one driver is measured."""

    def __init__(self, cpu, seconds, tmp, keep=None, name="perf", pid=None):
        self.pid = pid   # net_vhost's testpmd: the report counts its samples only
        self.keep = keep and os.path.join(keep, f"{name}-{time.strftime('%H%M%S')}.data")
        self.path = os.path.join(tmp, f"perf-{time.monotonic_ns()}.data")
        self.proc = subprocess.Popen(["perf", "record", "-q", "-C", str(cpu), "-e", "cpu-clock", "-F", "4999",
                                      "-o", self.path, "--", "sleep", str(seconds)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def close(self):
        """Stop perf if the window ended early; remove its data file, or move it into --perf-keep (an early end
        is named -cut: its samples do not cover the window). A directory that can no longer be written is a
        warning, not the end of the run: the data is removed, the figures go on."""
        cut = self.proc.poll() is None
        if cut:
            self.proc.terminate()
            self.proc.communicate()
        if not os.path.exists(self.path):
            return
        if self.keep:
            stem, n = self.keep.removesuffix(".data") + ("-cut" if cut else ""), 1
            dest = stem + ".data"
            while os.path.exists(dest):   # two windows in one second (--seconds < 1, --rounds)
                n += 1
                dest = f"{stem}-{n}.data"
            try:
                shutil.move(self.path, dest)
                return
            except OSError as e:
                print(f"driver_vs_dpdk: --perf-keep: {dest}: {e.strerror or e}; not kept", file=sys.stderr)
        os.unlink(self.path)

    def report(self, pps, top=8):
        """Shares by shared object and the `top` hottest instructions; ns per packet from the measured rate."""
        _, err = self.proc.communicate()
        if self.proc.returncode:
            raise RuntimeError(f"perf record failed: {err.strip()[-300:]}")
        ns = 1e9 / pps if pps > 0 else None   # nothing forwarded in the window: no per-packet figure (JSON null)

        def rows(sort):
            # shares of all the CPU's samples (absolute), of net_vhost's process only: another process on that
            # CPU is not net_vhost's time (attack54: 24% of the samples were two unrelated python3 processes)
            only = ["--pid", str(self.pid), "--percentage", "absolute"] if self.pid else []
            out = subprocess.run(["perf", "report", "-i", self.path, "--stdio", "-q", "-n", "-t", ";", *only,
                                  "--sort", sort], capture_output=True, text=True, check=True).stdout
            return [[f.strip() for f in line.split(";")] for line in out.splitlines() if line.count(";") >= 2]

        by_dso = [{"dso": r[2], "share": float(r[0].rstrip("%")) / 100, "samples": int(r[1])} for r in rows("dso")]
        for d in by_dso:
            d["ns_per_packet"] = None if ns is None else round(d["share"] * ns, 2)
        hot = [{"dso": r[2], "where": r[3].removeprefix("[.] "), "share": float(r[0].rstrip("%")) / 100}
               for r in rows("dso,sym")[:top]]
        return {"samples": sum(d["samples"] for d in by_dso), "device_ns_per_packet": ns and round(ns, 2),
                "other_processes_share": round(max(0.0, 1 - sum(d["share"] for d in by_dso)), 4),
                "by_dso": by_dso, "hottest": hot}


def sample(tp, seconds, period, warmup, alive=lambda: True):
    """Median of RX-packets deltas of net_vhost's port 0 (our clock) and of testpmd's own Rx-pps."""
    tps, own = tp.sample_rx(max(1, round(seconds / period)) + warmup, period, alive=alive)
    kept, tkept = own[warmup:] or own, tps[warmup:] or tps
    return {"median_pps": round(statistics.median(kept)) if kept else 0,
            "testpmd_median_rx_pps": round(statistics.median(tkept)) if tkept else 0,
            "samples": [round(x) for x in kept]}


def measure_window(tp, args, name, alive=lambda: True):
    """After the warm-up: net_vhost's rate samples, its burst statistics and (--perf) its profile, over one window."""
    bursts = device_bursts(tp, args.warmup * args.period)
    prof = DeviceProfile(tp.fwd_cpu, args.seconds, os.path.dirname(tp.socket_path), args.perf_keep,
                         name, tp.pid) if args.perf else None
    try:
        r = sample(tp, args.seconds, args.period, 0, alive=alive)
        r["net_vhost_bursts"] = bursts()
        if prof:
            r["net_vhost_profile"] = prof.report(statistics.mean(r["samples"]) if r["samples"] else 0)
    finally:
        if prof:
            prof.close()
    return r


def measure_ours(tp, path, packed, in_order, args):
    total = (args.warmup + round(args.seconds / args.period)) * args.period + 2
    argv = [sys.executable, "-m", "vring.cli", "driver", "--socket", tp.socket_path, "--json",
            "--split" if not packed else "--packed", "--in-order" if in_order else "--no-in-order",
            "--mrg-rxbuf", "--mode", "macfwd", "--count", str(args.burst * args.tx_first_bursts),
            "--burst", str(args.burst),
            "--pkt-size", "64", "--seconds", str(total), "--pin", "1", *args.driver_arg]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tp.wait_link_up(timeout=30)
        r = measure_window(tp, args, f"{path}-ours", alive=lambda: proc.poll() is None)
        out, err = proc.communicate(timeout=total + 30)
        if proc.returncode:
            raise RuntimeError(f"vring driver failed (status {proc.returncode}): {err.strip()[-1000:]}")
        res = json.loads(out)
        r["driver_avg_rx_pps"] = res["rx_pps"]
        r["driver_counters"] = {"rx": res["rx"]["packets"], "tx": res["tx"]["packets"],
                                "kicks": res["tx"]["kicks"], "cleanups": res["tx"]["cleanups"]}
        return r
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def measure_dpdk(tp, path, packed, in_order, args):
    v = dpdk.Testpmd.virtio_user(tp.socket_path, packed=packed, in_order=in_order, mrg_rxbuf=True, fwd="mac",
                                 burst=args.burst, tx_first=True, lcores=(0, 1), autostart=False)
    try:
        v.start(60)
        tp.wait_link_up(timeout=30)
        if args.tx_first_bursts == 1:
            v.start_forwarding()
        else:
            out = v.command(f"start tx_first {args.tx_first_bursts}")
            if "forwarding" not in out:
                raise RuntimeError(f"testpmd did not start: {out[-300:]}")
        return measure_window(tp, args, f"{path}-dpdk")
    finally:
        v.close()


def regimes(rounds):
    """Each driver's samples over all rounds, split into its own slow and fast regime when it shows two: the
    median in each, and ours / DPDK's within each regime where both split."""
    out = {}
    for who in ("vring_driver", "dpdk_virtio_user"):
        xs = [x for r in rounds for x in r[who]["samples"]]
        t = speed_regimes(xs)
        out[who] = None if t is None else {"threshold_pps": round(t), **by_regime(xs, t)}
    ours, theirs = out["vring_driver"], out["dpdk_virtio_user"]
    out["ratio"] = None if ours is None or theirs is None else {
        k: round(ours[k]["median"] / theirs[k]["median"], 3) for k in ("slow", "fast")}
    return out


def profile_summary(rounds, top=4):
    """net_vhost's ns per packet in each of its busiest shared objects: the median over rounds, per driver
    (rounds whose window forwarded nothing left out; None where no round is left)."""
    per = {who: {} for who in ("vring_driver", "dpdk_virtio_user")}
    for r in rounds:
        for who in per:
            for d in r[who]["net_vhost_profile"]["by_dso"]:
                xs = per[who].setdefault(d["dso"], [])
                if d["ns_per_packet"] is not None:
                    xs.append(d["ns_per_packet"])

    def med(who, dso):
        xs = per[who].get(dso, [0.0])
        return round(statistics.median(xs), 2) if xs else None

    busiest = sorted(per["vring_driver"], key=lambda k: -(med("vring_driver", k) or 0.0))[:top]
    return {dso: {who: med(who, dso) for who in per} for dso in busiest}


def _ns(x):
    return "-" if x is None else f"{x:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--period", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--tx-first-bursts", type=int, default=1,
                    help="bursts primed into the loop: testpmd `start tx_first N`, our --count N*burst")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--driver-arg", action="append", default=[],
                    help="extra `vring driver` argument (repeat), e.g. --driver-arg=--spin=0")
    ap.add_argument("--perf", action="store_true",
                    help="profile net_vhost's forwarding CPU (perf cpu-clock) while each driver is measured")
    ap.add_argument("--perf-keep", metavar="DIR",
                    help="with --perf: keep each window's perf.data in DIR (PATH-DRIVER-HHMMSS.data) for perf report")
    args = ap.parse_args()
    keep = args.perf_keep
    if keep is not None and not (args.perf and os.path.isdir(keep) and _writable_dir(keep)):
        sys.exit("--perf-keep needs --perf and an existing directory it can write into")
    bad = [p for p in args.paths.split(",") if p not in PATHS]
    if bad:
        sys.exit(f"--paths: {', '.join(bad)} not one of {', '.join(PATHS)}")
    if dpdk.skip_reason():
        sys.exit(dpdk.skip_reason())
    if args.perf and perf_skip_reason():
        sys.exit(perf_skip_reason())
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # through the clean-up below, as Ctrl-C
    try:
        run(args)
    except KeyboardInterrupt:
        sys.exit("driver_vs_dpdk: interrupted")


def run(args):
    out = {"config": vars(args), "paths": {}}
    for name in args.paths.split(","):
        packed, in_order = PATHS[name]
        rounds = []
        for _ in range(args.rounds):
            tmp = tempfile.mkdtemp(prefix="vring-bench-")
            tp = dpdk.Testpmd.vhost(os.path.join(tmp, "vhost.sock"), fwd="mac", burst=args.burst, lcores=(1, 0),
                                    extra=["--record-burst-stats"])
            try:
                tp.start(60)
                tp.clear_stats()
                ours = measure_ours(tp, name, packed, in_order, args)
                dpdk_r = measure_dpdk(tp, name, packed, in_order, args)
            finally:
                tp.close()
                shutil.rmtree(tmp, ignore_errors=True)
            rounds.append({"vring_driver": ours, "dpdk_virtio_user": dpdk_r})
        o = statistics.median(r["vring_driver"]["median_pps"] for r in rounds)
        d = statistics.median(r["dpdk_virtio_user"]["median_pps"] for r in rounds)
        out["paths"][name] = {"vring_driver_pps": round(o), "dpdk_virtio_user_pps": round(d),
                              "ratio": round(o / d, 3) if d else None, "rounds": rounds}
        empty = {who: statistics.median(r[who]["net_vhost_bursts"].get("RX", {}).get("share_by_size", {})
                                        .get("0", float("nan")) for r in rounds)
                 for who in ("vring_driver", "dpdk_virtio_user")}
        out["paths"][name]["net_vhost_empty_dequeue_share"] = empty
        out["paths"][name]["regimes"] = regimes(rounds)
        if args.perf:
            out["paths"][name]["net_vhost_ns_per_packet"] = prof = profile_summary(rounds)
            print(f"{name}: net_vhost ns per packet (median over rounds), vring driver / DPDK virtio_user: " + ", ".join(
                f"{dso} {_ns(v['vring_driver'])} / {_ns(v['dpdk_virtio_user'])}" for dso, v in prof.items()),
                file=sys.stderr)
        print(f"{name}: vring driver {o / 1e6:.3f} Mpps, DPDK virtio_user {d / 1e6:.3f} Mpps, "
              f"ratio {o / d if d else float('nan'):.3f}; net_vhost's dequeues found nothing in "
              f"{empty['vring_driver']:.0%} / {empty['dpdk_virtio_user']:.0%} of its polls"
              + (f"; within speed regimes: slow {out['paths'][name]['regimes']['ratio']['slow']:.3f}, fast "
                 f"{out['paths'][name]['regimes']['ratio']['fast']:.3f}" if out["paths"][name]["regimes"]["ratio"]
                 else ""), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
