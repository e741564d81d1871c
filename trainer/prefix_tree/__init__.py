"""Packed prefix trees: a micro-batch's sequences computed with every shared token once.

- ``build.py``: the radix tree of the token sequences and its layout in one packed row, with
  each sibling set's attention plan (``pack``), and ``lcp``.
- ``attention.py``: attention over the packed row as a transformers attention function (the
  kernels, their registration, and the packed forward: ``packed_logits``).
- ``targets.py``: which predictions of which sequences the packed forward computes
  (``Targets``), and their statistics put back in per-sequence rows.

trainer/forward.py puts them together: a micro-batch's per-token statistics, padded or packed.
"""
