"""automodel-quant: quantization-aware training, float8 training and quantized base weights.

- `automodel_quant.qat`: `QATConfig`, `prepare_qat_model`, `convert_qat_model`, fake-quant toggles (torchao).
- `automodel_quant.fp8`: `FP8Config`, `apply_fp8_to_model`, `precompute_fp8_scales_for_fsdp` (torchao).
- `automodel_quant.bnb`: `BnBQuantizationConfig`, `apply_bnb_quantization` (bitsandbytes, ``[bnb]`` extra).

Every name is also re-exported here, loaded on first access: ``import automodel_quant`` imports neither
torchao nor bitsandbytes (nor the submodules), so it costs about as much as ``import torch``.
"""

import lazy_loader

from automodel_mesh.version import installed_version

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

__version__ = installed_version("automodel-quant")
