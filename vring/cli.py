"""`vring` command line: one subcommand per module ``vring.cmd_<name>`` (each has ``register(sub)``)."""
import sys

SUBCOMMANDS = ["demo", "driver", "vhost", "dump", "bench", "conform", "tap"]


def build_parser():
    import argparse
    import importlib
    parser = argparse.ArgumentParser(prog="vring", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"vring.cmd_{name}").register(sub)
    return parser


def main(argv=None):
    # Building the parser imports every subcommand (numpy, cffi, ...): a Ctrl-C then is as quiet as one later
    # (exit 130, no traceback), so it is inside the try too.
    try:
        args = build_parser().parse_args(argv)
        # the process's own command line: a command's stop-signal handlers give way to SIG_IGN, not to what was
        # there before (the default action, which would kill it on its way out); a test calling in gets its own back
        args.own_process = argv is None
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    finally:
        if argv is None:   # the process's own command line (not a test calling in): it is over
            _ignore_ending_signals()


def _ignore_ending_signals():
    """The command is done, its clean-up too. The interpreter's shutdown puts the default handlers back, and a stop
    signal then (a supervisor that keeps sending, a second Ctrl-C) would turn the exit status into -N: ignored."""
    import signal
    from rings.interrupts import ENDING
    for s in ENDING:
        signal.signal(s, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
