"""Reading an adapter: a PEFT folder (or its tensors and config) -> validated ``AdapterWeights``
(the format and its config, the weight file, the embed_tokens/lm_head modules, its own tokenizer)."""
