"""PyTorch integration: the custom ops (``ops``), ``DecodeLinear``
(``linear``), merged projections (``merge``), ``patch_model`` and
``unpatch`` (``patch``) and tensor-parallel shards (``parallel``)."""
