"""``plugins.remote_connector``: the import path of the in-process remote connector before it was named
``kvstore_lmcache.remote_connector``; kept so existing LMCache configs load.  Importing it gives the module
``kvstore_lmcache.remote_connector`` itself (same classes, same state), never a copy."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("kvstore_lmcache.remote_connector")
