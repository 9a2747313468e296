"""The ID map keeps the suite honest: every applicable MUST of the checklist's virtqueue chapters has a test
named by its ID that runs on both implementations, and tests/README.md shows the current table."""
import os
import re

import pytest

import idmap
from checklist import APP_LEVEL, LEVELS, NOT_APPLICABLE, applicable_musts


def test_every_applicable_must_has_a_test_on_both_implementations():
    assert idmap.problems() == []


def test_readme_table_is_current():
    new, old = idmap.readme_with(idmap.table())
    assert new == old, "tests/README.md is stale: run `python3 tests/conformance/idmap.py --write`"


def test_names_map_to_ids():
    assert idmap.ids_in_name("test_split_d_01_packed_d_01_ring_parts_aligned") == ["SPLIT-D-01", "PACKED-D-01"]
    assert idmap.ids_in_name("test_evt18_need_event_vectors") == ["EVT-18"]
    assert idmap.ids_in_name("test_evt_25_mem_05_x") == ["EVT-25", "MEM-05"]
    assert idmap.ids_in_name("test_inorder_02_used") == ["INORDER-02"]
    assert idmap.ids_in_name("test_memory_1234_notif") == []


def test_the_missing_must_is_reported():
    m = idmap.mapping()
    victim = applicable_musts()[0]
    m[victim] = []
    assert any(p.startswith(victim) for p in idmap.problems(m))
    assert f"| {victim} | {LEVELS[victim]} | **MISSING** |" in idmap.table(m)


def test_not_applicable_and_app_level_items_are_musts_of_the_checklist():
    for i in list(NOT_APPLICABLE) + list(APP_LEVEL):
        assert "MUST" in LEVELS[i], i
    assert len(LEVELS) == 156 and len(applicable_musts()) == 59


def _checklist():
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (3, 4):   # <repo>/../shared (CI, main) or <worktree>/../../shared
        path = os.path.join(here, *[".."] * up, "shared", "spec", "virtio-checklist.md")
        if os.path.exists(path):
            return path
    return None


@pytest.mark.skipif(_checklist() is None, reason="shared/spec/virtio-checklist.md not found beside the repository")
def test_levels_match_the_checklist():
    with open(_checklist()) as f:
        text = f.read()
    rows = re.findall(r"^\| ((?:SPLIT-[LDV]|PACKED-[LDV]|EVT|INORDER|MEM|NOTIF)-\d\d) \| ([^|]+?) \|", text, re.M)
    assert dict(rows) == LEVELS
