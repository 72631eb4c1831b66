"""User-facing surfaces: the offline ``LLM``, the CLI and the demo."""
