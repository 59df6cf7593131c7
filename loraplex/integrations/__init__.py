"""Optional integrations with other serving systems. Nothing here is imported by ``import loraplex``.

- ``ray_serve``: N engine replicas behind one OpenAI-compatible endpoint on Ray Serve, routed by
  adapter affinity (``pip install 'loraplex[ray]'``; CLI ``loraplex serve-ray``).
"""
