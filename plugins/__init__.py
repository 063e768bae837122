"""LMCache plugins backed by kvstore.

Stable import paths for ``LMCACHE_EXTRA_CONFIG``:

* storage plugin:   ``storage_plugin.<name>.module_path = "plugins.storage_plugin"``,
  ``class_name = "KVStoreStoragePlugin"`` (with ``LMCACHE_STORAGE_PLUGINS=<name>``);
* remote connector: ``remote_storage_plugin.<name>.module_path = "plugins.remote_connector"``,
  ``class_name = "KVStoreRemoteConnector"`` (with ``LMCACHE_REMOTE_STORAGE_PLUGINS=<name>``;
  the name must not be one LMCache's built-in adapters claim: ``fs``, ``redis``, ``s3`` …);
* a CPU tensor connector for contiguous (HF transformers) KV: ``plugins.hf_connector``.

kvstore's own settings come from ``kvstore.*`` keys in the same ``extra_config``,
``KVSTORE_*`` variables or a config file (see `kvstore.store_config`).  No storage
logic lives in this package: it only translates between LMCache and kvstore.
"""
