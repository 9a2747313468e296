"""`vring` command line: one subcommand per module ``vring.cmd_<name>`` (each has ``register(sub)``)."""
import argparse
import importlib
import sys

SUBCOMMANDS = ["demo", "driver", "vhost", "dump", "bench", "conform", "tap"]


def build_parser():
    parser = argparse.ArgumentParser(prog="vring", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"vring.cmd_{name}").register(sub)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
