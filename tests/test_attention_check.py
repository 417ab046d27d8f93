"""`midas bench attention` (bench/attention_check.py): a path that raises or strays is recorded and the rest
still run; the rows are packed UL2 rows. (Its run on every path the CPU has is in tests/test_gpu_check.py.)"""

import pytest

from midas_jax.bench import attention_check
from midas_jax.errors import ConfigError

SHAPE = (2, 64, 4, 2, 16)


def test_the_rows_are_packed_ul2_rows_with_several_examples_prefixes_and_padding():
  rows = attention_check.packed_ul2_rows(seed=1, rows=4, length=128)
  for seg, prefix, objective in zip(rows["segment_ids"], rows["prefix_mask"], rows["objective_ids"]):
    examples = set(seg[seg > 0])
    assert len(examples) >= 3 and (seg == 0).any() and prefix.any()
    assert {int(objective[seg == e][0]) for e in examples} == {0, 1, 2}  # causal, prefix LM, span corruption


def test_a_path_that_raises_or_strays_is_recorded_and_the_others_still_run(monkeypatch):
  real = attention_check._path_function

  def broken(path, mask, platform, dtype):
    attend = real("dot_product", mask, platform, dtype)
    if path == "flash":
      raise RuntimeError("Triton: out of resources")
    if path == "xla":
      return lambda q, k, v: attend(q, k, v) * 1.01  # 1% off: outside float32's bound, inside nothing else
    return attend

  monkeypatch.setattr(attention_check, "_path_function", broken)
  report = attention_check.run([SHAPE], ["float32"], repeats=1)
  paths = report["cases"][0]["paths"]
  assert paths["flash"]["status"] == "failed" and "Triton: out of resources" in paths["flash"]["error"]
  assert paths["xla"]["status"] == "outside_bound" and paths["xla"]["relative_error"]["out"] > 2 ** -9
  assert paths["dot_product"]["status"] == "ok" and paths["cudnn"]["status"] == "skipped"
  assert report["failed"] == ["float32 (2, 64, 4, 2, 16) flash: failed", "float32 (2, 64, 4, 2, 16) xla: outside_bound"]
  text = attention_check.format_report(report)
  assert "flash        failed: RuntimeError: Triton: out of resources" in text and "failed: float32" in text


def test_bad_shapes_and_names_are_config_errors():
  with pytest.raises(ConfigError, match="five positive integers"):
    attention_check.parse_shape("2,64,4")
  with pytest.raises(ConfigError, match="kv_heads that divides"):
    attention_check.check_case((2, 64, 4, 3, 16), "float32")
  with pytest.raises(ConfigError, match="unknown path 'splash'"):
    attention_check.run([SHAPE], ["float32"], ["splash"])
  assert attention_check.parse_shape("2,2048,16,16,128") == (2, 2048, 16, 16, 128)
