"""The checkpoint-file reader: one sequence for ``load``, ``load(into=)``, ``load_slices``, ``verify`` and DCP's reader.

open the file and check its header and identity (checks.py) → plan → stream the data region
in checked pieces (stream.py; ``verify`` stops here) → rebuild the entries through their
providers (rebuild.py); the entry points are in restore.py, and every byte comes through
one seam (source.py). This package imports nothing itself, so that ``verify`` never
imports torch.
"""
