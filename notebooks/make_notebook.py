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
    new_markdown_cell("""## Running it on Colab
No checkout is needed: set `MIDAS_SOURCE` in the next cell to where pip can fetch midas_jax, a git URL
(`git+https://github.com/<you>/midas_jax.git`, your fork) or a wheel's URL (`pip wheel --no-deps .` in a checkout
builds one), then *Runtime > Run all*. The cell installs the package with the conversion extra beside Colab's own
packages, keeping any version already there that fits setup.py's ranges; if the install replaced a package the
runtime had already imported (jax at another version, say), it restarts the runtime: run all again then. In a
checkout, or where midas_jax is installed, it installs nothing.

**On a TPU runtime:** *Runtime > Change runtime type*, pick a TPU, then run all. The first cell sees the TPU
(`/dev/accel*` or `/dev/vfio`) and adds the `tpu` extra (jax[tpu] with its libtpu, which must match jax);
`jax.devices()` then lists the TPU cores and the runs below use all of them (MeshConfig data = -1). A GPU runtime
needs no extra: Colab's jax sees its GPU."""),
    new_code_cell("""# Install (on Colab without a checkout): midas_jax from MIDAS_SOURCE, a git URL or a wheel's URL.
MIDAS_SOURCE = "git+https://github.com/YOUR_ORG/midas_jax.git"
import glob, importlib, importlib.metadata, importlib.util, os, subprocess, sys
COLAB = "COLAB_RELEASE_TAG" in os.environ or "google.colab" in sys.modules

def checkout_root():
    path = os.path.abspath(".")
    while not (os.path.isfile(os.path.join(path, "setup.py")) and os.path.isdir(os.path.join(path, "midas_jax"))):
        if path == os.path.dirname(path):
            return None
        path = os.path.dirname(path)
    return path

def imported_versions():
    \"\"\"Distribution -> installed version, for the packages this process has imported.\"\"\"
    owners = importlib.metadata.packages_distributions()
    found = {}
    for dist in {d for name in list(sys.modules) if "." not in name for d in owners.get(name, ())}:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found

if importlib.util.find_spec("midas_jax") is None:
    root = checkout_root()
    extras = "convert,tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "convert"
    if root is None and "YOUR_ORG" in MIDAS_SOURCE:
        raise RuntimeError("midas_jax is not installed and this is not a checkout of it: set MIDAS_SOURCE at the "
                           "top of this cell to your fork's git URL or to a wheel's URL, then run it again")
    target = ["-e", f"{root}[{extras}]"] if root else [f"midas_jax[{extras}] @ {MIDAS_SOURCE}"]
    before = imported_versions()
    print("installing", *target)
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *target])
    importlib.invalidate_caches()
    replaced = sorted(d for d, v in before.items() if imported_versions().get(d, v) != v)
    if replaced:
        print("the install replaced packages this runtime had already imported:", ", ".join(replaced))
        if COLAB:
            print("restarting the runtime: run all again")
            os.kill(os.getpid(), 9)  # Colab restarts a runtime whose process ends
        raise RuntimeError("restart the kernel and run this cell again")
    import site; importlib.reload(site)  # an editable install's path file
import jax, midas_jax
print("midas_jax from", os.path.dirname(os.path.dirname(midas_jax.__file__)))
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
