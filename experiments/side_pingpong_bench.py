"""The ping-pong layer stack on one GPU with the exchange on the side stream, spanning the other
nano-batch's matmuls (``distca_jax/side_pingpong.py``), against the same stack on one stream.

One GPU, the real data plane (distca backend, its host plans on the run's own batches; one
server, so every route is the device's own group), Llama-3-8B layer shapes, ``--rows`` rows of
``--tokens / --rows`` tokens (two nano-batches), ``--layers`` layers, forward + backward of the
stack (a sum of squares of its output; the embedding and LM head left out, as they do not
change with the exchange). Variants, each compiled once and timed on the same inputs:
  pingpong      ``model.ping_pong_layers``, the exchange as XLA's copy (side_stream_blocks=0)
  side_inline   ``model.ping_pong_layers``, the side copy started and done at once (the path
                the trainer runs with side_stream_blocks > 0)
  side_overlap  ``side_pingpong.ping_pong_beside``: each exchange spans the other nano-batch's
                post-CA (send) and pre-CA (return), forward and backward
  side_serial   the same with every copy done before that work (the serialized order)
Checks: side_overlap's loss and gradients against pingpong's (bf16 tolerance); the compiled GPU
program's spans (``side_stream.schedule_spans``: copies with the other nano-batch's matrix
products between start and done). Profile: one side_overlap and one side_serial call under
jax.profiler, summarized into the copy kernels' busy time and the part of it concurrent with
matmul kernels of another stream (and with any kernel). With ``--train-steps N``: N training
steps (trainer.train_and_evaluate) with side_stream_blocks 0 and ``--blocks``, same batches.

Run (GPU; the side-stream library built by custom_ops/side_stream/build.sh):
  python3 -m experiments.side_pingpong_bench --out results/micro/side_pingpong_bench
CPU smoke: python -m experiments.side_pingpong_bench --tiny --out /tmp/spp
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import command_line, git_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, few reps")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--tokens", type=int, default=65536, help="tokens per GPU (all rows)")
  p.add_argument("--rows", type=int, default=2, help="rows per GPU (two nano-batches)")
  p.add_argument("--blocks", type=int, default=16, help="the side copy's CTAs")
  p.add_argument("--kernel", default="flash3", help="attention kernel (GPU)")
  p.add_argument("--reps", type=int, default=5, help="timed trials per variant")
  p.add_argument("--step", type=int, default=0, help="the batch (data step) planned")
  p.add_argument("--trace", default="", help="profile folder (default: a temporary one)")
  p.add_argument("--train-steps", type=int, default=0,
                 help="also train this many steps with and without the side stream")
  p.add_argument("--train-only", action="store_true",
                 help="only the training steps (--train-steps), into --out")
  p.add_argument("--commit", default="")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "micro", "side_pingpong_bench"))
  return p.parse_args(argv)


def _config(a, blocks: int):
  from distca_jax import configs_io  # pylint: disable=import-outside-toplevel
  t = a.tokens // a.rows
  common = [f"tokens_per_rank={t}", f"rows_per_rank={a.rows}", "attention.backend=distca",
            "attention.nano_batches=2", "attention.distca.local_steps=False",
            "attention.distca.min_gain=0.0", "attention.distca.memory_mode=keep",
            f"attention.distca.side_stream_blocks={blocks}", "mesh.data=1", "mesh.tensor=1",
            "attention.distca.caps_from_batches=8",
            "checkpoint_every=0", "tensorboard=False", "eval_every=0"]
  if a.tiny:
    return configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), common + [
        f"model.n_layers={a.layers}"])
  return configs_io.load_config(os.path.join(ROOT, "configs", "gpu_bench.py"), common + [
      f"model.n_layers={a.layers}", f"attention.kernel={a.kernel}"])


def copy_overlap(trace_path: str) -> dict:
  """The copy kernels' (``CopyRows``) busy time (us) and the part of it concurrent with matmul
  kernels of another stream, and with any kernel of another stream."""
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel
  ev = profiling.load_events(trace_path)
  copy = [e for e in ev if "CopyRows" in e.name or "CopyRows" in e.long_name]
  streams = {e.stream for e in copy}
  cu = profiling.merge_intervals([(e.start_us, e.end_us) for e in copy])
  busy = profiling.total_length(cu)

  def beside(events):
    other = profiling.merge_intervals([(e.start_us, e.end_us) for e in events
                                       if e.stream not in streams])
    return busy - profiling.total_length(profiling.subtract_intervals(cu, other))

  mm = [e for e in ev if profiling.event_category(e) == "matmul"]
  return {"copy_kernels": len(copy), "copy_busy_us": busy,
          "with_matmul_us": beside(mm), "with_any_us": beside(ev),
          "with_matmul_frac": beside(mm) / busy if busy else float("nan"),
          "matmul_kernels": len(mm)}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main(a) -> int:
  if a.tiny:
    jax.config.update("jax_platforms", "cpu")
  if a.train_only:
    res = {"command": command_line(__file__),
           "commit": a.commit or git_commit(), "device": jax.devices()[0].device_kind,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "train": _train(a)}
    profiling_write(a.out, res, _train_markdown(res))
    return 0
  from distca_jax import model as model_lib, profiling, sharding as shard_lib  # pylint: disable=import-outside-toplevel
  from distca_jax import side_pingpong, trainer  # pylint: disable=import-outside-toplevel
  from distca_jax.data import make_source  # pylint: disable=import-outside-toplevel

  c0, c1 = _config(a, 0), _config(a, a.blocks)
  mesh = shard_lib.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])
  be0, be1 = trainer.make_backend(c0), trainer.make_backend(c1)
  m = trainer.make_model(c1, be1)
  cfg = m.cfg
  params = trainer.create_train_state(c1, m, trainer.make_optimizer(c1), mesh).params
  layers = jax.tree.map(lambda x: getattr(x, "value", x), params["layers"]["layer"],
                        is_leaf=lambda x: hasattr(x, "value"))
  del params
  src = make_source(c1.data, rows=a.rows, tokens_per_row=c1.tokens_per_rank,
                    vocab_size=cfg.vocab_size, seed=c1.seed)
  doclens = src.doclens(a.step)
  plan = model_lib.execution_plan(cfg, nano_batches=2)
  x = (jax.random.normal(jax.random.key(0), (a.rows, c1.tokens_per_rank, cfg.dim), jnp.float32)
       .astype(cfg.compute_dtype))
  res = {"command": command_line(__file__),
         "commit": a.commit or git_commit(), "device": jax.devices()[0].device_kind,
         "backend": jax.default_backend(), "jax": jax.__version__,
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "shapes": {"layers": a.layers, "rows": a.rows, "tokens_per_row": c1.tokens_per_rank,
                    "dim": cfg.dim, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                    "mlp": cfg.mlp_dim, "kernel": c1.attention.kernel},
         "blocks": a.blocks, "docs": [len(d) for d in doclens], "variants": {}}
  with trainer.mesh_context(mesh):
    lays = {}
    for name, be in (("0", be0), ("1", be1)):
      batch = trainer.add_host_plan(src.batch(a.step), be, doclens, c1.tokens_per_rank)
      lays[name] = trainer.layout_of(trainer.device_batch(batch, mesh))

    def stack(be, lay, beside=None):
      pieces = model_lib.layer_pieces(cfg, be.fn)
      if beside is None:
        run = lambda l, x: model_lib.ping_pong_layers(plan, pieces, l, x, lay)
      else:
        run = lambda l, x: side_pingpong.ping_pong_beside(plan, pieces, be.beside_fn, l, x, lay,
                                                          head_dim=cfg.head_dim, order=beside)
      return jax.value_and_grad(lambda l, x: jnp.sum(run(l, x).astype(jnp.float32) ** 2),
                                argnums=(0, 1))

    # The baseline first; the tables are written after every variant (a run cut short keeps
    # what it measured).
    variants = {"pingpong": stack(be0, lays["0"]),
                "side_overlap": stack(be1, lays["1"], "overlap"),
                "side_serial": stack(be1, lays["1"], "serial"),
                "side_inline": stack(be1, lays["1"])}
    trace = a.trace or tempfile.mkdtemp(prefix="side_pp_trace_")
    ref = None
    for name, f in variants.items():
      t0 = time.perf_counter()
      compiled = jax.jit(f).lower(layers, x).compile()
      compile_s = time.perf_counter() - t0
      t = profiling.time_call(compiled, layers, x, iters=a.reps, warmup=1)
      spans, fwd, bwd = (side_pingpong.spans_other(compiled.as_text())
                         if name.startswith("side_") else ([], 0, 0))
      v = res["variants"][name] = {
          "median_ms": 1e3 * t["median_s"], "min_ms": 1e3 * t["min_s"],
          "trials_ms": [1e3 * s for s in t["trials_s"]], "compile_s": compile_s,
          "copies": len(spans), "spans_other": fwd + bwd, "spans_other_fwd_bwd": [fwd, bwd]}
      loss, grads = jax.device_get(compiled(layers, x))
      if ref is None:
        ref = (loss, grads)
      else:
        v["loss_rel"] = abs(float(loss) - float(ref[0])) / abs(float(ref[0]))
        v["grad_rel_max"] = max(_rel(u, w) for u, w in zip(jax.tree.leaves(grads),
                                                           jax.tree.leaves(ref[1])))
      del loss, grads
      if name in ("side_overlap", "side_serial") and jax.default_backend() == "gpu":
        _, path = profiling.capture(compiled, layers, x, logdir=os.path.join(trace, name))
        v["profile"] = copy_overlap(path)
      del compiled
      print(name, {k: w for k, w in v.items() if k != "trials_ms"}, flush=True)
      profiling.write_tables(a.out, res, _markdown(res))
  if a.train_steps:
    res["train"] = _train(a)
    profiling.write_tables(a.out, res, _markdown(res))
  return 0


def _train(a) -> dict:
  """``a.train_steps`` steps with side_stream_blocks 0 and ``a.blocks`` (same seed, batches)."""
  import inspect  # pylint: disable=import-outside-toplevel
  from distca_jax import model as model_lib, trainer  # pylint: disable=import-outside-toplevel
  # Whether the model's ping-pong runs side_pingpong.ping_pong_beside (the backend's beside_fn).
  out = {"model_uses_beside": "beside_fn" in inspect.getsource(model_lib.Transformer.__call__)}
  for blocks in (0, a.blocks):
    c = _config(a, blocks)
    c.num_steps, c.log_every, c.optim.warmup_steps = a.train_steps, 1, 1
    with tempfile.TemporaryDirectory() as work:
      recs = trainer.train_and_evaluate(c, work)
    out[str(blocks)] = {"loss": [r["loss"] for r in recs],
                        "step_time_s": [r.get("step_time_s") for r in recs]}
    print("train", blocks, out[str(blocks)], flush=True)
  return out


def _markdown(res) -> str:
  s = res["shapes"]
  lines = [f"# Side-stream ping-pong on one GPU ({res['date']})", "",
           f"Command: `{res['command']}`", "",
           f"Commit {res['commit']}; device: 1 x {res['device']} ({res['backend']}, jax "
           f"{res['jax']}). Stack: {s['layers']} layers (dim {s['dim']}, {s['heads']}/"
           f"{s['kv_heads']} heads, MLP {s['mlp']}), {s['rows']} rows x {s['tokens_per_row']} "
           f"tokens (two nano-batches), kernel {s['kernel']}, side copy {res['blocks']} CTAs; "
           f"forward + backward of the stack; documents per row {res['docs']}.", "",
           "| variant | median ms | min ms | vs pingpong | copies | spanning other | loss rel | "
           "grad rel max |", "|---|---|---|---|---|---|---|---|"]
  base = res["variants"].get("pingpong", {}).get("median_ms", float("nan"))
  for name, v in res["variants"].items():
    lines.append(f"| {name} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | "
                 f"{v['median_ms'] / base:.3f} | {v['copies']} | {v['spans_other']} | "
                 f"{v.get('loss_rel', 0.0):.1e} | {v.get('grad_rel_max', 0.0):.1e} |")
  lines += ["", "spanning other: copies with a matmul of the other nano-batch scheduled between "
            "start and done in the compiled program (side_stream.schedule_spans)."]
  for name in ("side_overlap", "side_serial"):
    p = res["variants"].get(name, {}).get("profile")
    if p:
      lines.append(f"- profile {name}: {p['copy_kernels']} copy kernels busy "
                   f"{p['copy_busy_us']:.0f} us, {p['with_matmul_us']:.0f} us "
                   f"({100 * p['with_matmul_frac']:.1f}%) concurrent with matmul kernels of "
                   f"another stream, {p['with_any_us']:.0f} us with any kernel")
  if "train" in res:
    lines += _train_lines(res["train"])
  return "\n".join(lines)


def _train_lines(train) -> list[str]:
  lines = [("- the trainer's ping-pong runs side_pingpong.ping_pong_beside (exchanges spanning "
            "the other nano-batch's matmuls)") if train["model_uses_beside"] else
           ("- the trainer's ping-pong is model.ping_pong_layers: with side_stream_blocks > 0 "
            "each exchange is the side copy started and done at once (side_inline)")]
  for blocks, t in train.items():
    if blocks == "model_uses_beside":
      continue
    times = [x for x in t["step_time_s"][1:] if x is not None]
    med = f"{1e3 * float(np.median(times)):.1f} ms" if times else "n/a"
    lines.append(f"- training, side_stream_blocks={blocks}: median step {med} (after the "
                 f"first), losses {[round(x, 5) for x in t['loss']]}")
  return lines


def _train_markdown(res) -> str:
  return "\n".join([f"# Training with and without the side stream ({res['date']})", "",
                    f"Command: `{res['command']}`", "",
                    f"Commit {res['commit']}; device: 1 x {res['device']}.", ""]
                   + _train_lines(res["train"]))


def profiling_write(stem, res, md):
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel
  profiling.write_tables(stem, res, md)


if __name__ == "__main__":
  sys.exit(main(_args()))
