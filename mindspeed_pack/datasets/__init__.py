"""Packed datasets on disk: written by preprocessing (``preprocess``, ``pack_writer``: Megatron indexed
datasets and their sidecar) and read by training (``packed_documents``, ``packed_dataset``,
``sample_index``, ``pretrain_dataset``, ``online_packing``, ``rollouts``), with the checks of the
sidecar against a run's flags (``sidecar_checks``, ``validation``).

May import ``data`` (rows, handlers, templates, tokenizers), ``packing``, ``config`` (``--config`` of
preprocessing), ``model`` and ``runtime``; never ``checkpoint`` or ``training``.
"""
