"""`vring conform`: check anyone's virtio-net backend (``device``) or driver (``driver``) against the spec.

The result is one row per checklist ID (shared/spec/virtio-checklist.md): pass (with the number of
observations), FAIL with the evidence, WARN (a SHOULD-level deviation, with the evidence) or not exercised.
Exit status: 0 all exercised requirements hold, 1 a requirement failed, 2 usage or connection error (or a
run that ended early: the peer left, stopped answering or stalled).
"""
import argparse
import sys

from rings.errors import VringError
from rings.interrupts import ending_like_ctrl_c
from vring.stdout import result

EPILOG_DEVICE = """\
The backend must loop the frames it receives on the driver's Tx queue back into the driver's Rx queue:
  dpdk-testpmd --no-huge --no-pci -m 512 --vdev net_vhost0,iface=S -- -i --forward-mode=io   (then: start)
  vring vhost --socket S --fwd macswap
A backend that does not loop gets its Tx side checked; the Rx rows stay "not exercised"."""

EPILOG_DRIVER = """\
The driver must send back what it receives (a forwarding application):
  dpdk-testpmd --no-huge --no-pci -m 512 --single-file-segments \\
      --vdev virtio_user0,path=S,packed_vq=1,in_order=1 -- -i --forward-mode=mac   (then: start)
  vring driver --socket S --mode macfwd --seconds 20
The harness injects its own numbered frames; frames the driver sends first (tx_first) are looped too."""


def _onoff(p, name, dest, default, what):
    g = p.add_mutually_exclusive_group()
    g.add_argument(f"--{name}", dest=dest, action="store_true", help=f"{what}" + (" (default)" if default else ""))
    g.add_argument(f"--no-{name}", dest=dest, action="store_false", help=f"not {what}" + ("" if default else
                                                                                          " (default)"))
    p.set_defaults(**{dest: default})


def _common(p):
    p.add_argument("--socket", required=True, metavar="PATH", help="the vhost-user socket")
    p.add_argument("--json", action="store_true", help="the report as JSON instead of the table")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each vhost-user reply (default 5)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random choices (default 1)")


def register(sub):
    p = sub.add_parser("conform", help="check a virtio-net backend or driver against the spec, over vhost-user",
                       description=__doc__)
    roles = p.add_subparsers(dest="role", required=True, metavar="ROLE")

    d = roles.add_parser("device", help="we are the driver: check the backend at --socket",
                         description="We are the frontend (virtio-net driver); the backend under test is checked.",
                         epilog=EPILOG_DEVICE, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(d)
    g = d.add_mutually_exclusive_group()
    g.add_argument("--packed", dest="packed", action="store_true", help="packed virtqueues")
    g.add_argument("--split", dest="packed", action="store_false", help="split virtqueues (default)")
    d.set_defaults(packed=False)
    _onoff(d, "in-order", "in_order", True, "negotiate VIRTIO_F_IN_ORDER")
    _onoff(d, "mrg-rxbuf", "mrg_rxbuf", False, "negotiate VIRTIO_NET_F_MRG_RXBUF")
    _onoff(d, "event-idx", "event_idx", False, "negotiate VIRTIO_F_EVENT_IDX")
    _onoff(d, "indirect", "indirect", True, "use VIRTIO_F_INDIRECT_DESC when offered")
    d.add_argument("--ring-size", type=int, default=256, help="entries per vring (default 256)")
    d.add_argument("--layout", choices=("spread", "contiguous"), default="spread",
                   help="ring areas apart, in reverse order, minimally aligned (default), or virtio_user's layout")
    d.add_argument("--base", type=int, default=None,
                   help="split: first ring index (default: 1.5 rings before 65536, to cross the 16-bit wrap)")
    d.add_argument("--scenarios", default=None, metavar="A,B,...",
                   help="run only these scenarios (start, batches, chains, rx-hdr-split, mergeable, notify-off, "
                        "spurious-kicks)")
    d.add_argument("--stall", type=float, default=5.0,
                   help="seconds without progress before the backend counts as stalled (default 5)")
    d.add_argument("--rx-wait", type=float, default=1.0, help="seconds to wait for a frame to come back")
    d.set_defaults(run=run_device)

    v = roles.add_parser("driver", help="we are the device: check the driver that connects to --socket",
                         description="We are the backend (a virtio-net device); the frontend under test is "
                                     "checked.", epilog=EPILOG_DRIVER,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(v)
    v.add_argument("--client", action="store_true",
                   help="connect to --socket (a frontend in server mode) instead of listening")
    v.add_argument("--seconds", type=float, default=10.0, help="how long to run the scenarios (default 10)")
    v.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the driver to connect and start")
    v.add_argument("--phases", default=None, metavar="A,B,...",
                   help="run only these device behaviours, in this order (per-buffer, kicks, batches, ring-full, "
                        "late, spurious-calls)")
    _onoff(v, "event-idx", "event_idx", True, "offer VIRTIO_F_EVENT_IDX")
    _onoff(v, "indirect", "indirect", True, "offer VIRTIO_F_INDIRECT_DESC")
    v.set_defaults(run=run_driver)
    p.set_defaults(run=lambda a: p.error("choose a role: device or driver"))


def _emit(args, report):
    if not result(report.to_json() if args.json else report.table(), "vring conform"):
        return 2
    return report.exit_code()


def _fail(e):
    print(f"vring conform: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


def _ended(args, e, report):
    """The run ended on an error before it had a report of its own: one line on stderr, and with --json still a
    document (its ``error`` set), so a script reading stdout always gets one. The table shows only if something
    already failed; the exit status is the report's (1 when a requirement failed, else 2)."""
    _fail(e)
    report.error = f"{type(e).__name__}: {e}"
    if args.json or report.failed():
        _emit(args, report)
    return report.exit_code()


def run_device(args):
    from conform.device import SCENARIOS, DeviceHarness, DeviceOptions
    try:
        opts = DeviceOptions(socket=args.socket, packed=args.packed, in_order=args.in_order,
                             mrg_rxbuf=args.mrg_rxbuf, event_idx=args.event_idx, indirect=args.indirect,
                             ring_size=args.ring_size, timeout=args.timeout, stall=args.stall, rx_wait=args.rx_wait,
                             base=args.base, layout=args.layout, seed=args.seed,
                             scenarios=tuple(args.scenarios.split(",")) if args.scenarios else SCENARIOS)
        harness = DeviceHarness(opts)
    except VringError as e:   # usage: no run, no report
        return _fail(e)
    return _run(args, harness)


def _run(args, harness):
    try:
        with ending_like_ctrl_c():   # SIGTERM / SIGHUP: the socket and rings cleaned up as on Ctrl-C
            report = harness.run()
    except VringError as e:
        return _ended(args, e, harness.report)
    return _emit(args, report)


def run_driver(args):
    from conform.driver import DriverHarness, DriverOptions
    try:
        opts = DriverOptions(socket=args.socket, client=args.client, seconds=args.seconds, wait=args.wait,
                             timeout=args.timeout, seed=args.seed, event_idx=args.event_idx, indirect=args.indirect,
                             **({"phases": tuple(args.phases.split(","))} if args.phases else {}))
        harness = DriverHarness(opts)
    except VringError as e:
        return _fail(e)
    return _run(args, harness)
