"""What `vring tap` costs the data path: packets per second of a DPDK testpmd pair (virtio_user <-> net_vhost,
64-byte frames looping in mac forwarding, as shared/tools/dpdk-loopback.sh) connected directly and through
the tap (default pass-through: kick and call eventfds go straight through, the tap only relays control
messages), measured side by side in one run, the two arms alternating.

    python3 benchmarks/tap_cost.py [--repeat 5] [--seconds 8] [--variants split-in-order,packed-in-order]
                                   [--tap-args "--ctl /tmp/t.ctl"] [--json out.json]

Each measurement starts fresh processes, waits for the link, samples the virtio side's Rx rate every
second (``Testpmd.sample_rx``), drops the first two samples and takes the median. Per variant it prints the
median of the per-run medians of each arm and their ratio (tap / direct), the median of the ratios of the
back-to-back pairs (which drift on a shared machine touches less), and every run's figure: the
machine is shared and noisy, so look at the spread before the ratio. It also prints the CPU time the tap
process used in each run (start-up included): with the default pass-through the data path never reaches it.
"""
import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vring import dpdk  # noqa: E402

VARIANTS = {"split-in-order": (False, True), "split": (False, False),
            "packed-in-order": (True, True), "packed": (True, False)}


def _cpu_seconds(pid):
    """User + system CPU time a process has used so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(packed, in_order, via_tap, seconds, tap_args=()):
    d = tempfile.mkdtemp(prefix="vring-tapcost-")
    b = os.path.join(d, "vhost.sock")
    a = os.path.join(d, "tap.sock") if via_tap else b
    vhost = dpdk.Testpmd.vhost(b)
    virtio = dpdk.Testpmd.virtio_user(a, packed=packed, in_order=in_order, autostart=False)
    tap = None
    try:
        vhost.start()
        if via_tap:
            tap = subprocess.Popen([sys.executable, "-m", "vring.cli", "tap", "--listen", a, "--connect", b,
                                    *tap_args], stderr=subprocess.DEVNULL)
            t0 = time.monotonic()
            while not os.path.exists(a):
                if tap.poll() is not None or time.monotonic() - t0 > 30:
                    raise RuntimeError("vring tap did not come up")
                time.sleep(0.05)
        virtio.start()
        vhost.wait_link_up()
        virtio.start_forwarding()
        pps, _ = virtio.sample_rx(max(3, int(seconds)), 1.0)
        kept = pps[2:] or pps
        return statistics.median(kept), pps, _cpu_seconds(tap.pid) if tap is not None else None
    finally:
        virtio.close()
        vhost.close()
        if tap is not None:
            tap.send_signal(signal.SIGTERM)
            tap.wait(20)
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--variants", default="split-in-order,packed-in-order")
    p.add_argument("--tap-args", default="", help="extra vring tap options (e.g. --ctl PATH --log FILE)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if dpdk.skip_reason():
        sys.exit(dpdk.skip_reason())
    out = {"machine": f"{os.cpu_count()} CPUs, shared with other work (noisy): compare the spread",
           "repeat": args.repeat, "seconds": args.seconds, "tap_args": args.tap_args, "variants": {}}
    for name in args.variants.split(","):
        packed, in_order = VARIANTS[name]
        runs, cpu = {"direct": [], "tap": []}, []
        for k in range(args.repeat):
            order = ("direct", "tap") if k % 2 == 0 else ("tap", "direct")  # alternate: drift hits both arms
            for arm in order:
                med, samples, used = measure(packed, in_order, arm == "tap", args.seconds,
                                             shlex.split(args.tap_args))
                runs[arm].append(med)
                if used is not None:
                    cpu.append(used)
                print(f"{name} run {k + 1} {arm:6s}: median {med:>10,.0f} pps  samples {samples}"
                      + (f"  tap CPU {used:.2f} s (start-up included)" if used is not None else ""), flush=True)
        direct, tap = statistics.median(runs["direct"]), statistics.median(runs["tap"])
        pairs = [t / d for t, d in zip(runs["tap"], runs["direct"])]  # back to back: less exposed to drift
        out["variants"][name] = {"direct_pps": runs["direct"], "tap_pps": runs["tap"], "direct_median": direct,
                                 "tap_median": tap, "ratio_tap_over_direct": round(tap / direct, 4),
                                 "pair_ratios": [round(x, 4) for x in pairs],
                                 "median_pair_ratio": round(statistics.median(pairs), 4), "tap_cpu_s": cpu}
        print(f"{name}: direct median {direct:,.0f} pps, through the tap {tap:,.0f} pps, "
              f"ratio {tap / direct:.3f}, median of the back-to-back pair ratios {statistics.median(pairs):.3f} "
              f"{[round(x, 2) for x in pairs]} (runs: direct {[round(x) for x in runs['direct']]}, "
              f"tap {[round(x) for x in runs['tap']]}); the tap's own CPU per run "
              f"{[round(x, 2) for x in cpu]} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
