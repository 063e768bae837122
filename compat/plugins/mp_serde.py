"""``plugins.mp_serde``: the import path of the CacheGen serde for LMCache's own L2 adapters before it was named
``kvstore_lmcache.mp_serde``; kept so existing LMCache configs load.  Importing it gives the module
``kvstore_lmcache.mp_serde`` itself (same classes, same state), never a copy."""

import importlib
import sys

if __name__ == "__main__":  # python -m plugins.mp_serde ...
    sys.exit(importlib.import_module("kvstore_lmcache.mp_serde").main())
sys.modules[__name__] = importlib.import_module("kvstore_lmcache.mp_serde")
