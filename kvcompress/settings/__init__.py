"""The user-facing compression settings, by job (no vLLM imports):

- ``flags``: the flag table: every ``--kv-*`` flag and ``additional_config`` key, its type,
  choices, default, range and help, and the groups ``vllm serve --help`` and the README show;
- ``config``: ``KVCompressionConfig``, built from flags, ``additional_config`` or a request's
  overrides, and its validation (every error names the flag and what is allowed);
- ``resolution``: what ``auto`` stands for, and the scoring and model files chosen when the
  engine starts.

Each is imported by its own path: this package re-exports nothing.
"""
