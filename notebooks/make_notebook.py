"""Writes notebooks/midas_colab.ipynb from the cells below (edit here, then run this file).

Keeping the notebook's source in a .py file keeps its diffs readable; the .ipynb is committed
without outputs.
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# midas_jax in a notebook: MIDAS against its baseline, at tiny scale

Trains an 8-layer Llama-style model on the built-in corpus twice, at full depth throughout (the
baseline) and grown by MIDAS in 4 stages (each growth copies the middle block right after itself),
then plots both losses against training FLOPs, shows the grown model's layer similarity, evaluates a
reasoning primitive and exports the model to Hugging Face transformers. About 5 minutes on a Colab
CPU; a GPU or TPU runtime is faster. Nothing is downloaded but the packages."""),
    new_code_cell("""# Install: in Colab, clone the repository first (File > Open notebook > GitHub, or `!git clone <your
# fork's URL>`), then run this cell from inside the checkout. The conversion extra brings torch (CPU)
# and transformers for the last section.
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("midas_jax") is None:
    root = os.path.abspath(".")
    while root != "/" and not os.path.isfile(os.path.join(root, "setup.py")):
        root = os.path.dirname(root)
    if root == "/":
        raise RuntimeError("midas_jax is not installed and this is not a checkout of it: clone the "
                           "repository and open the notebook from inside it")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}[convert]"])
    import site; importlib.reload(site)
import jax
print("jax", jax.__version__, "devices:", jax.devices())"""),
    new_code_cell("""# The run: gin/experiments/midas_cpu.gin, the README's default job. SMALL (set by the test suite)
# shrinks it to a smoke test of every cell.
from midas_jax import gin_config
SMALL = os.environ.get("MIDAS_NOTEBOOK_SMALL") == "1"
WORKDIR = os.path.abspath(os.environ.get("MIDAS_NOTEBOOK_WORKDIR", "runs/notebook"))
overrides = ["CheckpointConfig.every = 0"]  # save at stage boundaries and at the end only
if SMALL:
    overrides += ["TrainerConfig.num_steps = 16", "TrainerConfig.eval_every = 8", "TrainerConfig.eval_batches = 1",
                  "TrainerConfig.log_every = 4", "DataConfig.seq_len = 64", "DataConfig.batch_size = 8",
                  "ModelConfig.d_model = 64", "ModelConfig.d_ff = 128"]
gin_config.parse(["experiments/midas_cpu.gin"], overrides)
config = gin_config.run_config_from_gin()
print(config.model)
print(config.stacking)"""),
    new_markdown_cell("""## Train the pair
`compare` trains the baseline, then the MIDAS run, on the same data, seed and steps, and writes one
folder per run (metrics, checkpoints, stages.json) plus a table and a loss-vs-FLOPs plot."""),
    new_code_cell("""from IPython.display import Image, Markdown, display
from midas_jax import compare
report = compare.compare(config, WORKDIR)
display(Markdown(report["table"]))
print(f"wall-clock speedup {report['measured_speedup']:.2f}x at {report['flop_ratio']:.2f}x fewer FLOPs")
display(Image(os.path.join(WORKDIR, "loss_vs_flops.png")))"""),
    new_code_cell("""# The held-out loss per objective of the UL2 mixture, against steps, with the stage boundaries.
import matplotlib.pyplot as plt
from midas_jax.train.metrics import read_metrics
fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
for run in ("baseline", "midas"):
    rows = read_metrics(os.path.join(WORKDIR, run), "eval")
    for ax, objective in zip(axes, ("causal", "prefix", "span")):
        ax.plot([r["step"] for r in rows], [r[f"loss/{objective}"] for r in rows], "o-", label=run)
        ax.set_title(f"eval loss, {objective}"); ax.set_xlabel("step")
for growth in report["growths"]:
    for ax in axes:
        ax.axvline(growth["step"], color="gray", linestyle="--", linewidth=0.8)
axes[0].legend(); plt.tight_layout(); plt.show()"""),
    new_markdown_cell("""## Layer similarity of the grown model
Cosine similarity between the weights of every pair of layers and of blocks. Layers that MIDAS
copied start identical and drift apart as training goes on; the red outlines mark the pairs the
last growth made."""),
    new_code_cell("""from midas_jax.checkpoint import load_model
from midas_jax.evals import suites
midas_dir = os.path.join(WORKDIR, "midas")
grown = load_model(midas_dir)
print(f"step {grown.step}, stage {grown.stage}, depth {grown.model_config.num_layers}")
similarity = suites.run("similarity", grown, midas_dir, {})
print("most similar blocks:", similarity["results"]["blocks"]["most_similar"])
display(Image(os.path.join(midas_dir, "eval", "similarity_blocks.png")))"""),
    new_markdown_cell("""## A reasoning primitive
Variable assignment at depth 1, 5-shot, scored by exact match of greedy decoding (README, "Evaluate a
run", shows the formats). A model this small and this briefly trained scores near zero: the point is
the instrument. `midas eval --suite=all` runs every suite from the command line."""),
    new_code_cell("""options = {"tasks": ["assignment_depth1"], "num_examples": 8 if SMALL else 50, "k_shot": 2 if SMALL else 5}
for run in ("baseline", "midas"):
    model = load_model(os.path.join(WORKDIR, run))
    record = suites.run("primitives", model, os.path.join(WORKDIR, run), options)
    task = record["results"]["tasks"]["assignment_depth1"]
    print(f"{run}: accuracy {task['accuracy']:.2f}; e.g. {task['samples'][0]}")"""),
    new_markdown_cell("""## Export to Hugging Face transformers
The grown model as a `LlamaForCausalLM` directory (safetensors, config, tokenizer), loaded back with
transformers and checked against our own logits."""),
    new_code_cell("""import numpy as np
from midas_jax.convert.export import export_model
hf_dir = os.path.join(WORKDIR, "midas_hf")
if not os.path.isdir(hf_dir):
    export_model(midas_dir, hf_dir, "hf")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
hf_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(hf_dir)
ids = tokenizer("a=5; b=a; print b ->", return_tensors="pt").input_ids
with torch.no_grad():
    hf_logits = hf_model(ids).logits[0].numpy()

import dataclasses
from midas_jax.model import Decoder
cfg = dataclasses.replace(grown.model_config, dtype="float32")
tokens = jax.numpy.asarray(ids.numpy())
batch = {"inputs": tokens, "positions": jax.numpy.arange(tokens.shape[1])[None],
         "segment_ids": jax.numpy.ones_like(tokens), "prefix_mask": jax.numpy.zeros(tokens.shape, bool)}
ours = np.asarray(Decoder(cfg).apply({"params": grown.params}, batch))[0]
print(type(hf_model).__name__, "max |logit diff| vs midas_jax:", float(np.abs(ours - hf_logits).max()))
print(tokenizer.decode(hf_model.generate(ids, do_sample=False, max_new_tokens=8)[0]))"""),
]


def main() -> str:
  nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                          "language": "python"},
                                           "colab": {"provenance": []}})
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "midas_colab.ipynb")
  nbformat.write(nb, path)
  return path


if __name__ == "__main__":
  print(main())
