"""Buffers per second for publish + consume + reclaim of one-descriptor buffers (ring 256, burst 32).

C path and reference model, in one process and across two processes (one per core), for the four
variants. Prints JSON. Usage: python benchmarks/ring_ops.py [--count N] [--ref-count N] [--repeat R]
"""
import argparse
import json
import os
import platform
import statistics

from rings.twoproc import run_one_process, run_two_processes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2_000_000, help="buffers per C-path point")
    ap.add_argument("--ref-count", type=int, default=50_000, help="buffers per reference-model point")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point; the median is reported")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--burst", type=int, default=32)
    args = ap.parse_args()
    points = []
    for impl in ("c", "reference"):
        count = args.count if impl == "c" else args.ref_count
        for fmt in ("split", "packed"):
            for in_order in (False, True):
                for procs, fn in (("one", run_one_process), ("two", run_two_processes)):
                    rates = [fn(fmt, args.size, in_order, count, burst=args.burst, impl=impl,
                                check=False)["rate"] for _ in range(args.repeat)]
                    points.append(dict(impl=impl, fmt=fmt, variant="in_order" if in_order else "normal",
                                       processes=procs, buffers=count,
                                       median_bufs_per_s=round(statistics.median(rates)),
                                       min=round(min(rates)), max=round(max(rates))))
                    print(json.dumps(points[-1]), flush=True, file=__import__("sys").stderr)
    print(json.dumps(dict(machine=dict(cpus=os.cpu_count(), python=platform.python_version(),
                                       platform=platform.platform()),
                          ring_size=args.size, burst=args.burst, points=points), indent=2))


if __name__ == "__main__":
    main()
