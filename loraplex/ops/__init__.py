"""Batched LoRA ops."""
