"""`vring driver`: the virtio-net driver process against a vhost-user backend (e.g. DPDK net_vhost)."""
import json
import os
import signal
import sys

from rings.affinity import pin_error
from rings.errors import ConfigError
from rings.layout import check_size
from rings.pcap import is_socket
from rings.vhost_user import check_listen_path, check_unix_path
from virtio.app import DriverConfig, run
from virtio.net import PUBLISH_EVERY, PUBLISH_EVERY_MAX, TX_HDR
from virtio.pool import HEADROOM

from . import snapshot_options
from .stdout import result, unblocked


def register(sub):
    p = sub.add_parser("driver", help="run the virtio-net driver (vhost-user frontend) against a backend",
                       description=__doc__)
    p.add_argument("--socket", required=True, help="the backend's vhost-user socket (with --server: ours)")
    p.add_argument("--reconnect", action="store_true",
                   help="when the backend goes away keep rings and buffers, connect again (backoff, bounded by "
                        "--seconds) and resume at our ring positions; events as JSON lines on stderr")
    p.add_argument("--server", action="store_true",
                   help="listen on --socket (mode 0600); the backend connects (vring vhost --client, DPDK "
                        "net_vhost client=1) and may reconnect, as DPDK virtio_user server=1")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--inflight", dest="inflight", action="store_true", default=None,
                   help="negotiate VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD (inflight tracking) when offered; the default "
                        "with --reconnect or --server")
    g.add_argument("--no-inflight", dest="inflight", action="store_false",
                   help="do not negotiate INFLIGHT_SHMFD, even with --reconnect or --server")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--packed", dest="packed", action="store_true", help="packed virtqueues")
    g.add_argument("--split", dest="packed", action="store_false", help="split virtqueues (default)")
    p.set_defaults(packed=False)
    for name, dest, default, what in (("in-order", "in_order", True, "VIRTIO_F_IN_ORDER"),
                                      ("mrg-rxbuf", "mrg_rxbuf", True, "VIRTIO_NET_F_MRG_RXBUF"),
                                      ("event-idx", "event_idx", False, "VIRTIO_F_EVENT_IDX"),
                                      ("indirect", "indirect", True, "VIRTIO_F_INDIRECT_DESC"),
                                      ("version-1", "version_1", True, "VIRTIO_F_VERSION_1")):
        g = p.add_mutually_exclusive_group()
        g.add_argument(f"--{name}", dest=dest, action="store_true", help=f"negotiate {what}" +
                       (" (default)" if default else ""))
        g.add_argument(f"--no-{name}", dest=dest, action="store_false", help=f"do not negotiate {what}" +
                       ("" if default else " (default)"))
        p.set_defaults(**{dest: default})
    p.add_argument("--ring-size", type=int, default=256)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--mode", choices=("txonly", "macfwd", "rxonly", "rate"), default="macfwd",
                   help="rate: open loop at --rate frames/s, every frame stamped with the time it was due and its "
                        "round trip measured (default macfwd)")
    p.add_argument("--rate", type=float, default=0.0, metavar="PPS", help="--mode rate: frames per second")
    p.add_argument("--rx-burst", type=int, default=0, metavar="N",
                   help="--mode rate: receive at most N frames per step (default --burst; smaller: a receiver "
                        "slower than the sender)")
    p.add_argument("--count", type=int, default=0,
                   help="txonly/rxonly: stop after N packets; macfwd: inject N packets first (like tx_first)")
    p.add_argument("--seconds", type=float, default=0.0, help="run for S seconds (default: until Ctrl-C, "
                   "or until --count for txonly/rxonly)")
    p.add_argument("--pkt-size", type=int, default=64, help="frame size in bytes (without FCS), min 60")
    p.add_argument("--buf-size", type=int, default=2048,
                   help="pool buffer size incl. the headroom (small buffers: chained Tx, merged Rx; at 192 a 64-byte "
                        "frame takes 2 buffers, so the Rx ring holds half as many frames)")
    p.add_argument("--headroom", type=int, default=HEADROOM, metavar="BYTES",
                   help=f"bytes before the frame in each buffer; the Rx header lands in its last 12 (10 without "
                        f"VERSION_1), the Tx header goes there (default {HEADROOM}: header and frame start share a "
                        f"cache line; 128: the frame starts a line, as in DPDK's mbufs)")
    p.add_argument("--json", action="store_true", help="print the counters as JSON")
    p.add_argument("--check", action="store_true",
                   help="check the arguments and what the queues could carry (chain lengths, Rx buffers, injected "
                        "frames), print the warnings, and exit without connecting: 0 when the run could start, 2 "
                        "with the reason when it could not")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 when Tx buffers are still in flight at exit (the backend never completed "
                        "them); without it that is a warning (and tx_unfinished in the counters)")
    p.add_argument("--verify", action="store_true",
                   help="check every received frame: MACs swapped, payload intact, sequence numbers; macfwd --count: "
                        "every frame sent comes back, and once more at the end. Exit 1 when a check failed "
                        "(verify.failures says which)")
    p.add_argument("--stamp", action="store_true", help="timestamp generated frames (CLOCK_MONOTONIC ns)")
    p.add_argument("--latency", action="store_true",
                   help="macfwd: measure the round-trip latency of every frame (stamped at each send)")
    p.add_argument("--wait", action="store_true",
                   help="poll while busy; after --spin empty polls enable calls, re-check the ring and sleep on the "
                        "Rx call eventfd")
    p.add_argument("--latency-warmup", type=float, default=0.0, metavar="S",
                   help="start the latency histogram over S seconds after the loop starts (default: whole run)")
    p.add_argument("--idle-first", type=float, default=0.0, metavar="S",
                   help="bring the queues up, then stay idle S seconds before sending (to measure idle CPU); not "
                        "counted in --seconds, and a signal ends it like the run")
    p.add_argument("--tx-hdr", choices=TX_HDR, default="headroom",
                   help="where the Tx virtio-net header goes: the packet's headroom (one descriptor, default), "
                        "a descriptor of its own chained before the data, or one indirect descriptor for both")
    p.add_argument("--hdr-init", choices=("burst", "packet"), default="burst",
                   help="clear the Tx header template once per burst (default) or each header once per packet")
    p.add_argument("--doorbell", choices=("burst", "packet"), default="burst",
                   help="publish and (if the device asks) kick once per burst (default, like xmit_more) or after "
                        "every packet")
    p.add_argument("--tx-publish", type=int, default=PUBLISH_EVERY, metavar="N",
                   help=f"macfwd with no more than a burst out (sent, not back yet): receive, send and publish N "
                        f"packets at a time (default {PUBLISH_EVERY}), so that the device starts on the first "
                        f"packets while the driver receives the next; 0: whole bursts. Kicks stay once per step "
                        f"(--doorbell)")
    p.add_argument("--tx-slow-path", dest="force_slow", action="store_true",
                   help="send every packet through the slow path (header descriptor or indirect)")
    p.add_argument("--spin", type=int, default=64,
                   help="macfwd, rxonly: empty Rx polls done in C on an idle ring (with --wait: before sleeping); "
                        "C returns to Python at least every millisecond meanwhile, so a stop is seen at once")
    p.add_argument("--pin", type=int, default=None, metavar="CPU", help="pin this process to CPU")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for each vhost-user reply (SET_MEM_TABLE: at least 15, the backend maps "
                        "the memory meanwhile)")
    p.add_argument("--drain", type=float, default=0.3,
                   help="seconds to drain Rx at the end (--verify counts what comes back then; 0: no count)")
    p.add_argument("--ctl", metavar="PATH", help="serve ring dumps on this control socket (vring dump --ctl)")
    p.add_argument("--pcap", metavar="FILE", help="write the frames sent and received (pcap; the loop then runs "
                   "Python once per burst)")
    p.add_argument("--pcap-count", type=int, default=10000, metavar="N",
                   help="with --pcap: stop capturing after N frames (default %(default)s; 0: no limit)")
    snapshot_options.add(p)
    p.add_argument("--dst-mac", default=DriverConfig.dst_mac)
    p.add_argument("--src-mac", default=DriverConfig.src_mac)
    p.set_defaults(run=main)
    return p


def _check_args(args):
    """The first argument out of range, in words (None if all are fine): checked before connecting, so that a
    typo is a one-line error instead of a traceback (or a run that silently sends nothing) later."""
    import math
    for name, value, lo, hi in (("--count", args.count, 0, None), ("--burst", args.burst, 1, 1024),
                                ("--rx-burst", args.rx_burst, 0, 1024), ("--pkt-size", args.pkt_size, 1, 65535 - 12),
                                ("--spin", args.spin, 0, 1 << 31), ("--pcap-count", args.pcap_count, 0, None),
                                ("--pin", args.pin, 0, None), ("--tx-publish", args.tx_publish, 0, PUBLISH_EVERY_MAX)):
        if value is not None and (value < lo or hi is not None and value > hi):
            return f"{name} must be " + (f"{lo}..{hi}" if hi is not None else f">= {lo}") + f", not {value}"
    for name, value in (("--seconds", args.seconds), ("--drain", args.drain), ("--latency-warmup", args.latency_warmup),
                        ("--idle-first", args.idle_first), ("--rate", args.rate)):
        if not (math.isfinite(value) and value >= 0):
            return f"{name} must be a finite number >= 0, not {value}"
    try:
        check_size("packed" if args.packed else "split", args.ring_size)
    except ConfigError as e:
        return f"--ring-size: {e}"
    if args.pin is not None and (why := pin_error(args.pin)):
        return why
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a finite number > 0, not {args.timeout}"
    for name, path in (("--pcap", args.pcap), ("--ctl", args.ctl)):
        if path == "":   # as `vring vhost`: an empty path is a mistake, not "off" (leave the option out)
            return f"{name} needs a path, not an empty one"
    # created once the device runs (or, --server, before connecting): what can be known now is said now
    made = [(name, path) for name, path in (("--pcap", args.pcap), ("--ctl", args.ctl),
                                            ("--socket", args.socket if args.server else None)) if path]
    for name, path in made:
        if path.endswith("/"):   # abspath would drop it; open and bind would not
            return f"{name} {path}: a trailing / names a directory, not a file"
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return f"{name} {path}: there is no directory {os.path.dirname(os.path.abspath(path))}"
    if args.pcap and os.path.isdir(args.pcap):
        return f"--pcap {args.pcap} is a directory"
    if args.pcap and is_socket(args.pcap):
        return f"--pcap {args.pcap} is a unix socket, not a file or a FIFO"
    for i, (a, pa) in enumerate(made):   # one file under two options (symlinks resolved): one would take the other's
        for b, pb in made[i + 1:]:
            if os.path.realpath(pa) == os.path.realpath(pb):
                return f"{a} and {b} are the same path, {pa}"
    for name, path in (("--ctl", args.ctl), ("--socket", args.socket if args.server else None)):
        try:
            if path:
                check_listen_path(path)
        except ConfigError as e:
            return f"{name} {e}"
    try:
        check_unix_path(args.socket)   # --server: checked above; a client connects to it
    except ConfigError as e:
        return f"--socket {e}"
    for name, mac in (("--dst-mac", args.dst_mac), ("--src-mac", args.src_mac)):
        parts = mac.split(":")
        if len(parts) != 6 or not all(len(p) == 2 and all(c in "0123456789abcdefABCDEF" for c in p) for p in parts):
            return f"{name} must look like 02:00:00:00:00:01, not {mac!r}"
    return None


def _print_report(args, res):
    """The report on stdout. Its reader going away (`| head`) changes nothing the run returns; a stdout that
    cannot be written otherwise (a full disk) is a one-line error: exit 2."""
    return None if result(lambda: _write_report(args, res), "vring driver") else 2


def _write_report(args, res):
    if args.json:
        print(json.dumps(res, indent=1))
        return
    if res.get("checked"):
        n = len(res["warnings"])
        print(f"vring driver: the configuration checks out ({n} warning{'s' * (n != 1)}); not connected")
        return
    rx, tx = res["rx"], res["tx"]
    print(f"features {res['features']:#x} ({' '.join(res['feature_names'])}), header {res['hdr_size']} B")
    print(f"rx: {rx['packets']} packets {rx['bytes']} bytes ({res['rx_pps']} pps), errors {rx['errors']}")
    print(f"tx: {tx['packets']} packets {tx['bytes']} bytes ({res['tx_pps']} pps), kicks {tx['kicks']}, "
          f"cleanups {tx['cleanups']}, reclaimed {tx['reclaimed_descs']} descs, dropped {tx['dropped']}")
    for key in ("latency", "verify", "pcap", "error"):
        if key in res:
            print(f"{key}: {res[key]}")


def main(args):
    cfg = DriverConfig(
        socket=args.socket, packed=args.packed, in_order=args.in_order, mrg_rxbuf=args.mrg_rxbuf,
        version_1=args.version_1, event_idx=args.event_idx, indirect=args.indirect, ring_size=args.ring_size,
        burst=args.burst, mode=args.mode, count=args.count, seconds=args.seconds, pkt_size=args.pkt_size,
        dst_mac=args.dst_mac, src_mac=args.src_mac, verify=args.verify, stamp=args.stamp, latency=args.latency, wait=args.wait,
        force_slow=args.force_slow, spin=args.spin, buf_size=args.buf_size, headroom=args.headroom, drain=args.drain, timeout=args.timeout, pin=args.pin,
        ctl=args.ctl, pcap=args.pcap, pcap_count=args.pcap_count, rate=args.rate,
        latency_warmup=args.latency_warmup, idle_first=args.idle_first,
        tx_hdr=args.tx_hdr, hdr_init=args.hdr_init, doorbell=args.doorbell, tx_publish=args.tx_publish,
        rx_burst=args.rx_burst,
        reconnect=args.reconnect, server=args.server, inflight=args.inflight)
    error = _check_args(args) or snapshot_options.apply(args)
    if error is None and args.mode == "rate" and not args.rate > 0:
        error = "--mode rate needs --rate PPS > 0"
    if error:
        print(f"vring driver: {error}", file=sys.stderr)
        return 2
    if args.check:
        try:
            warnings = cfg.check()
        except ConfigError as e:
            print(f"vring driver: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        for w in warnings:
            print(f"vring driver: warning: {w}", file=sys.stderr)
        return _print_report(args, {"checked": True, "connected": False, "warnings": warnings}) or 0
    with unblocked(stdout=False):   # its events and warnings: a stderr reader that stopped holds up no ring and
        return _run(args, cfg)      # no exit (the report, on stdout, is the result: it waits for its reader)


def _run(args, cfg):
    try:
        res = run(cfg, after_signals=signal.SIG_IGN if getattr(args, "own_process", False) else None)
    except Exception as e:  # a clear one-line error, not a traceback, for protocol/feature failures
        from rings.errors import VringError
        if isinstance(e, (VringError, OSError)):   # OSError: a --pcap/--ctl path we cannot create
            if getattr(e, "report", None) is not None:   # the run had started: what it did, the error in it
                _print_report(args, e.report)   # exit 2 whatever became of the report
            print(f"vring driver: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise
    rc = _print_report(args, res) or 0
    failures = res.get("verify", {}).get("failures")
    if failures:
        print(f"vring driver: VerifyFailed: {'; '.join(failures)}", file=sys.stderr)
        rc = rc or 1
    unfinished = res.get("tx_unfinished", 0)
    if unfinished:
        what = (f"{unfinished} Tx buffer{'s' * (unfinished != 1)} still in flight at exit: the backend never "
                f"completed them")
        if args.strict:
            print(f"vring driver: TxUnfinished: {what}", file=sys.stderr)
            return 2
        print(f"vring driver: warning: {what} (--strict makes this an error)", file=sys.stderr)
    return rc
