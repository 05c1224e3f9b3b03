"""Rows on the inter-host link per device: the two-level exchange against 'dense' (host only).

For both workloads at 128K tokens per rank (one row per rank, documents within rows, as the
trainer plans them), S servers of L per host, plans balanced within caps sampled the way the
backend sizes them (the envelope of the first batches x 1.1, ``plan.spec.suggest_caps``), per
part (Q, K/V) of the dispatch, on the busiest device:

* useful: the rows it sends to other hosts (each row once, what any exchange must move);
* two-level: leg A's ``ppermute`` rounds, each padded to the bucket (``exchange_buckets`` 8) of
  its largest group (``dataplane.exchange.round_wire_rows``);
* dense: the blocks of the one-level dense exchange that go to other hosts, ``(S - L) / S`` of
  ``dataplane.dense_wire_rows``;

and the relay rows the two-level exchange needs (leg A's receive buffer) against its safe bound
``plan.two_level.safe_relay`` of the caps. The output return moves the Q rows again (the same
wire). Rows, not seconds: no GPU measurement (docs/design.md, "The two-level exchange").

Run:
  python -m experiments.two_level_wire   # writes results/two_level_wire.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import numpy as np

from distca_jax import plan as plan_lib
from distca_jax.data.workloads import WorkloadSampler
from distca_jax.dataplane import DEFAULT_EXCHANGE_BUCKETS, dense_wire_rows, round_wire_rows
from distca_jax.plan import two_level
import experiments


def _part_rows(send_len, cap_send, cap_recv, relay_cap, s, l, buckets):
  """Per-device rows of one part: (useful inter-host, two-level leg A wire, dense inter-host
  wire, relay needed), busiest device."""
  host = np.arange(s) // l
  cross = np.where(host[:, None] != host[None, :], send_len, 0)
  a, _ = two_level.leg_lengths(send_len, l)
  return (int(cross.sum(1).max(initial=0)),
          round_wire_rows(a, min(cap_send, relay_cap), buckets, l, "hosts"),
          dense_wire_rows(send_len, min(cap_send, cap_recv), buckets) * (s - l) // s,
          int(two_level.relay_rows(send_len, l).max(initial=0)))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens", type=int, default=131072, help="tokens per rank")
  p.add_argument("--servers", default="16,32,64")
  p.add_argument("--per-host", default="4,8", help="servers per host L")
  p.add_argument("--sample", type=int, default=32,
                 help="batches the caps are sized on (the backend's caps_from_batches)")
  p.add_argument("--steps", type=int, default=8, help="batches scored (after the sampled ones)")
  p.add_argument("--buckets", type=int, default=DEFAULT_EXCHANGE_BUCKETS)
  p.add_argument("--out", default="results/two_level_wire")
  args = p.parse_args()
  command = experiments.command_line(__file__)
  t = args.tokens
  options = plan_lib.PlanOptions(min_shard=None).for_rows(t)
  rows = []
  for name in args.workloads.split(","):
    sampler = WorkloadSampler(name, t, seed=0)
    for s in [int(v) for v in args.servers.split(",")]:
      sample = [sampler.step_doclens(step, s) for step in range(args.sample)]
      for l in [int(v) for v in args.per_host.split(",")]:
        if s % l or s == l:
          continue
        cap, relay = plan_lib.spec.suggest_caps(sample, s, t, options=options,
                                                servers_per_host=l, multiple=128)
        cap = plan_lib.Capacity(**{f: int(np.ceil(getattr(cap, f) * 1.1 / 128) * 128)
                                   if f != "tasks" else cap.tasks
                                   for f in plan_lib.CAP_FIELDS})
        safe = (two_level.safe_relay(cap.q_send, cap.q_recv, s, l),
                two_level.safe_relay(cap.kv_send, cap.kv_recv, s, l))
        relay = tuple(min(sf, int(np.ceil(r * 1.1 / 128) * 128)) for r, sf in zip(relay, safe))
        per = []
        for step in range(args.sample, args.sample + args.steps):
          plan = plan_lib.schedule(sampler.step_doclens(step, s), s, tokens_per_rank=t,
                                   capacity=cap, options=options)
          parts = {}
          for part, ln, cs, cr, rc in (("q", plan.pair_q_rows, cap.q_send, cap.q_recv, relay[0]),
                                       ("kv", plan.pair_kv_rows, cap.kv_send, cap.kv_recv,
                                        relay[1])):
            useful, two, dense, need = _part_rows(np.asarray(ln), cs, cr, rc, s, l, args.buckets)
            parts[part] = {"useful": useful, "two_level": two, "dense": dense,
                           "relay_needed": need}
          per.append(parts)
        agg = {"workload": name, "servers": s, "per_host": l, "tokens_per_rank": t,
               "capacity": dataclasses.asdict(cap), "relay": list(relay),
               "safe_relay": list(safe), "batches": per}
        for part in ("q", "kv"):
          tot = {k: sum(b[part][k] for b in per) for k in ("useful", "two_level", "dense")}
          agg[f"{part}_two_level_over_useful"] = tot["two_level"] / max(1, tot["useful"])
          agg[f"{part}_dense_over_useful"] = tot["dense"] / max(1, tot["useful"])
          agg[f"{part}_useful_mean"] = tot["useful"] / len(per)
          agg[f"{part}_relay_needed_max"] = max(b[part]["relay_needed"] for b in per)
        agg["relay_overflows"] = sum(b["q"]["relay_needed"] > relay[0]
                                     or b["kv"]["relay_needed"] > relay[1] for b in per)
        rows.append(agg)
        print(f"{name:8s} S={s:3d} L={l}: Q two-level/useful "
              f"{agg['q_two_level_over_useful']:.2f} dense/useful {agg['q_dense_over_useful']:.1f}"
              f"; K/V {agg['kv_two_level_over_useful']:.2f} / {agg['kv_dense_over_useful']:.1f}; "
              f"relay {relay} of safe {safe}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  meta = {"command": command, "commit": experiments.git_commit(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": "host CPU (NumPy only; no device)"}
  with open(args.out + ".json", "w") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)
  lines = [
      "# Inter-host rows per device: two-level exchange vs dense (host only)", "",
      f"- command: `{command}`; commit `{meta['commit']}`; {meta['date']}; {meta['machine']}",
      f"- {args.steps} batches per row scored after {args.sample} sampled for the caps "
      "(envelope x 1.1, the backend's startup sizing), one row of "
      f"{t // 1024}K tokens per rank, default balancer options; busiest device per batch, summed "
      "over batches. 'useful': rows the device sends to other hosts; 'two-level': leg A's "
      f"rounds, each padded to its bucket ({args.buckets} buckets); 'dense': the one-level dense "
      "exchange's blocks to other hosts. Relay: leg A's receive rows needed (max over batches) / "
      "sized from the sample / the safe bound; 'over sized': scored batches that need more "
      "relay rows than sized (the backend plans such a batch to move nothing). Rows, not time: "
      "GPU timing is open (docs/design.md).", "",
      "| workload | servers | per host | Q useful rows | Q two-level / useful | Q dense / useful | "
      "K/V useful rows | K/V two-level / useful | K/V dense / useful | Q relay need / sized / "
      "safe | K/V relay need / sized / safe | over sized |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['workload']} | {r['servers']} | {r['per_host']} | {r['q_useful_mean']:.0f} | "
        f"{r['q_two_level_over_useful']:.2f} | {r['q_dense_over_useful']:.1f} | "
        f"{r['kv_useful_mean']:.0f} | {r['kv_two_level_over_useful']:.2f} | "
        f"{r['kv_dense_over_useful']:.1f} | {r['q_relay_needed_max']} / {r['relay'][0]} / "
        f"{r['safe_relay'][0]} | {r['kv_relay_needed_max']} / {r['relay'][1]} / "
        f"{r['safe_relay'][1]} | {r['relay_overflows']}/{len(r['batches'])} |")
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  main()
