"""GGUF checkpoints (llama.cpp's single-file format), served as they are.

``source.find_gguf`` tells a GGUF model (a ``*.gguf`` file, or a folder holding one) from an HF folder;
``reader.GGUFFile`` opens one (``GGUFError`` for a corrupt or truncated file); ``metadata`` turns its
metadata into the HF config and tokenizer as transformers reads them; ``loader.load_gguf_model`` builds the
model with the base weights kept in their block formats where a kernel serves them
(``loraplex.ops.gguf``) and dequantized to float elsewhere.
"""
