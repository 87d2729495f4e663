"""Samples from raw rows: file readers (``readers``: parquet/arrow/csv/json/jsonl/txt), the Alpaca,
ShareGPT, OpenAI-messages, pairwise and KTO handlers (``handlers``, ``pairwise``, ``kto``), chat templates (JSON
slot templates in ``templates``, the model's own Jinja template in ``chat_template``), tokenizers
(``tokenizer``) and the deterministic demo data (``toy``).

Imports nothing of mindspeed_pack outside this package: ``datasets`` turns its samples into packs.
"""
