"""`vring vhost` that dies (os._exit, like a kill -9: nothing is cleaned up) at a chosen point of its data path:
right after its Nth enqueue attempt that delivered packets, i.e. after the Rx used entries are published and
before the Tx chains those packets came from are completed. That is the window where a restart without
inflight tracking loses or duplicates packets, hit every time instead of by chance.

    python3 tests/crashing_vhost.py N <vring vhost arguments>
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vhost import datapath  # noqa: E402
from vhost._net import ffi, lib  # noqa: E402

CRASH_AFTER = int(sys.argv[1])
_count = [0]


@ffi.def_extern()
def vh_test_hook(ctx, attempt, delivered, left):
    if delivered:
        _count[0] += 1
        if _count[0] >= CRASH_AFTER:
            os._exit(9)


_init = datapath.Datapath.__init__


def _init_with_hook(self, *args, **kw):
    _init(self, *args, **kw)
    self.set_hook(lib.vh_test_hook)


datapath.Datapath.__init__ = _init_with_hook

if __name__ == "__main__":
    from vring.cli import main
    sys.exit(main(["vhost", *sys.argv[2:]]))
