"""kvstore's LMCache integration, imported as ``kvstore_lmcache`` (the repository folder
``plugins/`` is mapped to that name by pyproject's ``package-dir``).

Module paths for LMCache's configuration:

* MP mode, L2 adapter: ``--l2-adapter '{"type": "plugin", "module_path":
  "kvstore_lmcache.l2_adapter", "class_name": "KVStoreL2Adapter", "adapter_params": {...}}'``;
  CacheGen as a serde of LMCache's own adapters: ``kvstore_lmcache.mp_serde``;
* storage plugin:   ``storage_plugin.<name>.module_path = "kvstore_lmcache.storage_plugin"``,
  ``class_name = "KVStoreStoragePlugin"`` (with ``LMCACHE_STORAGE_PLUGINS=<name>``);
* remote connector: ``remote_storage_plugin.<name>.module_path =
  "kvstore_lmcache.remote_connector"``, ``class_name = "KVStoreRemoteConnector"`` (with
  ``LMCACHE_REMOTE_STORAGE_PLUGINS=<name>``; the name must not be one LMCache's built-in
  adapters claim: ``fs``, ``redis``, ``s3`` …).

The old paths (``plugins.l2_adapter``, ``plugins.storage_plugin``, …) still load: the
distribution ships them as a namespace package (``compat/plugins/``) whose modules are
aliases of these, so it never shadows another project's ``plugins`` package.

kvstore's own settings come from ``kvstore.*`` keys in the same ``extra_config`` (or
``adapter_params``), ``KVSTORE_*`` variables or a config file (see `kvstore.store_config`).
No storage logic lives in this package: it only translates between LMCache and kvstore.
"""

from pathlib import Path as _Path

if __name__ == "plugins":
    # Imported under its old name from a checkout (the repository root on sys.path finds
    # this folder first): serve submodules from the aliases, so `plugins.l2_adapter` is
    # `kvstore_lmcache.l2_adapter` itself and not a second copy of it.
    __path__ = [str(_Path(__file__).resolve().parent.parent / "compat" / "plugins")]
