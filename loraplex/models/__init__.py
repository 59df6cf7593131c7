"""Llama-family models and their loading."""
