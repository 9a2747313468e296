"""Packets/s of DPDK virtio_user against `vring vhost`, and against DPDK's own net_vhost, in one run.

Four paths (split/packed x normal/in-order), 64-byte frames (testpmd's default), burst 32, mergeable Rx
buffers on (virtio_user's default). Both backends forward with MAC swap (`--forward-mode=mac` / `--fwd
macswap`) on CPU 0; virtio_user's testpmd forwards on CPU 1 and primes the loop with `start tx_first`.
The rate is testpmd's Rx-pps on the virtio_user port, sampled every PERIOD seconds; the first WARMUP samples
are dropped and the median of the rest is reported (the same method as vring.dpdk.measure_dpdk_pair).

    python benchmarks/vhost_vs_dpdk.py [--seconds 8] [--period 1] [--warmup 2] [--rounds 3] [--paths split,...]

A loop primed with one burst of 32 packets is latency bound and settles into different steady states from one
start to the next (DPDK's own pair moves by 2x between runs on a 2-CPU VM), so each path is measured in
ROUNDS rounds, alternating net_vhost and `vring vhost`, and the median over rounds is reported.

Prints one JSON document. Not a test.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vhost.testing import VhostProcess  # noqa: E402
from vring import dpdk  # noqa: E402

PATHS = {"split": (False, False), "split-inorder": (False, True), "packed": (True, False),
         "packed-inorder": (True, True)}


def sample(tp, seconds, period, warmup):
    pps, own = tp.sample_rx(max(1, round(seconds / period)), period)
    kept, own_kept = pps[warmup:] or pps, own[warmup:] or own
    return {"median_rx_pps": int(statistics.median(kept)), "own_median_rx_pps": int(statistics.median(own_kept)),
            "samples": kept}


def measure_vring(packed, in_order, args):
    tmp = tempfile.mkdtemp(prefix="vring-bench-")
    sock = os.path.join(tmp, "vhost.sock")
    try:
        with VhostProcess(sock, "--fwd", "macswap", "--burst", args.burst, *args.vhost_args, pin=0) as be:
            be.wait_socket()
            tp = dpdk.Testpmd.virtio_user(sock, packed=packed, in_order=in_order, mrg_rxbuf=True, fwd="mac",
                                          burst=args.burst, tx_first=True, fwd_cpu=1, autostart=False)
            try:
                tp.start(60)
                tp.start_forwarding()
                r = sample(tp, args.seconds, args.period, args.warmup)
            finally:
                tp.close()
            final = be.stop()
        r["backend"] = {"rxq0": final["rxq0"], "txq1": final["txq1"]} if final else None
        return r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--period", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--vhost-args", default="", help="extra `vring vhost` options, space separated")
    args = ap.parse_args()
    args.vhost_args = args.vhost_args.split()
    if dpdk.skip_reason():
        sys.exit(dpdk.skip_reason())
    out = {"frame_bytes": 64, "burst": args.burst, "seconds": args.seconds, "period": args.period,
           "warmup": args.warmup, "rounds": args.rounds, "vhost_args": args.vhost_args, "paths": {}}
    names = args.paths.split(",")
    runs = {name: {"dpdk": [], "vring": [], "counters": None, "errors": []} for name in names}
    for rnd in range(args.rounds):
        for name in names:
            packed, in_order = PATHS[name]
            d = dpdk.measure_dpdk_pair(packed=packed, in_order=in_order, seconds=args.seconds, burst=args.burst,
                                       period=args.period, warmup=args.warmup, fwd="mac")
            v = measure_vring(packed, in_order, args)
            r = runs[name]
            r["dpdk"].append(d["median_rx_pps"])
            r["vring"].append(v["median_rx_pps"])
            r["counters"] = v["backend"]
            r["errors"] += [e for side in d["errors"].values() for e in side]
            print(f"round {rnd + 1} {name:15s} net_vhost {d['median_rx_pps']:>10,} pps   "
                  f"vring vhost {v['median_rx_pps']:>10,} pps", file=sys.stderr, flush=True)
    for name in names:
        r = runs[name]
        dpps, vpps = int(statistics.median(r["dpdk"])), int(statistics.median(r["vring"]))
        out["paths"][name] = {
            "dpdk_net_vhost_pps": dpps, "vring_vhost_pps": vpps,
            "ratio": round(vpps / dpps, 3) if dpps else None,
            "dpdk_rounds": r["dpdk"], "vring_rounds": r["vring"],
            "vring_backend_counters_last_round": r["counters"], "dpdk_errors": r["errors"],
        }
    ratios = [p["ratio"] for p in out["paths"].values() if p["ratio"]]
    out["median_ratio"] = round(statistics.median(ratios), 3) if ratios else None
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
