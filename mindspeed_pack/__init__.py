"""mindspeed-pack: exact multi-sample packing for Megatron-Core fine-tuning."""
__version__ = "0.1.0"
