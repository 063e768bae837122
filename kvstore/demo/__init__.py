"""`kvstore demo`: SmolLM2-135M on CPU, the real LMCache engine, kvstore underneath."""
