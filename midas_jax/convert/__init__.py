"""Conversion to and from Hugging Face transformers (Llama, GPT-2), torch state dicts and npz.

Pure maps (mapping, hf_config) work on NumPy trees; export and import wrap them with files.
torch, transformers and safetensors are imported only inside the functions that need them.
"""

from midas_jax.convert.export import export_model, unroll_loop, write_export
from midas_jax.convert.hf_config import check_exportable, model_config_from_hf, to_hf_config
from midas_jax.convert.hf_import import import_hf, load_hf
from midas_jax.convert.mapping import from_hf_state_dict, to_hf_state_dict
from midas_jax.convert.writers import FORMATS, read_npz

__all__ = ["FORMATS", "check_exportable", "export_model", "from_hf_state_dict", "import_hf",
           "load_hf", "model_config_from_hf", "read_npz", "to_hf_config", "to_hf_state_dict", "unroll_loop",
           "write_export"]
