"""LoRA-aware layers."""
