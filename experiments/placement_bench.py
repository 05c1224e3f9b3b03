"""Where the key/value attention buffers are built: all after the wire, or own rows before it.

The exchange's step 3 (``distca_jax.dataplane``) fills a server's key/value attention buffers
``[kv_tokens, K, D]`` from its own rows ``[T]`` and its flat receive buffer ``[kv_recv]`` (the
rows of every sender, grouped by sender), through ``kv_attn_idx`` into ``concat(own,
received)``, whose entries may repeat (a key prefix several tasks read). The data plane does it
with one fused gather from both sources (``dataplane.gather_two``), which can start only when
the exchange is done, so all of it sits on the exchange's critical path. The query buffer is
built in two steps (``dataplane.place_unique``): own rows first, while the rows are on the wire,
then only the received rows. This benchmark times, on ONE device and without any collective,
the candidate ways to build the key/value buffer from a real plan's routing (the busiest
receiving server of a ``--servers``-server plan, its receive buffer filled with random rows):

  gather_two   ``dataplane.gather_two``: one gather from both sources, all after the wire;
  own_first    the own rows' gather (before the wire), then a select pass over every row that
               takes the received row where there is one (after the wire);
  scatter      the own rows' gather (before the wire), then a scatter of the received rows into
               their places, every attention row an index (those not fed by the wire dropped);
  scatter_compact  the same scatter over only the attention rows fed by the wire (positions and
               sources compacted on the host, padded to a multiple of 8: the floor of what a
               compacted list in the metadata could do).

For each own-first variant the whole forward is timed as one program (a separately compiled
``post`` would first copy its argument ``pre``), and its part after the wire (what the
exchange's end waits for) is reported as whole - pre; medians of ``--iters`` calls. Then the
forward+backward of each whole variant. Every variant's output is checked equal to
``gather_two``'s, and its gradients close to it. The query buffer's own-first placement is timed
too (``dataplane.place_unique`` from the ``[q_recv]`` receive buffer) for scale.

Run (one GPU; the numbers are per server):
  python -m experiments.placement_bench                 # Pretrain and ProLong, 64K tokens
  python -m experiments.placement_bench --tiny          # CPU smoke test
Writes results/micro/placement_bench.{json,md} (--out changes the stem).
"""

from __future__ import annotations

import argparse
import datetime
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import dataplane, profiling
from distca_jax import plan as plan_lib
from distca_jax.data.workloads import WorkloadSampler
import experiments


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, 2 iters")
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens-per-rank", type=int, default=None, help="default 65536 (tiny: 512)")
  p.add_argument("--servers", type=int, default=2)
  p.add_argument("--heads", type=int, default=None, help="default 32 (tiny: 4)")
  p.add_argument("--kv-heads", type=int, default=None, help="default 8 (tiny: 2)")
  p.add_argument("--head-dim", type=int, default=None, help="default 128 (tiny: 16)")
  p.add_argument("--batches", type=int, default=3, help="plans per workload (their busiest "
                 "receiving servers are timed)")
  p.add_argument("--iters", type=int, default=None, help="default 20 (tiny: 2)")
  p.add_argument("--tolerance", type=float, default=0.05)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="output stem (default results/micro/placement_bench)")
  a = p.parse_args()
  for name, big, small in (("tokens_per_rank", 65536, 512), ("heads", 32, 4), ("kv_heads", 8, 2),
                           ("head_dim", 128, 16), ("iters", 20, 2)):
    if getattr(a, name) is None:
      setattr(a, name, small if a.tiny else big)
  if a.out is None:
    a.out = os.path.join(REPO, "results", "micro", "placement_bench_tiny" if a.tiny else "placement_bench")
  if a.servers < 2:
    p.error(f"--servers={a.servers} must be >= 2 (one server receives nothing)")
  return a


def own_first_pre(own, idx):
  return dataplane.take_rows(own, idx)  # received rows' places stay 0


def _recv_index(idx, t, c):
  """(index into the receive buffer ``[c]`` (``c`` where the row is not received), fed by it)."""
  r = idx - t
  fed = (r >= 0) & (r < c)
  return jnp.where(fed, r, c), fed


def own_first_post(pre, recv, idx, t):
  ridx, fed = _recv_index(idx, t, recv.shape[0])
  got = dataplane.take_rows(recv, ridx)
  return jnp.where(fed[:, None, None], got, pre)


def scatter_post(pre, recv, idx, t):
  n = idx.shape[0]
  ridx, fed = _recv_index(idx, t, recv.shape[0])
  dst = jnp.where(fed, jnp.arange(n, dtype=jnp.int32), n)
  got = dataplane.take_rows(recv, ridx)
  return pre.at[dst].set(got, mode="drop", unique_indices=True)


def compact_post(pre, recv, pos, ridx_at_pos):
  got = dataplane.take_rows(recv, ridx_at_pos)
  return pre.at[pos].set(got, mode="drop", unique_indices=True)


def run_workload(name: str, a) -> list[dict]:
  s, t, h, kh, d = a.servers, a.tokens_per_rank, a.heads, a.kv_heads, a.head_dim
  dtype = jnp.float32 if a.tiny else jnp.bfloat16
  byte_model = dict(q_heads=h, kv_heads=kh, head_dim=d, dtype_bytes=jnp.dtype(dtype).itemsize)
  sampler = WorkloadSampler(name, t, seed=a.seed)
  layouts = [sampler.step_doclens(i, s) for i in range(a.batches)]
  options = plan_lib.PlanOptions(tolerance=a.tolerance, min_shard=plan_lib.auto_min_shard(t),
                                 **byte_model)
  cap = plan_lib.suggest_capacity(layouts, s, t, multiple=plan_lib.row_multiple(t),
                                  options=options)
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
  rng = np.random.default_rng(a.seed)
  k_own = jnp.asarray(rng.standard_normal((t, kh, d), np.float32), dtype)
  q_own = jnp.asarray(rng.standard_normal((t, h, d), np.float32), dtype)
  j = {"gather_two": jax.jit(dataplane.gather_two), "pre": jax.jit(own_first_pre),
       "q_place": jax.jit(dataplane.place_unique)}
  out = []
  for i, doc_lens in enumerate(layouts):
    hp = plan_lib.host_plan(doc_lens, spec, options)
    meta = hp.meta
    kv_received = meta.kv_send_len.sum(axis=0)  # the self pair is 0: nothing of its own arrives
    server = int(np.argmax(kv_received))
    if kv_received[server] == 0:
      print(f"[{name}] batch {i}: nothing moves; skipped", flush=True)
      continue
    kv_idx_np = meta.kv_attn_idx[server]
    kv_idx = jnp.asarray(kv_idx_np)
    q_idx = jnp.asarray(meta.q_attn_idx[server])
    # The flat receive buffers the exchange fills (their capped sizes, whatever the batch).
    k_recv = jnp.asarray(rng.standard_normal((cap.kv_recv, kh, d), np.float32), dtype)
    q_recv = jnp.asarray(rng.standard_normal((cap.q_recv, h, d), np.float32), dtype)
    # Rows of the attention buffer fed by the wire, and where they read (host-side compaction
    # of the server's own mapping).
    r = kv_idx_np.astype(np.int64) - t
    pos_np = np.flatnonzero((r >= 0) & (r < cap.kv_recv))
    count = -(-max(1, pos_np.size) // 8) * 8
    pos = np.full(count, kv_idx_np.shape[0], np.int32)
    pos[:pos_np.size] = pos_np
    src = np.full(count, cap.kv_recv, np.int32)
    src[:pos_np.size] = r[pos_np]
    pos, src = jnp.asarray(pos), jnp.asarray(src)

    want = j["gather_two"](k_own, k_recv, kv_idx)
    # The whole placement of each variant (pre and post in one program: a separate post would
    # copy its argument ``pre`` before writing into it); post = whole - pre.
    whole = {
        "gather_two": lambda own, recv: dataplane.gather_two(own, recv, kv_idx),
        "own_first": lambda own, recv: own_first_post(own_first_pre(own, kv_idx), recv, kv_idx,
                                                      t),
        "scatter": lambda own, recv: scatter_post(own_first_pre(own, kv_idx), recv, kv_idx, t),
        "scatter_compact": lambda own, recv: compact_post(own_first_pre(own, kv_idx), recv, pos,
                                                          src)}
    calls = {
        "gather_two": (j["gather_two"], (k_own, k_recv, kv_idx)),
        "pre": (j["pre"], (k_own, kv_idx)),
        **{key: (jax.jit(whole[key]), (k_own, k_recv))
           for key in ("own_first", "scatter", "scatter_compact")},
        "q_place": (j["q_place"], (q_own, q_recv, q_idx)),
    }
    rec = {"batch": i, "server": server, "kv_tokens": cap.kv_tokens, "q_tokens": cap.q_tokens,
           "kv_recv": cap.kv_recv, "q_recv": cap.q_recv,
           "kv_rows_received": int(kv_received[server]),
           "kv_attention_rows_fed_by_wire": int(pos_np.size),
           "kv_buffer_MB_per_array": cap.kv_tokens * kh * d * jnp.dtype(dtype).itemsize / 2**20}
    for key, (f, args) in calls.items():
      got = f(*args)
      if key in ("own_first", "scatter", "scatter_compact"):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)
      rec[key] = profiling.time_call(f, *args, iters=a.iters)
    for key in ("own_first", "scatter", "scatter_compact"):
      rec[f"{key}_post_s"] = rec[key]["median_s"] - rec["pre"]["median_s"]
      rec[f"{key}_post_over_gather_two"] = rec[f"{key}_post_s"] / rec["gather_two"]["median_s"]
    # Forward + backward of the whole placement (pre and post), cotangent random: the backward
    # sums each row's contributions into the own rows and the receive buffer.
    ct = jnp.asarray(rng.standard_normal(want.shape, np.float32), dtype)
    grads = {}
    for key, f in whole.items():
      fb = jax.jit(lambda own, recv, ct, f=f: jax.vjp(f, own, recv)[1](ct))
      grads[key] = fb(k_own, k_recv, ct)
      rec[f"{key}_fwd_bwd"] = profiling.time_call(fb, k_own, k_recv, ct, iters=a.iters)
    for key in ("own_first", "scatter", "scatter_compact"):
      for g, w in zip(grads[key], grads["gather_two"]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2, err_msg=f"{key} gradient")
    out.append(rec)
    ms = lambda k: rec[k]["median_s"] * 1e3
    post = lambda k: rec[f"{k}_post_s"] * 1e3
    print(f"[{name}] batch {i} server {server}: {rec['kv_rows_received']} K/V rows received "
          f"(a {cap.kv_recv}-row receive buffer), {pos_np.size} of {cap.kv_tokens} "
          f"attention rows fed by them; one K buffer: "
          f"gather_two {ms('gather_two'):.3f} ms | own rows (pre) {ms('pre'):.3f} ms; whole "
          f"(post = whole - pre): select {ms('own_first'):.3f} ({post('own_first'):.3f}), "
          f"scatter {ms('scatter'):.3f} ({post('scatter'):.3f}), compact "
          f"{ms('scatter_compact'):.3f} ({post('scatter_compact'):.3f}) ms | Q place "
          f"{ms('q_place'):.3f} ms | fwd+bwd: "
          f"gather_two {ms('gather_two_fwd_bwd'):.3f}, select {ms('own_first_fwd_bwd'):.3f}, "
          f"scatter {ms('scatter_fwd_bwd'):.3f}, compact {ms('scatter_compact_fwd_bwd'):.3f} ms",
          flush=True)
  return out


def _markdown(res: dict) -> str:
  lines = [f"# Key/value buffer placement on one device ({res['date']})", "",
           f"Command: `{res['command']}`", "",
           f"Device: {res['device_kind']} ({res['backend']}); {res['servers']}-server plans, "
           f"{res['tokens_per_rank']} tokens per server, heads {res['heads']}/{res['kv_heads']} "
           f"x {res['head_dim']} {res['dtype']}; the busiest receiving server of each batch. "
           f"Times in ms for ONE of the K and V buffers (the exchange builds both), forward, "
           f"median of {res['iters']}. Own-first variants: the whole forward (own rows' gather, "
           "then the received rows), and in brackets its part after the wire (whole - pre).", "",
           "| workload | batch | K/V rows received / kv_recv | rows fed by the wire / kv_tokens | gather_two "
           "(all after the wire) | own rows (pre) | select | scatter | compact scatter | "
           "Q buffer, own-first | fwd+bwd: gather_two / select / scatter / compact |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for w in res["workloads"]:
    for r in w["batches"]:
      ms = lambda k: f"{r[k]['median_s'] * 1e3:.3f}"
      both = lambda k: f"{ms(k)} ({r[k + '_post_s'] * 1e3:.3f})"
      lines.append(f"| {w['workload']} | {r['batch']} | {r['kv_rows_received']} / {r['kv_recv']} | "
                   f"{r['kv_attention_rows_fed_by_wire']} / {r['kv_tokens']} | "
                   f"{ms('gather_two')} | {ms('pre')} | {both('own_first')} | {both('scatter')} | "
                   f"{both('scatter_compact')} | {ms('q_place')} | "
                   f"{ms('gather_two_fwd_bwd')} / {ms('own_first_fwd_bwd')} / "
                   f"{ms('scatter_fwd_bwd')} / {ms('scatter_compact_fwd_bwd')} |")
  return "\n".join(lines)


def main(a) -> None:
  if a.tiny:
    jax.config.update("jax_platforms", "cpu")
  dev = jax.devices()[0]
  res = {"command": experiments.command_line(__file__),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "backend": jax.default_backend(), "device_kind": dev.device_kind,
         "servers": a.servers, "tokens_per_rank": a.tokens_per_rank, "heads": a.heads,
         "kv_heads": a.kv_heads, "head_dim": a.head_dim,
         "dtype": "float32" if a.tiny else "bfloat16", "iters": a.iters,
         "tolerance": a.tolerance, "workloads": []}
  for name in a.workloads.split(","):
    res["workloads"].append({"workload": name, "batches": run_workload(name, a)})
  profiling.write_tables(a.out, res, _markdown(res))


if __name__ == "__main__":
  main(_args())
