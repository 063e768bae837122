"""Real servers and faults on loopback for tests and benchmarks.

Owns: starting and stopping a private `redis-server` (`redis_server.RedisServer`), a
SeaweedFS S3 endpoint (`seaweed.SeaweedS3`), and a TCP fault proxy (`fault_proxy`) that
injects errors, resets, stalls and WAN-like bandwidth.  Must not touch: kvstore's
stores or backends; it only runs the parts a store talks to.  Used by `tests/` and
`benchmarks/`; nothing in the serving path imports it.
"""
