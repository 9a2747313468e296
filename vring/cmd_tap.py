"""`vring tap`: a transparent vhost-user proxy between any frontend and any backend (DPDK virtio_user and
net_vhost, QEMU, ours), and what it sees from there.

Where the peers are:
  --listen A            the frontend connects to A (a client frontend: virtio_user, QEMU without server=on)
  --frontend-connect A  the frontend listens at A (virtio_user server=1): the tap connects, and reconnects
  --connect B           the backend listens at B (net_vhost, vring vhost): the tap connects to it for every
                        frontend that comes
  --backend-listen B    the backend connects to B (net_vhost client=1, vring vhost --client)
Every message, with its fds, goes on unchanged, replies included; kick and call eventfds pass straight
through (the data path never touches the tap) unless --notify-tap.

What it tells:
  --ctl SOCK     live dumps of the peers' rings: `vring dump --ctl SOCK [rx|tx|rx1|...]`, --watch, --raw
                 (ring memory decoded without either peer's private state; the unknowns are said)
  --log FILE     every message both ways as JSON lines; `vring tap --decode FILE` prints them
  --pcap FILE    the frames crossing the rings (virtio-net header stripped), at most --pcap-count
  --notify-tap   the tap's own eventfds between the peers: every kick and call counted, timed, passed on

Exit status: 0 served (or decoded a clean log), 1 a run-time error or a log line that would not decode, 2 usage.
"""
import argparse
import contextlib
import math
import os
import sys
import threading

from rings import interrupts
from rings.ctl import ControlServer
from rings.errors import VringError
from vring.stdout import closed_quietly, usage_error


def register(sub):
    p = sub.add_parser("tap", help="transparent vhost-user proxy: message log, live ring dumps, packet capture",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fe = p.add_mutually_exclusive_group()
    fe.add_argument("--listen", metavar="A", help="socket the frontend connects to (created 0600)")
    fe.add_argument("--frontend-connect", metavar="A", help="the frontend's listening socket")
    be = p.add_mutually_exclusive_group()
    be.add_argument("--connect", metavar="B", help="the backend's listening socket")
    be.add_argument("--backend-listen", metavar="B", help="socket the backend connects to (created 0600)")
    p.add_argument("--ctl", metavar="SOCK", help="serve live ring dumps here (vring dump --ctl SOCK)")
    p.add_argument("--log", metavar="FILE", help="write every vhost-user message as a JSON line")
    p.add_argument("--pcap", metavar="FILE", help="write the frames crossing the rings (pcap)")
    p.add_argument("--pcap-count", type=int, default=10000, metavar="N",
                   help="stop capturing after N frames (default %(default)s; 0: no limit)")
    p.add_argument("--notify-tap", action="store_true",
                   help="interpose the tap's own kick/call eventfds to count and time every notification")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N",
                   help="exit after N frontend/backend pairs have come and gone (default: serve forever)")
    p.add_argument("--peer-timeout", type=float, default=30.0, metavar="S",
                   help="how long to wait for the backend once a frontend is there (default %(default)s)")
    p.add_argument("--decode", metavar="FILE", help="print a --log file readably and exit")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.set_defaults(run=run)


def run(args):
    if args.decode:
        from tap.msglog import decode_file
        try:   # with no stdout (`>&-`) the log is still read: the exit status says whether it decodes
            with open(os.devnull, "w") if sys.stdout is None else contextlib.nullcontext(sys.stdout) as stream:
                bad = decode_file(args.decode, stream)
                stream.flush()
        except BrokenPipeError:   # `vring tap --decode LOG | head` (only stdout can be a pipe here)
            return closed_quietly()
        except OSError as e:
            raise SystemExit(f"vring tap: {e}")
        return 1 if bad else 0
    if not (args.listen or args.frontend_connect) or not (args.connect or args.backend_listen):
        return usage_error("vring tap", "give the frontend side (--listen A or --frontend-connect A) and the "
                                        "backend side (--connect B or --backend-listen B)")
    if args.pcap_count < 0:
        return usage_error("vring tap", f"--pcap-count must be >= 0, not {args.pcap_count}")
    if args.max_sessions is not None and args.max_sessions < 1:   # 0: would serve nobody and exit 0
        return usage_error("vring tap", f"--max-sessions must be >= 1, not {args.max_sessions}")
    given = [p for p in (args.listen, args.frontend_connect, args.connect, args.backend_listen, args.ctl, args.log,
                         args.pcap) if p is not None]
    if "" in given:
        return usage_error("vring tap", "a socket or file option needs a non-empty path")
    paths = [os.path.realpath(p) for p in given]   # (one file under two names, through a symlink, is one)
    if len(set(paths)) < len(paths):   # the tap would meet itself there, or write a file over its socket
        return usage_error("vring tap", "the frontend's, the backend's and the --ctl socket, --log and --pcap "
                                        "each need a path of their own")
    if not (math.isfinite(args.peer_timeout) and 0 < args.peer_timeout <= 86400):   # nan, <= 0: every frontend dropped
        return usage_error("vring tap", f"--peer-timeout must be a number of seconds in (0, 86400], not "
                                        f"{args.peer_timeout}")
    import logging

    from rings.pcap import PcapWriter
    from tap.capture import Capture
    from tap.msglog import MessageLog
    from tap.notify import NotifyRelay
    from tap.picture import Picture, queue_name
    from tap.proxy import Endpoint, Tap

    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(asctime)s tap %(levelname)s %(message)s")
    stop = threading.Event()
    interrupts.install(lambda *_: stop.set())
    log = notify = ctl = capture = frontend = backend = None
    try:
        ctl = ControlServer(args.ctl) if args.ctl else None
        picture = Picture(notify_tap=args.notify_tap,
                          on_vring=(lambda i: ctl.register(queue_name(i), lambda: picture.view(i))) if ctl else None)
        log = MessageLog(args.log) if args.log else None
        notify = NotifyRelay(picture, log) if args.notify_tap else None
        if args.pcap:
            capture = Capture(picture, PcapWriter(args.pcap, args.pcap_count or None)).start()
        frontend = Endpoint("frontend", args.listen or args.frontend_connect, listen=bool(args.listen))
        backend = Endpoint("backend", args.connect or args.backend_listen, listen=bool(args.backend_listen))
        tap = Tap(frontend, backend, picture, log, notify, peer_timeout=args.peer_timeout)
        if ctl is not None:
            ctl.start()
        frontend.open()
        backend.open()
        print(f"vring tap: {frontend} <-> {backend}", file=sys.stderr, flush=True)
        tap.serve(stop, args.max_sessions)
    except (VringError, OSError) as e:
        raise SystemExit(f"vring tap: {' '.join(str(e).split())}")
    finally:
        for side in (frontend, backend):  # serve() closes them; this covers a failure before it runs
            if side is not None:
                side.close()
        if capture is not None:
            capture.stop()
            st = capture.stats()
            print(f"vring tap: pcap {st['path']}: {st['written']} frames"
                  + (f" (limit {st['limit']}, {st['left_out']} more seen and left out)" if st["limit"] else "")
                  + (f"; {st['dropped']} dropped (the reader fell behind or left)" if st["dropped"] else "")
                  + f"; not captured: lapped {st['lapped']}, lost {st['lost']}, unreadable {st['unreadable']}, "
                    f"not seen published {st['not_seen_published']}"
                  + (f"; capture stopped: {st['error']}" if st["error"] else ""), file=sys.stderr)
        if notify is not None:
            notify.close()
        if ctl is not None:
            ctl.close()
        if log is not None:
            log.close()
    return 0
