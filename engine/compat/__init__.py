"""Platform compatibility layers (CPU-only Megatron-Core support)."""
