"""Engine-aware quantization_config fixups and pre-upload validation."""
