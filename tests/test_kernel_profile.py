"""experiments.kernel_profile and its parts: trace analysis on synthetic events, and a tiny CPU
run end to end."""

import json
import os

import numpy as np
import pytest

from distca_jax.profiling import DeviceEvent
from experiments import kernel_bench as kb
from experiments import kernel_profile as kp
from experiments import kernel_profile_trace as kpt


def Ev(name, start_us, dur_us, long_name=""):  # pylint: disable=invalid-name
  """A kernel event as profiling.load_events gives them (device 0, one stream)."""
  return DeviceEvent(0, "Stream #13", name, start_us, dur_us, long_name=long_name)


# ------------------------------------------------------------------------------------------------
# Pure parts
# ------------------------------------------------------------------------------------------------

FA3_FWD = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
           "flash::CollectiveMainloopFwdSm90<2, cute::tuple<_1,_1,_1>, 128, 128>>>>(...)")
FA3_BWD = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<...>>>"


@pytest.mark.parametrize("name,long_name,role,phase", [
    ("mosaic_attention_fwd", "", "fwd", "forward"),
    ("mosaic_attention_dq_1", "", "dq", "backward"),
    ("mosaic_attention_dkv", "", "dkdv", "backward"),
    ("mosaic_attention_bwd", "", "bwd", "backward"),
    ("device_kernel", FA3_FWD, "fwd", "forward"),
    ("device_kernel", FA3_BWD, "bwd", "backward"),
    ("device_kernel", "cutlass::device_kernel<flash::FlashAttnBwdPreprocess<...>>", "bwd-pre",
     "backward"),
    ("device_kernel", "cutlass::device_kernel<flash::FlashAttnBwdPostprocessConvertdQ<...>>",
     "bwd-post", "backward"),
    ("device_kernel", "cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>", "fwd-combine",
     "forward"),
    ("void flash::prepare_varlen_num_blocks_kernel<1>(...)", "", "scheduler", None),
    ("loop_select_fusion_3", "", "glue", None),
])
def test_kernel_role(name, long_name, role, phase):
  assert kpt.kernel_role(name, long_name) == (role, phase)


def test_short_kernel_name():
  assert kpt.short_kernel_name("device_kernel", FA3_FWD) == "FlashAttnFwdSm90"
  assert kpt.short_kernel_name("mosaic_attention_dq_1") == "mosaic_attention_dq_1"
  assert kpt.short_kernel_name("x" * 100).endswith("...")


def _synthetic_call(t0):
  """One forward+backward call of ours (two-kernel backward): work lists, fwd, delta, dq, dkdv,
  a trailing copy."""
  return [Ev("sort_fusion", t0, 10.0), Ev("mosaic_attention_fwd", t0 + 10, 100.0),
          Ev("input_reduce_fusion", t0 + 110, 5.0), Ev("mosaic_attention_dq", t0 + 115, 60.0),
          Ev("mosaic_attention_dkv", t0 + 175, 140.0), Ev("copy_3", t0 + 315, 4.0)]


def test_split_calls_and_breakdown():
  events = _synthetic_call(0.0) + _synthetic_call(50_000.0)
  calls = kpt.split_calls(events[::-1], gap_us=10_000)  # order of the input does not matter
  assert [len(c) for c in calls] == [6, 6]
  flops_fwd, flops_bwd = 4e9, 10e9
  b = kpt.kernel_breakdown(calls, flops_fwd, flops_bwd)
  rows = {r["name"]: r for r in b["kernels"]}
  assert b["calls"] == 2 and b["device_us"] == pytest.approx(319.0)
  assert b["span_us"] == pytest.approx(319.0)
  assert [r["name"] for r in b["kernels"]][:3] == ["mosaic_attention_dkv", "mosaic_attention_fwd",
                                                   "mosaic_attention_dq"]
  assert {n: r["phase"] for n, r in rows.items()} == {
      "sort_fusion": "forward", "mosaic_attention_fwd": "forward",
      "input_reduce_fusion": "backward", "mosaic_attention_dq": "backward",
      "mosaic_attention_dkv": "backward", "copy_3": "backward"}
  assert all(r["count"] == 1 for r in rows.values())
  assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
  # Forward FLOPs on the forward kernel; backward FLOPs split 60:140 between dq and dkdv.
  assert rows["mosaic_attention_fwd"]["tflops"] == pytest.approx(4e9 / 100e-6 / 1e12)
  assert rows["mosaic_attention_dq"]["flops"] == pytest.approx(10e9 * 60 / 200)
  assert rows["mosaic_attention_dkv"]["tflops"] == pytest.approx(10e9 / 200e-6 / 1e12)
  assert rows["copy_3"]["flops"] is None and rows["copy_3"]["tflops"] is None
  fwd, bwd = b["phases"]["forward"], b["phases"]["backward"]
  assert (fwd["attention_us"], fwd["other_us"]) == (100.0, 10.0)
  assert (bwd["attention_us"], bwd["other_us"]) == (200.0, 9.0)
  assert bwd["tflops_incl_glue"] == pytest.approx(10e9 / 209e-6 / 1e12)


def test_breakdown_separates_kernels_sharing_a_display_name():
  # FA3's kernels are all cutlass::device_kernel<...>: the long name tells them apart.
  call = [Ev("where_fusion", 0.0, 2.0), Ev("device_kernel", 2.0, 50.0, FA3_FWD),
          Ev("device_kernel", 60.0, 20.0, "flash::FlashAttnBwdPreprocess<...>"),
          Ev("device_kernel", 80.0, 120.0, FA3_BWD)]
  b = kpt.kernel_breakdown([call], 2e9, 5e9)
  rows = {r["short_name"]: r for r in b["kernels"]}
  assert set(rows) == {"where_fusion", "FlashAttnFwdSm90", "FlashAttnBwdPreprocess",
                       "FlashAttnBwdSm90"}
  assert rows["FlashAttnFwdSm90"]["tflops"] == pytest.approx(2e9 / 50e-6 / 1e12)
  assert rows["FlashAttnBwdSm90"]["tflops"] == pytest.approx(5e9 / 120e-6 / 1e12)
  assert rows["FlashAttnBwdPreprocess"]["flops"] is None
  assert rows["where_fusion"]["phase"] == "forward"
  assert b["phases"]["backward"]["other_us"] == 20.0


def test_breakdown_without_attention_kernels_has_unknown_phase():
  calls = kpt.split_calls([Ev("ynn_fusion", 0.0, 3.0), Ev("while.2", 1.0, 4.0)], gap_us=100)
  b = kpt.kernel_breakdown(calls, 1e6, 2.5e6)
  assert list(b["phases"]) == ["unknown"]
  assert b["phases"]["unknown"]["tflops_attention"] is None
  assert b["device_us"] == pytest.approx(7.0) and b["span_us"] == pytest.approx(5.0)


def test_parse_kernel_details_and_match():
  d = kpt.parse_kernel_details("regs:168 static_shared:0 dynamic_shared:147456 grid:32,130,1 "
                              "block:256,1,1 occ_pct:6.25")
  assert d == dict(regs=168, static_shared=0, dynamic_shared=147456, grid=[32, 130, 1],
                   block=[256, 1, 1], occ_pct=6.25)
  details = {"mosaic_attention_fwd": d, FA3_FWD: dict(regs=128)}
  assert kpt.match_details(details, "mosaic_attention_fwd") is d
  assert kpt.match_details(details, "FlashAttnFwdSm90", FA3_FWD) == dict(regs=128)
  assert kpt.match_details(details, "FlashAttnFwdSm90") == dict(regs=128)  # contained, unique
  assert kpt.match_details(details, "fusion") is None


def test_removed_pallas_backend_is_a_clear_error(capsys):
  """``--kernels pallas`` (the removed Triton kernel) stops both tools with one line naming what
  to run instead; an unknown name lists the choices."""
  for parse in (kp.parse_args, kb.parse_args):
    with pytest.raises(SystemExit):
      parse(["--kernels", "mosaic,pallas"])
    assert ("--kernels: 'pallas' (the Triton kernel) was removed; use 'mosaic'"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
      parse(["--kernels", "triton"])
    assert "unknown kernel 'triton'; choose from (" in capsys.readouterr().err
  assert kb.parse_args(["--kernels", "mosaic:two-kernel,flash3"]).kernels == "mosaic:two-kernel,flash3"


def test_old_kernel_flags_name_the_new_ones(capsys, monkeypatch):
  """The kernel tools' old flags (``--backends``, cost_table's ``--backend``) stop with one
  error line naming the new flag."""
  from experiments import cost_table
  for parse, old, new in ((kp.parse_args, "--backends", "--kernels"),
                          (kb.parse_args, "--backends", "--kernels")):
    with pytest.raises(SystemExit):
      parse([old, "mosaic"])
    err = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert err == [f"{err[0].split(':')[0]}: error: {old} was renamed: use {new} (it names "
                   "kernels, not training backends)"], err
  monkeypatch.setattr("sys.argv", ["cost_table", "--backend", "flash3"])
  with pytest.raises(SystemExit):
    cost_table._parse()
  assert "error: --backend was renamed: use --kernel" in capsys.readouterr().err
  monkeypatch.setattr("sys.argv", ["cost_table", "--kernel", "flash3", "--out", "x.json"])
  assert cost_table._parse().kernel == "flash3"


# ------------------------------------------------------------------------------------------------
# A tiny run on CPU: the blockwise kernel as ours against the jnp reference
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("kernel_profile") / "kp.json"
  assert kp.main(["--tiny", "--out", str(out)]) == 0
  with open(out) as f:
    return out, json.load(f)


@pytest.mark.slow
def test_tiny_entries_have_kernel_rows_and_times(tiny):
  out, result = tiny
  names = kp.TINY["workloads"].split(",")
  assert result["workloads"] == names and result["backends"] == ["blockwise", "reference"]
  assert {(e["workload"], e["backend"]) for e in result["entries"]} == {
      (w, b) for w in names for b in ("blockwise", "reference")}
  for e in result["entries"]:
    assert e["status"] == "ok", e.get("traceback_tail", e.get("error"))
    t = e["timing"]
    assert t["fwd_ms"] > 0 and t["fwd_bwd_ms"] > 0
    assert t["bwd_ms"] == pytest.approx(t["fwd_bwd_ms"] - t["fwd_ms"])
    trace = e["trace"]
    assert trace["calls_found"] == kp.TINY["trace_calls"] and "call_split_note" not in trace
    rows = trace["kernels"]
    assert len(rows) >= 3
    assert all(r["count"] > 0 and r["total_us"] > 0 and r["name"] for r in rows)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["total_us"] for r in rows) == pytest.approx(trace["device_us"])
    assert sum(s["total_us"] for s in trace["phases"].values()) == pytest.approx(
        trace["device_us"])
    assert os.path.exists(os.path.join(os.path.dirname(out), trace["path"]))
    assert e["flops_bwd"] == pytest.approx(2.5 * e["flops_fwd"]) and e["flops_fwd"] > 0


@pytest.mark.slow
def test_tiny_gap_table_and_markdown(tiny):
  out, result = tiny
  gap = result["gap"]
  assert (gap["ours"], gap["baseline"]) == ("blockwise", "reference")
  by = {(e["workload"], e["backend"]): e for e in result["entries"]}
  for wl in result["workloads"]:
    rows = {r["phase"]: r for r in gap["rows"] if r["workload"] == wl}
    assert {"forward", "backward", "total"} <= set(rows)
    ours, base = by[(wl, "blockwise")], by[(wl, "reference")]
    for phase, key in (("forward", "fwd_ms"), ("backward", "bwd_ms"), ("total", "fwd_bwd_ms")):
      r = rows[phase]
      assert r["ours_timed_ms"] == ours["timing"][key]
      assert r["timed_ratio"] == pytest.approx(ours["timing"][key] / base["timing"][key])
    total = rows["total"]
    assert total["ours_ms"] == pytest.approx(ours["trace"]["device_us"] / 1e3)
    assert total["ratio"] == pytest.approx(total["ours_ms"] / total["base_ms"])
  with open(os.path.splitext(out)[0] + ".md") as f:
    md = f.read()
  assert md.startswith("# Kernel profile: blockwise against reference")
  assert f"- command: `python -m experiments.kernel_profile --tiny --out {out}`" in md
  assert "- device: cpu" in md and "## Where the gap is (blockwise vs reference)" in md
  for wl in result["workloads"]:
    assert f"### {wl} / blockwise" in md and f"| {wl} | total |" in md
  assert np.isfinite([r["ours_ms"] for r in gap["rows"] if r["phase"] == "total"]).all()


def test_breakdown_of_unsplit_calls_is_per_call():
  """When the calls do not separate, one group holding all of them over num_calls gives the same
  per-call kernel times, counts and rates as the split calls."""
  calls = [_synthetic_call(0.0), _synthetic_call(50_000.0)]
  split = kpt.kernel_breakdown(calls, 4e9, 10e9)
  merged = kpt.kernel_breakdown([calls[0] + calls[1]], 4e9, 10e9, num_calls=2)
  assert merged["calls"] == 2 and merged["device_us"] == pytest.approx(split["device_us"])
  want = {r["name"]: r for r in split["kernels"]}
  for r in merged["kernels"]:
    assert r["count"] == 1 and r["total_us"] == pytest.approx(want[r["name"]]["total_us"])
    if r["attention"]:
      assert r["tflops"] == pytest.approx(want[r["name"]]["tflops"])
