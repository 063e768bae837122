"""``plugins.l2_adapter``: the import path of the MP-mode L2 adapter before it was named
``kvstore_lmcache.l2_adapter``; kept so existing LMCache configs load.  Importing it gives the module
``kvstore_lmcache.l2_adapter`` itself (same classes, same state), never a copy."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("kvstore_lmcache.l2_adapter")
