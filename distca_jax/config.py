"""Every configuration key, defined and documented once.

Config files under `configs/` call `base_config()` and override what they need; command lines
override further with `--config.section.key=value`. A key that is not defined here is an error
(ml_collections ConfigDicts are locked), so a typo never passes silently.
"""

from __future__ import annotations

import jax
import ml_collections

from distca_jax import ops
from distca_jax.plan import cost, ticks
from distca_jax.errors import UserError
from distca_jax.model import ModelConfig


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # --- model: the Llama-3 family decoder; every field of distca_jax.model.ModelConfig (see its
  # comments for meaning): vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, mlp_dim,
  # rope_theta, rope_scaling_factor (0 = off; Llama-3.1 uses 8), rope_low_freq_factor,
  # rope_high_freq_factor, rope_original_max_position, norm_eps, tie_embeddings, dtype (compute),
  # param_dtype (master weights), remat ('none' | 'full' | 'save_dots' | 'save_qkv_out' |
  # 'save_attention' | 'offload_mlp'; model.ModelConfig.remat says what each keeps),
  # remat_mlp_layers (with 'save_attention': the first N layers also keep their MLP activations),
  # scan_layers, init_std, loss_chunk (tokens per LM-head chunk), layer_pattern / window /
  # chunk (local and global attention layers: '' all full, 'local', 'K:G' e.g. '5:1', or 'L'/'G'
  # per layer; local = a sliding window of `window` tokens or chunks of `chunk` tokens;
  # distca_jax/layer_types.py says what each backend does with them).
  c.model = ml_collections.ConfigDict(vars(ModelConfig()).copy())

  # --- attention: core attention, the pluggable middle of every layer.
  c.attention = ml_collections.ConfigDict()
  c.attention.backend = "local"   # distca_jax.backends: 'local' (blockwise jnp, each row its
                                  # own documents), 'reference' (dense jnp; tests), 'distca'
                                  # (CAD), 'packed_dp', 'cp', 'wlb' (baselines)
  c.attention.block_q = 512       # `local`: query block (clamped to a divisor of tokens_per_rank)
  c.attention.block_k = 512       # `local`: key block
  c.attention.nano_batches = 1    # 2 = ping-pong (model.ping_pong_layers): each rank's rows form
                                  # two nano-batches A and B; while one's core attention (and its
                                  # all-to-alls) runs, the other runs post-CA of layer i and
                                  # pre-CA of layer i+1, which do not depend on it; the carry
                                  # between layers also holds A's CA output and B's q/k/v;
                                  # needs rows_per_rank % nano_batches == 0
  c.attention.kernel = "auto"     # ops.core_attention kernel of the fused backends (distca,
                                  # packed_dp, cp, wlb): 'auto' ('blockwise' on CPU, 'reference'
                                  # elsewhere: ops.default_kernel), 'blockwise' (jnp tiles),
                                  # 'reference' (dense jnp), 'mosaic' (ours, Hopper), 'flash3'
  # `distca`: core attention disaggregation (distca_jax/plan, distca_jax/dataplane,
  # distca_jax/backends/distca.py). Caps are rows per device and call; 0 = auto: the row caps from
  # the run's first batches (caps_from_batches), else plan.default_capacity; tasks 64 per row.
  c.attention.distca = ml_collections.ConfigDict()
  c.attention.distca.tolerance = cost.DEFAULT_TOLERANCE
                                          # every server within (1 + tolerance) x mean pairs;
                                          # default: plan.cost.DEFAULT_TOLERANCE says why
  c.attention.distca.min_gain = 0.02      # the gate: a plan moves nothing when perfect balance
                                          # would speed the step up by less than this
                                          # (plan.predicted_step_gain); 0.02 keeps most of the
                                          # per-batch bound's gain (results/per_batch_bound.md)
  c.attention.distca.min_shard = 0        # shortest query piece a split may create; 0 = auto
                                          # (512, or tokens_per_rank / 16 for short rows)
  c.attention.distca.intra_host_gbps = cost.INTRA_HOST_GBPS  # per-GPU link rates (GB/s) the
  c.attention.distca.inter_host_gbps = cost.INTER_HOST_GBPS  # planner prices moves with, inside
                                          # a host (344: the remote exchange fitted on 4 x
                                          # H100) and between hosts (50: a 400 Gb/s NIC per
                                          # GPU, stated); only their ratio counts
  c.attention.distca.q_send = 0           # query rows a rank sends to all other servers
  c.attention.distca.kv_send = 0          # key/value rows a rank sends to all other servers
  c.attention.distca.q_recv = 0           # query rows a server receives from all other ranks
  c.attention.distca.kv_recv = 0          # key/value rows a server receives from all other ranks
  c.attention.distca.q_tokens = 0         # query rows in a server's attention input
  c.attention.distca.kv_tokens = 0        # key/value rows in a server's attention input
  c.attention.distca.tasks = 0            # CA-tasks (varlen segments) per server
  c.attention.distca.caps_from_batches = 32  # row caps left at 0: the envelope of this many of
                                          # the run's batches planned at startup (per call:
                                          # nano-batch, or pipeline tick under mesh.pipe > 1);
                                          # 0 = fixed fractions (plan.default_capacity)
  c.attention.distca.caps_headroom = 1.1  # >= 1: margin over the sampled batches' envelope
  c.attention.distca.memory_mode = "auto" # 'keep': servers keep received Q/K/V for the
                                          # backward; 'resend': they are re-sent (recomputed);
                                          # 'auto': 'keep' when the memory pre-flight finds it
                                          # fits with 4% to spare, else 'resend' (one more
                                          # compile)
  c.attention.distca.collective = "auto"  # how rows cross the wire: 'remote' (device-
                                          # initiated copies, each row once; Hopper GPUs of one
                                          # process), 'ragged' (XLA's ragged all-to-all; GPU),
                                          # 'ring' (ppermute rounds; any platform), 'dense'
                                          # (padded all-to-all), 'two_level' (a leg between
                                          # hosts, each row across once, then one inside each
                                          # host; any platform, any number of processes);
                                          # 'auto': remote on the GPUs of one process,
                                          # two_level on several, ring elsewhere
  c.attention.distca.servers_per_host = 0  # servers (data ranks) per host, L: the planner
                                          # balances inside hosts first and prices moves by
                                          # link (intra/inter_host_gbps), 'two_level' runs its
                                          # legs over them; it must divide the servers
                                          # (numbered host-major);
                                          # 0 = auto: servers / processes in a multi-process
                                          # job (jax.local_device_count() without tensor
                                          # parallelism), all servers (one host) otherwise
  c.attention.distca.q_relay = 0          # 'two_level': query rows a device relays between
  c.attention.distca.kv_relay = 0         # hosts (key/value rows); 0 = auto: the sampled
                                          # batches' envelope (caps_from_batches) with
                                          # headroom, at most the safe bound (plan.two_level:
                                          # min(L x recv, (hosts - 1) x send)), which is the
                                          # value when caps_from_batches = 0
  c.attention.distca.pool_stages = True  # mesh.pipe > 1: plan each tick over every pipe x data
                                          # rank (pooled: a stage in its bubble serves the
                                          # others); False: per-stage CAD, each stage's data
                                          # ranks serve only that stage's rows (every exchange
                                          # runs over 'data' within the stage)
  c.attention.distca.exchange_buckets = 8  # 'dense' (and 'two_level''s rounds: per round): per
                                          # batch the smallest of n block sizes that holds its
                                          # largest group (1 = the largest)
  c.attention.distca.buckets = 4          # compiled exchange capacities per step (send and
                                          # receive buffers): bucket i of n holds (i + 1) / n
                                          # of the caps; the host runs each call in the smallest
                                          # its plans fit (plan.buckets; the attention buffers
                                          # stay the caps'); 1 = the caps' buffers always
  c.attention.distca.local_steps = True   # a batch whose plans move no row runs the step's
                                          # second branch, packed_dp's attention (no exchange);
                                          # mesh.pipe = 1 only
  c.attention.distca.nano_rows = "heavy_first"  # attention.nano_batches=2: 'heavy_first'
                                          # orders each rank's rows by attention work first,
                                          # so each nano-batch pairs rows of like weight across
                                          # ranks (less to move per nano-batch); 'given' keeps
                                          # each rank's row order (nano-batch i takes its i-th
                                          # share)
  c.attention.distca.side_stream_blocks = 0  # > 0: the exchange of one server (one data rank
                                          # per exchange: one GPU) runs on a side CUDA stream
                                          # with this many 1024-thread CTAs (custom_ops/
                                          # side_stream.py, its library built), at most the
                                          # GPU's SMs (resident at once; 132 on CPU);
                                          # distca_jax.side_pingpong spans one nano-batch's
                                          # exchanges over the other's post-/pre-CA; 0 = off
  c.attention.distca.local_gain = 0.05    # with local_steps: a batch whose every plan could gain
                                          # less than this moves nothing and runs that branch.
                                          # On H100s at 128K, batches below 0.04 ran slower
                                          # through CAD than packed_dp, those above 0.10 faster
                                          # (results/skip/README.md)
  c.attention.distca.branch = "gain"     # with local_steps, which branch a batch whose plans
                                          # move rows runs: 'gain' (local when every plan could
                                          # gain less than local_gain); 'price' (plan.choice:
                                          # both branches priced by the calibrated step model,
                                          # corrected per branch by measured / predicted step
                                          # times, CAD only when priced faster by a margin, a
                                          # 1% regret guard; one process, no pipeline; each
                                          # step's branch and reason in WORKDIR/branches.jsonl).
                                          # Replayed on committed runs it matched 'gain' on
                                          # average (results/skip/branch_replay.md)
  # Baselines (distca_jax/baselines): 'packed_dp' (each rank its own documents, one fused varlen
  # call), 'cp' (per-sequence context parallelism: groups of cp_size consecutive data ranks, head-
  # tail chunks, K/V all-gathered) and 'wlb' (WLB-LLM packing over DP groups + per-document CP).
  # 'cp' and 'wlb' rearrange each batch on the host (Backend.host_arrange, called by the trainer's
  # input thread through trainer.add_host_plan).
  c.attention.baselines = ml_collections.ConfigDict()
  c.attention.baselines.cp_size = 0            # cp / wlb: ranks per CP group (divides mesh.data);
                                               # 0 = chosen at startup (baselines.ideal: the
                                               # fastest predicted on never-trained batches whose
                                               # step fits memory; cp_size 1 computes what
                                               # packed_dp does)
  c.attention.baselines.wlb_alpha = 1.0        # wlb: per-rank token cap Lmax = alpha x
                                               # tokens_per_rank (>= 1; > 1 trades memory balance
                                               # for attention balance); 0 = WLB-ideal's pick
  c.attention.baselines.max_docs_per_row = 128  # packed_dp / cp: task-table slots per row
                                               # (documents or pieces; unused ones cost flash3
                                               # launch work); packing errors name the need
  c.attention.baselines.wlb_tasks_per_row = 0  # wlb: task-table slots per row (document pieces:
                                               # a head and a tail chunk per document and rank);
                                               # 0 = sized at startup from sampled batches at
                                               # wlb's configuration (baselines.ideal.
                                               # wlb_tasks_needed: x1.25 over the most seen)
  c.attention.baselines.memory_gib = 0.0       # cp / wlb choosing (cp_size or wlb_alpha 0):
                                               # the memory per device the chosen
                                               # configuration's step must fit (GiB; 0 = the
                                               # device's bytes_limit, as the pre-flight; no
                                               # check where none is reported)

  # --- mesh: named axes; data x tensor x pipe must equal the device count.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                # data-parallel ranks (= CAD attention servers); -1: all the rest
  c.mesh.tensor = 1               # tensor parallelism over heads, MLP and vocab
  c.mesh.pipe = 1                 # pipeline stages (distca_jax.pipeline): each holds n_layers /
                                  # pipe consecutive layers; the parameters keep their shape
  c.mesh.fsdp = False             # FSDP: parameters, gradients and Adam moments also split over
                                  # `data` (each weight's `embed` dim; model.dim must divide by
                                  # the data size); each layer all-gathers its weights inside
                                  # the layer scan just before use and reduce-scatters their
                                  # gradients (sharding.FSDP_RULE, sharding.gathered); same
                                  # math, 1/data of the state per device; checkpoints are
                                  # layout-free (resume with or without it)

  # --- pipeline: the GPipe schedule used when mesh.pipe > 1 (a scan over M + pipe - 1 ticks).
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.microbatches = 0     # M: each data rank's rows split into M microbatches (rows_per_rank
                                  # must be a multiple); 0 = 2 x mesh.pipe. The bubble is
                                  # (pipe - 1) / (M + pipe - 1) of each stage's ticks; GPipe
                                  # keeps all M in flight: activation memory per step is
                                  # smallest near M = 2 x pipe (results/pipeline/
                                  # aot_memory_pipeline.md)

  # --- batch: every data-parallel rank gets `rows_per_rank` rows of `tokens_per_rank` tokens.
  c.tokens_per_rank = 256         # the per-rank token budget (the context window that is packed)
  c.rows_per_rank = 1             # rows (sequences) per rank per step

  # --- data
  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"     # 'synthetic' (document layouts from the paper's length samples,
                                  # learnable token patterns) or 'files' (tokenized dataset)
  c.data.workload = "pretrain"    # synthetic: 'pretrain' or 'prolong', or the path of a
                                  # document-length file of your own data (a JSON list, a .npy
                                  # array or one length a line), whose lengths are used as given
  c.data.context_length = 0       # synthetic: length the recipe scales to; 0 = tokens_per_rank
  c.data.path = ""                # files: dataset prefix (PREFIX.tokens.npy + PREFIX.offsets.npy)
  c.data.shuffle = True           # files: a seeded document permutation per epoch
  c.data.eval_path = ""           # files: the held-out dataset evaluation reads (a prefix as
                                  # data.path); "" = the documents data.eval_fraction holds out
  c.data.eval_fraction = 0.0      # files: this fraction of data.path's documents (the last ones
                                  # in file order, at least one) is held out: never trained on,
                                  # evaluated when eval_every > 0 and data.eval_path is ""

  # --- optimizer: AdamW, linear warmup then cosine decay, global-norm clipping.
  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-4               # peak learning rate
  c.optim.min_lr_ratio = 0.1      # final lr = lr * min_lr_ratio
  c.optim.warmup_steps = 20
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0         # max global gradient norm; 0 disables clipping

  # --- run
  c.seed = 0                      # seeds parameters, data and the step RNG
  c.init_from_hf = ""             # a Hugging Face Llama checkpoint directory (config.json +
                                  # safetensors; distca_jax.hf_import): a run that starts fresh
                                  # (no checkpoint in its workdir) takes its parameters from it
                                  # (fine-tuning; the optimizer starts fresh); its architecture
                                  # must equal config.model's (checked, with every tensor's
                                  # name and shape). Export with python -m distca_jax.hf_export
  c.num_steps = 100               # total optimizer steps (also the cosine decay length)
  c.log_every = 10                # steps between progress lines / log records
  c.eval_every = 0                # steps between evaluations on held-out data (0: none; an
                                  # evaluated step is also logged): the mean loss over eval_steps
                                  # held-out batches (forward only, the run's attention backend)
                                  # and its perplexity, as eval_loss / eval_ppl in the progress
                                  # line, metrics.jsonl and TensorBoard. Held out: synthetic, a stream
                                  # of its own seed (seed + data.EVAL_SEED_OFFSET); files,
                                  # data.eval_path or data.eval_fraction (neither set: no
                                  # evaluation, said in one line at startup)
  c.eval_steps = 4                # held-out batches per evaluation (the same ones every time;
                                  # each the shape of a training batch)
  c.checkpoint_every = 50         # steps between checkpoints; 0 disables checkpointing
  c.keep_checkpoints = 3          # keep the last k checkpoints
  c.async_checkpoint = True       # orbax saves in the background while training goes on
  c.peak_tflops = 0.0             # per-device peak for MFU; 0 = look up by device kind (H100/H200:
                                  # 989 dense bf16), unknown devices report no MFU
  c.tensorboard = True            # write TensorBoard event files under WORKDIR/tb
  c.train = ml_collections.ConfigDict()
  c.train.max_bad_steps = 3       # stop after this many consecutive skipped steps: a step is
                                  # skipped (no update applied) when its loss or gradient norm is
                                  # not finite or spikes (below)
  c.train.spike_sigmas = 6.0      # a loss or gradient norm whose log is more than this many running
                                  # standard deviations (at least 0.05 for the loss, 0.25 for the
                                  # gradient norm) above its running mean is a spike; 0: off
  c.train.spike_warmup_steps = 5  # good steps that build the running statistics before spikes
                                  # are looked for
  c.train.stop_timeout_s = 120.0  # after SIGINT / SIGTERM the run saves at the next step
                                  # boundary; if none comes within this many seconds (a stuck
                                  # device call or process, or a long compile), it exits at once
                                  # with one line, as a second signal does
  c.profile_step = -1             # -1: off. N: profile step N (0-based; N = 0 also traces the
                                  # compilation on the host) into WORKDIR/profile, write
                                  # report.json / report.md there (distca_jax.profiling: per-rank
                                  # busy, attention, matmul, exposed-communication time) and log
                                  # the straggler table; that step is left out of step_time_s
  return c


def with_overrides(c: ml_collections.ConfigDict, over: dict) -> ml_collections.ConfigDict:
  """A copy of ``c`` with the flattened ``over`` (``{"a.b": value}``) applied."""
  v = ml_collections.ConfigDict(c.to_dict())
  v.update_from_flattened_dict(over)
  return v


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The typed, validated model config of a run config."""
  try:
    return ModelConfig(**c.model.to_dict())
  except ValueError as e:  # ModelConfig names the field and the fix
    raise UserError(f"config.model: {e}") from e


def data_ranks(c: ml_collections.ConfigDict, device_count: int | None = None) -> int:
  """``mesh.data`` of a run: the configured size, or for -1 every device of the job
  (``device_count``, default ``jax.device_count()``) over ``mesh.tensor x mesh.pipe``, as
  ``sharding.make_mesh`` lays it out. The one place the config's -1 is read."""
  if c.mesh.data != -1:
    return int(c.mesh.data)
  tensor, pipe = int(c.mesh.tensor), int(c.mesh.pipe)
  if tensor < 1 or pipe < 1:
    raise UserError(f"mesh.tensor={tensor} and mesh.pipe={pipe} must be >= 1")
  n = jax.device_count() if device_count is None else int(device_count)
  return n // (tensor * pipe)


def validate(c: ml_collections.ConfigDict) -> None:
  """Errors for values that would fail late (or silently) inside a run."""
  if c.tokens_per_rank <= 0:
    raise UserError(f"tokens_per_rank={c.tokens_per_rank} must be positive")
  if c.rows_per_rank <= 0:
    raise UserError(f"rows_per_rank={c.rows_per_rank} must be positive")
  if c.num_steps <= 0:
    raise UserError(f"num_steps={c.num_steps} must be positive")
  if c.optim.warmup_steps < 0 or c.optim.warmup_steps > c.num_steps:
    raise UserError(f"optim.warmup_steps={c.optim.warmup_steps} must be in [0, num_steps="
                    f"{c.num_steps}]")
  ops.check_kernel(c.attention.kernel, "attention.kernel")
  if c.attention.nano_batches not in (1, 2):
    raise UserError(f"attention.nano_batches={c.attention.nano_batches}; use 1 (single stream) "
                    "or 2 (ping-pong)")
  if c.eval_every < 0:
    raise UserError(f"eval_every={c.eval_every} must be >= 0 (0: no evaluation)")
  if c.eval_steps < 1:
    raise UserError(f"eval_steps={c.eval_steps} must be >= 1 (held-out batches per evaluation)")
  if not 0.0 <= c.data.eval_fraction < 1.0:
    raise UserError(f"data.eval_fraction={c.data.eval_fraction} must be in [0, 1) (the share of "
                    "data.path's documents held out for evaluation)")
  if c.profile_step != -1 and not 0 <= c.profile_step < c.num_steps:
    raise UserError(f"profile_step={c.profile_step} must be -1 (off) or a step in [0, num_steps="
                    f"{c.num_steps})")
  if c.attention.distca.branch not in ("gain", "price"):
    raise UserError(f"attention.distca.branch={c.attention.distca.branch!r}; use 'gain' (the "
                    "local_gain threshold) or 'price' (the calibrated step model, plan.choice)")
  if (c.attention.backend == "distca" and c.attention.distca.branch == "price"
      and (c.mesh.pipe > 1 or not c.attention.distca.local_steps)):
    raise UserError("attention.distca.branch='price' chooses between CAD and the step's local "
                    f"branch, which needs attention.distca.local_steps=True (got "
                    f"{c.attention.distca.local_steps}) and mesh.pipe=1 (got {c.mesh.pipe}); "
                    "or set attention.distca.branch='gain'")
  for key in ("servers_per_host", "q_relay", "kv_relay"):
    v = c.attention.distca[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise UserError(f"attention.distca.{key}={v!r} must be an int >= 0 (0 = auto)")
  v = c.attention.distca.buckets
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise UserError(f"attention.distca.buckets={v!r} must be an int >= 1 (1 = no buckets)")
  if c.attention.distca.nano_rows not in ("given", "heavy_first"):
    raise UserError(f"attention.distca.nano_rows={c.attention.distca.nano_rows!r}; use 'given' "
                    "(each rank's rows as sampled) or 'heavy_first'")
  d = c.attention.distca
  if not (d.intra_host_gbps > 0 and d.inter_host_gbps > 0):
    raise UserError(f"attention.distca.intra_host_gbps={d.intra_host_gbps}, inter_host_gbps="
                    f"{d.inter_host_gbps} must be positive rates in GB/s (defaults 344 and 50)")
  if c.rows_per_rank % c.attention.nano_batches:
    raise UserError(f"rows_per_rank={c.rows_per_rank} must be a multiple of attention."
                    f"nano_batches={c.attention.nano_batches} (each nano-batch is whole rows)")
  if c.train.max_bad_steps < 1:
    raise UserError(f"train.max_bad_steps={c.train.max_bad_steps} must be >= 1 (consecutive "
                    "skipped steps before the run stops)")
  if not c.train.stop_timeout_s > 0:
    raise UserError(f"train.stop_timeout_s={c.train.stop_timeout_s} must be > 0 (seconds from a "
                    "stop signal to the next step boundary before the run exits without saving)")
  if c.train.spike_sigmas < 0 or c.train.spike_warmup_steps < 1:
    raise UserError(f"train.spike_sigmas={c.train.spike_sigmas} must be >= 0 (0: off) and "
                    f"train.spike_warmup_steps={c.train.spike_warmup_steps} >= 1")
  if c.mesh.pipe > 1:
    m = ticks.resolve_microbatches(c.pipeline.microbatches, c.mesh.pipe)
    if c.rows_per_rank % m:
      raise UserError(f"rows_per_rank={c.rows_per_rank} must be a multiple of pipeline."
                      f"microbatches={m} (each microbatch is whole rows of every data rank; "
                      "0 = 2 x mesh.pipe)")
    if c.model.n_layers % c.mesh.pipe:
      raise UserError(f"model.n_layers={c.model.n_layers} must be a multiple of mesh.pipe="
                      f"{c.mesh.pipe} (each stage holds n_layers / pipe layers)")
    if c.attention.nano_batches != 1 or not c.model.scan_layers:
      raise UserError(f"mesh.pipe={c.mesh.pipe} runs the single stream over scanned layers; set "
                      "attention.nano_batches=1 and model.scan_layers=True")
  model_config(c)
