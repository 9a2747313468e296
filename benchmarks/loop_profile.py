"""Instructions per packet of the C hot paths, in one process: our driver's macfwd step (virtio/csrc/vnet.h,
``vn_fwd_burst``) against our backend's poll iteration (vhost/csrc/vhost_net.h, ``vh_run``) over the same
shared memory, alternating one step of each for N rounds. No clock, no other process: under
``valgrind --tool=callgrind`` the counts are the same on a quiet and on a loaded machine. Both functions are
kept out of line (``noinline``) so that callgrind can count from them; the cffi call overhead is left out.

    python3 benchmarks/loop_profile.py --callgrind             # every path: Ir/packet of the backend and driver
    python3 benchmarks/loop_profile.py --callgrind --vhost txq_flush=none --paths packed-normal --keep
    callgrind_annotate --auto=yes /tmp/vring-cg-*/packed-normal.cg     # where they go, line by line (--keep)

The steps alternate, so each side always sees full bursts of --burst packets (--inject smaller than the burst
makes them partial). Without ``--callgrind`` the script runs the loop once and checks that nothing was dropped.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PATHS = {"split-normal": (False, False), "split-in-order": (False, True),
         "packed-normal": (True, False), "packed-in-order": (True, True)}
DEVICE_FN, DRIVER_FN = "vh_run", "vn_fwd_burst"   # C only: the cffi call overhead stays out


def run_loop(path, rounds, inject, burst, ring, pkt_size, mrg, vhost_opts=None, tx_hdr="headroom"):
    """Inject ``inject`` packets, forward them for ``rounds`` rounds; returns the counters (packets each side
    moved since the start, injection included: callgrind counts the calls made then too)."""
    import numpy as np

    from rings.layout import (VIRTIO_F_IN_ORDER, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_RING_PACKED,
                              VIRTIO_F_VERSION_1, VIRTIO_NET_F_MRG_RXBUF, bit)
    from rings.virtq import CMemory, DeviceQueue
    from vhost import _net as vh
    from vhost.datapath import Datapath, Options
    from virtio import _net as vn
    from virtio import packets
    from virtio.net import NetQueues

    packed, in_order = PATHS[path]
    f = bit(VIRTIO_F_VERSION_1) | bit(VIRTIO_F_INDIRECT_DESC)
    f |= (bit(VIRTIO_F_RING_PACKED) if packed else 0) | (bit(VIRTIO_F_IN_ORDER) if in_order else 0)
    f |= bit(VIRTIO_NET_F_MRG_RXBUF) if mrg else 0
    nq = NetQueues(f, size=ring, burst=burst, hdr=tx_hdr)
    try:
        nq.rx.fill()
        cmem = CMemory(nq.mem.table)
        opts = Options(burst=burst, **(vhost_opts or {}))
        dev = [DeviceQueue(cmem, lay, f, in_order_batch=opts.in_order_batch and i == 1)
               for i, lay in enumerate((nq.mem.rx_layout, nq.mem.tx_layout))]
        for q in dev:
            q.enable_kicks(False)
        dp = Datapath(dev[0], dev[1], f, opts)
        tmpl = packets.template(pkt_size)
        idx = np.zeros(ring + burst, np.uint32)
        lens = np.full(ring + burst, len(tmpl), np.uint32)
        p_idx = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(idx))
        p_lens = vn.ffi.cast("uint32_t *", vn.ffi.from_buffer(lens))
        p_tmpl = vn.ffi.cast("uint8_t *", vn.ffi.from_buffer(tmpl))
        left, seq = inject, 0
        while left:
            k = vn.lib.vn_gen(nq.pool.c, p_idx, min(burst, left), p_tmpl, len(tmpl), seq, packets.SEQ_OFF, 0, 0)
            sent = nq.tx.burst(idx[:k], lens[:k])
            assert sent == k, "the Tx ring takes the injected packets"
            vh.lib.vh_run(dp.n, 1, 1 << 40)
            left -= k
            seq += k
        rx, tx = nq.rx.c, nq.tx.c
        fwd, run = vn.lib.vn_fwd_loop, vh.lib.vh_run
        for _ in range(rounds):
            if fwd(rx, tx, p_idx, p_lens, burst, 0, 1, vn.ffi.NULL, 0) < 0:
                raise RuntimeError("driver queue broke")
            if run(dp.n, 1, 1 << 40):
                raise RuntimeError(f"device queue broke: {dp.n.broken}")
        st = dp.stats()
        return {"path": path, "driver_rx": int(rx.packets), "device_tx": st["tx_packets"],
                "rx_dropped": st["rx_dropped"], "tx_bursts": st["tx_bursts"], "rx_attempts": st["rx_attempts"],
                "driver_tx_cleanups": int(tx.cleanups)}
    finally:
        nq.close()


def inclusive_ir(out_file):
    """{function: inclusive Ir} for the two entry points, from callgrind_annotate --inclusive=yes."""
    r = subprocess.run(["callgrind_annotate", "--inclusive=yes", out_file], capture_output=True, text=True,
                       check=True)
    got = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(.*?\)\s+(\S+)", line) or re.match(r"\s*([\d,]+)\s+(\S+)", line)
        if not m:
            continue
        ir, fn = int(m.group(1).replace(",", "")), m.group(2)
        for want in (DEVICE_FN, DRIVER_FN):
            if fn.endswith(want) or fn.split(":")[-1] == want:
                got[want] = max(got.get(want, 0), ir)
    return got


def callgrind(args):
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not installed")
    rows = []
    tmp = tempfile.mkdtemp(prefix="vring-cg-")
    try:
        for path in args.paths:
            out = os.path.join(tmp, f"{path}.cg")
            cnt = os.path.join(tmp, f"{path}.json")
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    f"--toggle-collect={DEVICE_FN}", f"--toggle-collect={DRIVER_FN}",
                    sys.executable, os.path.abspath(__file__), "--path", path, "--rounds", str(args.rounds),
                    "--inject", str(args.inject), "--burst", str(args.burst), "--ring-size", str(args.ring_size),
                    "--pkt-size", str(args.pkt_size), "--tx-hdr", args.tx_hdr, "--counters", cnt] \
                + (["--no-mrg-rxbuf"] if not args.mrg else [])
            for o in args.vhost:
                argv += ["--vhost", o]
            subprocess.run(argv, check=True, capture_output=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT))
            with open(cnt) as f:
                c = json.load(f)
            ir = inclusive_ir(out)
            missing = [fn for fn in (DEVICE_FN, DRIVER_FN) if not ir.get(fn)]
            if missing:
                raise SystemExit(f"callgrind counted nothing in {', '.join(missing)} (inlined? built without "
                                 f"symbols?)")
            pk = c["device_tx"]
            rows.append({"path": path, "device_ir_per_pkt": round(ir.get(DEVICE_FN, 0) / pk, 1),
                         "driver_ir_per_pkt": round(ir.get(DRIVER_FN, 0) / c["driver_rx"], 1),
                         "packets": pk, "rx_dropped": c["rx_dropped"],
                         "pkts_per_dequeue_burst": round(pk / max(c["tx_bursts"], 1), 2)})
            if args.keep:
                print(f"kept {out}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="packed-normal", choices=list(PATHS))
    ap.add_argument("--paths", default=",".join(PATHS), help="--callgrind: the paths to measure")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--inject", type=int, default=256)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--ring-size", type=int, default=256)
    ap.add_argument("--pkt-size", type=int, default=64)
    ap.add_argument("--no-mrg-rxbuf", dest="mrg", action="store_false")
    from virtio.net import TX_HDR
    ap.add_argument("--tx-hdr", default="headroom", choices=TX_HDR,
                    help="where the driver puts its Tx header (vring driver --tx-hdr)")
    ap.add_argument("--vhost", action="append", default=[], metavar="KEY=VALUE",
                    help="a vhost.datapath.Options field (e.g. in_order_batch=1, txq_flush=threshold)")
    ap.add_argument("--counters", help="write the counters as JSON here")
    ap.add_argument("--callgrind", action="store_true", help="run every path under callgrind, print Ir/packet")
    ap.add_argument("--keep", action="store_true", help="--callgrind: keep the callgrind output files")
    args = ap.parse_args()
    if args.callgrind:
        args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        rows = callgrind(args)
        print(f"{'path':16s} {'device Ir/pkt':>14s} {'driver Ir/pkt':>14s} {'pkts/burst':>11s} {'drops':>6s}")
        for r in rows:
            print(f"{r['path']:16s} {r['device_ir_per_pkt']:14.1f} {r['driver_ir_per_pkt']:14.1f} "
                  f"{r['pkts_per_dequeue_burst']:11.2f} {r['rx_dropped']:6d}")
        print(json.dumps({"rounds": args.rounds, "inject": args.inject, "burst": args.burst, "tx_hdr": args.tx_hdr,
                          "mrg_rxbuf": args.mrg, "rows": rows}))
        return
    vopts = {}
    for o in args.vhost:
        k, _, v = o.partition("=")
        vopts[k] = int(v) if v.isdigit() else v
    c = run_loop(args.path, args.rounds, args.inject, args.burst, args.ring_size, args.pkt_size, args.mrg, vopts,
                 args.tx_hdr)
    if args.counters:
        with open(args.counters, "w") as f:
            json.dump(c, f)
    else:
        print(json.dumps(c))
    if c["rx_dropped"]:
        raise SystemExit(f"{c['rx_dropped']} packets dropped")


if __name__ == "__main__":
    main()
