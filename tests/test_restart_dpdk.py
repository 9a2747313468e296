"""Interop restarts as DPDK DTS's "vhost/virtio-user loopback server mode" plan runs them (issue 10).

* DPDK virtio_user ``server=1`` + `vring vhost --client`, the backend killed -9 and relaunched, then
  ``stop`` / ``start tx_first`` on testpmd: traffic resumes;
* `vring driver --server` + DPDK net_vhost ``client=1``, testpmd killed -9 and relaunched (``start tx_first``):
  traffic resumes through our driver.

Two combinations per direction here (all eight each: benchmarks/dts_server_mode.py), chosen so that between
them packed and split, in-order and not, mergeable on and off are all covered.
"""
import pytest

from vring import dpdk
from vring.restarts import dts_net_vhost_client, dts_virtio_user_server

pytestmark = pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "ok")

COMBOS = [pytest.param(False, True, True, id="split-inorder-mrg1"),
          pytest.param(True, False, False, id="packed-normal-mrg0")]


@pytest.mark.parametrize("packed,in_order,mrg", COMBOS)
def test_virtio_user_server_with_vring_vhost_client_killed(packed, in_order, mrg):
    r = dts_virtio_user_server(packed, in_order, mrg, kills=1, settle=0.3)
    assert r["resumed"], r
    assert r["rows"][1]["resume_s"] is not None, r
    assert r["testpmd_errors"] == [], r


@pytest.mark.parametrize("packed,in_order,mrg", [pytest.param(True, True, False, id="packed-inorder-mrg0"),
                                                 pytest.param(False, False, True, id="split-normal-mrg1")])
def test_vring_driver_server_with_net_vhost_client_killed(packed, in_order, mrg):
    r = dts_net_vhost_client(packed, in_order, mrg, kills=1, settle=0.3)
    assert r["resumed"], r
    assert r["connections"] == 2 and r["driver_errors"] == 0, r
    assert all(row["driver_event"] for row in r["rows"]), r
