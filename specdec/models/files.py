"""On-disk names of the model directories in :mod:`specdec.models` (standard library only).

A draft directory: ``DRAFT_MARKER`` (marker + config, written last), ``DRAFT_WEIGHTS``,
``DRAFT_EMBEDDINGS`` and a copy of the tokenizer. An exit adapter directory: ``EXIT_MARKER``
(written last) and ``EXIT_WEIGHTS``. The demo's ``exit/`` directory holds ``layer{L}`` adapter
directories and ``EXIT_SUMMARY``, written when the build is complete. An EAGLE head
directory: ``EAGLE_MARKER`` (written last) and ``EAGLE_WEIGHTS``. A Medusa heads directory:
``MEDUSA_MARKER`` (written last) and ``MEDUSA_WEIGHTS``.
"""

from __future__ import annotations

DRAFT_MARKER = "specdec_draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_EMBEDDINGS = "embeddings.safetensors"
DRAFT_FILES = (DRAFT_MARKER, DRAFT_WEIGHTS, DRAFT_EMBEDDINGS)
DRAFT_FORMAT = "specdec-draft"
DRAFT_VERSION = 1

EXIT_MARKER = "specdec_exit.json"
EXIT_WEIGHTS = "exit.safetensors"
EXIT_FILES = (EXIT_MARKER, EXIT_WEIGHTS)
EXIT_FORMAT = "specdec-exit"
EXIT_VERSION = 1
EXIT_SUMMARY = "exit.json"

EAGLE_MARKER = "specdec_eagle.json"
EAGLE_WEIGHTS = "eagle.safetensors"
EAGLE_FILES = (EAGLE_MARKER, EAGLE_WEIGHTS)
EAGLE_FORMAT = "specdec-eagle"
EAGLE_VERSION = 1

MEDUSA_MARKER = "specdec_medusa.json"
MEDUSA_WEIGHTS = "medusa.safetensors"
MEDUSA_FILES = (MEDUSA_MARKER, MEDUSA_WEIGHTS)
MEDUSA_FORMAT = "specdec-medusa"
MEDUSA_VERSION = 1
