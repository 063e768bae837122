"""``plugins.hf_connector``: the import path of the demo's CPU tensor connector before it
moved to ``kvstore.demo.hf_connector``; kept so existing LMCache configs load.  Importing it
gives that module itself, never a copy."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("kvstore.demo.hf_connector")
