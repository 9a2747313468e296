"""Fixtures of the conformance suite: ``impl`` (tests/conftest.py) is the module under test; ``rec`` is the same
pair of implementations with their ring accesses recorded in order (recording.py)."""
import pytest

from recording import Recorder


@pytest.fixture(params=["c", "reference"])
def rec(request):
    return Recorder(request.param)
