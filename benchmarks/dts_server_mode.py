"""DPDK DTS "vhost/virtio-user loopback server mode", both directions, every combination (issue 10).

* virtio_user ``server=1`` (dpdk-testpmd, mac forwarding) with `vring vhost --client` killed -9 and relaunched,
  then ``stop`` + ``start tx_first`` on testpmd, as DTS does;
* `vring driver --server` (macfwd, nothing injected) with DPDK net_vhost ``client=1`` killed -9 and relaunched,
  ``start tx_first`` on each new testpmd.

For packed/split x in-order/normal x mergeable on/off: per launch the time from relaunch until testpmd's Rx
counter moves (resume_s) and the packets testpmd received in the next second. The tests
(tests/test_restart_dpdk.py) run a few of these combinations; this script runs them all.

    python3 benchmarks/dts_server_mode.py [--kills 2] [--json dts.json]
"""
import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vring import dpdk  # noqa: E402
from vring.restarts import dts_net_vhost_client, dts_virtio_user_server  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if dpdk.skip_reason():
        sys.exit(dpdk.skip_reason())
    results, ok = [], True
    print(f"{'case':45s} {'ring':7s} {'order':8s} {'mrg':4s} {'resume_s per relaunch':28s} {'rx pkts/1s':>14s} ok")
    for fn, (packed, in_order, mrg) in itertools.product((dts_virtio_user_server, dts_net_vhost_client),
                                                          itertools.product((0, 1), repeat=3)):
        r = fn(bool(packed), bool(in_order), bool(mrg), kills=a.kills, settle=1.0)
        results.append(r)
        ok &= r["resumed"]
        rel = [x["resume_s"] for x in r["rows"][1:]]
        print(f"{r['case']:45s} {'packed' if packed else 'split':7s} {'in-order' if in_order else 'normal':8s} "
              f"{mrg:<4d} {str(rel):28s} {min(x['rx_packets'] for x in r['rows']):>14d} "
              f"{'yes' if r['resumed'] else 'NO'}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("verdict:", "OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
