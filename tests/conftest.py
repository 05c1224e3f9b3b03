"""Test setup: 8 fake CPU devices (set before jax is imported), CPU code compiled at XLA's backend
optimization level 0, strict numerics, and the `seed` fixture every randomized test draws from."""

import fcntl
import os
import shutil
import tempfile
import zlib

from child_env import OPT_LEVEL

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile hundreds of small programs and run each a few times: most of their time is
# XLA's CPU backend (LLVM) optimizing machine code, which level 0 (``child_env.OPT_LEVEL``; the
# tests' subprocesses get it from ``child_env.cpu_xla_flags``) mostly skips. An XLA_FLAGS that
# names a level keeps it; GPU runs (JAX_PLATFORMS other than cpu) keep the default.
if (os.environ["JAX_PLATFORMS"] == "cpu"
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " " + OPT_LEVEL

import jax  # noqa: E402  (must follow the environment setup above)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# The tests' subprocesses (trainer runs, several processes, faults) compile the same few programs
# again and again (a run resumed, the same run on 1 and on 2 processes): they share one persistent
# compilation cache per test run, made here by the first process (the pytest-xdist controller, or
# the only one) and inherited by the workers and their children through the environment, and
# removed at its end (a cold compile of the tiny trainer: 24 s of CPU; from the cache: 6 s). Its
# lock (a size limit turns it on) keeps processes from reading an entry being written. The test
# processes themselves compile as before (a test's programs differ from the others').
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="distca-tests-cache-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30))
jax.config.update("jax_enable_compilation_cache", False)

_SEED = pytest.StashKey[int]()


@pytest.fixture
def seed(request) -> int:
  """A fixed seed per test, from its id, so every run draws the same inputs; a failing test
  prints it. DISTCA_TEST_SEED=N mixes N in, to draw other inputs: rerun with the same N to
  reproduce."""
  extra = os.environ.get("DISTCA_TEST_SEED", "")
  value = zlib.crc32(f"{request.node.nodeid}#{extra}".encode()) & ((1 << 30) - 1)
  request.node.stash[_SEED] = value
  return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.failed and _SEED in item.stash:
    extra = os.environ.get("DISTCA_TEST_SEED")
    report.sections.append(("seed", f"seed={item.stash[_SEED]}"
                            + (f" (DISTCA_TEST_SEED={extra})" if extra else "")))
  return report


# Tests of the fast tier that took 2.5 s or more on 2 idle cores (`pytest -m "not slow" tests
# --durations=80`, 2026-12-07): marked `slow` here (they run in the full suite) so the fast tier
# stays under 5 minutes. Node ids as pytest prints them.
MEASURED_SLOW = frozenset({
    "tests/test_dispatch.py::test_a_batch_whose_plans_move_nothing_runs_the_local_step",
    "tests/test_pipeline.py::test_pipelined_loss_and_grads_equal_pipe_1[2-2-2-2-none-local]",
    "tests/test_train.py::test_remat_policies_keep_loss_and_gradients[save_attention]",
    "tests/test_dispatch.py::test_exchange_equals_reference_both_memory_modes_single_trace"
    "[ring-modes0]",
    "tests/test_train.py::test_ping_pong_schedule_variants_equal_single_stream"
    "[True-1-save_attention]",
    "tests/test_train.py::test_sharded_loss_and_grads_equal_single_device[8-1]",
    "tests/test_scheduler.py::test_caps_never_exceeded_small_layouts",
    "tests/test_fuzz_plan.py::test_planner_fuzz_coverage_work_and_caps[0]",
    "tests/test_multihost.py::test_checkpoint_restores_into_another_layout_bit_for_bit"
    "[data2_tensor2_pipe2]",
    "tests/test_remote_exchange.py::test_dispatch_with_remote_lowers_for_cuda",
    "tests/test_eval.py::test_files_without_held_out_data_train_and_say_there_is_no_evaluation",
    "tests/test_two_level.py::test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back"
    "[8-rounds-rounds-8]",
    "tests/test_dispatch.py::test_row_copies_as_words_are_bit_exact_and_differentiate_like_take",
    "tests/test_remote_exchange.py::test_signal_only_remote_dispatch_lowers_for_cuda",
    "tests/test_reliability.py::test_nonfinite_step_is_skipped_inside_the_step",
    # 2.5-5 s each (the same run):
    "tests/test_two_level.py::test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back"
    "[1-rounds-rounds-8]",
    "tests/test_scheduler.py::test_properties_on_workloads[prolong-65536-512-0.0-False-23]",
    "tests/test_train.py::test_chunked_cross_entropy_matches_full_logits[37-8]",
    "tests/test_attention.py::test_local_equals_reference[4-2-None-blocks0]",
    "tests/test_train.py::test_tiny_compiles_ahead_of_time_with_its_state_as_arguments",
    "tests/test_mosaic_attention.py::test_kernels_lower_for_cuda"
    "[1000-2045-128-True-True-True-True]",
    "tests/test_fuzz_plan.py::test_cad_outputs_and_grads_on_fuzzed_layouts[11]",
    "tests/test_ops.py::test_flash3_remat_keeps_o_and_compact_lse_not_the_raw_buffer",
    "tests/test_two_level.py::test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back"
    "[4-ring-dense-8]",
    "tests/test_two_level.py::test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back"
    "[4-rounds-rounds-8]",
    "tests/test_ops.py::test_reference_agrees_with_dense_causal_attention",
    "tests/test_ops.py::test_flash3_launch_buckets_mask_padding_and_match_reference[11]",
    "tests/test_watchdog.py::"
    "test_a_peer_lost_while_this_process_waits_at_the_exit_barrier_is_named",
    "tests/test_ops.py::test_blockwise_tile_sizes_match_oracle[24x8]",
    "tests/test_ops.py::test_blockwise_tile_sizes_match_oracle[64x128]",
    "tests/test_two_level.py::test_dispatch_with_two_level_lowers_for_cuda",
    "tests/test_dispatch.py::test_exchange_buffers_do_not_grow_with_the_number_of_servers",
    "tests/test_baselines.py::test_packed_dp_equals_local_and_reference[1]",
    "tests/test_two_level.py::test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back"
    "[2-rounds-rounds-8]",
    "tests/test_mosaic_attention.py::test_kernels_lower_for_cuda[1003-2048-64-True-True-True-True]",
    "tests/test_train.py::test_chunked_cross_entropy_matches_full_logits[64-16]",
    "tests/test_baselines.py::test_arrange_batch_feeds_the_backend_and_keeps_every_token",
    # The simulator's validation against the committed runs: its module fixture
    # (`sim.validate.validate()`) takes 17 s of CPU (tests/cpu_times.py, 2026-12-07).
    "tests/test_simulator.py::test_validation_replays_committed_runs",
    "tests/test_simulator.py::test_validation_explains_every_miss",
    # 20-51 s each in the full suite on 2 workers (--durations, 2026-12-07); the layer types keep
    # a fast model-against-reference test (window) and the chunked kernel-level test.
    "tests/test_layer_types_train.py::test_chunked_model_trains_with_distca_like_local[layers0]",
    "tests/test_layer_types_train.py::test_packed_dp_runs_local_layers[local0]",
    "tests/test_layer_types.py::test_model_equals_per_layer_reference[kw2]",
})


# Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadfile`: each test file on one worker,
# its module fixtures made once) the tests whose node id starts with one of these also run one at
# a time across the workers, under a lock file of the run: the multi-process runs (gloo
# coordinators, heartbeat and stop timeouts; each is already 2 processes).
SERIAL_TESTS = (
    "tests/test_multihost.py::",
    "tests/test_two_level.py::test_two_processes_",
    "tests/test_watchdog.py::",
)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.nodeid in MEASURED_SLOW:
      item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in each worker of an xdist run
  if not run or not item.nodeid.startswith(SERIAL_TESTS):
    return (yield)
  with open(os.path.join(tempfile.gettempdir(), f"distca-tests-{run}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return (yield)


def pytest_unconfigure(config):
  del config
  if _CACHE_DIR:  # this process made the run's cache (module comment above)
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
