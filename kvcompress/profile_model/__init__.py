"""Per-model files, made once by ``python -m kvcompress.profile_model MODEL``:

- ``profiles``: a model's query profile (``--kv-scoring expected``), fitted by
  ``profile_fit``;
- ``surrogates``: its score surrogate (``--kv-scoring surrogate`` and ``auto``), fitted by
  ``surrogate_fit`` with a reconstruction pass as teacher;
- ``calibration``: the text both fits run the model over;
- ``store``: where the files live (the user's kvcompress cache, keyed by the model's
  fingerprint, or beside a model folder) and how the server finds them;
- ``command``: the command line.

``profiles`` and ``surrogates`` are read by the engine at start; the fits and the command
load Hugging Face transformers and run only here. No vLLM imports.
"""
