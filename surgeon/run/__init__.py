"""Run: the real vLLM engine in a subprocess, tiny models, and the demo."""
