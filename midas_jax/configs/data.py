"""Where tokens come from and what examples are made of them (the UL2 mixture)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Tuple

from midas_jax.errors import require


SOURCES = ("builtin", "text", "seqio", "prepared", "mixture")
MIXTURE_SOURCES = ("builtin", "text", "prepared")  # what a DataConfig.mixture source may be
_METRIC_NAMES = ("causal", "prefix", "span")  # the objectives' own `loss/<name>` keys
ORIGINS = ("builtin", "text", "seqio", "tfds")  # what `midas data prepare` reads into a store
VOCABS = ("byte", "sentencepiece", "tokenizers")
CORPUS_HOLDOUTS = ("none", "composition")
MAX_CORPUS_DOCUMENTS = 2_000_000  # the built-in corpus is held in memory: ~0.23 GB of text per million documents


@dataclasses.dataclass(frozen=True)
class ObjectivesConfig:
  """The UL2 mixture: which objective each example trains (gin/objectives/ holds the mixtures).

  Each example is causal LM, prefix LM or span corruption with probabilities causal_rate,
  prefix_rate, span_rate (summing to 1; the MIDAS paper's 0.6 / 0.2 / 0.2). A span example draws one
  (mean span length, noise density) pair from span_denoisers uniformly: the default is T5's
  R-denoiser (3.0, 0.15); gin/objectives/ul2_full.gin sets UL2's R and X set. mode_tokens prepends
  [NLU] (R), [NLG] (X) or [S2S] (prefix LM) to the inputs, as UL2 does. Span corruption marks its
  spans with up to num_sentinels sentinels. Sentinels and mode tokens are the top extra ids of the
  vocabulary (see data/ul2/objectives.py).
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
class MixtureSource:
  """One source of DataConfig.mixture (data/mixture.py): its name (eval records `loss/<name>`), its
  weight (normalized over the mixture; StackingConfig.stage_mixtures may set other weights per stage),
  and where its tokens come from: source "builtin", "text" or "prepared" with the DataConfig settings
  of the same names. Everything else (vocabulary, seq_len, batch_size, the objectives) is the run's.
  In gin, a dict: {'name': 'web', 'weight': 0.7, 'source': 'prepared', 'prepared_dir': 'stores/web'}.
  """

  name: str
  weight: float = 1.0
  source: str = "builtin"
  train_files: Tuple[str, ...] = ()
  eval_files: Tuple[str, ...] = ()
  jsonl_field: str = "text"
  corpus_seed: int = 0
  prepared_dir: Optional[str] = None
  prepared_from: str = ""

  def __post_init__(self):
    s = "MixtureSource."
    for name in ("train_files", "eval_files"):  # gin and JSON hand over lists, or one bare pattern
      value = getattr(self, name)
      object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
    require(isinstance(self.name, str) and bool(self.name) and "/" not in self.name
            and self.name not in _METRIC_NAMES, s + "name",
            f"{self.name!r} cannot name a source (metrics are keyed loss/<name>)",
            f"use a non-empty name without '/' and other than {_METRIC_NAMES}")
    require(isinstance(self.weight, (int, float)) and 0 <= self.weight < float("inf"), s + "weight",
            f"source {self.name!r}: must be a finite number >= 0, got {self.weight!r}",
            "weights are relative: e.g. 0.7 and 0.3, or 7 and 3")
    require(self.source in MIXTURE_SOURCES, s + "source", f"source {self.name!r}: unknown kind {self.source!r}",
            f"use one of {MIXTURE_SOURCES}")
    require(self.source != "text" or len(self.train_files) > 0, s + "train_files",
            f"source {self.name!r} is 'text' but lists no files", "set its train_files, e.g. ['code/*.jsonl']")
    require(self.source != "prepared" or bool(self.prepared_dir), s + "prepared_dir",
            f"source {self.name!r} is 'prepared' but names no store",
            "set its prepared_dir to the --out of `midas data prepare`")
    require(self.source == "prepared" or not self.prepared_from, s + "prepared_from",
            f"source {self.name!r}: set with source={self.source!r}",
            "leave prepared_from '' unless source is 'prepared'")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where tokens come from, and how they are batched (ObjectivesConfig: what examples are made of them).

  source "builtin": the generated corpus (nothing downloaded); "text": local .txt/.jsonl/.gz files
  (train_files, eval_files: glob patterns); "seqio": a registered seqio Task (seqio_task), read
  once into a local token cache of at most max_documents documents per split; "prepared": a token
  store at prepared_dir written by `midas data prepare` (data/store/), read by index, every document
  once per epoch; "mixture": the weighted sources of `mixture` (MixtureSource entries or dicts of
  their fields), each packed row drawn from one of them (data/mixture.py).
  batch_size is the global number of rows per step.

  What `midas data prepare` reads: prepared_from (with source "prepared"; otherwise the source
  itself): "builtin", "text" (train_files / eval_files, also .parquet with the text in column
  jsonl_field), "seqio" (seqio_task) or "tfds" (tfds_name, tfds_data_dir, the splits
  tfds_train_split / tfds_eval_split, the text in feature tfds_text_feature). A run on a store checks
  that the store was prepared with its vocabulary, and from these settings when prepared_from is set.
  read_threads: ranged reads of a store on gs:// in flight at once per batch read (local stores are read in
  line). read_ahead: with a store on gs://, the steps whose reads run while a step is built (each read
  costs a round trip, so several run at once). read_merge_gap_bytes: ranges of one store file that a
  batch reads less than this many bytes apart are one request (a bucket limits requests per second, and
  reading 256 KiB more costs a few ms, less than a request's round trip; 0: only touching ranges).
  read_retry_timeout_s: how long a store read that meets a transient storage fault (HTTP 429, 5xx, ...)
  is tried again, with backoff, before the run stops with exit status 75 (0: never tried again).
  min_chunk: a row is filled example by example until fewer than min_chunk of its slots remain.

  corpus_holdout: what the built-in corpus leaves out (data/sources/corpus.py): "none", or "composition": no
    depth-2 variable chains and no pre-school-math lines, in either split, so the primitives
    assignment_depth2 and psm measure composing what was trained (one hop; literals and `print`).
  corpus_documents: the built-in corpus's training documents, generated deterministically (validation keeps
    1,000, which skip every training text, so they depend on it): a long run reads a larger corpus rather than
    repeating this one.

  The held-out ("validation") split, which evaluation reads: eval_seed seeds its random stream (None: seed),
  so that with eval_seed fixed, training seeds vary the training rows only and every seed is scored on the
  same batches. heldout_shard (i, n): its batches draw only from held-out documents i, i + n, i + 2n, ...,
  so that one held-out split gives n disjoint evaluation sets (e.g. learning rates chosen on (0, 2), the
  loss reported on (1, 2)); in-memory sources only (not a prepared store).

  vocab: "byte", "sentencepiece" (spm_model: a .model file of any special-id layout) or "tokenizers"
  (tokenizer: a tokenizer.json, or a directory holding one with its tokenizer_config.json). A
  tokenizer's own ids are kept; extra_ids ids are appended above them for the special tokens it
  lacks (data/vocab/vocabulary.py). tokenizer may also name the transformers tokenizer files of a SentencePiece
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
  corpus_holdout: str = "none"
  seq_len: int = 256
  batch_size: int = 16
  seed: int = 0
  eval_seed: Optional[int] = None
  heldout_shard: Optional[Tuple[int, int]] = None
  corpus_documents: int = 20_000
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
  read_merge_gap_bytes: int = 256 * 1024
  read_retry_timeout_s: float = 300.0
  mixture: Tuple[MixtureSource, ...] = ()

  def __post_init__(self):
    s = "DataConfig."
    require(self.source != "seqio" or bool(self.seqio_task), s + "seqio_task",
            "source='seqio' needs a task name", "set DataConfig.seqio_task to a registered seqio Task")
    require(self.corpus_holdout in CORPUS_HOLDOUTS, s + "corpus_holdout", f"unknown choice {self.corpus_holdout!r}",
            f"use one of {CORPUS_HOLDOUTS}")
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
    self._check_mixture()
    self._check_heldout()
    require(self.seq_len >= 8, s + "seq_len", f"must be >= 8, got {self.seq_len}", "typical: 256 to 8192")
    require(self.batch_size > 0, s + "batch_size", "must be > 0", "set a positive global batch size")
    require(self.seed >= 0, s + "seed", f"must be >= 0, got {self.seed}", "use a non-negative integer")
    require(self.extra_ids >= 0, s + "extra_ids", f"must be >= 0, got {self.extra_ids}",
            "128 leaves room for span-corruption sentinels and mode tokens")
    require(2 <= self.min_chunk <= self.seq_len, s + "min_chunk", "must be in [2, seq_len]",
            "16 is the default")
    require(isinstance(self.read_merge_gap_bytes, numbers.Integral) and self.read_merge_gap_bytes >= 0,
            s + "read_merge_gap_bytes", f"must be a whole number >= 0, got {self.read_merge_gap_bytes!r}",
            "the default is 262144 (256 KiB); 0 merges only ranges that touch")
    require(isinstance(self.read_retry_timeout_s, numbers.Real) and 0 <= self.read_retry_timeout_s < float("inf"),
            s + "read_retry_timeout_s", f"must be a number of seconds >= 0, got {self.read_retry_timeout_s!r}",
            "the default is 300; 0 leaves the retries to the storage client alone")

  def split_seed(self, split: str) -> int:
    """The seed of `split`'s random stream: seed for "train", eval_seed (when set) for the held-out split."""
    return self.seed if split == "train" or self.eval_seed is None else self.eval_seed

  @property
  def origin(self) -> str:
    """The source a store is prepared from: prepared_from with source 'prepared', else the source."""
    return self.prepared_from if self.source == "prepared" else self.source

  def _check_mixture(self) -> None:
    s = "DataConfig.mixture"
    entries = []
    for entry in self.mixture:  # dicts from gin and from a checkpoint's JSON
      if isinstance(entry, dict):
        unknown = sorted(set(entry) - {f.name for f in dataclasses.fields(MixtureSource)})
        require(not unknown and "name" in entry, s, f"entry {entry!r} has unknown fields {unknown} or no name",
                f"give each source a name and only fields of MixtureSource: "
                f"{[f.name for f in dataclasses.fields(MixtureSource)]}")
        entry = MixtureSource(**entry)
      require(isinstance(entry, MixtureSource), s, f"entry {entry!r} is not a source",
              "list MixtureSource(...) entries, or dicts such as {'name': 'web', 'source': 'builtin'}")
      entries.append(entry)
    object.__setattr__(self, "mixture", tuple(entries))
    require((self.source == "mixture") == bool(entries), s,
            f"source={self.source!r} with {len(entries)} mixture sources",
            "set DataConfig.source = 'mixture' together with DataConfig.mixture, or neither")
    names = [e.name for e in entries]
    require(len(set(names)) == len(names), s, f"source names {names} repeat", "give every source its own name")
    require(not entries or sum(e.weight for e in entries) > 0, s, "every weight is 0",
            "give at least one source a positive weight")

  def _check_heldout(self) -> None:
    s = "DataConfig."
    seed = self.eval_seed
    require(seed is None or (isinstance(seed, numbers.Integral) and seed >= 0), s + "eval_seed",
            f"must be None or an integer >= 0, got {seed!r}",
            "None draws the held-out batches from DataConfig.seed; fix it (e.g. 0) to score every seed alike")
    size = self.corpus_documents
    require(isinstance(size, numbers.Integral) and 100 <= size <= MAX_CORPUS_DOCUMENTS, s + "corpus_documents",
            f"must be an integer in [100, {MAX_CORPUS_DOCUMENTS:,}], got {size!r}",
            "the default is 20000; take enough that a run passes over the corpus at most a few times")
    shard = self.heldout_shard
    if shard is None:
      return
    if isinstance(shard, list):  # gin and JSON hand over lists
      shard = tuple(shard)
    require(isinstance(shard, tuple) and len(shard) == 2 and all(isinstance(x, numbers.Integral) for x in shard)
            and shard[1] >= 1 and 0 <= shard[0] < shard[1], s + "heldout_shard",
            f"{shard!r} is not a shard (i, n) with n >= 1 and 0 <= i < n",
            "write e.g. (0, 2) for held-out documents 0, 2, 4, ... and (1, 2) for the others, or None for all")
    object.__setattr__(self, "heldout_shard", (int(shard[0]), int(shard[1])))
    stores = (["DataConfig.source is 'prepared'"] if self.source == "prepared" else []) + [
        f"mixture source {e.name!r} is 'prepared'" for e in self.mixture if e.source == "prepared"]
    require(not stores, s + "heldout_shard", f"is {shard!r}, but {'; '.join(stores)}: a prepared store's held-out "
            "split is read whole", "leave DataConfig.heldout_shard None, or read the data in memory "
            "(source builtin, text or seqio)")

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
