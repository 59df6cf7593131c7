"""Turning a step's logits into tokens: ``params.py`` (``SamplingParams`` and its limits), ``sampler.py``
(greedy and seeded draws, vectorised), ``logits_processors.py`` (penalties, bias, min_tokens),
``logprobs.py`` (raw logprobs of chosen and top tokens, prompt logprobs), ``structured/`` (grammars)."""
