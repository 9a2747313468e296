"""`vring bench` beyond the closed polled loop: default pinning, --notify (kicks, calls, CPU, idle cost), --rate
(latency against offered load), --study (variants side by side). Short runs, well-formed output; no assertion on
rates or latencies (the machine is shared), only a loose bound on idle CPU time. (Argument errors: test_bench.)"""
import json

import pytest

from vring import bench, dpdk, studies
from vring.cli import build_parser, main

from test_bench import _assert_clean, tracked  # noqa: F401 (the fixture)

SHORT = ["--seconds", "0.6", "--warmup", "0.3", "--interval", "0.2", "-q"]


def _with_plot(args, png):
    """args + --plot png where matplotlib is installed (and png), else (args, None)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return args, None
    return args + ["--plot", str(png)], png


def test_default_cpus_two_least_busy_device_on_the_quieter(monkeypatch):
    monkeypatch.setattr(bench, "_allowed_cpus", lambda: [0, 1, 2, 3])
    dev, drv, how = bench.default_cpus({0: 0.9, 1: 0.05, 2: 0.5, 3: 0.01})
    assert (dev, drv) == (3, 1) and "least busy" in how["chosen"]
    monkeypatch.setattr(bench, "_allowed_cpus", lambda: [5])
    dev, drv, how = bench.default_cpus({5: 0.2})
    assert dev == drv == 5
    cfg = bench.BenchConfig(device_cpu=dev, driver_cpu=drv, cpu_choice=how)
    note = bench.pinning_note(cfg)
    assert "device on CPU 5, driver on CPU 5" in note and "WARNING: both sides share CPU 5" in note


@pytest.mark.parametrize("name", list(studies.STUDIES))
def test_every_study_variant_is_a_real_option_of_our_processes(name):
    """Each variant's arguments parse as `vring driver` / `vring vhost` options (real code paths, no stubs), and
    the variants of a group differ in them."""
    cfg = bench.BenchConfig(paths=list(studies.get(name).default_paths), repeat=2)
    pts = list(studies.get(name).points(cfg))
    parser = build_parser()
    seen = {}
    for p in pts:
        assert p.pair == "ours/ours" and p.variant and p.group
        parser.parse_args(["driver", "--socket", "s", *p.driver_args])
        parser.parse_args(["vhost", "--socket", "s", *p.device_args])
        seen.setdefault((p.group, p.rep), []).append((p.path, p.driver_args, p.device_args))
    for variants in seen.values():
        assert len(set(variants)) == len(studies.get(name).variants) >= 2
    reps = [p.rep for p in pts]
    assert reps == sorted(reps) and set(reps) == {0, 1}
    first = [p.variant for p in pts if p.rep == 0][:len(studies.get(name).variants)]
    second = [p.variant for p in pts if p.rep == 1][:len(studies.get(name).variants)]
    assert first == second[::-1]   # order reversed every other repeat


def test_notify_closed_loop_idle_cpu_kicks_calls(tmp_path, tracked, capsys):  # noqa: F811
    out = tmp_path / "b.json"
    rc = main(["bench", "--notify", "--paths", "packed-in-order", "--idle", "1.2", "--json", str(out), *SHORT])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    (p,) = res["points"]
    (r,) = res["runs"]
    assert p["mode"] == "notify" and "notify" in text and "idle dev" in text
    dev_argv = next(x.argv for x in tracked if x.name == "device")
    drv_argv = next(x.argv for x in tracked if x.name == "driver")
    assert dev_argv[dev_argv.index("--idle") + 1] == "sleep" and "--wait" in drv_argv
    assert p["notifications"]["kicks_per_packet"] is not None and p["notifications"]["calls_per_packet"] is not None
    idle = r["cpu"]["idle"]
    assert idle is not None and idle["seconds"] > 0.5
    assert idle["device"] < 0.3 and idle["driver"] < 0.3, idle   # an idle queue costs ~no CPU (loose bound)
    assert r["cpu"]["measured"]["device"] is not None
    assert r["drops"]["device"]["rx_dropped"] == 0 and p["loss_check_ok"]
    assert res["pinning"].startswith("pinned: device on CPU") and res["pinning"] in text
    _assert_clean(tmp_path, tracked)


def test_rate_open_loop_latency_per_rate(tmp_path, tracked, capsys):  # noqa: F811
    out = tmp_path / "r.json"
    args, png = _with_plot(["bench", "--rate", "20k", "--modes", "poll", "--paths", "split-normal", "--json",
                            str(out), *SHORT], tmp_path / "r.png")
    rc = main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    (p,) = res["points"]
    (r,) = res["runs"]
    assert p["offered_pps"] == 20000 and "20k" in text and "offered" in text
    assert r["latency"]["p50_us"] is not None and "due" in r["latency"]["method"]
    assert "warm-up" in r["latency"]["method"]
    lc = r["loss_check"]
    assert lc["ok"] and lc["injected"] == r["counters"]["driver"]["rate"]["offered"] > 0
    drv_argv = next(x.argv for x in tracked if x.name == "driver")
    assert drv_argv[drv_argv.index("--mode") + 1] == "rate"
    if png is not None:
        assert png.stat().st_size > 1000
    _assert_clean(tmp_path, tracked)


def test_study_table_json_plot(tmp_path, tracked, capsys):  # noqa: F811
    out = tmp_path / "s.json"
    args, png = _with_plot(["bench", "--study", "hdr-init", "--paths", "packed-normal", "--json", str(out), *SHORT],
                           tmp_path / "s.png")
    rc = main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    st = res["study"]
    assert st["name"] == "hdr-init" and st["baseline"] == "per packet"
    rows = {r["variant"]: r for r in st["rows"]}
    assert set(rows) == {"per packet", "per burst"}
    assert rows["per burst"]["reported"] == "+3.5%" and "11.30 -> 11.70" in st["authors"]
    assert rows["per packet"]["vs_baseline"] is None
    assert rows["per burst"]["vs_baseline"]["median_of_per_repeat"] > 0
    assert all(r["mpps"] > 0 and r["loss_check_ok"] for r in rows.values())
    for line in ("study hdr-init", "reported by the original authors", "per packet: driver --hdr-init packet",
                 "(baseline)", "+3.5%"):
        assert line in text, line
    argv = {tuple(x.argv[x.argv.index("--hdr-init") + 1:][:1]) for x in tracked if x.name == "driver"}
    assert argv == {("packet",), ("burst",)}
    if png is not None:
        assert png.stat().st_size > 1000
    _assert_clean(tmp_path, tracked)


def test_study_table_fits_long_groups():
    """A group name with its pair and rate is printed whole (two rates must stay apart)."""
    groups = ["packed-in-order ours/dpdk @ 10k fps", "packed-in-order ours/dpdk @ 1M fps"]
    rows = [{"group": g, "pair": "ours/dpdk", "pkt_size": 64, "variant": v, "mpps": 1.0, "descs_per_packet": 1.0,
             "drops": 0, "vs_baseline": None if v == "headroom" else {"median_of_per_repeat": 1.0},
             "reported": "", "loss_check_ok": True} for g in groups for v in ("headroom", "chain", "indirect")]
    st = studies.get("hdr-prepend")
    result = {"study": {"name": st.name, "what": st.what, "authors": st.authors, "baseline": st.baseline,
                        "columns": list(st.columns), "rows": rows,
                        "variants": [{"label": v.label, "driver_args": list(v.driver_args), "device_args": [],
                                      "reported": v.reported} for v in st.variants]},
              "pinning": "pinned", "points": [], "config": {}}
    text = studies.format_study(result)
    for g in groups:
        assert sum(line.startswith(g + " ") for line in text.splitlines()) == 3, text


def test_tx_hdr_choices_are_the_drivers():
    from virtio.net import TX_HDR
    assert bench.TX_HDR == TX_HDR


def test_driver_side_studies_face_dpdk_too():
    """hdr-prepend / hdr-init differ in the driver only, so they may run in front of DPDK's net_vhost as well: one
    group per pair, the pair in the group's name; studies with device variants stay ours/ours."""
    st = studies.get("hdr-prepend")
    cfg = bench.BenchConfig(pairs=["ours/ours", "ours/dpdk"], paths=["split-normal"], repeat=1)
    st.check_pairs(cfg.pairs)
    pts = list(st.points(cfg))
    assert {(p.pair, p.group) for p in pts} == {("ours/ours", "split-normal"), ("ours/dpdk", "split-normal ours/dpdk")}
    assert len(pts) == 2 * len(st.variants)
    studies.get("hdr-init").check_pairs(["ours/ours", "ours/dpdk"])
    for name in ("tx-cleanup", "doorbell", "retries", "txq"):
        with pytest.raises(ValueError, match="ours/ours only"):
            studies.get(name).check_pairs(["ours/dpdk"])


@pytest.mark.skipif(bool(dpdk.skip_reason()), reason=dpdk.skip_reason() or "ok")
def test_hdr_prepend_in_front_of_net_vhost(tmp_path, tracked, capsys):  # noqa: F811
    """The study against DPDK's device: every variant ran (our driver with its --tx-hdr), DPDK's net_vhost
    forwarded all of it back (loss check), and the table names the pair."""
    out = tmp_path / "s.json"
    rc = main(["bench", "--study", "hdr-prepend", "--pairs", "ours/dpdk", "--paths", "split-in-order",
               "--json", str(out), *SHORT])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["study"]["rows"]}
    assert set(rows) == {"headroom", "chain", "indirect"}
    assert all(r["group"] == "split-in-order ours/dpdk" and r["pair"] == "ours/dpdk" and r["mpps"] > 0
               and r["loss_check_ok"]
               for r in rows.values())
    assert rows["chain"]["descs_per_packet"] == pytest.approx(2.0, abs=0.05)
    # rings of twice --inject by default: every variant has all its packets in flight, none dropped
    res = json.loads(out.read_text())
    assert res["config"]["ring_size"] == 512 and all(r["drops"] == 0 for r in rows.values())
    argv = {x.argv[x.argv.index("--tx-hdr", x.argv.index("--tx-hdr") + 1) + 1] for x in tracked if x.name == "driver"}
    assert argv == {"headroom", "chain", "indirect"}
    assert "split-in-order ours/dpdk" in text
    _assert_clean(tmp_path, tracked)


def test_tx_hdr_reaches_our_driver(tmp_path, tracked, capsys):  # noqa: F811
    """--tx-hdr chain: our driver sends two descriptors a packet (measured from its Tx reclaim counters), with
    the inject small enough for half a ring; the output says which header placement ran."""
    out = tmp_path / "b.json"
    rc = main(["bench", "--tx-hdr", "chain", "--paths", "packed-in-order", "--inject", "64", "--json", str(out),
               *SHORT])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    drivers = [x for x in tracked if x.name == "driver"]
    assert drivers and all(x.argv[x.argv.index("--tx-hdr") + 1] == "chain" for x in drivers)
    res = json.loads(out.read_text())
    (pt,) = res["points"]
    assert pt["tx_descs_per_packet"] == pytest.approx(2.0, abs=0.05) and pt["drops"] == 0
    assert res["config"]["tx_hdr"] == "chain" and "--tx-hdr chain" in res["pinning"]
    _assert_clean(tmp_path, tracked)
