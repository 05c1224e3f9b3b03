"""Profiling: exact interval arithmetic, kernel classification, trace parsing (GPU layout from a
hand-built trace, CPU layout from a real one) and the profiled training step."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distca_jax import profiling, trainer
from distca_jax.profiling import DeviceEvent

from test_train import _with_heads, tiny_config


# ------------------------------------------------------------------------------------------------
# Interval arithmetic
# ------------------------------------------------------------------------------------------------
def test_merge_and_subtract_by_hand():
  merged = profiling.merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (1, 2), (5, 7), (6, 6),
                                      (10, 12), (10.5, 11)])
  assert merged == [(0, 4), (5, 7), (10, 12)]  # touching (3, 4) joins; empty (6, 6) dropped
  assert profiling.total_length(merged) == 8
  b = profiling.merge_intervals([(-1, 0.5), (3, 6), (11, 11.5), (20, 30)])
  assert profiling.subtract_intervals(merged, b) == [(0.5, 3), (6, 7), (10, 11), (11.5, 12)]
  assert profiling.subtract_intervals(merged, []) == merged
  assert profiling.subtract_intervals([], b) == []
  with pytest.raises(ValueError, match="ends before it starts"):
    profiling.merge_intervals([(2, 1)])


def test_interval_functions_match_brute_force_on_random_sets():
  rng = np.random.default_rng(1234)
  for _ in range(200):
    def rand_set():
      n = int(rng.integers(0, 8))
      starts = rng.integers(0, 40, n)
      return [(int(s), int(s + rng.integers(0, 10))) for s in starts]
    a, b = rand_set(), rand_set()
    cells = lambda ivs: {t for s, e in ivs for t in range(s, e)}  # unit cells [t, t + 1)
    ma, mb = profiling.merge_intervals(a), profiling.merge_intervals(b)
    assert profiling.total_length(ma) == len(cells(a))
    assert all(s < e for s, e in ma) and all(x[1] < y[0] for x, y in zip(ma, ma[1:]))
    diff = profiling.subtract_intervals(ma, mb)
    assert profiling.total_length(diff) == len(cells(a) - cells(b))
    assert cells(diff) == cells(a) - cells(b)


# ------------------------------------------------------------------------------------------------
# Classification
# ------------------------------------------------------------------------------------------------
KERNEL_NAMES = {
    "attention": [
        "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t>>, false>",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
        "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>, cute::C<128>>>>>",
        "void flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8>>",
        "flash_mha_varlen_fwd", "flash_mha_varlen_bwd",  # flash-attn3-jax's FFI targets
        "mosaic_attention_fwd", "mosaic_attention_bwd", "mosaic_attention_dkv",  # ours (Mosaic GPU)
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80",
    ],
    "collective": [
        "ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
        "all-to-all.3", "all-gather-start.1", "reduce-scatter.2", "all-reduce-done",
        "collective-permute-start.4", "ragged-all-to-all.1", "send-done.2",
    ],
    "matmul": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_"
        "segment_k_off_kernel__5x_cublas",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopB_NTT",
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn>",
        "gemm_fusion_dot_12", "triton_gemm_dot_5", "dot.7",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8",
        "Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1",
    ],
    "other": [
        "loop_add_fusion", "input_reduce_fusion_3", "wrapped_tanh", "ynn_fusion.1", "MemcpyD2D",
        "copy.4", "bitcast_dynamic-update-slice_fusion", "wrapped_reduce-window", "while.14",
        "loop_multiply_fusion_2", "triton_softmax_7", "dotted_transpose", "Memset",
    ],
}


@pytest.mark.parametrize("category", sorted(KERNEL_NAMES))
def test_classify_real_kernel_names(category):
  for name in KERNEL_NAMES[category]:
    assert profiling.classify(name) == category, name


def test_event_category_falls_back_to_long_name_and_hlo_op():
  ev = DeviceEvent(0, "Stream #7", "Kernel2", 0.0, 1.0, hlo_op="all-to-all.1")
  assert profiling.event_category(ev) == "collective"
  ev = DeviceEvent(0, "Stream #7", "kernel_func", 0.0, 1.0,
                   long_name="void flash::FlashAttnBwdSm90<...>")
  assert profiling.event_category(ev) == "attention"
  ev = DeviceEvent(0, "s", "fusion", 0.0, 1.0, hlo_op="fusion.3")
  assert profiling.event_category(ev) == "other"


# ------------------------------------------------------------------------------------------------
# Report on hand-built events
# ------------------------------------------------------------------------------------------------
def _ev(device, stream, name, start, end):
  return DeviceEvent(device, stream, name, float(start), float(end - start))


SYNTHETIC = [
    # device 0: a collective [5, 20] partly hidden by a gemm [0, 10] and an attention kernel
    # [12, 16] (twice: duplicate), on other streams; an 'other' kernel with one nested in it.
    _ev(0, "Stream #7", "sm90_xmma_gemm_bf16bf16", 0, 10),
    _ev(0, "Stream #13", "ncclDevKernel_AllToAll_RING_LL", 5, 20),
    _ev(0, "Stream #7", "flash_fwd_kernel", 12, 16),
    _ev(0, "Stream #7", "flash_fwd_kernel", 12, 16),
    _ev(0, "Stream #7", "loop_add_fusion", 25, 30),
    _ev(0, "Stream #7", "input_reduce_fusion_3", 26, 28),
    # device 1 (the straggler): long attention overlapping a matmul on another stream, then an
    # exposed all-gather with a nested duplicate collective.
    _ev(1, "Stream #7", "mosaic_attention_fwd", 0, 30),
    _ev(1, "Stream #8", "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 10, 20),
    _ev(1, "Stream #13", "ncclDevKernel_AllGather_RING_LL", 30, 35),
    _ev(1, "Stream #14", "ncclDevKernel_AllGather_RING_LL", 32, 34),
    # device 2: a collective wholly hidden by a gemm, with a nested matmul.
    _ev(2, "Stream #13", "ncclDevKernel_SendRecv", 0, 8),
    _ev(2, "Stream #7", "Cijk_Alik_Bljk_BBS_BH", 0, 8),
    _ev(2, "Stream #7", "cutlass_80_tensorop_s16816gemm", 2, 4),
]


def test_step_report_by_hand():
  report = profiling.step_report(SYNTHETIC, step_time_s=0.5)
  rows = {r["device"]: r for r in report["devices"]}
  assert sorted(rows) == [0, 1, 2]
  expect = {
      # busy: [0, 20] + [25, 30]; compute: [0, 10] + [12, 16] + [25, 30];
      # exposed: [5, 20] - compute = [10, 12] + [16, 20]; span 0..30.
      0: dict(busy_us=25, attention_us=4, matmul_us=10, collective_us=15, other_us=5,
              compute_us=19, exposed_collective_us=6, span_us=30, gaps_us=5, events=6),
      # busy [0, 35]; compute [0, 30]; the collective [30, 35] is exposed in full.
      1: dict(busy_us=35, attention_us=30, matmul_us=10, collective_us=5, other_us=0,
              compute_us=30, exposed_collective_us=5, span_us=35, gaps_us=0, events=4),
      2: dict(busy_us=8, attention_us=0, matmul_us=8, collective_us=8, other_us=0,
              compute_us=8, exposed_collective_us=0, span_us=8, gaps_us=0, events=3),
  }
  for device, want in expect.items():
    got = {k: rows[device][k] for k in want}
    assert got == want, device
    assert rows[device]["step_us"] == 500000
    assert rows[device]["idle_us"] == 500000 - want["busy_us"]
  s = report["straggler"]
  assert s["slowest_device"] == 1
  assert s["attention_us"]["max"] == 30 and s["attention_us"]["argmax"] == 1
  assert s["attention_us"]["mean"] == pytest.approx(34 / 3)
  assert s["attention_us"]["max_over_mean"] == pytest.approx(90 / 34)
  assert s["matmul_us"]["max"] == 10 and s["matmul_us"]["argmax"] == 0  # tie: lowest device
  assert s["compute_us"]["mean"] == pytest.approx(19)
  assert s["busy_us"]["max"] == 35 and s["busy_us"]["mean"] == pytest.approx(68 / 3)
  # 'other' names by summed (not unioned) time, digit suffixes dropped.
  assert [(o["name"], o["total_us"], o["count"]) for o in report["other_top"]] == [
      ("loop_add_fusion", 5, 1), ("input_reduce_fusion", 2, 1)]
  # Attention kernels the same way, over devices (the duplicate counts: summed time).
  assert [(o["name"], o["total_us"], o["count"], o["devices"])
          for o in report["attention_top"]] == [("mosaic_attention_fwd", 30, 1, 1),
                                                ("flash_fwd_kernel", 8, 2, 1)]


def test_step_report_without_step_time_and_format():
  report = profiling.step_report(SYNTHETIC)
  assert report["step_us"] is None and "idle_us" not in report["devices"][0]
  text = profiling.format_report(profiling.step_report(SYNTHETIC, step_time_s=0.5))
  rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
  assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"]
  assert "idle (step - busy) ms" in text
  assert "slowest device: 1" in text
  assert "| `mosaic_attention_fwd` | 0.030 | 1 | 1 |" in text
  assert "`input_reduce_fusion`" in text
  assert "| 1 | 0.035 | 0.030 | 0.010 | 0.005 | 0.005 | 0.000 | 0.030 | 0.000 | 499.965 |" in text
  assert profiling.format_report(profiling.step_report([])) == "_no device events in the trace_"


# ------------------------------------------------------------------------------------------------
# Parsing: the GPU layout (hand-built after xprof's conventions) and the CPU one
# ------------------------------------------------------------------------------------------------
def _write_trace(path, events):
  with gzip.open(path, "wt") as f:
    json.dump({"displayTimeUnit": "ns", "metadata": {"highres-ticks": True},
               "traceEvents": events}, f)
  return str(path)


def _meta(pid, name, tid=None):
  if tid is None:
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def test_load_events_gpu_layout(tmp_path):
  derived = 0xDEADBEEF + 5
  events = [
      _meta(1, "/device:GPU:0"), _meta(2, "/device:GPU:1"), _meta(701, "/host:CPU"),
      _meta(1, "Stream #7(Kernel)", 7), _meta(1, "Stream #13(Kernel,MemcpyD2D)", 13),
      _meta(1, "XLA Ops", derived), _meta(2, "Stream #7(Kernel)", 7),
      _meta(2, "CUPTI overhead", 99), _meta(701, "python", 5),
      {"ph": "X", "pid": 1, "tid": 7, "ts": 100.0, "dur": 10.0, "name": "sm90_xmma_gemm_x",
       "args": {"hlo_op": "custom-call.1", "hlo_module": "jit_train_step"}},
      {"ph": "X", "pid": 1, "tid": 13, "ts": 105.5, "dur": 20.0, "name": "Kernel2",
       "args": {"hlo_op": "all-to-all.2"}},
      {"ph": "X", "pid": 1, "tid": 13, "ts": 130.0, "dur": 2.0, "name": "MemcpyD2D",
       "args": {"hlo_op": "copy.3", "memcpy_details":
                "kind_src:device kind_dst:device size:4000000 dest:0 async:1"}},
      {"ph": "X", "pid": 1, "tid": derived, "ts": 105.5, "dur": 20.0, "name": "all-to-all.2"},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 101.0, "dur": 5.0, "name": "kernel_func",
       "args": {"long_name": "void flash::FlashAttnFwdSm90<...>"}},
      {"ph": "X", "pid": 2, "tid": 99, "ts": 101.0, "dur": 1.0, "name": "CUPTI overhead"},
      # Host events are ignored when device processes exist, even thunk-like ones.
      {"ph": "X", "pid": 701, "tid": 5, "ts": 90.0, "dur": 50.0, "name": "fusion.1",
       "args": {"hlo_op": "fusion.1", "device_ordinal": "0"}},
      {"ph": "i", "pid": 1, "tid": 7, "ts": 99.0, "name": "marker"},
  ]
  got = profiling.load_events(_write_trace(tmp_path / "h.trace.json.gz", events))
  assert got == [
      DeviceEvent(0, "Stream #7(Kernel)", "sm90_xmma_gemm_x", 100.0, 10.0, hlo_op="custom-call.1"),
      DeviceEvent(0, "Stream #13(Kernel,MemcpyD2D)", "Kernel2", 105.5, 20.0, hlo_op="all-to-all.2"),
      DeviceEvent(0, "Stream #13(Kernel,MemcpyD2D)", "MemcpyD2D", 130.0, 2.0, hlo_op="copy.3",
                  bytes=4_000_000),
      DeviceEvent(1, "Stream #7(Kernel)", "kernel_func", 101.0, 5.0,
                  long_name="void flash::FlashAttnFwdSm90<...>"),
  ]
  report = profiling.step_report(got)
  rows = {r["device"]: r for r in report["devices"]}
  assert rows[0]["matmul_us"] == 10 and rows[0]["collective_us"] == 20
  assert rows[0]["exposed_collective_us"] == 15.5  # [110, 125.5]
  assert rows[1]["attention_us"] == 5


def test_load_events_cpu_layout_keeps_innermost(tmp_path):
  def thunk(tid, name, ts, dur, device):
    return {"ph": "X", "pid": 701, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"device_ordinal": str(device), "hlo_module": "jit_f", "hlo_op": name}}
  events = [
      _meta(701, "/host:CPU"), _meta(701, "tf_XLAPjRtCpuClient/1", 11),
      _meta(701, "tf_XLAEigen/2", 12),
      thunk(11, "copy.1", 0.0, 1.0, 0),
      thunk(11, "while.14", 1.0, 10.0, 0),          # encloses the next two: dropped
      thunk(11, "dot.3", 1.001, 4.0, 0),
      {"ph": "X", "pid": 701, "tid": 11, "ts": 5.0, "dur": 0.1, "name": "end: dot.3", "args": {}},
      thunk(11, "all-reduce.1", 5.5, 5.5, 0),       # ends at the while's end (rounded)
      thunk(11, "wrapped_tanh", 11.0, 2.0, 0),      # starts where the while ends: kept
      thunk(12, "ynn_fusion.1", 3.0, 2.0, 1),
      thunk(12, "ynn_fusion.1", 3.0, 2.0, 1),       # an equal duplicate: both kept
      {"ph": "X", "pid": 701, "tid": 11, "ts": 0.0, "dur": 20.0,
       "name": "ThunkExecutor::Execute (wait for completion)", "args": {"device_ordinal": "0"}},
  ]
  got = profiling.load_events(_write_trace(tmp_path / "h.trace.json.gz", events))
  assert [(e.device, e.name, e.start_us) for e in got] == [
      (0, "copy.1", 0.0), (0, "dot.3", 1.001), (0, "all-reduce.1", 5.5), (0, "wrapped_tanh", 11.0),
      (1, "ynn_fusion.1", 3.0), (1, "ynn_fusion.1", 3.0)]
  assert got[0].stream == "tf_XLAPjRtCpuClient/1"


def test_capture_on_cpu_traces_the_ops_that_ran(tmp_path):
  """A real CPU trace: no device processes, but one thunk event per HLO op and device."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(7)
  x = jax.device_put(rng.standard_normal((16, 32), np.float32), NamedSharding(mesh, P("data")))
  w = jnp.asarray(rng.standard_normal((32, 32), np.float32))

  @jax.jit
  def reduce_fn(x, w):
    return jnp.tanh(x @ w).sum()  # rows sharded over 2 devices: an all-reduce

  @jax.jit
  def gather_fn(x):
    return jax.lax.with_sharding_constraint(x * 2.0, NamedSharding(mesh, P()))  # an all-gather

  want = reduce_fn(x, w)
  jax.block_until_ready(gather_fn(x))
  logdir = str(tmp_path / "prof")
  out, path = profiling.capture(reduce_fn, x, w, logdir=logdir)
  assert os.path.isfile(path) and path.endswith(".trace.json.gz") and path.startswith(logdir)
  np.testing.assert_allclose(out, want, rtol=1e-6)
  events = profiling.load_events(path)
  assert {e.device for e in events} == {d.id for d in mesh.devices.flat}
  for device in (0, 1):
    names = [e.name for e in events if e.device == device]
    assert any(n.startswith("all-reduce") for n in names), names
  assert all(e.dur_us >= 0 for e in events)
  # A second capture into the same logdir (same second, so maybe the same run folder) yields the
  # new trace: all-gather, no all-reduce.
  _, path2 = profiling.capture(gather_fn, x, logdir=logdir)
  names2 = {e.name for e in profiling.load_events(path2)}
  assert any(n.startswith("all-gather") for n in names2), names2
  assert not any(n.startswith("all-reduce") for n in names2), names2
  report = profiling.step_report(events)
  assert all(r["collective_us"] > 0 for r in report["devices"])


# ------------------------------------------------------------------------------------------------
# Training integration
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_with_profile_step_writes_reports(tmp_path, capsys):
  # Step 0 compiles, step 1 gives a step time, step 2 is profiled, step 3 is timed again.
  base = {"mesh.data": 4, "mesh.tensor": 2, "num_steps": 4, "log_every": 1, "checkpoint_every": 0,
          "tensorboard": False, "optim.warmup_steps": 1, "profile_step": 2}
  c = _with_heads(tiny_config(**base))
  workdir = tmp_path / "run"
  records = trainer.train_and_evaluate(c, str(workdir))
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in records)
  # Only unprofiled, compiled steps are timed.
  assert ["step_time_s" in r for r in records] == [False, True, False, True]
  profile_dir = workdir / "profile"
  report = json.loads((profile_dir / "report.json").read_text())
  md = (profile_dir / "report.md").read_text()
  trace_devices = {e.device for e in profiling.load_events(report["trace_path"])}
  assert trace_devices == set(range(8))
  assert [r["device"] for r in report["devices"]] == sorted(trace_devices)
  assert report["step_time_from"] == "argument"  # step 1's time, not the profiled call's
  assert report["step_us"] == pytest.approx(records[1]["step_time_s"] * 1e6)
  rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
  assert len(rows) == 2 * len(trace_devices)  # the per-device table and the class breakdown
  for r in report["devices"]:
    assert 0 < r["busy_us"] <= r["span_us"] + 1e-9
    assert r["compute_us"] > 0 and r["collective_us"] > 0  # tensor=2: all-reduces in every layer
  # The class breakdown: the compiled step's HLO names the LM-head and optimizer scopes.
  assert report["breakdown_scoped"]
  for r, d in zip(report["breakdown"], report["devices"]):
    assert sum(r[k] for k in profiling.STEP_CLASSES) == pytest.approx(r["busy"], rel=1e-6)
    assert r["busy"] == pytest.approx(d["busy_us"] / 1e3, rel=1e-6)
    assert r["host gaps"] == pytest.approx(r["step"] - r["busy"])
    assert r["lm_head_loss"] > 0 and r["optimizer"] > 0 and r["collective"] > 0, r
  assert "Step time by kernel class" in md
  assert "slowest device:" in capsys.readouterr().out


def test_step_class_and_breakdown_by_hand():
  op_names = {"fusion.1": "jit(step)/transpose(jvp(lm_head_loss))/dot_general",
              "fusion.2": "jit(step)/optimizer_update/mul", "fusion.3": "jit(step)/layers/add",
              "copy.4": "jit(step)/while/body/copy"}
  evs = [_ev(0, "s", "flash_fwd_kernel", 0, 10),              # attention
         _ev(0, "s", "gemm_fusion_dot", 10, 20),                # matmul
         DeviceEvent(0, "s", "loop_fusion", 20.0, 5.0, hlo_op="fusion.1"),      # LM head
         DeviceEvent(0, "s", "loop_fusion", 25.0, 2.0, hlo_op="fusion.2"),      # optimizer
         DeviceEvent(0, "s", "loop_add_fusion", 27.0, 3.0, hlo_op="fusion.3"),  # elementwise
         DeviceEvent(0, "s", "copy", 30.0, 4.0, hlo_op="copy.4"),                # copy
         _ev(0, "t", "ncclDevKernel_AllReduce", 5, 15)]          # collective, 5 us under others
  # In a command buffer the HLO op is the buffer; the kernel's name gives the instruction.
  evs.append(DeviceEvent(0, "s", "fusion_2", 34.0, 1.0, hlo_op="command_buffer_7"))
  assert profiling.step_class(evs.pop(), op_names) == "optimizer"
  classes = [profiling.step_class(ev, op_names) for ev in evs]
  assert classes == ["attention", "matmul", "lm_head_loss", "optimizer", "elementwise", "copy",
                     "collective"]
  (row,) = profiling.step_breakdown(evs, op_names, step_time_s=40e-6)
  # Priority order: attention [0,10) then collective [10,15) (its first half is under attention),
  # matmul keeps [15,20) only.
  assert row["attention"] == pytest.approx(0.010) and row["collective"] == pytest.approx(0.005)
  assert row["matmul"] == pytest.approx(0.005) and row["lm_head_loss"] == pytest.approx(0.005)
  assert row["optimizer"] == pytest.approx(0.002) and row["elementwise"] == pytest.approx(0.003)
  assert row["copy"] == pytest.approx(0.004) and row["busy"] == pytest.approx(0.034)
  assert row["host gaps"] == pytest.approx(0.006)
  assert "| 0 |" in profiling.format_breakdown([row])


def test_hlo_op_names_reads_compiled_text():
  def f(x):
    with jax.named_scope("optimizer_update"):
      return jnp.sin(x) * 2.0
  text = jax.jit(f).lower(jnp.ones((8,))).compile().as_text()
  names = profiling.hlo_op_names(text)
  assert names and any("optimizer_update" in v for v in names.values()), text


def test_profile_step_out_of_range_is_an_error(tmp_path):
  c = tiny_config(**{"num_steps": 3, "profile_step": 3, "tensorboard": False,
                     "optim.warmup_steps": 1})
  with pytest.raises(ValueError, match="profile_step=3"):
    trainer.train_and_evaluate(c, str(tmp_path / "run"))


def test_other_top_names_the_hlo_ops_behind_each_name():
  """A copy-heavy step: the report says which HLO instructions the memcpy time came from."""
  gb = 10**9
  events = [DeviceEvent(0, "s", "MemcpyD2D", 0.0, 3000.0, hlo_op="copy.1", bytes=gb),
            DeviceEvent(0, "s", "MemcpyD2D", 3000.0, 5000.0, hlo_op="copy.2", bytes=2 * gb),
            DeviceEvent(1, "s", "MemcpyD2D", 0.0, 1000.0, hlo_op="copy.2", bytes=gb),
            DeviceEvent(1, "s", "MemcpyD2D", 1000.0, 500.0)]  # no hlo_op or size: counted only
  (top,) = profiling.step_report(events)["other_top"]
  assert (top["name"], top["total_us"], top["count"], top["devices"]) == ("MemcpyD2D", 9500, 4, 2)
  assert top["hlo_ops"] == [["copy.2", 6000.0], ["copy.1", 3000.0]]
  assert top["bytes"] == 4 * gb
  # 4 GB in 9.5 ms: 421 GB/s.
  assert "| 4.00 (421) | `copy.2` 6.0, `copy.1` 3.0 |" in profiling.format_report(
      profiling.step_report(events))


def test_the_report_keeps_more_other_names_than_its_text_lists():
  """The dict (the report's JSON) ranks up to OTHER_KEPT 'other' names by summed time; the text
  lists the first OTHER_TOP of them."""
  n = profiling.OTHER_TOP + 5
  # Names without digits (digit suffixes fold together); kernel k runs k + 1 us.
  names = [f"kernel_{chr(ord('a') + k)}" for k in range(n)]
  events = [DeviceEvent(0, "s", name, 10.0 * k, 10.0 * k + k + 1) for k, name in enumerate(names)]
  report = profiling.step_report(events)
  assert [o["name"] for o in report["other_top"]] == names[::-1]
  text = profiling.format_report(report)
  shown = [name for name in names if f"`{name}`" in text]
  assert shown == names[-profiling.OTHER_TOP:]


@pytest.mark.parametrize("min_trial_s", [0.0, 0.02])
def test_time_call_counts_calls_and_times_per_call(min_trial_s):
  """One compiling call and `warmup` more, one sizing call when trials batch calls, then `iters`
  trials of `reps` calls each; times are per call (each call sleeps at least 2 ms)."""
  import time  # pylint: disable=import-outside-toplevel
  calls = []
  x = jnp.zeros(())

  def fn(a):
    calls.append(1)
    time.sleep(0.002)
    return a

  t = profiling.time_call(fn, x, iters=3, warmup=1, min_trial_s=min_trial_s)
  sizing = 1 if min_trial_s > 0 else 0
  assert len(calls) == 1 + 1 + sizing + 3 * t["reps"], (len(calls), t)
  assert (t["reps"] == 1) if min_trial_s == 0 else (1 <= t["reps"] <= 10)
  assert len(t["trials_s"]) == 3 and t["min_s"] <= t["median_s"]
  assert all(0.002 <= s < 1.0 for s in t["trials_s"]), t
