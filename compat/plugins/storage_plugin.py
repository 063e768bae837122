"""``plugins.storage_plugin``: the import path of the in-process storage plugin before it was named
``kvstore_lmcache.storage_plugin``; kept so existing LMCache configs load.  Importing it gives the module
``kvstore_lmcache.storage_plugin`` itself (same classes, same state), never a copy."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("kvstore_lmcache.storage_plugin")
