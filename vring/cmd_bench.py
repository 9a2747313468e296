"""`vring bench`: the two-process loopback benchmark (driver process + device process, one CPU each).

The device (ours: `vring vhost --fwd macswap`; DPDK: testpmd net_vhost, macswap) and the driver (ours:
`vring driver --mode macfwd`; DPDK: testpmd virtio_user, mac, `start tx_first`) meet on a vhost-user socket in
a temporary directory; --inject packets are injected and loop. Per point (path x packet size x pair): packets/s
at the device (median of the samples after the warm-up, min, max), round-trip latency p50/p99/p99.9 from the
timestamps our driver writes into the payload, kicks and calls per packet, retries, drops, and the loss check
(injected = still in flight + counted lost, at the end).

examples:
  vring bench                                   ours against ours, the four paths, 64-byte frames
  vring bench --vs-dpdk                         ... and DPDK's pair at the same points: our rate / theirs
  vring bench --pairs ours/ours,dpdk/dpdk,ours/dpdk,dpdk/ours --seconds 10 --repeat 3 --json out.json
  vring bench --paths split-in-order,packed-in-order --pkt-size 64,512,1500 --plot rates.png
"""
import argparse
import json
import os
import sys
import time

from vring import bench


def _list_type(fn):
    def parse(text):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = fn.__name__.replace("parse_", "")
    return parse


def register(sub):
    p = sub.add_parser("bench", help="two-process loopback benchmark (ours and/or DPDK's driver and device)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--driver", choices=("ours", "dpdk"), default=None, help="the driver side (default ours)")
    g.add_argument("--device", choices=("ours", "dpdk"), default=None, help="the device side (default ours)")
    g.add_argument("--pairs", type=_list_type(bench.parse_pairs), default=None, metavar="D/V,...",
                   help="driver/device pairs, any of " + ", ".join(bench.PAIRS) + " (instead of --driver/--device)")
    g.add_argument("--vs-dpdk", action="store_true",
                   help="also run dpdk/dpdk at every point and print our rate / theirs")
    g.add_argument("--paths", type=_list_type(bench.parse_paths), default=list(bench.PATHS), metavar="P,...",
                   help="any of " + ", ".join(bench.PATHS) + "; or split, packed, normal, in-order, all "
                        "(default: all four)")
    g.add_argument("--pkt-size", type=_list_type(bench.parse_sizes), default=[64], metavar="N,...",
                   help=f"frame sizes in bytes without FCS, {bench.MIN_PKT}..{bench.MAX_PKT} (default 64)")
    g.add_argument("--burst", type=int, default=32, help="burst size on both sides (default 32)")
    g.add_argument("--ring-size", type=int, default=256, help="virtqueue size (default 256)")
    g.add_argument("--inject", type=int, default=256, metavar="N",
                   help="packets injected into the loop (default 256; DPDK's driver: whole bursts of tx_first)")
    g.add_argument("--retries", type=int, default=0, help="our device: Rx enqueue retries 0..8 (default 0)")
    g.add_argument("--txq-flush", default="rx-batch", metavar="rx-batch|timer:US|threshold",
                   help="our device: when the intermediate Tx queue is drained (default rx-batch)")
    g.add_argument("--mrg-rxbuf", action=argparse.BooleanOptionalAction, default=True,
                   help="negotiate VIRTIO_NET_F_MRG_RXBUF (default: yes)")
    t = p.add_argument_group("timing")
    t.add_argument("--seconds", type=float, default=10.0, help="measured seconds per point, after the warm-up "
                   "(default 10)")
    t.add_argument("--warmup", type=float, default=2.0, help="seconds of samples dropped at the start (default 2)")
    t.add_argument("--interval", type=float, default=0.5, help="seconds per rate sample (default 0.5)")
    t.add_argument("--repeat", type=int, default=1,
                   help="measure every point N times, each with fresh processes (default 1)")
    t.add_argument("--cpus", default=None, metavar="DEVICE,DRIVER",
                   help="CPUs to pin the device and the driver to (default: the first two allowed)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every figure and the machine description to FILE "
                   "('-': stdout)")
    o.add_argument("--plot", metavar="FILE.png", help="plot rates and latency percentiles (needs matplotlib: "
                   "pip install 'vring[plot]')")
    o.add_argument("--keep", action="store_true", help="keep each measurement's temporary directory (logs)")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(run=run, _parser=p)
    return p


def config_from_args(args):
    """BenchConfig from parsed arguments; raises ValueError with a user-facing message."""
    if args.pairs is not None and (args.driver or args.device):
        raise ValueError("give --pairs or --driver/--device, not both")
    pairs = args.pairs or [f"{args.driver or 'ours'}/{args.device or 'ours'}"]
    if args.vs_dpdk and "dpdk/dpdk" not in pairs:
        pairs = pairs + ["dpdk/dpdk"]
    dev_cpu, drv_cpu = bench.default_cpus()
    if args.cpus:
        try:
            dev_cpu, drv_cpu = (int(x) for x in args.cpus.split(","))
        except ValueError:
            raise ValueError(f"--cpus wants DEVICE,DRIVER (two CPU numbers), not {args.cpus!r}") from None
    cfg = bench.BenchConfig(pairs=pairs, paths=args.paths, pkt_sizes=args.pkt_size, burst=args.burst,
                            ring_size=args.ring_size, inject=args.inject, retries=args.retries,
                            txq_flush=args.txq_flush, mrg_rxbuf=args.mrg_rxbuf, seconds=args.seconds,
                            warmup=args.warmup, interval=args.interval, repeat=args.repeat,
                            device_cpu=dev_cpu, driver_cpu=drv_cpu, keep=args.keep)
    cfg.validate()
    if any("dpdk" in p for p in pairs):
        from vring import dpdk
        why = dpdk.skip_reason()
        if why:
            raise ValueError(f"the DPDK pairs need dpdk-testpmd: {why}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 (only: is it there)
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'vring[plot]' (or pip install matplotlib)") \
                from None
    return cfg


class Progress:
    """One live line on stderr (rewritten in place on a terminal; one line per finished point otherwise)."""

    def __init__(self, stream=None, quiet=False):
        stream = stream or sys.stderr
        self.stream, self.quiet = stream, quiet
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = 0.0
        self.width = 0

    def _head(self, kw):
        return (f"[{kw['index'] + 1}/{kw['count']}] {kw['pair']} {kw['path']} {kw['size']} B "
                f"rep {kw['rep'] + 1}")

    def update(self, **kw):
        if self.quiet or not self.tty:
            return
        now = time.monotonic()
        if now - self.last < 0.2 and kw.get("phase") not in ("failed",):
            return
        self.last = now
        text = self._head(kw) + f": {kw.get('phase', '')}"
        if kw.get("elapsed") is not None:
            text += f" {kw['elapsed']:.1f}/{kw['total']:.1f} s"
        if kw.get("pps") is not None:
            text += f"  now {kw['pps'] / 1e6:.3f} Mpps"
        if kw.get("median") is not None:
            text += f"  median {kw['median'] / 1e6:.3f} Mpps"
        self.stream.write("\r" + text.ljust(self.width)[:200])
        self.width = len(text)
        self.stream.flush()

    def record(self, rec, index, count):
        if self.quiet:
            return
        r = rec["rate"]["pps_median"]
        lc = rec["loss_check"]
        lat = rec["latency"]["p50_us"]
        text = (f"[{index}/{count}] {rec['pair']} {rec['path']} {rec['pkt_size']} B rep {rec['repeat'] + 1}: "
                f"{'-' if r is None else f'{r / 1e6:.3f}'} Mpps"
                + (f", p50 {lat:.1f} us" if lat is not None else "")
                + f", loss check {'ok' if lc['ok'] else 'FAILED'}")
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width) + "\n")
            self.width = 0
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def failed(self, kw):
        if self.quiet:
            return
        first = (kw.get("error") or "").splitlines()[0] if kw.get("error") else ""
        self.stream.write(("\r" if self.tty else "") + self._head(kw) + f": FAILED: {first}".ljust(self.width) + "\n")
        self.width = 0
        self.stream.flush()


def run(args):
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        args._parser.error(str(e))   # exit code 2
    prog = Progress(quiet=args.quiet)
    done = [0]
    total = sum(1 for _ in cfg.points())

    def progress(**kw):
        if kw.get("phase") == "failed":
            prog.failed(kw)
        else:
            prog.update(**kw)

    def on_record(rec):
        done[0] += 1
        prog.record(rec, done[0], total)

    import signal
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = bench.run_bench(cfg, progress=progress, on_record=on_record)
    finally:
        signal.signal(signal.SIGTERM, old)
    print(bench.format_table(result))
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, args.json)
            print(f"json: {args.json}", file=sys.stderr)
    if args.plot and result["points"]:
        bench.plot(result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if result["interrupted"]:
        print("vring bench: interrupted; the table and the JSON hold the points measured so far", file=sys.stderr)
        return 130
    ok = not result["errors"] and all(p["loss_check_ok"] for p in result["points"])
    return 0 if ok else 1


def _sigterm(*_):
    raise KeyboardInterrupt   # unwinds through every Measurement.close()
