"""Plain dataclass configs for every part of a run.

Each config validates itself on construction, so a bad value fails with a message that names the
setting and the fix before anything is compiled. gin binds these classes by name
(`ModelConfig.d_model = 256`, see `gin_config.py`); Python and notebook users construct them
directly.

This module imports nothing of the package but errors.py, so every other module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from midas_jax.errors import require

FAMILIES = ("llama", "gpt2")
INIT_SCHEMES = ("gpt2", "gamma")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots", "offload")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "dot_product", "flash")
MATMUL_OPERANDS = ("auto", "compute", "float32")
TPU_FLAGS = ("auto", "none")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer.

  family: "llama" (RMSNorm, rotary positions, SwiGLU, no biases, optional GQA) or
    "gpt2" (LayerNorm, learned positions, GELU MLP, biases, tied embeddings).
  vocab_size: None takes the data vocabulary's size rounded up to `vocab_multiple`.
  num_kv_heads: None means multi-head attention (= num_heads); fewer gives grouped-query attention.
  init: "gpt2" (the default: N(0, init_std) for every weight matrix and embedding table, with the two
    residual output projections scaled by 1/sqrt(2 * num_layers)), or "gamma": every weight matrix
    and embedding table drawn from N(0, (fan_in ** -init_gamma) ** 2), fan_in being the matrix's input
    dimension (d_model for embedding and position tables, heads * head_dim for the attention output,
    d_ff for the MLP output). Norm scales start at 1 and biases at 0 under both schemes.
  dtype: the compute dtype; param_dtype: the dtype parameters are stored (and updated) in.
  matmul_operands: what the matmuls multiply when dtype is bfloat16 (they accumulate in float32 either
    way): "compute" (bfloat16 operands), "float32" (the same bfloat16 values as float32 operands: the
    same products, at float32 speed) or "auto" (compute, except in a program the CPU cannot run with
    them, found by running it once on zeros before it trains: model/dot_support.py).
  loop_start, loop_size, loop_repeats: a looped model: layers [loop_start, loop_start + loop_size)
    share their weights across loop_repeats consecutive applications (1: no looping). Set in training
    for a looped model, or at evaluation to loop a grown model's middle block (model/layer_order.py).
  qkv_bias: llama family only: biases on the query, key and value projections (Qwen2's layout).
  attention: "dot_product" (XLA, with a dense [batch, 1, T, T] mask), "flash" (the fused Pallas
    kernels of model/kernels/: nothing of size T x T stored, fully masked blocks skipped) or "auto"
    (flash on TPU; dot_product on CPU, and on GPU until the Triton kernels have run on one). See
    model/attention.py.
  """

  family: str = "llama"
  vocab_size: Optional[int] = None
  vocab_multiple: int = 128
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  d_ff: int = 1024
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  tie_embeddings: bool = True
  norm_eps: float = 1e-5
  init: str = "gpt2"
  init_std: float = 0.02
  init_gamma: float = 0.5
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat_policy: str = "none"
  loop_start: int = 0
  loop_size: int = 0
  loop_repeats: int = 1
  attention: str = "auto"
  qkv_bias: bool = False
  matmul_operands: str = "auto"

  def __post_init__(self):
    s = "ModelConfig."
    require(self.attention in ATTENTION, s + "attention", f"unknown attention implementation {self.attention!r}",
            f"use one of {ATTENTION}")
    require(self.matmul_operands in MATMUL_OPERANDS, s + "matmul_operands",
            f"unknown choice {self.matmul_operands!r}", f"use one of {MATMUL_OPERANDS}")
    if self.loop_repeats != 1:
      require(self.loop_repeats >= 1 and self.loop_size >= 1 and self.loop_start >= 0
              and self.loop_start + self.loop_size <= self.num_layers, s + "loop_repeats",
              f"loop block [{self.loop_start}, {self.loop_start + self.loop_size}) x {self.loop_repeats} does not "
              f"fit {self.num_layers} layers", "set loop_start, loop_size >= 1 within num_layers and loop_repeats >= 1")
    require(self.family in FAMILIES, s + "family", f"unknown family {self.family!r}",
            f"use one of {FAMILIES}")
    for name in ("d_model", "num_layers", "num_heads", "d_ff", "max_seq_len", "vocab_multiple"):
      value = getattr(self, name)
      require(isinstance(value, int) and value > 0, s + name, f"must be a positive int, got {value!r}",
              f"set {s}{name} to a positive integer")
    if self.head_dim is None:
      require(self.d_model % self.num_heads == 0, s + "num_heads",
              f"num_heads={self.num_heads} does not divide d_model={self.d_model}",
              "pick num_heads that divides d_model, or set ModelConfig.head_dim explicitly")
    kv = self.kv_heads
    require(kv > 0 and self.num_heads % kv == 0, s + "num_kv_heads",
            f"num_kv_heads={kv} does not divide num_heads={self.num_heads}",
            "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
    require(self.family == "llama" or kv == self.num_heads, s + "num_kv_heads",
            "grouped-query attention is a llama-family option", "leave num_kv_heads unset for gpt2")
    require(self.family == "llama" or not self.qkv_bias, s + "qkv_bias",
            "gpt2-family models always have biases on every projection", "leave ModelConfig.qkv_bias False for gpt2")
    require(self.family == "llama" or self.tie_embeddings, s + "tie_embeddings",
            "gpt2-family models tie their embeddings", "set ModelConfig.tie_embeddings = True")
    require(self.family != "llama" or self.resolved_head_dim % 2 == 0, s + "head_dim",
            f"rotary positions need an even head_dim, got {self.resolved_head_dim}",
            "choose d_model / num_heads (or head_dim) even")
    require(self.init in INIT_SCHEMES, s + "init", f"unknown init scheme {self.init!r}",
            f"use one of {INIT_SCHEMES}")
    require(self.init_gamma > 0, s + "init_gamma", "must be > 0", "typical values are 0.3 to 1.0")
    require(self.remat_policy in REMAT_POLICIES, s + "remat_policy",
            f"unknown remat policy {self.remat_policy!r}", f"use one of {REMAT_POLICIES}")
    for name in ("dtype", "param_dtype"):
      require(getattr(self, name) in DTYPES, s + name, f"unsupported dtype {getattr(self, name)!r}",
              f"use one of {DTYPES}")
    if self.vocab_size is not None:
      require(self.vocab_size > 0, s + "vocab_size", "must be positive",
              "set it to at least the vocabulary size, or leave it None to take the vocabulary's")

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  def with_vocab(self, vocab_size: int) -> "ModelConfig":
    """Fills vocab_size from the data vocabulary (padded), or checks that a set one is big enough."""
    if self.vocab_size is None:
      padded = -(-vocab_size // self.vocab_multiple) * self.vocab_multiple
      return dataclasses.replace(self, vocab_size=padded)
    require(self.vocab_size >= vocab_size, "ModelConfig.vocab_size",
            f"{self.vocab_size} is smaller than the data vocabulary ({vocab_size} ids)",
            f"set ModelConfig.vocab_size >= {vocab_size}, or leave it None")
    return self


DEFAULT_RULES: Tuple[Tuple[str, Optional[str | Tuple[str, ...]]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh with axes (data, fsdp, tensor) and the logical-to-mesh axis rules.

  data, fsdp, tensor are the axis sizes within one slice (the devices joined by the fast
  interconnect, ICI); dcn_data and dcn_fsdp multiply the data and fsdp axes across slices (joined by
  the data-center network, DCN), so the mesh is (data * dcn_data, fsdp * dcn_fsdp, tensor) over
  dcn_data * dcn_fsdp slices. One of data, fsdp, tensor may be -1: it takes all the devices of a
  slice the others leave. `rules` maps each logical axis name to a mesh axis, a tuple of mesh axes,
  or None (replicated). `layers` must stay replicated, so growing the depth never changes how the
  other dimensions are laid out.
  tpu_flags: "auto" sets the libtpu flags this project recommends for the TPU generation named by
  MIDAS_TPU_ACCELERATOR or TPU_ACCELERATOR_TYPE (the launchers set it), before jax starts; flags in
  LIBTPU_INIT_ARGS keep their values. "none" leaves LIBTPU_INIT_ARGS as it is (tpu_flags.py).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  rules: Tuple[Tuple[str, object], ...] = DEFAULT_RULES
  dcn_data: int = 1
  dcn_fsdp: int = 1
  tpu_flags: str = "auto"

  def __post_init__(self):
    require(self.tpu_flags in TPU_FLAGS, "MeshConfig.tpu_flags", f"must be one of {TPU_FLAGS}, got {self.tpu_flags!r}",
            "'auto' sets the generation's recommended libtpu flags; 'none' leaves LIBTPU_INIT_ARGS as it is")
    sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
    for name, size in sizes.items():
      require(size == -1 or (isinstance(size, int) and size > 0), f"MeshConfig.{name}",
              f"axis size must be a positive int or -1, got {size!r}", "use -1 to fill the remaining devices")
    for name in ("dcn_data", "dcn_fsdp"):
      size = getattr(self, name)
      require(isinstance(size, int) and size >= 1, f"MeshConfig.{name}",
              f"must be a positive int, got {size!r}", "1 means a single slice along this axis")
    require(list(sizes.values()).count(-1) <= 1, "MeshConfig",
            "more than one axis size is -1", "set at most one of data, fsdp, tensor to -1")
    rules = dict(self.rules_as_tuples())
    require(rules.get("layers") is None, "MeshConfig.rules",
            "the 'layers' axis is mapped to a mesh axis",
            "map 'layers' to None: growth must never change the other axes' layout")

  @property
  def num_slices(self) -> int:
    return self.dcn_data * self.dcn_fsdp

  def rules_as_tuples(self) -> Tuple[Tuple[str, object], ...]:
    out = []
    for rule in self.rules:
      logical, mesh_axes = rule
      if isinstance(mesh_axes, list):
        mesh_axes = tuple(mesh_axes)
      out.append((logical, mesh_axes))
    return tuple(out)


DECAYS = ("cosine", "linear", "rsqrt", "constant", "wsd")
OPTIMIZERS = ("adamw", "adafactor")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """optax optimizer and learning-rate schedule: linear warmup, then the chosen decay.

  decay "cosine" and "linear" fall to final_lr_fraction * learning_rate at the last step; "rsqrt"
  scales by sqrt(warmup_steps / step) after warmup; "constant" holds the peak; "wsd"
  (warmup-stable-decay) holds the peak, then falls linearly to final_lr_fraction * learning_rate
  over the last decay_fraction of the steps (the usual schedule for runs that grow or continue: the
  rate does not depend on how long the run will be until its last stretch).
  Weight decay skips norms and biases always, and embedding tables unless decay_embeddings.
  """

  name: str = "adamw"
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  decay: str = "cosine"
  final_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_fraction: float = 0.2
  decay_embeddings: bool = False
  grad_clip_norm: Optional[float] = 1.0
  z_loss: float = 0.0

  def __post_init__(self):
    s = "OptimizerConfig."
    require(self.name in OPTIMIZERS, s + "name", f"unknown optimizer {self.name!r}",
            f"use one of {OPTIMIZERS}")
    require(self.decay in DECAYS, s + "decay", f"unknown decay {self.decay!r}", f"use one of {DECAYS}")
    require(self.learning_rate > 0, s + "learning_rate", "must be > 0", "typical values: 1e-4 to 3e-3")
    require(self.warmup_steps >= 0, s + "warmup_steps", "must be >= 0", "set it to 0 for no warmup")
    require(0 <= self.final_lr_fraction <= 1, s + "final_lr_fraction", "must be in [0, 1]",
            "0.1 is a common choice")
    require(self.grad_clip_norm is None or self.grad_clip_norm > 0, s + "grad_clip_norm",
            "must be > 0 or None", "use None to turn clipping off")
    for name in ("b1", "b2"):
      require(0 <= getattr(self, name) < 1, s + name, f"must be in [0, 1), got {getattr(self, name)}",
              "typical: b1 = 0.9, b2 = 0.95 to 0.999 (1.0 divides by zero in Adam's bias correction)")
    require(self.eps > 0, s + "eps", f"must be > 0, got {self.eps}", "1e-8 is the usual value")
    require(self.weight_decay >= 0, s + "weight_decay", f"must be >= 0, got {self.weight_decay}",
            "0 turns weight decay off; 0.1 is common")
    require(self.z_loss >= 0, s + "z_loss", "must be >= 0", "1e-4 is the t5x default; 0 turns it off")
    require(0 < self.decay_fraction <= 1, s + "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}",
            "0.1 to 0.2 is usual for decay='wsd' (it is read by no other decay)")


SOURCES = ("builtin", "text", "seqio", "prepared")
ORIGINS = ("builtin", "text", "seqio", "tfds")  # what `midas data prepare` reads into a store
VOCABS = ("byte", "sentencepiece", "tokenizers")


@dataclasses.dataclass(frozen=True)
class ObjectivesConfig:
  """The UL2 mixture: which objective each example trains (gin/objectives/ holds the mixtures).

  Each example is causal LM, prefix LM or span corruption with probabilities causal_rate,
  prefix_rate, span_rate (summing to 1; the MIDAS paper's 0.6 / 0.2 / 0.2). A span example draws one
  (mean span length, noise density) pair from span_denoisers uniformly: the default is T5's
  R-denoiser (3.0, 0.15); gin/objectives/ul2_full.gin sets UL2's R and X set. mode_tokens prepends
  [NLU] (R), [NLG] (X) or [S2S] (prefix LM) to the inputs, as UL2 does. Span corruption marks its
  spans with up to num_sentinels sentinels. Sentinels and mode tokens are the top extra ids of the
  vocabulary (see data/objectives.py).
  """

  causal_rate: float = 0.6
  prefix_rate: float = 0.2
  span_rate: float = 0.2
  span_denoisers: Tuple[Tuple[float, float], ...] = ((3.0, 0.15),)
  mode_tokens: bool = False
  num_sentinels: int = 100

  def __post_init__(self):
    s = "ObjectivesConfig."
    rates = (self.causal_rate, self.prefix_rate, self.span_rate)
    require(all(r >= 0 for r in rates) and abs(sum(rates) - 1.0) < 1e-6, s + "causal_rate",
            f"objective rates causal={rates[0]}, prefix={rates[1]}, span={rates[2]} must be >= 0 and sum to 1",
            "set ObjectivesConfig.causal_rate, prefix_rate and span_rate to add up to 1 (default 0.6 / 0.2 / 0.2)")
    require(self.span_rate == 0 or len(self.span_denoisers) > 0, s + "span_denoisers",
            "span_rate > 0 but no span denoisers", "list (mean span length, noise density) pairs")
    for pair in self.span_denoisers:
      require(len(pair) == 2 and pair[0] >= 1 and 0 < pair[1] < 1, s + "span_denoisers",
              f"{pair!r} is not a (mean span length >= 1, 0 < noise density < 1) pair",
              "write e.g. [(3.0, 0.15), (8.0, 0.5)]")
    require(self.num_sentinels >= 1, s + "num_sentinels", "must be >= 1", "T5 uses 100")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where tokens come from, and how they are batched (ObjectivesConfig: what examples are made of them).

  source "builtin": the generated corpus (nothing downloaded); "text": local .txt/.jsonl/.gz files
  (train_files, eval_files: glob patterns); "seqio": a registered seqio Task (seqio_task), read
  once into a local token cache of at most max_documents documents per split; "prepared": a token
  store at prepared_dir written by `midas data prepare` (data/store/), read by index, every document
  once per epoch.
  batch_size is the global number of rows per step.

  What `midas data prepare` reads: prepared_from (with source "prepared"; otherwise the source
  itself): "builtin", "text" (train_files / eval_files, also .parquet with the text in column
  jsonl_field), "seqio" (seqio_task) or "tfds" (tfds_name, tfds_data_dir, the splits
  tfds_train_split / tfds_eval_split, the text in feature tfds_text_feature). A run on a store checks
  that the store was prepared with its vocabulary, and from these settings when prepared_from is set.
  read_threads: ranged reads of a store on gs:// in flight at once per batch read (local stores are read in
  line). read_ahead: with a store on gs://, the steps whose reads run while a step is built (each read
  costs a round trip, so several run at once).
  min_chunk: a row is filled example by example until fewer than min_chunk of its slots remain.

  vocab: "byte", "sentencepiece" (spm_model: a .model file of any special-id layout) or "tokenizers"
  (tokenizer: a tokenizer.json, or a directory holding one with its tokenizer_config.json). A
  tokenizer's own ids are kept; extra_ids ids are appended above them for the special tokens it
  lacks (data/vocab.py). tokenizer may also name the transformers tokenizer files of a SentencePiece
  model (what `midas import` copies), which `midas export` then writes back.
  """

  source: str = "builtin"
  train_files: Tuple[str, ...] = ()
  eval_files: Tuple[str, ...] = ()
  jsonl_field: str = "text"
  vocab: str = "byte"
  spm_model: Optional[str] = None
  tokenizer: Optional[str] = None
  extra_ids: int = 128
  corpus_seed: int = 0
  seq_len: int = 256
  batch_size: int = 16
  seed: int = 0
  min_chunk: int = 16
  seqio_task: Optional[str] = None
  seqio_train_split: str = "train"
  seqio_eval_split: str = "validation"
  max_documents: int = 100_000
  prefetch: int = 2
  prepared_dir: Optional[str] = None
  prepared_from: str = ""
  tfds_name: Optional[str] = None
  tfds_data_dir: Optional[str] = None
  tfds_train_split: str = "train"
  tfds_eval_split: str = "validation"
  tfds_text_feature: str = "text"
  read_threads: int = 64
  read_ahead: int = 8

  def __post_init__(self):
    s = "DataConfig."
    require(self.source != "seqio" or bool(self.seqio_task), s + "seqio_task",
            "source='seqio' needs a task name", "set DataConfig.seqio_task to a registered seqio Task")
    require(self.max_documents > 0, s + "max_documents", "must be > 0", "the default is 100000")
    require(self.prefetch >= 0, s + "prefetch", "must be >= 0", "0 builds batches in the train loop")
    require(self.source in SOURCES, s + "source", f"unknown source {self.source!r}",
            f"use one of {SOURCES}")
    require(self.vocab in VOCABS, s + "vocab", f"unknown vocabulary {self.vocab!r}",
            f"use one of {VOCABS}")
    require(self.vocab != "sentencepiece" or bool(self.spm_model), s + "spm_model",
            "vocab='sentencepiece' needs a model file",
            "set DataConfig.spm_model, or train one with `midas data train-spm`")
    require(self.vocab != "tokenizers" or bool(self.tokenizer), s + "tokenizer",
            "vocab='tokenizers' needs a tokenizer file",
            "set DataConfig.tokenizer to a tokenizer.json or the directory that holds it")
    require(self.vocab != "byte" or not self.tokenizer, s + "tokenizer",
            "is set, but the byte vocabulary has no tokenizer files", "set DataConfig.vocab = 'tokenizers', or unset it")
    require(self.origin != "text" or len(self.train_files) > 0, s + "train_files",
            f"{'prepared_from' if self.source == 'prepared' else 'source'}='text' needs training files",
            "set DataConfig.train_files = ['path/*.txt']")
    self._check_prepared()
    require(self.seq_len >= 8, s + "seq_len", f"must be >= 8, got {self.seq_len}", "typical: 256 to 8192")
    require(self.batch_size > 0, s + "batch_size", "must be > 0", "set a positive global batch size")
    require(self.seed >= 0, s + "seed", f"must be >= 0, got {self.seed}", "use a non-negative integer")
    require(self.extra_ids >= 0, s + "extra_ids", f"must be >= 0, got {self.extra_ids}",
            "128 leaves room for span-corruption sentinels and mode tokens")
    require(2 <= self.min_chunk <= self.seq_len, s + "min_chunk", "must be in [2, seq_len]",
            "16 is the default")

  @property
  def origin(self) -> str:
    """The source a store is prepared from: prepared_from with source 'prepared', else the source."""
    return self.prepared_from if self.source == "prepared" else self.source

  def _check_prepared(self) -> None:
    s = "DataConfig."
    require(self.source != "prepared" or bool(self.prepared_dir), s + "prepared_dir",
            "source='prepared' needs the store's folder",
            "set DataConfig.prepared_dir to the --out of `midas data prepare` (a local path or gs:// URL)")
    require(self.prepared_from in ("",) + ORIGINS, s + "prepared_from",
            f"unknown source {self.prepared_from!r} to prepare from", f"use one of {ORIGINS}")
    require(self.source == "prepared" or not self.prepared_from, s + "prepared_from",
            f"set with source={self.source!r}", "set DataConfig.source = 'prepared', or leave prepared_from ''")
    require(self.origin != "seqio" or bool(self.seqio_task), s + "seqio_task",
            "preparing from seqio needs a task name", "set DataConfig.seqio_task to a registered seqio Task")
    require(self.origin != "tfds" or bool(self.tfds_name), s + "tfds_name",
            "preparing from TFDS needs a data set name", "set DataConfig.tfds_name, e.g. 'c4/en:3.0.1'")
    require(self.read_threads >= 1, s + "read_threads", f"must be >= 1, got {self.read_threads}",
            "64 suits a store on gs://")
    require(self.read_ahead >= 0, s + "read_ahead", f"must be >= 0, got {self.read_ahead}",
            "8 suits a store on gs://; 0 reads each step when it is built")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The loop: how long, how often to log and evaluate, and the MFU denominator.

  peak_flops_per_device: None takes a known accelerator's bf16 peak, or on CPU measures a matmul.
  progress_bar: None (the default) draws a bar on stderr only when stderr is a terminal; True
    draws it anyway (into a log file it redraws once a minute), False never.
  profile_steps: (start, stop) writes a jax.profiler trace of steps start+1 .. stop under
    <workdir>/profile (`midas train --profile=START:STOP`); None traces nothing.
  microbatches: gradient accumulation: each step's batch is split into this many microbatches whose
    gradients are summed in float32 inside the compiled step (the same loss and update as one pass
    over the whole batch, at the activation memory of one microbatch). DataConfig.batch_size must
    divide by microbatches x the mesh's data x fsdp.
  loss_chunk: the loss (cross-entropy and z-loss) runs over the sequence in chunks of this many
    positions, recomputing each chunk's logits in the backward pass, so the float32 logits are held
    for one chunk at a time; 0 computes them for the whole sequence at once.
  shared_filesystem: local paths (the workdir, DataConfig.prepared_dir) are on a filesystem every
    machine of a multi-machine run mounts (NFS, Filestore, GCS FUSE). Without it such a run refuses
    local paths at start (train/shared_paths.py); processes on one machine share it anyway.
  metrics_flush_seconds: on an object store, records are stored by a background thread this often
    (at least 1 s: GCS takes about one update per second to one object); at a checkpoint save the
    records so far are stored at once (a resume from it finds them), and a normal exit and a
    preemption store the rest (train/metrics.py).
  """

  num_steps: int = 1000
  seed: int = 0
  log_every: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  peak_flops_per_device: Optional[float] = None
  progress_bar: Optional[bool] = None
  microbatches: int = 1
  loss_chunk: int = 512
  profile_steps: Optional[Tuple[int, int]] = None
  shared_filesystem: bool = False
  metrics_flush_seconds: float = 5.0

  def __post_init__(self):
    s = "TrainerConfig."
    require(isinstance(self.microbatches, int) and self.microbatches >= 1, s + "microbatches",
            f"must be a positive int, got {self.microbatches!r}", "1 turns gradient accumulation off")
    require(isinstance(self.loss_chunk, int) and self.loss_chunk >= 0, s + "loss_chunk",
            f"must be an int >= 0, got {self.loss_chunk!r}", "512 is the default; 0 turns chunking off")
    if self.profile_steps is not None:
      ok = len(self.profile_steps) == 2 and 0 <= self.profile_steps[0] < self.profile_steps[1] <= self.num_steps
      require(ok, s + "profile_steps", f"must be (start, stop) with 0 <= start < stop <= num_steps, got "
              f"{self.profile_steps}", "trace a few steps after the first compile, e.g. (5, 8)")
    require(self.num_steps > 0, s + "num_steps", "must be > 0", "set the number of training steps")
    require(self.log_every > 0, s + "log_every", "must be > 0", "log every N >= 1 steps")
    require(self.eval_every >= 0, s + "eval_every", "must be >= 0", "0 turns periodic eval off")
    require(self.eval_batches > 0, s + "eval_batches", "must be > 0", "evaluate on >= 1 batch")
    require(self.metrics_flush_seconds >= 1, s + "metrics_flush_seconds",
            f"must be >= 1, got {self.metrics_flush_seconds!r}",
            "GCS takes about one update per second to one object; 5 is the default")


NO_USABLE_SAVE = ("error", "start_fresh")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When a run saves (orbax, under <workdir>/checkpoints) and which saves it keeps.

  every: save every N steps (0: only at stage boundaries, at the end and on preemption, which
    always save). keep: the newest saves kept; keep_every: also keep every save whose step is a
    multiple of this (None: none kept beyond `keep`). async_save: write in a background thread while
    training goes on (the run always waits for it before exiting).
  init_from: a params-only export (or a run's workdir) whose parameters start a new run, e.g. an
    imported Hugging Face model; ignored when the workdir already has checkpoints (resume wins).
  restore_retries, restore_timeout_s: a restore (or listing of the saves) that meets a storage error (HTTP
    408/429/5xx, a reset or timed-out connection, refused credentials) is tried again after 1, 2, 4, ... s
    (at most 60 s apart) up to restore_retries times, and no new try starts restore_timeout_s seconds after
    the first; then the run stops with the storage error (exit status 75), leaving the save as it is. A try
    that is running is not cut short: the storage clients retry on their own first (gcsfs about 30 s,
    tensorstore's array reads up to about 15 minutes).
  on_no_usable_save: when saves exist and none can be used (each damaged, and set aside), "error" stops the
    run listing them and why; "start_fresh" starts from step 0 (or init_from) with a warning.
  """

  every: int = 1000
  keep: int = 3
  keep_every: Optional[int] = None
  async_save: bool = True
  init_from: Optional[str] = None
  restore_retries: int = 6
  restore_timeout_s: float = 600.0
  on_no_usable_save: str = "error"

  def __post_init__(self):
    s = "CheckpointConfig."
    require(self.every >= 0, s + "every", "must be >= 0", "0 saves only at stage ends, the end and preemption")
    require(self.keep >= 1, s + "keep", "must be >= 1", "keep at least the newest checkpoint")
    require(self.keep_every is None or self.keep_every >= 1, s + "keep_every", "must be >= 1 or None",
            "e.g. 10000 keeps every 10000th step's save")
    require(self.restore_retries >= 0, s + "restore_retries", f"must be >= 0, got {self.restore_retries}",
            "6 waits out an outage of a few minutes; 0 stops at the first storage error the clients give up on")
    require(self.restore_timeout_s > 0, s + "restore_timeout_s", f"must be > 0, got {self.restore_timeout_s}",
            "600 (10 minutes) waits out a short storage outage before the run stops")
    require(self.on_no_usable_save in NO_USABLE_SAVE, s + "on_no_usable_save",
            f"must be one of {NO_USABLE_SAVE}, got {self.on_no_usable_save!r}",
            "'error' stops when every save is damaged; 'start_fresh' starts from step 0 instead")


GROWTH_MOMENTS = ("copy", "zero")
LR_SCHEDULES = ("global", "rewarm")


@dataclasses.dataclass(frozen=True)
class StackingConfig:
  """Growing depth in stages (MIDAS, GradStack, or a registered operator).

  num_stages: k, the number of stages; 1 (the default) trains at full depth throughout: the baseline.
    Stage i has i blocks (start_blocks + i - 1 in general), so the last has num_stages * block_size =
    ModelConfig.num_layers layers.
  block_size: b, layers per block; None means num_layers // (num_stages + start_blocks - 1).
  operator: how a stage is grown from the previous one: "midas" (copy the middle block, ceil(n/2),
    right after itself), "gradstack" (copy the top block onto the top), or any name registered with
    midas_jax.stacking.operators.register_operator (e.g. the examples "fresh_block", "gstack").
  alpha: the Prop-alpha exponent: stage i gets steps proportional to i^alpha (1 = Prop-1, 2 = Prop-2,
    0 = Equal). Ignored when stage_steps is given.
  stage_steps: explicit steps per stage (one per stage, each >= 1, summing to TrainerConfig.num_steps).
  new_moments: what optimizer moments a copied layer starts with: "copy" (its source's) or "zero".
  lr_schedule: "global" (one schedule over all steps, growth does not touch it) or "rewarm" (after
    each growth the learning rate warms up again, linearly over rewarm_steps, to the global value).
  rewarm_steps: the re-warmup length; 0 means OptimizerConfig.warmup_steps.
  start_blocks: blocks of the first stage (1: growth starts from one block). A run that starts from a
    model at some depth, e.g. an imported pretrained one (CheckpointConfig.init_from), sets it to that
    depth / block_size: stage i then has start_blocks + i - 1 blocks, and Prop-alpha gives it steps
    proportional to that count to the alpha.
  """

  num_stages: int = 1
  block_size: Optional[int] = None
  operator: str = "midas"
  alpha: float = 1.0
  stage_steps: Optional[Tuple[int, ...]] = None
  new_moments: str = "copy"
  lr_schedule: str = "global"
  rewarm_steps: int = 0
  start_blocks: int = 1

  def __post_init__(self):
    s = "StackingConfig."
    require(isinstance(self.num_stages, int) and self.num_stages >= 1, s + "num_stages",
            f"must be a positive int, got {self.num_stages!r}", "use 1 for no growth (the baseline)")
    require(self.block_size is None or (isinstance(self.block_size, int) and self.block_size >= 1),
            s + "block_size", f"must be a positive int or None, got {self.block_size!r}",
            "leave it None for num_layers // num_stages")
    require(isinstance(self.alpha, (int, float)) and -float("inf") < self.alpha < float("inf"), s + "alpha",
            f"must be a finite number, got {self.alpha!r}", "1.0 is Prop-1, 2.0 Prop-2, 0.0 Equal")
    if self.stage_steps is not None:
      steps = tuple(self.stage_steps)  # gin hands over lists
      object.__setattr__(self, "stage_steps", steps)
      require(len(steps) == self.num_stages, s + "stage_steps",
              f"{len(steps)} entries for num_stages={self.num_stages}", "list one step count per stage")
      require(all(isinstance(t, int) and t >= 1 for t in steps), s + "stage_steps",
              f"every stage needs a whole number of steps >= 1, got {steps}",
              "give each stage at least one step, or drop the stage")
    require(self.new_moments in GROWTH_MOMENTS, s + "new_moments",
            f"unknown choice {self.new_moments!r}", f"use one of {GROWTH_MOMENTS}")
    require(self.lr_schedule in LR_SCHEDULES, s + "lr_schedule",
            f"unknown choice {self.lr_schedule!r}", f"use one of {LR_SCHEDULES}")
    require(isinstance(self.rewarm_steps, int) and self.rewarm_steps >= 0, s + "rewarm_steps",
            f"must be an int >= 0, got {self.rewarm_steps!r}", "0 reuses OptimizerConfig.warmup_steps")
    require(isinstance(self.operator, str) and bool(self.operator), s + "operator",
            f"must be an operator name, got {self.operator!r}", "use 'midas' or 'gradstack'")
    require(isinstance(self.start_blocks, int) and self.start_blocks >= 1, s + "start_blocks",
            f"must be a positive int, got {self.start_blocks!r}",
            "use 1 to grow from one block, or the starting model's depth / block_size")

  def resolved_block_size(self, num_layers: int) -> int:
    blocks = self.num_stages + self.start_blocks - 1  # of the last stage, when each stage adds one
    return self.block_size if self.block_size is not None else num_layers // blocks

  def resolved_rewarm_steps(self, warmup_steps: int) -> int:
    return self.rewarm_steps or warmup_steps


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs.

  Checks that need the stacking operators (the depth a schedule reaches, stage lengths against
  warmups) live in stacking/checks.py, which the gin entry point and the stage controller run.
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  objectives: ObjectivesConfig = dataclasses.field(default_factory=ObjectivesConfig)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  stacking: StackingConfig = dataclasses.field(default_factory=StackingConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

  def __post_init__(self):
    require(self.data.seq_len <= self.model.max_seq_len, "DataConfig.seq_len",
            f"seq_len={self.data.seq_len} exceeds ModelConfig.max_seq_len={self.model.max_seq_len}",
            "raise ModelConfig.max_seq_len or lower DataConfig.seq_len")
    require(self.data.batch_size % self.trainer.microbatches == 0, "TrainerConfig.microbatches",
            f"batch_size={self.data.batch_size} does not split into {self.trainer.microbatches} microbatches",
            "choose microbatches that divide DataConfig.batch_size")


CONFIG_CLASSES: Sequence[type] = (ModelConfig, MeshConfig, OptimizerConfig, DataConfig, ObjectivesConfig,
                                  TrainerConfig, StackingConfig, CheckpointConfig)

# Settings that moved to another config: gin names the new place when an old binding is parsed,
# and checkpoints saved before the move are read with the setting where it is now.
MOVED_SETTINGS = {f"DataConfig.{name}": f"ObjectivesConfig.{name}"
                  for name in ("causal_rate", "prefix_rate", "span_rate", "span_denoisers", "mode_tokens",
                               "num_sentinels")}
