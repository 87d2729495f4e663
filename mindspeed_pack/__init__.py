"""mindspeed-pack: exact multi-sample packing for Megatron-Core fine-tuning."""
import warnings as _warnings

__version__ = "0.1.0"

# megatron-core warns at import, once per module (six times a run), that it falls back to torch or local kernels
# without Transformer Engine or Apex; a training run says once which fallbacks it uses
# (mindspeed_pack.model.te_spec.kernel_fallbacks, logged at model build), so those warnings are hidden.
_warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                         category=UserWarning, module=r"megatron\.")
