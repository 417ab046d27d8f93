"""The Colab notebook runs top to bottom, headless, at its small size, and stays in sync with its source."""

import json
import os

import pytest

from conftest import REPO_ROOT

nbformat = pytest.importorskip("nbformat", reason="install the notebooks extra: pip install -e .[notebooks]")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = os.path.join(REPO_ROOT, "notebooks", "midas_colab.ipynb")


def test_the_committed_notebook_is_what_make_notebook_writes(tmp_path):
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("make_notebook", os.path.join(REPO_ROOT, "notebooks", "make_notebook.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  committed = nbformat.read(NOTEBOOK, as_version=4)
  assert [c.source for c in committed.cells] == [c.source for c in module.CELLS], \
      "run `python notebooks/make_notebook.py` after editing its cells"
  assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


def test_the_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  workdir = tmp_path / "run"
  monkeypatch.setenv("MIDAS_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("MIDAS_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("XLA_FLAGS", "")  # the kernel is a fresh process: one CPU device, as in Colab
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  text = "\n".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
  assert f"midas_jax from {REPO_ROOT}\n" in text  # a checkout: the first cell installs nothing
  assert "wall-clock speedup" in text and "most similar blocks" in text
  assert "baseline: accuracy" in text and "midas: accuracy" in text
  assert "LlamaForCausalLM max |logit diff| vs midas_jax" in text
  diff = float(text.split("vs midas_jax:")[1].split()[0])
  assert diff < 1e-3
  comparison = json.load(open(workdir / "comparison.json"))
  assert [r["run"] for r in comparison["runs"]] == ["baseline", "midas"]
  assert os.path.isfile(workdir / "midas" / "eval" / "similarity_blocks.png")
  assert os.path.isfile(workdir / "midas_hf" / "model.safetensors")
