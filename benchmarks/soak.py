"""Soak: the kill -9 / relaunch loop for a given time (issue 10); RSS growth and open fds of both processes
and the counters' balance.

Half the time `vring vhost` is killed -9 every 0.5-1 s under a `vring driver --reconnect --verify` (macfwd,
256 frames) that lives through it all: the driver's RSS and fds are sampled after each resume, each backend
instance's before its kill; the balance is the frame population at the end (every injected frame present,
in flight, or dropped under a named counter; duplicates counted). The other half `vring driver` is the one
killed -9 and a new one started, against one backend that lives: its RSS and fds are sampled after each
kill; the balance is the backend's conservation (tx_packets = rx_packets + rx_dropped + rx_too_big +
fwd_dropped once the last driver stopped cleanly). Goal: growth < 1 MiB after the first cycle, constant fds.

    python3 benchmarks/soak.py --minutes 10 [--split] [--no-in-order] [--json soak.json]

Needs psutil (pip install psutil): process RSS and fd counts, rather than parsing /proc by hand.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vring.restarts import soak  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--split", action="store_true", help="split rings (default packed)")
    ap.add_argument("--no-in-order", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()

    def progress(phase, k, sample):
        print(f"[{phase}] cycle {k}: rss {sample[0] / 2**20:.2f} MiB, fds {sample[1]}", flush=True)

    r = soak(a.minutes * 60, packed=not a.split, in_order=not a.no_in_order, progress=progress)
    print(json.dumps(r, indent=1))
    a_, b_ = r["backend_killed"], r["driver_killed"]
    ok = (a_["driver"].get("rss_growth_kib", 0) < 1024 and len(a_["driver"].get("fds", [])) <= 1
          and b_["backend"].get("rss_growth_kib", 0) < 1024 and len(b_["backend"].get("fds", [])) <= 1
          and a_["balance"]["balanced"] and b_["balance"]["balanced"]
          and a_["balance"]["ring_errors"] == 0 and b_["balance"]["ring_errors"] == 0)
    print(f"\nbackend killed {a_['kills']}x: driver RSS growth {a_['driver'].get('rss_growth_kib')} KiB, "
          f"fds {a_['driver'].get('fds')}; balance {a_['balance']}")
    print(f"driver killed {b_['kills']}x: backend RSS growth {b_['backend'].get('rss_growth_kib')} KiB, "
          f"fds {b_['backend'].get('fds')}; balance {b_['balance']}")
    print("verdict:", "OK" if ok else "FAIL")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
