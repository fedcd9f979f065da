"""Task families: tools, prompt, verifier, and state restore at any prefix; one folder each
(``trace_rl/envs/<family>/``), registered once in its ``__init__.py`` (``registry.family``)."""
