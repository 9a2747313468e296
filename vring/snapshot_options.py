"""The snapshot options `vring driver` and `vring vhost` share: where a queue broken by its peer writes its raw
ring snapshot (rings/rawdump.py: a private directory, the newest N kept)."""
from rings import rawdump


def add(p):
    p.add_argument("--snapshot-dir", metavar="DIR", default=None,
                   help="private directory (0700, created when missing) where a queue broken by hostile input "
                        "writes its raw ring snapshot (default: $VRING_SNAPSHOT_DIR, else "
                        "$XDG_RUNTIME_DIR/vring-snapshots or <tmp>/vring-snapshots-<uid>)")
    p.add_argument("--snapshot-keep", metavar="N", type=int, default=None,
                   help="keep the newest N snapshots there (default: $VRING_SNAPSHOT_KEEP, else 32)")


def apply(args):
    """Turn the broken-queue snapshots on as asked. Returns an error message, or None."""
    if args.snapshot_keep is not None and args.snapshot_keep < 1:
        return f"--snapshot-keep must be >= 1, not {args.snapshot_keep}"
    rawdump.set_snapshot_keep(args.snapshot_keep)
    rawdump.set_snapshot_dir(args.snapshot_dir or rawdump.DEFAULT)
    return None
