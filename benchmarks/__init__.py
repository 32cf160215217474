"""Benchmarks and studies of megatron_taco; ``benchmarks/README.md`` indexes them and their results.

Run them from the repository root as modules, ``python -m benchmarks.NAME ...``, with megatron_taco
importable (installed with ``pip install -e .``, as ``scripts/setup_env.sh`` does, or the repository on
``PYTHONPATH``); they import it and each other as packages, with no ``sys.path`` edits.
"""
