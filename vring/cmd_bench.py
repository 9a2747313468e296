"""`vring bench`: the two-process loopback benchmark (driver process + device process, one CPU each).

The device (ours: `vring vhost --fwd macswap`; DPDK: testpmd net_vhost, macswap) and the driver (ours:
`vring driver --mode macfwd`; DPDK: testpmd virtio_user, mac, `start tx_first`) meet on a vhost-user socket in
a temporary directory; --inject packets are injected and loop. Per point (path x packet size x pair): packets/s
at the device (median of the samples after the warm-up, min, max), round-trip latency p50/p99/p99.9 from the
timestamps our driver writes into the payload, kicks and calls per packet, retries, drops, and the loss check
(injected = still in flight + counted lost, at the end).

Both processes are pinned, by default to the two least busy CPUs this process may use (the first line of the
output says which; a warning when both must share one). CPU use of each process is reported per point.

--notify runs our sides with notifications (backend --idle sleep, driver --wait: poll while busy, then enable
notifications, re-check, block on the eventfd) and measures an idle interval first (--idle S): what a queue
with no traffic costs. --rate PPS,... paces our driver's Tx (open loop, frames stamped with the time they were
due) and reports latency against offered load, polled and notified. --study NAME measures one of the seeds'
design choices, its variants side by side (vring/studies.py): tx-cleanup, hdr-prepend, hdr-init, doorbell,
retries, txq.

examples:
  vring bench                                   ours against ours, the four paths, 64-byte frames
  vring bench --vs-dpdk                         ... and DPDK's pair at the same points: our rate / theirs
  vring bench --pairs ours/ours,dpdk/dpdk,ours/dpdk,dpdk/ours --seconds 10 --repeat 3 --json out.json
  vring bench --paths split-in-order,packed-in-order --pkt-size 64,512,1500 --plot rates.png
  vring bench --notify --modes poll,notify      polled and notified side by side: kicks, calls, CPU, idle CPU
  vring bench --rate 10k,100k,1M,4M --plot load.png       latency against offered load, polled and notified
  vring bench --study txq --repeat 3 --json txq.json --plot txq.png
"""
import argparse
import json
import os
import sys
import time

from rings.interrupts import ending_like_ctrl_c
from vring import bench, stdout


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
    g.add_argument("--paths", type=_list_type(bench.parse_paths), default=None, metavar="P,...",
                   help="any of " + ", ".join(bench.PATHS) + "; or split, packed, normal, in-order, all "
                        "(default: all four; a study: its own)")
    g.add_argument("--pkt-size", type=_list_type(bench.parse_sizes), default=[64], metavar="N,...",
                   help=f"frame sizes in bytes without FCS, {bench.MIN_PKT}..{bench.MAX_PKT} (default 64)")
    g.add_argument("--burst", type=int, default=32, help="burst size on both sides (default 32)")
    g.add_argument("--ring-size", type=int, default=None,
                   help="virtqueue size (default 256; --study hdr-prepend: twice --inject, so that a chain of two "
                        "descriptors a packet has every packet in flight too)")
    g.add_argument("--inject", type=int, default=256, metavar="N",
                   help="packets injected into the loop (default 256; DPDK's driver: whole bursts of tx_first)")
    g.add_argument("--retries", type=int, default=0, help="our device: Rx enqueue retries 0..8 (default 0)")
    g.add_argument("--txq-flush", default="rx-batch", metavar="none|rx-batch|timer:US|threshold",
                   help="our device: when the intermediate Tx queue is drained (default rx-batch)")
    g.add_argument("--mrg-rxbuf", action=argparse.BooleanOptionalAction, default=True,
                   help="negotiate VIRTIO_NET_F_MRG_RXBUF (default: yes)")
    g.add_argument("--tx-hdr", choices=bench.TX_HDR, default="headroom",
                   help="our driver: its Tx virtio-net header in the packet's headroom (1 descriptor, default), in a "
                        "descriptor of its own chained before the data (2 descriptors), or indirect (vring driver "
                        "--tx-hdr). In front of DPDK's net_vhost, chain can be the faster: see README.md, Benchmarks")
    g.add_argument("--headroom", type=int, default=bench.HEADROOM, metavar="BYTES",
                   help=f"our driver: its buffers' headroom (vring driver --headroom; default {bench.HEADROOM}, 128 "
                        f"starts each frame on a cache line)")
    n = p.add_argument_group("notifications, offered load, studies")
    n.add_argument("--notify", action="store_true",
                   help="run our sides with notifications (vring vhost --idle sleep, vring driver --wait) instead "
                        "of polling; with --rate: only notified")
    n.add_argument("--modes", type=_list_type(bench.parse_modes), default=None, metavar="poll,notify",
                   help="modes to measure side by side (default: poll; notify with --notify; both with --rate)")
    n.add_argument("--idle", type=float, default=None, metavar="S",
                   help="seconds our driver stays idle (queues up, no traffic) before sending, to measure what an "
                        "idle queue costs polled and notified (default: 2 when notify is among the modes, else 0)")
    n.add_argument("--idle-polls", type=int, default=256, metavar="N",
                   help="notify mode: empty polls before our backend sleeps (default 256)")
    n.add_argument("--rate", type=_list_type(bench.parse_rates), default=None, metavar="PPS,...",
                   help="open loop: our driver offers PPS frames/s (10k, 1M, ...), each stamped with the time it was "
                        "due; latency p50/p99/p99.9 per rate, polled and notified")
    from vring import studies
    n.add_argument("--study", choices=list(studies.STUDIES), default=None,
                   help="measure a design choice's variants side by side: " + "; ".join(
                       f"{s.name}: {s.what.split(':')[0].split(' (')[0]}" for s in studies.STUDIES.values()))
    t = p.add_argument_group("timing")
    t.add_argument("--seconds", type=float, default=10.0, help="measured seconds per point, after the warm-up "
                   "(default 10; at most 86400)")
    t.add_argument("--warmup", type=float, default=2.0, help="seconds of samples dropped at the start (default 2; "
                   "at most 86400)")
    t.add_argument("--interval", type=float, default=0.5, help="seconds per rate sample (default 0.5)")
    t.add_argument("--repeat", type=int, default=1,
                   help="measure every point N times, each with fresh processes (default 1)")
    t.add_argument("--cpus", default=None, metavar="DEVICE,DRIVER",
                   help="CPUs to pin the device and the driver to (default: the two least busy allowed ones)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every figure and the machine description to FILE "
                   "('-': stdout)")
    o.add_argument("--plot", metavar="FILE.png", help="plot rates and latency percentiles (needs matplotlib: "
                   "pip install 'vring[plot]')")
    o.add_argument("--keep", action="store_true", help="keep each measurement's temporary directory (logs)")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(run=run, _parser=p)
    return p


def _modes(args):
    if args.modes is not None:
        if args.notify and "notify" not in args.modes:
            raise ValueError("--notify and --modes without notify contradict each other")
        return args.modes
    if args.notify:
        return ["notify"]
    return ["poll", "notify"] if args.rate else ["poll"]


def config_from_args(args):
    """BenchConfig from parsed arguments; raises ValueError with a user-facing message."""
    from vring import studies
    if args.pairs is not None and (args.driver or args.device):
        raise ValueError("give --pairs or --driver/--device, not both")
    pairs = args.pairs or [f"{args.driver or 'ours'}/{args.device or 'ours'}"]
    if args.study and args.vs_dpdk:
        raise ValueError(f"--study {args.study} compares variants of our side: no --vs-dpdk (dpdk/dpdk has none)")
    if args.vs_dpdk and "dpdk/dpdk" not in pairs:
        pairs = pairs + ["dpdk/dpdk"]
    if not any(p.startswith("ours/") for p in pairs):
        for given, why in ((args.tx_hdr != "headroom", "--tx-hdr places our driver's Tx header"),
                           (args.headroom != bench.HEADROOM, "--headroom sizes our driver's buffers")):
            if given:
                raise ValueError(f"{why}: no pair here runs our driver")
    paths, ring = args.paths, args.ring_size
    if args.study:
        study = studies.get(args.study)
        study.check_pairs(pairs)
        if study.tx_hdr_fixed and args.tx_hdr != "headroom":
            raise ValueError(f"--study {args.study}: {study.tx_hdr_fixed}; no --tx-hdr {args.tx_hdr}")
        if args.modes is not None or args.notify:
            raise ValueError(f"--study {args.study} sets its own mode ({study.mode})")
        paths = paths or list(study.default_paths)
    # chains of two descriptors a packet (--tx-hdr chain, or a study's variant): rings of twice --inject, so that
    # every packet injected can be in flight
    k = max(studies.get(args.study).descs_per_packet if args.study else 1, 2 if args.tx_hdr == "chain" else 1)
    if k > 1 and ring is None:
        ring = max(256, 1 << (k * args.inject - 1).bit_length())
    elif k > 1 and ring < k * args.inject:
        raise ValueError(f"{'--study ' + args.study if args.study else '--tx-hdr chain'} takes {k} descriptors a "
                         f"packet: --ring-size must be at least {k} x --inject ({k * args.inject}) for every packet "
                         f"injected to be in flight")
    if args.cpus:
        try:
            dev_cpu, drv_cpu = (int(x) for x in args.cpus.split(","))
        except ValueError:
            raise ValueError(f"--cpus wants DEVICE,DRIVER (two CPU numbers), not {args.cpus!r}") from None
        how = {"chosen": "--cpus"}
    else:
        dev_cpu, drv_cpu, how = bench.default_cpus()
    modes = _modes(args)
    idle = args.idle if args.idle is not None else (2.0 if "notify" in modes else 0.0)
    cfg = bench.BenchConfig(pairs=pairs, paths=paths or list(bench.PATHS), pkt_sizes=args.pkt_size,
                            burst=args.burst, ring_size=256 if ring is None else ring, inject=args.inject, retries=args.retries,
                            txq_flush=args.txq_flush, mrg_rxbuf=args.mrg_rxbuf, tx_hdr=args.tx_hdr,
                            headroom=args.headroom,
                            seconds=args.seconds, warmup=args.warmup, interval=args.interval, repeat=args.repeat,
                            device_cpu=dev_cpu, driver_cpu=drv_cpu, cpu_choice=how, modes=modes,
                            rates=args.rate or [], idle_first=idle, idle_polls=args.idle_polls, study=args.study,
                            keep=args.keep)
    cfg.validate()
    if any("dpdk" in p for p in pairs):
        from vring import dpdk
        why = dpdk.skip_reason()
        if why:
            raise ValueError(f"the DPDK pairs need dpdk-testpmd: {why}")
    for option, path in (("--json", args.json if args.json != "-" else None), ("--plot", args.plot)):
        why = None if path is None else check_output_path(option, path)
        if why:
            raise ValueError(why)
    if args.json is not None and args.json != "-" and args.json == args.plot:
        raise ValueError(f"--json and --plot both name {args.json}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 (only: is it there)
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'vring[plot]' (or pip install matplotlib)") \
                from None
        ext = os.path.splitext(args.plot)[1][1:].lower()
        if ext:
            from matplotlib.backend_bases import FigureCanvasBase
            kinds = FigureCanvasBase.get_supported_filetypes()
            if ext not in kinds:
                raise ValueError(f"--plot {args.plot}: matplotlib cannot write .{ext} files "
                                 f"(it can: {', '.join(sorted(kinds))})")
    return cfg


class Progress:
    """One live line on stderr (rewritten in place on a terminal; one line per finished point otherwise)."""

    def __init__(self, stream=None, quiet=False):
        stream = stream or sys.stderr
        self.stream, self.quiet = stream, quiet
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = 0.0
        self.width = 0

    @staticmethod
    def _what(pt):
        bits = [pt.pair, pt.path, f"{pt.size} B"]
        if pt.mode != "poll":
            bits.append(pt.mode)
        if pt.rate is not None:
            bits.append(f"{bench._rate_label(pt.rate)} fps")
        if pt.variant:
            bits.append(f"[{pt.variant}]")
        return " ".join(bits) + f" rep {pt.rep + 1}"

    def _head(self, kw):
        return f"[{kw['index'] + 1}/{kw['count']}] " + self._what(kw["point"])

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
        pt = bench.Point(rec["repeat"], rec["path"], rec["pkt_size"], rec["pair"], rec["mode"], rec["offered_pps"],
                         rec["group"], rec["variant"])
        text = (f"[{index}/{count}] {self._what(pt)}: "
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
    if not args.quiet:
        print(bench.pinning_note(cfg), file=sys.stderr, flush=True)
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

    # SIGTERM and SIGHUP (the terminal closed: our children run in sessions of their own and do not get it) end
    # the run like Ctrl-C: every process of the current measurement is stopped and its directory removed
    with ending_like_ctrl_c():
        result = bench.run_bench(cfg, progress=progress, on_record=on_record)
    # a reader that went away (`| head`) leaves the status as it is; the --json file and the plot are still made
    failed_output = not stdout.result(bench.format_table(result), "vring bench")
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            failed_output = not stdout.result(text, "vring bench") or failed_output
        else:
            tmp = args.json + ".tmp"
            try:
                with open(tmp, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, args.json)
                print(f"json: {args.json}", file=sys.stderr)
            except OSError as e:   # checked before the run, but the disk may fill up or the directory go
                print(f"vring bench: cannot write --json {args.json}: {e.strerror or e}", file=sys.stderr)
                failed_output = True
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    if args.plot and result["points"]:
        try:
            bench.plot(result, args.plot)
            print(f"plot: {args.plot}", file=sys.stderr)
        except (OSError, ValueError) as e:
            print(f"vring bench: cannot write --plot {args.plot}: {getattr(e, 'strerror', None) or e}",
                  file=sys.stderr)
            failed_output = True
    if result["interrupted"]:
        print("vring bench: interrupted; the table and the JSON hold the points measured so far", file=sys.stderr)
        return 130
    ok = not result["errors"] and all(p["loss_check_ok"] for p in result["points"]) and not failed_output
    return 0 if ok else 1


def check_output_path(option, path):
    """Why ``path`` cannot be written as ``option``'s output (None if it can): checked before the run, so that a
    typo costs a usage error instead of the results of a (possibly hours-long) run."""
    if path == "":
        return f"{option} wants a file name, not an empty string"
    if os.path.isdir(path):
        return f"{option} {path}: is a directory (give a file name)"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"{option} {path}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {path}: directory {parent} is not writable"
    if os.path.lexists(path) and not os.path.isfile(path):
        return f"{option} {path}: exists and is not a regular file"
    return None
