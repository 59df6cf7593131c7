"""The engine checking itself: the invariants its debug checks assert each step (``invariants``) and the faults
tests arm in it (``faults``)."""
