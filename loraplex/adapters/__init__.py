"""Adapter runtime: PEFT reading, host tier, device slots, manager, per-step indices."""
