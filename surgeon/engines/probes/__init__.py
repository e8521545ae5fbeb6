"""The probes: per engine (vLLM, SGLang), classify captures, dispatch, model runners, pipeline stages, the on-disk cache."""
