"""`vring demo`: a driver process and a device process move numbered buffers over each ring variant.

Exit status: 0 done (a reader that closed the pipe included), 1 a variant failed, 2 usage."""
import json

from rings.errors import ConfigError, VringError
from rings.interrupts import ending_like_ctrl_c
from rings.layout import MAX_QUEUE_SIZE, check_size
from rings.twoproc import run_two_processes
from vring.stdout import StdoutClosed, closed_quietly, out, usage_error


def register(sub):
    p = sub.add_parser("demo", help="move buffers between two processes over split and packed rings")
    p.add_argument("--count", type=int, default=200_000, help="buffers per variant (default 200000)")
    p.add_argument("--ring-size", type=int, default=256)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run)


def run(args):
    if not (0 < args.count < 1 << 63 and 0 < args.burst <= MAX_QUEUE_SIZE):   # (a burst is at most a ring)
        return usage_error("vring demo", f"--count must be in 1..2^63-1 and --burst in 1..{MAX_QUEUE_SIZE}, not "
                                         f"{args.count} and {args.burst}")
    try:
        for fmt in ("split", "packed"):   # every variant runs at this size: a split one needs a power of 2
            check_size(fmt, args.ring_size)
    except ConfigError as e:
        return usage_error("vring demo", f"--ring-size: {e}")
    # SIGTERM / SIGHUP (a supervisor, a closed terminal) end the demo like Ctrl-C: the two child processes are
    # stopped and the shared-memory segment unlinked on the way out (exit 130), instead of dying at once and
    # leaving both behind
    with ending_like_ctrl_c():
        try:
            return _run(args)
        except StdoutClosed:   # `vring demo | head -1`: the reader has all it wanted
            return closed_quietly()
        except OSError as e:   # stdout on a full disk
            raise SystemExit(f"vring demo: {e}") from None


def _run(args):
    results = []
    for fmt in ("split", "packed"):
        for in_order in (False, True):
            variant = f"{fmt}/{'in-order' if in_order else 'normal'}"
            try:
                r = run_two_processes(fmt, args.ring_size, in_order, args.count, burst=args.burst)
            except VringError as e:
                raise SystemExit(f"vring demo: {variant}: {e}")
            r["variant"] = variant
            results.append(r)
            if not args.json:
                out(f"{variant:17} {r['buffers']:>9} buffers in {r['seconds']:.2f}s "
                    f"({r['rate'] / 1e6:.2f} M/s), each seen once by the device and returned once "
                    f"to the driver; device calls {r['calls']}, driver kicks {r['kicks']}")
    if args.json:
        out(json.dumps(results, indent=2))
