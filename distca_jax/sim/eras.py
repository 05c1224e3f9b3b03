"""The committed end-to-end runs ``sim.validate`` replays, by code generation / device ("era").

A run is ``(file stem under results/, backend or None for all)``. Each era is calibrated on
packed_dp or one-GPU runs of its own (``CALIBRATION_RUNS``) or priced with an earlier era's
calibration (``CALIBRATED_AS``); every other case of that era is held out (``HELD_OUT_RUNS``).

* 'v5': the 2-GPU runs (``*_v5*``), made without two single-stream fixes (FA3's forward no
  longer cloned, no raw LSE buffer copy), which change step times;
* 'current': one H200 of the current code (its held-out runs include one on 4 x H200);
* 'h100': 4 x H100 of the current code (results/four/raw/): calibrated on three packed_dp runs
  of 356931f; held out, its distca runs of that code and the runs of ff00a0c / 2adb8bc under
  results/four/raw/s4: packed_dp, wlb (CP 4 / CP 2, alpha 1.0), cp (CP 1) and distca at 128K,
  pipe 2 x data 2 with distca pooled and per stage, 2 rows per GPU with and without ping-pong at
  32K and 64K; and the distca runs of 8051464 on 2 x H100 under results/skip, Pretrain and
  ProLong 128K;
* 'h100-local': the H100 code with the train step's local branch (bcacbbe: results/skip's
  packed_dp, distca and distca with the gate at 0.06 of the same call), priced with the 'h100'
  calibration (fitted on runs made before its own);
* 'h200': 4 x H200 of 63a9720 (results/four/raw/s6: the local branch, ``local_gain`` 0.05,
  ``min_gain`` 0.02), its own calibration. Rule: every single-stream packed_dp run of the era
  without a pipeline is a calibration run (the 128K call, issue35's 20-step call at 128K and
  the 2 x 32K call's packed_dp: 128K and 2 x 32K rows, three parameters on six runs); held out,
  everything else: wlb (CP 4 / CP 2, alpha 1.0), cp (CP 4 / CP 2) and distca at 128K, issue35's
  distca, pipe 2 x data 2 (packed_dp, distca pooled and per stage), and the 2 x 32K call's
  ping-pong and distca runs (its ProLong distca+pingpong run was cut by a time limit);
* 'h200-s7': another 4 x H200 machine, the code of 231bdf7 (results/four/raw/s7: 'h200''s code
  with the flash3 masking and the exchange's receive buffer built inside the layer loop, which
  the cost model does not see), priced with the 'h200' calibration (fitted on another machine's
  runs): every run held out, packed_dp included: the four strategies at 128K, packed_dp and
  distca at 64K, pipe 2 x data 2, the 2 x 32K ping-pong call, and the two trees' runs (63a9720
  and 231bdf7, same batches).
* 'h200-s8': a 4 x H200 host, the code of 8ec3962 (results/four/raw/s8, host A), priced
  with the 'h200' calibration, every run held out: Pretrain 128K with 'keep' and 'resend' (and
  'resend' alone), ProLong 2 x 32K with and without ping-pong (the profiled call), and ping-pong
  with 'given' and 'heavy_first' rows (each nano-batch planned apart, as the backend plans it:
  ``validate.run_batches``).

distca's runs are priced with the exchange and memory mode they ran (an override, else what
'auto' ran as: ``AUTO_RAN_AS``), the gates and the local branch of their era (``ERA_MIN_GAIN``,
``ERA_LOCAL_GAIN``, ``ERA_LOCAL_STEPS``: the runs before bcacbbe sent every batch through the
exchange) unless an override set them.
"""

from __future__ import annotations

# Calibration runs per era.
CALIBRATION_RUNS = {
    "current": [("e2e_1gpu_64k_v7", None), ("e2e_1gpu_pingpong_v6_final", "packed_dp"),
                ("e2e_1gpu_pingpong_v6_final", "distca")],
    "v5": [("e2e_1gpu_probe_v6", None)],
    # packed_dp moves nothing: its 4-GPU steps calibrate the H100's compute (fixed, matmul rate,
    # attention scale: three runs, three parameters); distca's runs are held out.
    "h100": [("four/raw/e2e_bk_pretrain_packed_dp", None),
             ("four/raw/e2e_bk_prolong_packed_dp", None),
             ("four/raw/e2e_4gpu_pretrain_128k_packed_dp", None)],
    # The same on 4 x H200: every single-stream packed_dp run without a pipeline (the rule of
    # the module docstring).
    "h200": [("four/raw/s6/e2e_4gpu_128k_packed_dp", None),
             ("four/raw/s6/e2e_4gpu_128k_issue35", "packed_dp"),
             ("four/raw/s6/e2e_4gpu_pingpong", "packed_dp")],
}
# Eras priced with another era's calibration (fitted on runs made before theirs): 'h100-local'
# is the H100 code with the train step's local branch (bcacbbe on).
CALIBRATED_AS = {"h100-local": "h100", "h200-s7": "h200", "h200-s8": "h200"}
# Every era, in the order the cases are listed.
ERAS = ("current", "v5", "h100", "h100-local", "h200", "h200-s7", "h200-s8")
# The eras of the current code (the summary's 4-GPU count).
CURRENT_ERAS = ("current", "h100", "h100-local", "h200", "h200-s7", "h200-s8")
# results/four/raw/s8's e2e_bench runs (the heavy-first call's ProLong part ran again alone).
S8_STEMS = ("e2e_4gpu_keep_resend", "e2e_4gpu_resend_alone", "e2e_4gpu_pingpong_profile",
            "e2e_4gpu_pingpong_heavy_first", "e2e_4gpu_pingpong_heavy_first_prolong")
HELD_OUT_RUNS = {
    "current": [("e2e_1gpu_pingpong_v6_fixed_4l", None), ("e2e_1gpu_64k_nodsf", None),
                ("e2e_1gpu_2x64k_nodsf", None),
                ("e2e_1gpu_pingpong_v6_final", "packed_dp+pingpong"),
                ("e2e_1gpu_pingpong_v6_final", "distca+pingpong"),
                ("one_gpu/e2e_16l_64k", None), ("one_gpu/e2e_16l_128k", None),
                # 4 x H200 (results/four/README.md at 356931f): ProLong 64K, 'auto' = 'remote'.
                ("four/raw/h200_e2e_prolong_64k", None)],
    "v5": [("e2e_2gpu_64k_v5c", None), ("e2e_2gpu_128k_v5b", None),
           ("e2e_2gpu_prolong_128k_v5b", None), ("e2e_2gpu_128k_v5_sa", None),
           ("e2e_2gpu_pingpong_2x64k_v5", None)],
    "h100": [("four/raw/e2e_bk_pretrain_distca", None), ("four/raw/e2e_bk_prolong_distca", None),
             # results/four/README.md at 356931f: Pretrain 128K with cuda_async (one process per
             # backend) and Pretrain 64K with 'dense' and 'remote' (one process, another host).
             ("four/raw/e2e_128k_cuda_async_packed_dp", None),
             ("four/raw/e2e_128k_cuda_async", None),
             ("four/raw/e2e_4gpu_pretrain_64k_remote", None),
             # results/four/raw/s4 (code of ff00a0c / 2adb8bc): the four strategies at 128K (one
             # process per backend, same batches; wlb at its recorded configuration, cp at the
             # config's CP size 1), pipe 2 x data 2 (distca pooled per tick and per stage), and
             # 2 rows per GPU with and without ping-pong at 32K and (another host) 64K.
             *[(f"four/raw/s4/e2e_4gpu_128k_{b}", None) for b in ("packed_dp", "wlb", "cp",
                                                                  "distca")],
             ("four/raw/s4/e2e_4gpu_4d_pretrain", None),
             ("four/raw/s4/e2e_4gpu_pingpong", None),
             ("four/raw/s4/e2e_4gpu_pingpong_prolong_distca", None),
             ("four/raw/s4/e2e_4gpu_pingpong_64k", None),
             # results/skip (2 x H100, one call): distca of the tree before the step's local
             # branch (8051464; every batch through the exchange), Pretrain and ProLong 128K.
             ("skip/raw/step_cond/e2e_2gpu_skip_old_pretrain", None),
             ("skip/raw/step_cond/e2e_2gpu_skip_old_prolong", None)],
    # results/skip (the same call): the tree with the step's local branch (bcacbbe): packed_dp,
    # distca and distca with the gate at 0.06 (its override), Pretrain and ProLong 128K.
    "h100-local": [("skip/raw/step_cond/e2e_2gpu_skip_new_pretrain", None),
                   ("skip/raw/step_cond/e2e_2gpu_skip_new_prolong", None)],
    # results/four/raw/s6 (4 x H200, code of 63a9720): wlb, cp and distca at 128K (one process
    # per backend, the packed_dp run's batches; wlb and cp at their recorded configuration),
    # issue35's distca (20 steps, same call as its packed_dp), pipe 2 x data 2, and the 2 x 32K
    # call's ping-pong and distca runs.
    "h200": [*[(f"four/raw/s6/e2e_4gpu_128k_{b}", None) for b in ("wlb", "cp", "distca")],
             ("four/raw/s6/e2e_4gpu_128k_issue35", "distca"),
             ("four/raw/s6/e2e_4gpu_4d_pretrain", None),
             *[("four/raw/s6/e2e_4gpu_pingpong", b) for b in ("packed_dp+pingpong", "distca",
                                                              "distca+pingpong")]],
    # results/four/raw/s7 (another 4 x H200, code of 231bdf7): every run (one process per
    # backend at 128K on the packed_dp run's batches, wlb and cp at their recorded
    # configuration; the 64K, 4D and 2 x 32K calls; each tree's packed_dp and distca).
    "h200-s7": [*[(f"four/raw/s7/e2e_4gpu_128k_{b}", None) for b in ("packed_dp", "wlb", "cp",
                                                                     "distca")],
                ("four/raw/s7/e2e_4gpu_64k", None),
                ("four/raw/s7/e2e_4gpu_4d_pretrain", None),
                ("four/raw/s7/e2e_4gpu_pingpong", None),
                *[(f"four/raw/s7/e2e_4gpu_trees_{t}_{b}", None) for t in ("old", "new")
                  for b in ("packed_dp", "distca")]],
    # results/four/raw/s8 (a 4 x H200 host, code of 8ec3962): every run of host A.
    "h200-s8": [(f"four/raw/s8/{stem}", None) for stem in S8_STEMS],
}
# What 'auto' ran as in runs of the distca backend that set no override (the exchange's
# ``collective``, ``memory_mode``), where it is not ('dense', 'keep'): the runs made at 356931f
# on one process ('auto' = 'remote'); the pre-flight's choice for Pretrain 128K on 4 x H100
# ("'keep' needs 71.63 GiB per device, leaves less than 4% of 72.85 GiB spare; running
# 'resend'", results/four/README.md).
AUTO_RAN_AS = {
    "four/raw/e2e_128k_cuda_async": {"collective": "remote", "memory_mode": "resend"},
    "four/raw/h200_e2e_prolong_64k": {"collective": "remote", "memory_mode": "keep"},
    # results/four/raw/s4 (one process, 'auto' = 'remote'): 128K logged "'keep' needs 71.63
    # (71.41) GiB per device, leaves less than 4% of 72.84 GiB spare; running 'resend'"; the
    # others need at most 71.5 GB (XLA's plan + workspace), so 'keep'.
    "four/raw/s4/e2e_4gpu_128k_distca": {"collective": "remote", "memory_mode": "resend"},
    **{f"four/raw/s4/{stem}": {"collective": "remote", "memory_mode": "keep"}
       for stem in ("e2e_4gpu_4d_pretrain", "e2e_4gpu_pingpong",
                    "e2e_4gpu_pingpong_prolong_distca", "e2e_4gpu_pingpong_64k")},
    # results/skip/raw/step_cond: every distca run logged "'auto': 'keep' (fits: ...)".
    **{f"skip/raw/step_cond/e2e_2gpu_skip_{t}_{w}": {"collective": "remote", "memory_mode": "keep"}
       for t in ("old", "new") for w in ("pretrain", "prolong")},
    # results/four/raw/s6 (one process, 'auto' = 'remote'): every distca run logged
    # "distca memory_mode 'auto': 'keep' (fits: ...)" on the H200's larger memory.
    **{f"four/raw/s6/{stem}": {"collective": "remote", "memory_mode": "keep"}
       for stem in ("e2e_4gpu_128k_distca", "e2e_4gpu_128k_issue35", "e2e_4gpu_4d_pretrain",
                    "e2e_4gpu_pingpong")},
    # results/four/raw/s7 (one process, 'auto' = 'remote'): every distca run logged "'keep'".
    **{f"four/raw/s7/{stem}": {"collective": "remote", "memory_mode": "keep"}
       for stem in ("e2e_4gpu_128k_distca", "e2e_4gpu_64k", "e2e_4gpu_4d_pretrain",
                    "e2e_4gpu_pingpong", "e2e_4gpu_trees_old_distca", "e2e_4gpu_trees_new_distca")},
    # results/four/raw/s8 (one process, 'auto' = 'remote'; the memory mode an override where
    # set, else "'keep' (fits: ...)" as logged).
    **{f"four/raw/s8/{stem}": {"collective": "remote", "memory_mode": "keep"}
       for stem in S8_STEMS},
}
# Runs of one backend each (one process per backend, same host and session) paired for
# distca's speedup; runs of one call pair within their file.
PAIRED_RUNS = {"four/raw/e2e_bk_pretrain_distca": "four/raw/e2e_bk_pretrain_packed_dp",
               "four/raw/e2e_bk_prolong_distca": "four/raw/e2e_bk_prolong_packed_dp",
               "four/raw/e2e_128k_cuda_async": "four/raw/e2e_128k_cuda_async_packed_dp",
               **{f"four/raw/{s}/e2e_4gpu_128k_{b}": f"four/raw/{s}/e2e_4gpu_128k_packed_dp"
                  for s in ("s4", "s6", "s7") for b in ("wlb", "cp", "distca")},
               **{f"four/raw/s7/e2e_4gpu_trees_{t}_distca":
                  f"four/raw/s7/e2e_4gpu_trees_{t}_packed_dp" for t in ("old", "new")},
               "four/raw/s4/e2e_4gpu_pingpong_prolong_distca": "four/raw/s4/e2e_4gpu_pingpong",
               "four/raw/s8/e2e_4gpu_resend_alone": "four/raw/s8/e2e_4gpu_keep_resend"}
# e2e_bench variants that change only distca (no packed_dp twin): their speedup is over the
# plain baseline of the same call.
DISTCA_ONLY_VARIANTS = ("+remote", "+dense", "+ragged", "+perstage", "+gate06")
# The planner's gate (min_gain) each code era ran with (a run's override wins): 0 = no gate.
ERA_MIN_GAIN = {"current": 0.02, "v5": 0.0, "h100": 0.02, "h100-local": 0.02, "h200": 0.02,
                "h200-s7": 0.02, "h200-s8": 0.02}
# The rows of each nano-batch of the recorded ping-pong runs without an override
# (attention.distca.nano_rows): every one ran the rows as sampled.
RUNS_NANO_ROWS = "given"
# Each era's train step had the local branch (a run's override wins): not before bcacbbe.
ERA_LOCAL_STEPS = {"current": False, "v5": False, "h100": False, "h100-local": True,
                   "h200": True, "h200-s7": True, "h200-s8": True}
# The local branch's own threshold (``attention.distca.local_gain``; a run's override wins):
# 0 before 4fc4057 (a step ran locally only when its gated plans moved nothing), 0.05 since.
ERA_LOCAL_GAIN = {"current": 0.0, "v5": 0.0, "h100": 0.0, "h100-local": 0.0, "h200": 0.05,
                  "h200-s7": 0.05, "h200-s8": 0.05}
