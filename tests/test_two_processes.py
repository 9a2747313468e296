"""Two processes over one shared region: 1,000,000 buffers through each variant, each accounted for once.

The device checks every sequence number it polls is new (nothing duplicated, nothing corrupted); the
driver checks every token comes back exactly once (nothing lost). Normal queues complete in random order
(SPLIT-D-16, PACKED-D-26); in-order queues write one used entry per poll batch (INORDER-06/11).
"""
import os

import pytest

from rings.twoproc import run_one_process, run_two_processes

VARIANTS = [(fmt, io) for fmt in ("split", "packed") for io in (False, True)]


@pytest.mark.parametrize("fmt,in_order", VARIANTS)
def test_million_buffers_two_processes(fmt, in_order):
    before = set(os.listdir("/dev/shm"))
    stats = run_two_processes(fmt, 256, in_order, 1_000_000, burst=32)
    assert stats["buffers"] == 1_000_000
    assert set(os.listdir("/dev/shm")) <= before, "the shared-memory segment must be unlinked"


@pytest.mark.parametrize("fmt,in_order", VARIANTS)
def test_odd_sizes_one_process(fmt, in_order):
    size = 4 if fmt == "split" else 7
    assert run_one_process(fmt, size, in_order, 20_000, burst=5)["buffers"] == 20_000


@pytest.mark.parametrize("fmt,in_order", VARIANTS)
def test_reference_model_two_processes(fmt, in_order):
    """The reference model across processes too: indices and flags must be published in one store
    (struct.pack_into zeroes its target first, which once showed the peer used.idx 0: SPLIT-D-17)."""
    assert run_two_processes(fmt, 256, in_order, 30_000, impl="reference", check=False)["buffers"] == 30_000
