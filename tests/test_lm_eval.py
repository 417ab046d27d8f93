"""lm-evaluation-harness over our models (evals/lm_eval_adapter.py), offline on the local tasks of
tests/lm_eval_tasks/: `midas eval --suite=lm_eval` writes the harness's results, and every number the
harness got from the model is checked against our own code on the same tokens:

  loglikelihood          = continuations.logprobs (what the primitive_scores suite reads), summed
  loglikelihood_rolling  = the same, window by window: each window predicts the next max_length
                           tokens (the last one fewer) from the max_length + 1 tokens that end it
  generate_until         = decoding.greedy_decode without a cache or early stop, cut at the first
                           stop string

Tolerance of the log-likelihoods: both sides compute float32 logits from the same parameters in
batches of other shapes (other rows, other padding), so XLA may sum each matmul in another order;
a token's log-probability then moves by a few float32 ulps of the logits' size, and a sum over n
tokens by n of them. We allow TOKEN_ATOL (1e-4 nats) per token, 1e-4 * n in all, and record the
largest difference seen.
"""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local jsonl files; nothing downloads
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import tiny_model  # noqa: E402
from midas_jax import cli, configs  # noqa: E402
from midas_jax.checkpoint import load_model, write_params_export  # noqa: E402
from midas_jax.data.vocab.vocabulary import ByteVocabulary  # noqa: E402
from midas_jax.errors import ConfigError  # noqa: E402
from midas_jax.evals import continuations, decoding, lm_eval_adapter  # noqa: E402
from midas_jax.model import Decoder, dummy_batch  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASKS = ("midas_choice", "midas_rolling", "midas_generate")
VOCAB = ByteVocabulary()
MAX_LENGTH = 64  # the model's context: the longest document needs three rolling windows
TOKEN_ATOL = 1e-4


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  """A params-only export of a tiny decoder with N(0, 1) weights (peaked, varied predictions)."""
  cfg = tiny_model(max_seq_len=MAX_LENGTH).with_vocab(VOCAB.vocab_size)
  shapes = nn.unbox(jax.eval_shape(Decoder(cfg).init, jax.random.key(5), dummy_batch(1, 8))["params"])
  rng = np.random.default_rng(5)
  params = jax.tree.map(lambda x: rng.normal(0.0, 1.0, x.shape).astype(x.dtype), shapes)
  path = str(tmp_path_factory.mktemp("lm_eval") / "export")
  config = configs.RunConfig(model=cfg, data=configs.DataConfig(seq_len=MAX_LENGTH))
  write_params_export(path, params, config, {"step": 7, "stage": 2})
  return path


@pytest.fixture(scope="module")
def harness(export, tmp_path_factory):
  """`midas eval --suite=lm_eval` on the three local tasks, with the per-request records kept."""
  out = str(tmp_path_factory.mktemp("lm_eval_out"))
  code = cli.main(["eval", f"--workdir={export}", "--suite=lm_eval", f"--tasks={','.join(TASKS)}",
                   f"--include_path={TASKS_DIR}", f"--out={out}", "--batch_size=4", "--opt=log_samples=true",
                   "--opt=bootstrap_iters=0"])
  assert code == 0
  with open(os.path.join(out, "lm_eval.json")) as f:
    record = json.load(f)
  return load_model(export), record


def _requests(record, task):
  """(arguments, response) of every request the harness sent for `task`."""
  return [(args, resp[0]) for sample in record["results"]["samples"][task]
          for args, resp in zip(sample["arguments"], sample["resps"])]


def _our_sums(model, rows, max_length=MAX_LENGTH):
  """(sum of the continuation's log-probs in float64, all greedy) as the primitive_scores suite reads them."""
  logps = continuations.logprobs(model.params, model.model_config, rows, max_length, batch_size=8)
  out = []
  for (_, cont), lp in zip(rows, logps):
    token_lp = [float(lp[j, t]) for j, t in enumerate(cont)]
    out.append((sum(token_lp), all(int(lp[j].argmax()) == t for j, t in enumerate(cont))))
  return out


def test_the_command_writes_the_harness_results_with_the_checkpoint(harness, capsys):
  _, record = harness
  assert (record["suite"], record["step"], record["stage"], record["depth"]) == ("lm_eval", 7, 2, 2)
  assert record["max_length"] == MAX_LENGTH and record["add_bos"] is True
  results = record["results"]["results"]
  assert set(results) == set(TASKS)
  assert 0 <= results["midas_choice"]["acc,none"] <= 1 and 0 <= results["midas_generate"]["exact_match,none"] <= 1
  assert results["midas_rolling"]["bits_per_byte,none"] > 0
  assert [len(record["results"]["samples"][t]) for t in TASKS] == [6, 3, 5]  # every doc of the jsonl files


def test_loglikelihood_equals_our_primitive_scores_reading(harness):
  model, record = harness
  requests = _requests(record, "midas_choice")
  assert len(requests) == 18  # one per choice
  rows = []
  for (context, continuation), _ in requests:
    assert context and not context.endswith(" ") and continuation.startswith(" ")  # the split is the texts'
    rows.append(([VOCAB.start_id] + VOCAB.encode(context), VOCAB.encode(continuation)))
  ours = _our_sums(model, rows)
  worst = 0.0
  for (_, (logp, greedy)), (_, cont), (our_logp, our_greedy) in zip(requests, rows, ours):
    assert abs(logp - our_logp) <= TOKEN_ATOL * len(cont) and greedy == our_greedy
    worst = max(worst, abs(logp - our_logp) / len(cont))
  print(f"loglikelihood: largest |harness - ours| per token {worst:.2e} nats over {len(rows)} requests")
  # The harness's accuracy is the share of questions whose true choice has the highest log-likelihood.
  by_doc = [[r[0] for r in s["resps"]] for s in record["results"]["samples"]["midas_choice"]]
  labels = [s["doc"]["label"] for s in record["results"]["samples"]["midas_choice"]]
  acc = np.mean([int(np.argmax([lp for lp, _ in lls]) == label) for lls, label in zip(by_doc, labels)])
  assert record["results"]["results"]["midas_choice"]["acc,none"] == pytest.approx(acc)


def _rolling_windows(tokens, start_id, length):
  """Every token predicted once: the first `length` from the start token, then each next `length`
  (the last window fewer) from the length + 1 tokens ending the window."""
  first = min(length, len(tokens))
  windows, done = [([start_id], tokens[:first])], first
  while done < len(tokens):
    end = min(done + length, len(tokens))
    windows.append((tokens[end - length - 1:done], tokens[done:end]))
    done = end
  return windows


def test_rolling_loglikelihood_is_the_sum_of_our_token_logprobs(harness):
  model, record = harness
  requests = _requests(record, "midas_rolling")
  windows_per_doc, worst = [], 0.0
  for (text,), logp in requests:
    tokens = VOCAB.encode(text)
    windows = _rolling_windows(tokens, VOCAB.start_id, MAX_LENGTH)
    assert sum(len(w[1]) for w in windows) == len(tokens)
    windows_per_doc.append(len(windows))
    # A window is max_length + 1 tokens: the last is only predicted, so causal attention leaves the
    # others as the model saw them; our suite takes it as one token more.
    ours = sum(lp for lp, _ in _our_sums(model, windows, MAX_LENGTH + 1))
    assert abs(logp - ours) <= TOKEN_ATOL * len(tokens), (text, logp, ours)
    worst = max(worst, abs(logp - ours) / len(tokens))
  assert windows_per_doc == [1, 3, 1]  # the long document crosses two window boundaries
  print(f"loglikelihood_rolling: largest |harness - ours| per token {worst:.2e} nats over {len(requests)} documents")


def test_generate_until_equals_our_greedy_decoding_cut_at_the_stop_strings(harness):
  model, record = harness
  requests = _requests(record, "midas_generate")
  cut = 0
  for (context, gen_kwargs), text in requests:
    stops, budget = gen_kwargs["until"], gen_kwargs["max_gen_toks"]
    prompt = [VOCAB.start_id] + VOCAB.encode(context)
    [(ids, _)] = decoding.greedy_decode(model.params, model.model_config, [prompt], [budget], [VOCAB.eos_id],
                                        MAX_LENGTH, cache=False)
    full = VOCAB.decode(ids)
    ends = [full.index(s) for s in stops if s in full]
    assert text == full[:min(ends, default=len(full))]
    cut += text != full
  print(f"generate_until: {len(requests)} generations equal ours, {cut} of them cut at a stop string")
  assert cut >= 2, "the stop strings of midas_generate.yaml should cut some of this model's generations"


def test_the_model_class_is_registered_and_builds_from_a_workdir(export):
  cls = lm_eval_adapter.lm_class()
  assert lm_eval.api.registry.get_model(lm_eval_adapter.NAME) is cls is lm_eval_adapter.MidasLM
  lm = cls.create_from_arg_string(f"workdir={export},max_length=32,add_bos=False", {"batch_size": 2,
                                                                                    "device": None})
  assert (lm.max_length, lm.batch_size, lm.add_bos, lm.prefix_token_id) == (32, 2, False, VOCAB.start_id)
  from lm_eval.api.instance import Instance
  asked = [Instance("loglikelihood", {}, ("a=5; print a ->", " 5"), 0),
           Instance("loglikelihood", {}, ("", "hello"), 1)]  # an empty context: the prefix token
  got = lm.loglikelihood(asked)
  model = load_model(export)
  ours = _our_sums(model, [(VOCAB.encode("a=5; print a ->"), VOCAB.encode(" 5")),
                           ([VOCAB.start_id], VOCAB.encode("hello"))], 32)
  for (logp, greedy), (our_logp, our_greedy) in zip(got, ours):
    assert abs(logp - our_logp) <= TOKEN_ATOL * 5 and greedy == our_greedy


def test_rows_compile_a_few_widths_and_long_rows_lose_their_oldest_context(export):
  model = load_model(export)
  cfg = model.model_config
  rng = np.random.default_rng(0)
  rows = [(list(rng.integers(3, 200, n)), list(rng.integers(3, 200, 3))) for n in range(1, 61, 3)]
  fn = continuations._totals_fn(cfg)
  before = fn._cache_size()
  got = continuations.totals(model.params, cfg, rows, MAX_LENGTH, batch_size=4)
  assert fn._cache_size() - before <= 2  # widths 32 and 64, batches of 4
  ours = _our_sums(model, rows)
  assert all(abs(a[0] - b[0]) <= TOKEN_ATOL * 3 and a[1] == b[1] for a, b in zip(got, ours))
  assert [continuations.bucket_width(n, 64) for n in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, 64]
  long_row = (list(rng.integers(3, 200, 90)), [7, 8, 9])
  kept = (long_row[0][-(MAX_LENGTH + 1 - 3):], long_row[1])
  [a, b] = continuations.totals(model.params, cfg, [long_row, kept], MAX_LENGTH, batch_size=2)
  assert abs(a[0] - b[0]) <= 1e-6 and a[1] == b[1]


def test_generation_cuts_at_stop_strings_and_refuses_a_budget_past_the_context(export):
  assert lm_eval_adapter.cut_at_stops("ab\ncdQ:e", ["Q:", "\n", ""]) == "ab"
  assert lm_eval_adapter.cut_at_stops("abc", []) == "abc"
  model = load_model(export)
  with pytest.raises(ConfigError, match="max_gen_toks"):
    lm_eval_adapter.generate_texts(model.params, model.model_config, VOCAB, [[1, 2]], ["\n"], MAX_LENGTH, MAX_LENGTH)


def test_the_command_names_what_is_wrong(export, tmp_path, capsys):
  def error(*flags):
    assert cli.main(["eval", f"--workdir={export}", f"--out={tmp_path}", *flags]) == 2
    return capsys.readouterr().err

  assert "--tasks" in error("--suite=lm_eval")
  assert "runs alone" in error("--suite=lm_eval,primitives", "--tasks=midas_choice")
  assert "--include_path" in error("--suite=primitives", f"--include_path={TASKS_DIR}")
  assert "reads no ['loop_repeats']" in error("--suite=lm_eval", "--tasks=midas_choice", "--loop_repeats=2")
  assert "is not a directory" in error("--suite=lm_eval", "--tasks=midas_choice", f"--include_path={tmp_path}/none")
  assert not os.listdir(tmp_path)  # refused before anything ran
