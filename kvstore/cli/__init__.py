"""The ``kvstore`` command: `main` is the click group; each subcommand lives in its own
module (``bench``, ``codec``, ``demo``, ``doctor``, ``ops`` for migrate / ls / stat /
verify / gc, ``simulate``) and is imported only when it runs.  Must not touch: storage
logic; commands call into `kvstore.ops`, `kvstore.tiered`, `kvstore.throughput` and the
codecs, and print what they return.
"""
