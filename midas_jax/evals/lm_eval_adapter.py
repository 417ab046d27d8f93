"""lm-evaluation-harness over our models: any checkpoint (any stage, any depth) or an imported HF model.

`MidasLM` is an `lm_eval` model class (registered as "midas") over a Decoder's parameters, its
config and the run's own vocabulary. It answers the harness's three request types:

  loglikelihood          (context, continuation) -> (sum of the continuation's token log-probs,
                         whether greedy decoding from the context writes exactly the continuation)
  loglikelihood_rolling  a document's log-likelihood, every token predicted once, in windows of the
                         model's max_length (lm_eval.utils.get_rolling_token_windows, disjoint)
  generate_until         greedy (or sampled, with do_sample) decoding with the key/value cache
                         (evals/decoding.py), cut at the first stop string, at most max_gen_toks

Tokens follow the harness's conventions (lm_eval.api.model.TemplateLM): a context's trailing spaces
move to the continuation, the continuation is what encoding context + continuation adds past the
context, and an empty context is replaced by the prefix token. Our prefix token is the vocabulary's
`start_id`, the token every training example's inputs start with (data/ul2/packing.py), and by default
(`add_bos=True`) a context starts with it too, as every document did in training; `add_bos=False`
scores raw text as lm_eval's GPT-2 setup does. A row longer than max_length + 1 tokens loses its
oldest context tokens, as in lm_eval's own models.

Log-likelihood requests are scored by continuations.py (`totals`), the scorer of the
`primitive_scores` suite: float32 log-probabilities on the device, summed per row in float64 on the
host, in batches of few shapes.

generate_until stops a row early at EOS or at a token whose own text contains a stop string (the
text is cut there anyway); otherwise it runs to max_gen_toks and the text is cut at the first stop
string, as the harness's models do.

lm_eval is imported only inside functions (the `eval` extra); `midas eval --suite=lm_eval` runs
`evaluate`, which writes the harness's results JSON (with the checkpoint's step, stage and depth)
through midas_jax.fs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax

from midas_jax import fs
from midas_jax.checkpoint import load_model
from midas_jax.configs import ModelConfig
from midas_jax.errors import ConfigError, require
from midas_jax.evals import continuations, decoding
from midas_jax.evals.options import context_length
from midas_jax.model import dot_support

NAME = "midas"
RUNS_ALONE = True  # the `lm_eval` suite: its own flags and results JSON (evals/suites.py)
DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_BATCH_SIZE = continuations.DEFAULT_BATCH_SIZE
INSTALL_HINT = "install the eval extra: pip install 'midas_jax[eval]' (lm-eval)"


def _import_lm_eval():
  try:
    import lm_eval  # noqa: F401
  except ImportError:
    raise ConfigError("--suite", "lm_eval is not installed", INSTALL_HINT) from None
  return lm_eval


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
  """The text before the first occurrence of any (non-empty) stop string."""
  for stop in stops:
    if stop:
      text = text.split(stop, 1)[0]
  return text


@functools.lru_cache(maxsize=32)
def _stop_ids(vocab, stops: Tuple[str, ...]) -> Tuple[int, ...]:
  """EOS and every id whose own text contains a stop string: a row may end there, its text is cut anyway."""
  ids = {vocab.eos_id}
  stops = tuple(s for s in stops if s)
  if stops:
    ids.update(i for i in range(vocab.vocab_size) if any(s in vocab.decode([i]) for s in stops))
  return tuple(sorted(ids))


def generate_texts(params, cfg: ModelConfig, vocab, prompts: Sequence[Sequence[int]], stops: Sequence[str],
                   max_gen_toks: int, max_length: int, batch_size: int = DEFAULT_BATCH_SIZE,
                   sampling: decoding.Sampling = decoding.GREEDY) -> List[str]:
  """Each prompt's continuation (at most max_gen_toks tokens, decoded with the KV cache), cut at the
  first stop string. A prompt keeps its last max_length - max_gen_toks tokens."""
  require(0 < max_gen_toks < max_length, "max_gen_toks", f"must be between 1 and max_length - 1 = {max_length - 1}, "
          f"got {max_gen_toks}", "ask the task for fewer tokens, or evaluate with a longer max_length")
  if not prompts:
    return []
  keep = max_length - max_gen_toks
  prompts = [list(p)[-keep:] for p in prompts]
  decoded = decoding.generate(params, cfg, prompts, [max_gen_toks] * len(prompts), _stop_ids(vocab, tuple(stops)),
                              max_length, batch_size, sampling)
  return [cut_at_stops(vocab.decode(ids), stops) for ids, _ in decoded]


@dataclasses.dataclass
class _GenRequest:
  stops: Tuple[str, ...]
  max_gen_toks: int
  sampling: decoding.Sampling


@functools.lru_cache(maxsize=1)
def lm_class():
  """The lm_eval model class over our models, registered with lm_eval's registry as NAME."""
  _import_lm_eval()
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval.models.utils import normalize_gen_kwargs
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

  class MidasLM(TemplateLM):
    """An lm_eval LM over Decoder(model_config) with `params` and the run's vocabulary.

    From Python: MidasLM(model=load_model(DIR)) or MidasLM(params=..., model_config=..., vocab=...);
    through the registry: lm_eval.simple_evaluate(model="midas", model_args="workdir=DIR,step=S").
    """

    def __init__(self, workdir: Optional[str] = None, step: Optional[int] = None, model=None, params=None,
                 model_config: Optional[ModelConfig] = None, vocab=None, max_length: Optional[int] = None,
                 batch_size: Any = DEFAULT_BATCH_SIZE, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 add_bos: bool = True, seed: int = 0, **ignored):
      super().__init__()
      del ignored  # the harness passes max_batch_size and device to every model class
      if workdir is not None:
        model = load_model(workdir, step)
      if model is not None:
        params, model_config, vocab = model.params, model.model_config, model.vocab
        max_length = max_length or context_length(model)
      require(params is not None and model_config is not None and vocab is not None, "MidasLM",
              "needs a model", "pass workdir=DIR, model=LoadedModel, or params, model_config and vocab")
      self.params, self.model_config, self.vocab = jax.device_put(params), model_config, vocab
      self._max_length = int(max_length or model_config.max_seq_len)
      require(1 < self._max_length <= model_config.max_seq_len, "max_length",
              f"must be between 2 and the model's max_seq_len {model_config.max_seq_len}, got {self._max_length}",
              "pass a shorter max_length")
      if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
        batch_size = DEFAULT_BATCH_SIZE  # jit compiles per batch width: no search for the largest
      self.batch_size = int(batch_size)
      require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {batch_size}", "pass a positive batch size")
      self.max_gen_toks, self.add_bos, self.seed = int(max_gen_toks), bool(add_bos), int(seed)

    @property
    def eot_token_id(self) -> int:
      return self.vocab.eos_id

    @property
    def prefix_token_id(self) -> int:
      return self.vocab.start_id

    @property
    def max_length(self) -> int:
      return self._max_length

    @property
    def tokenizer_name(self) -> str:
      return f"midas-{self.vocab.kind}-{self.vocab.fingerprint[:16]}"

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
      start = [self.vocab.start_id] if self.add_bos and add_special_tokens is not False else []
      return start + list(self.vocab.encode(string))

    def tok_decode(self, ids) -> str:
      return self.vocab.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
      # A context of nothing but spaces has no tokens once they move to the continuation: the prefix token.
      rows = [(ctx or [self.prefix_token_id], cont) for _, ctx, cont in requests]
      results = continuations.totals(self.params, self.model_config, rows, self._max_length, self.batch_size)
      for (key, _, _), result in zip(requests, results):
        if key is not None:
          self.cache_hook.add_partial("loglikelihood", key, result)
      return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
      windows, owner = [], []
      for index, (text,) in enumerate(req.args for req in requests):
        tokens = self.tok_encode(text, add_special_tokens=False)
        for window in get_rolling_token_windows(tokens, self.prefix_token_id, self._max_length, context_len=1):
          windows.append(make_disjoint_window(window))
          owner.append(index)
      scored = continuations.totals(self.params, self.model_config, windows, self._max_length, self.batch_size)
      sums = [0.0] * len(requests)  # an empty document: log 1
      for index, (logp, _) in zip(owner, scored):
        sums[index] += logp
      for req, total in zip(requests, sums):
        self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
      return sums

    def _gen_request(self, gen_kwargs: Dict[str, Any]) -> _GenRequest:
      kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
      stops = kwargs["until"] if isinstance(kwargs["until"], list) else [kwargs["until"]]
      sampling = decoding.GREEDY
      if kwargs.get("do_sample") and float(kwargs.get("temperature", 0.0)) > 0:
        sampling = decoding.Sampling(float(kwargs["temperature"]), int(kwargs.get("top_k") or 0), self.seed)
      return _GenRequest(tuple(str(s) for s in stops), int(kwargs["max_gen_toks"]), sampling)

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
      groups: Dict[Tuple, List[int]] = {}
      asked = [(req.args[0], self._gen_request(req.args[1])) for req in requests]
      for i, (_, gen) in enumerate(asked):
        groups.setdefault((gen.stops, gen.max_gen_toks, gen.sampling), []).append(i)
      out: List[str] = [""] * len(requests)
      for (stops, max_gen_toks, sampling), members in groups.items():
        prompts = [self.tok_encode(asked[i][0]) or [self.prefix_token_id] for i in members]
        texts = generate_texts(self.params, self.model_config, self.vocab, prompts, stops, max_gen_toks,
                               self._max_length, self.batch_size, sampling)
        for i, text in zip(members, texts):
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
      return out

  MidasLM.__qualname__ = "MidasLM"  # found as lm_eval_adapter.MidasLM (the module's __getattr__)
  return register_model(NAME)(MidasLM)


def __getattr__(name: str):
  # `midas_jax.evals.lm_eval_adapter:MidasLM` resolves for lm_eval's lazy registry entries too.
  if name == "MidasLM":
    return lm_class()
  raise AttributeError(name)


def _task_manager(tasks: Sequence[str], include_path: Optional[str]):
  """A TaskManager that knows `tasks`: the include path's alone when it has them all (indexing
  lm_eval's own 14,000 tasks takes seconds), else with lm_eval's."""
  from lm_eval.tasks import TaskManager
  if include_path:
    local = TaskManager(include_path=include_path, include_defaults=False)
    if not [t for t in tasks if t not in local.all_tasks]:
      return local
  manager = TaskManager(include_path=include_path)
  unknown = [t for t in tasks if t not in manager.all_tasks]
  if unknown:
    raise ConfigError("--tasks", f"lm_eval knows no task or group {unknown}",
                      "name tasks from `lm_eval ls tasks`, or pass --include_path=DIR with their YAML")
  return manager


def evaluate(model, tasks: Sequence[str], out_path: str, include_path: Optional[str] = None,
             num_fewshot: Optional[int] = None, limit: Optional[int] = None, batch_size: int = DEFAULT_BATCH_SIZE,
             max_length: Optional[int] = None, add_bos: bool = True, log_samples: bool = False,
             bootstrap_iters: int = 100000, seed: Optional[int] = None) -> Tuple[Dict[str, Any], str]:
  """Runs lm_eval.simple_evaluate with a LoadedModel on `tasks`; writes out_path (JSON: the checkpoint's
  step, stage and depth, then the harness's results, with per-sample records when log_samples) and
  returns (the record, the harness's results table)."""
  lm_eval = _import_lm_eval()
  from lm_eval.utils import handle_non_serializable, make_table
  require(bool(tasks), "--tasks", "--suite=lm_eval needs tasks", "pass --tasks=hellaswag,arc_easy (any lm_eval task)")
  if include_path:
    require(fs.isdir(include_path), "--include_path", f"{include_path} is not a directory",
            "pass a directory (local or gs://) of lm_eval task YAML files")
  seeds = {} if seed is None else {"random_seed": seed, "numpy_random_seed": seed, "torch_random_seed": seed,
                                   "fewshot_random_seed": seed}
  start = time.time()

  def run(cfg: ModelConfig):
    lm = lm_class()(model=dataclasses.replace(model, model_config=cfg), max_length=max_length,
                    batch_size=batch_size, add_bos=add_bos, seed=seed or 0)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                                   **seeds)

  # lm_eval reads local task files only, and some lazily (a task's !function helpers): a gs:// include
  # path is copied for the whole run.
  with contextlib.ExitStack() as stack:
    local = stack.enter_context(fs.local_tree(include_path)) if include_path else None
    manager = _task_manager(tasks, local)
    # A CPU that cannot run the model's bfloat16 matmuls: again with float32 operands (model/dot_support.py).
    results = dot_support.retry_widened(run, model.model_config)
  record = {"suite": "lm_eval", "step": model.step, "stage": model.stage, "depth": model.model_config.num_layers,
            "tasks": list(tasks), "max_length": max_length or context_length(model), "add_bos": add_bos,
            "seconds": round(time.time() - start, 1), "results": results}
  text = json.dumps(record, indent=2, default=handle_non_serializable)
  fs.write_text(out_path, text + "\n")
  table = make_table(results) + (make_table(results, "groups") if results.get("groups") else "")
  return json.loads(text), table
