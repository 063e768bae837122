"""kvstore: an asyncio object store for LLM KV-cache chunks, under LMCache and vLLM.

Layers (see docs/design.md): keys → frame → codec → backends (mem, file, redis, s3)
→ tier / TieredStore + policy engine → plugins for LMCache; a `kvstore` CLI on top.
"""

__version__ = "0.1.0"
