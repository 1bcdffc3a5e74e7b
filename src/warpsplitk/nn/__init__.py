"""PyTorch integration: the custom ops (``ops``), ``DecodeLinear`` and
``patch_model`` (``linear``), merged projections (``merge``) and
tensor-parallel shards (``parallel``)."""
