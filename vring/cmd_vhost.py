"""`vring vhost`: the vhost-user backend emulator (a virtio-net device that forwards packets back)."""
import dataclasses
import logging
import os
import signal
import sys

from rings import interrupts
from rings.affinity import pin_all_threads, pin_error
from rings.ctl import ControlServer
from rings.errors import ConfigError
from rings.interrupts import SignalWakeup

from . import snapshot_options
from .stdout import closed_quietly, unblocked

log = logging.getLogger("vhost")


def register(sub):
    p = sub.add_parser("vhost", help="run the vhost-user backend (virtio-net device) on a Unix socket")
    p.add_argument("--socket", required=True, metavar="PATH", help="vhost-user socket (created with mode 0600)")
    p.add_argument("--client", action="store_true",
                   help="connect to PATH (a frontend in server mode) instead of listening; reconnects")
    p.add_argument("--retries", type=int, default=0, metavar="N",
                   help="Rx enqueue retries 0..8, each only after an attempt that made progress (default 0)")
    p.add_argument("--used-batch", choices=("per-buffer", "per-burst"), default="per-burst",
                   help="publish used entries after each buffer/packet or once per burst (default); with inflight "
                        "tracking Tx chains wait until their frames are delivered")
    p.add_argument("--in-order-batch", action="store_true",
                   help="with IN_ORDER: one used entry per batch on the Tx queue (vring 1), as DPDK writes it")
    p.add_argument("--txq-threshold", type=int, default=32, metavar="N",
                   help="intermediate Tx queue: enqueue when N packets wait (default 32)")
    p.add_argument("--txq-flush", default="rx-batch", metavar="none|rx-batch|timer:US|threshold",
                   help="drain the rest after every poll (rx-batch, default), after US microseconds "
                        "(timer:US), or when the Tx queue runs dry (threshold); none: no intermediate queue, "
                        "each one-segment frame up to --pkt-size is copied straight from the Tx buffer into an Rx "
                        "buffer")
    p.add_argument("--idle", choices=("poll", "sleep"), default="poll",
                   help="poll: busy-poll the Tx queue always (default, like net_vhost); sleep: after --idle-polls "
                        "empty polls enable kicks, re-check the ring, and block on the kick eventfd")
    p.add_argument("--idle-polls", type=int, default=256, metavar="N",
                   help="--idle sleep: empty polls before going to sleep (default 256)")
    p.add_argument("--fwd", choices=("macswap", "io", "rxonly"), default="macswap")
    p.add_argument("--burst", type=int, default=32, help="dequeue burst (default 32)")
    p.add_argument("--pkt-size", type=int, default=2048,
                   help="bytes a frame takes in the intermediate queue (default 2048); longer frames, up to 65535 "
                        "bytes, take the room they need, longer ones are dropped and counted")
    p.add_argument("--stats-interval", type=float, default=0.0, metavar="S",
                   help="print counters every S seconds (default: only at exit)")
    p.add_argument("--json", action="store_true", help="counters as JSON lines")
    p.add_argument("--pin", type=int, default=None, metavar="CPU", help="pin the process to CPU")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="exit after N frontends have come and gone (default: serve forever)")
    p.add_argument("--reconnect", type=float, default=1.0, metavar="S", help="--client: retry every S seconds")
    p.add_argument("--handshake-timeout", type=float, default=5.0, metavar="S",
                   help="drop a frontend that has not asked GET_FEATURES within S seconds of connecting "
                        "(default 5); while one frontend is served, others are refused at once")
    p.add_argument("--slice-us", type=int, default=500, metavar="US",
                   help="data-path time slice between looks at the control socket (default 500)")
    p.add_argument("--timing", action="store_true",
                   help="measure the time spent in iterations that moved packets (busy_ns counter)")
    p.add_argument("--crash-after", type=int, default=0, metavar="N",
                   help="fault injection: exit at once (as a kill -9 would: nothing cleaned up) right after the Nth "
                        "enqueue that delivered packets; with inflight tracking, before the Tx chains they came from "
                        "are completed: the window a restarting frontend must handle (default 0: never)")
    p.add_argument("--ctl", metavar="PATH", help="serve ring dumps on this control socket (vring dump --ctl)")
    p.add_argument("--pcap", metavar="FILE", help="write the frames taken off and put on the rings (pcap; "
                   "captured one burst at a time, which drains the intermediate queue after every burst; every frame "
                   "is copied into it, --txq-flush none too)")
    p.add_argument("--pcap-count", type=int, default=10000, metavar="N",
                   help="with --pcap: stop capturing after N frames (default %(default)s; 0: no limit)")
    snapshot_options.add(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.set_defaults(run=run)


def run(args):
    from vhost.datapath import Options
    from vhost.server import Server

    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose + 1, 2), stream=sys.stderr,
                        format="%(asctime)s vhost %(levelname)s %(message)s")
    import math
    for name, value, positive in (("--handshake-timeout", args.handshake_timeout, True),
                                  ("--reconnect", args.reconnect, True),
                                  ("--stats-interval", args.stats_interval, False),
                                  ("--pcap-count", args.pcap_count, False), ("--retries", args.retries, False),
                                  ("--idle-polls", args.idle_polls, False), ("--slice-us", args.slice_us, True),
                                  ("--crash-after", args.crash_after, False)):
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            return _error(f"{name} must be a number {'>' if positive else '>='} 0, not {value}")
    if args.ctl is not None and (not args.ctl or os.path.abspath(args.ctl) == os.path.abspath(args.socket)):
        return _error(f"--ctl needs a path of its own (not empty, not --socket), not {args.ctl!r}")
    if args.pcap == "":
        return _error("--pcap needs a path, not an empty one")
    if args.slice_us > 10_000_000:   # the C loop takes it in ns, a uint64; the control socket waits a slice
        return _error(f"--slice-us must be at most 10000000 (10 s), not {args.slice_us}")
    if args.max_connections is not None and args.max_connections < 1:   # 0 or less: served nobody, exit 0
        return _error(f"--max-connections must be >= 1, not {args.max_connections}")
    if args.pin is not None:
        if why := pin_error(args.pin):
            return _error(why)
        pin_all_threads(args.pin)   # numpy's BLAS threads too: started at import, unpinned
    try:
        opts = Options(burst=args.burst, retries=args.retries, used_batch=args.used_batch,
                       in_order_batch=args.in_order_batch, txq_threshold=args.txq_threshold,
                       txq_flush=args.txq_flush, fwd=args.fwd, pkt_size=args.pkt_size,
                       timing=args.timing, idle=args.idle, idle_polls=args.idle_polls,
                       crash_after=args.crash_after)
    except (ConfigError, ValueError) as e:
        return _error(e)
    error = snapshot_options.apply(args)
    if error:
        return _error(error)
    server = Server(args.socket, opts, client=args.client, reconnect_s=args.reconnect, budget_us=args.slice_us,
                    stats_interval=args.stats_interval, json_stats=args.json,
                    handshake_timeout=args.handshake_timeout)
    old = interrupts.install(server.on_signal)   # each ends it cleanly: the socket file goes too
    try:
        with unblocked() as (out, _):   # a reader that stopped reading holds up neither the rings nor a stop
            if out is not None:
                server.out = out
            rc = _serve(args, server, opts)
            if out is not None:
                out.close()
                if server.out_error is None and server.out is not None:
                    server.out_error = out.error
                if out.dropped and out.error is None:   # (one that went away: `| head`, no news)
                    log.warning("%d lines of stats dropped: stdout's reader did not take them in time", out.dropped)
        if server.out_error is not None:   # no second error at exit; a reader that went away (`| head`) is no
            closed_quietly()               # error, a stdout that failed otherwise (a full disk) is, as elsewhere
            if not isinstance(server.out_error, BrokenPipeError):
                rc = rc or 2
        return rc
    finally:   # see cli.main: SIG_IGN for the process's own command line, a test's own handlers otherwise
        interrupts.restore(old, signal.SIG_IGN if getattr(args, "own_process", False) else None)


def _serve(args, server, opts):
    """Open the sockets and serve; the stop signals' handlers are installed."""
    ctl = None
    try:   # a live socket at either path is never taken over: a clear error, exit 2
        server.open()
        if server.stopping:   # a stop signal came first (the open may have waited for its directory's lock)
            server.close()
            return 0
        if args.ctl:
            def queue(index):  # the queues of the current connection's data path, if any
                dp = server.device.datapath if server.device is not None else None
                return None if dp is None else (dp.rxq, dp.txq)[index]
            ctl = ControlServer(args.ctl).register("rx", lambda: queue(0)).register("tx", lambda: queue(1))
            ctl.start()
    except ConfigError as e:
        server.close()
        return _error(e)
    pcap = None
    if args.pcap:   # last: a run that ends in a usage error or on a taken socket neither leaves nor truncates it
        from rings.pcap import PcapWriter
        try:
            pcap = PcapWriter(args.pcap, args.pcap_count or None)
        except (OSError, ValueError) as e:
            if ctl is not None:
                ctl.close()
            server.close()
            why = str(e) if isinstance(e, ConfigError) else f"{args.pcap}: {getattr(e, 'strerror', None) or e}"
            return _error(f"--pcap {why}")   # (a ConfigError names the path itself)
        server.options = dataclasses.replace(opts, pcap=pcap)   # no connection yet: each one's device takes these
    if not args.client:
        print(f"vring vhost: listening on {args.socket}", file=sys.stderr, flush=True)
    server.wakeup = SignalWakeup()   # a stop signal ends whatever wait the server is in at once
    try:
        server.serve(max_connections=args.max_connections)
    finally:
        server.wakeup.close()
        if ctl is not None:
            ctl.close()
        if pcap is not None:
            pcap.close()
            limit = f"limit {pcap.limit}, " if pcap.limit else ""
            print(f"vring vhost: pcap {pcap.path}: {pcap.written} frames" +
                  (f" ({limit}{pcap.left_out} more left out)" if limit or pcap.left_out else "") +
                  (f"; {pcap.dropped} dropped" + ("" if pcap.error else " (the reader fell behind)")
                   if pcap.dropped else "") +
                  (f"; capture stopped: {pcap.error}" if pcap.error else ""), file=sys.stderr)
    return 0


def _error(e):
    print(f"vring vhost: {e}", file=sys.stderr, flush=True)
    return 2
