"""``plugins.keymap``: the import path of LMCache key -> object name mapping before it was named
``kvstore_lmcache.keymap``; kept so existing LMCache configs load.  Importing it gives the module
``kvstore_lmcache.keymap`` itself (same classes, same state), never a copy."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("kvstore_lmcache.keymap")
