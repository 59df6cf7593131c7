"""Speculative decoding: n-gram drafts per request (``ngram``), which requests draft and how many tokens
(``speculator``), and the acceptance rule applied to the verified logits (``verify``)."""
