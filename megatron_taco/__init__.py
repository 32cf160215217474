"""megatron_taco: compressed model-parallel communication for Megatron-Core (TACO and MAPL).

The public API lives in the modules (each declares it in ``__all__``); this package file imports nothing, so
that ``python -m megatron_taco.launch`` can put a Megatron-LM checkout first on ``sys.path`` before anything
imports ``megatron``. The entry points:

- ``megatron_taco.launch``: ``python -m megatron_taco.launch SCRIPT``, ``install_hooks()`` (what ``patches/`` call);
- ``megatron_taco.config``: ``TacoConfig`` / ``MaplConfig``, their flags, and ``config.errors`` (one error type
  per config family);
- ``megatron_taco.megatron.attach.attach_taco`` and ``megatron_taco.mapl.stage.attach_mapl`` / ``start_mapl`` /
  ``schedule_inputs``: TACO and MAPL on built GPTModel chunks;
- ``megatron_taco.comm``: the compressed ``all_gather`` / ``reduce_scatter`` / ``all_reduce``;
- ``megatron_taco.codec.TacoCodec``: the wire codec;
- ``megatron_taco.training``: the self-contained trainer (``examples/pretrain_gpt.py``).
"""
