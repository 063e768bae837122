"""Settings of the S3 backend, read from its URL.

Owns: ``s3://bucket/prefix?option=value`` → `S3Options` (validated, with defaults and
error messages that name the fix) and the botocore client configuration built from it.
Must not touch: the network.  Credentials are never read from the URL: they come from
the standard AWS chain (environment, ``AWS_PROFILE`` / ``profile=``, config files,
instance roles).

Options (all optional):

=============================  ===============  ===========================================
option                         default          meaning
=============================  ===============  ===========================================
endpoint_url                   (AWS)            S3-compatible server, e.g. http://minio:9000
region                         env / us-east-1  signing region
profile                        env              AWS profile for credentials
addressing_style               auto             path | virtual | auto (path for MinIO/Ceph)
concurrency                    16               requests in flight; also the pool size
multipart_threshold            16MiB            objects larger than this upload in parts
part_size                      8MiB             multipart part size, at least (S3's minimum: 5MiB)
range_threshold                16MiB            objects larger than this download in ranges
range_size                     8MiB             size of one ranged GET (past range_threshold)
stream                         true             presigned GETs and PUTs on worker threads:
                                                reads land in the caller's tensors straight
                                                from the socket, writes go from its buffers;
                                                false (or checksum=when_supported, or a
                                                proxy for the endpoint): all through
                                                aiobotocore
checksum                       when_required    botocore request_checksum_calculation and
                                                response_checksum_validation: when_required
                                                (frames carry their own CRC32C checksum) or
                                                when_supported (CRC on every request too)
retry_mode                     standard         botocore retry mode: standard | adaptive | legacy
max_attempts                   4                attempts per request, first one included
timeout                        30               deadline in seconds for one object operation
connect_timeout                3                seconds to open a connection
read_timeout                   10               seconds of socket silence before a retry
breaker_failures               5                consecutive failures that open the breaker
breaker_reset                  1.0              seconds before an open breaker lets a probe by
contains                       auto             head | list | auto (list for large batches)
contains_list_min              128              batch size from which auto uses a listing
max_object_size                1GiB             larger objects are neither written nor read
=============================  ===============  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from kvstore.backends.base import DEFAULT_MAX_OBJECT
from kvstore.options import option_bool, parse_size, url_options
from kvstore.redact import redact_url

_CHECKSUM = ("when_required", "when_supported")
_RETRY = ("standard", "adaptive", "legacy")
_ADDRESSING = ("auto", "path", "virtual")
_CONTAINS = ("auto", "head", "list")
MIN_PART = 5 << 20


@dataclass(frozen=True, slots=True)
class S3Options:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    concurrency: int = 16
    multipart_threshold: int = 16 << 20
    part_size: int = 8 << 20
    range_threshold: int = 16 << 20
    range_size: int = 8 << 20
    checksum: str = "when_required"
    retry_mode: str = "standard"
    max_attempts: int = 4
    timeout: float = 30.0
    connect_timeout: float = 3.0
    read_timeout: float = 10.0
    breaker_failures: int = 5
    breaker_reset: float = 1.0
    contains: str = "auto"
    contains_list_min: int = 128
    max_object_size: int = DEFAULT_MAX_OBJECT
    stream: bool = True

    @classmethod
    def from_url(cls, url: str) -> S3Options:
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3":
            raise ValueError(f"{redact_url(url)!r} is not an s3:// URL")
        bucket = parts.netloc
        if not bucket or "@" in bucket or ":" in bucket:
            raise ValueError(
                f"{redact_url(url)!r}: write s3://BUCKET/PREFIX?endpoint_url=...; credentials come from the "
                "AWS environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...), never from the URL"
            )
        prefix = unquote(parts.path).strip("/")
        opts = url_options(url, set(cls.__dataclass_fields__) - {"bucket", "prefix"})

        def choice(name: str, allowed: tuple[str, ...]) -> str:
            value = opts[name].strip().lower()
            if value not in allowed:
                raise ValueError(
                    f"{name}={opts[name]!r} in {redact_url(url)!r}; use one of {', '.join(allowed)}"
                )
            return value

        def positive(name: str, conv):
            try:
                value = conv(opts[name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}={opts[name]!r} in {redact_url(url)!r} is not a number") from exc
            if value is None or value <= 0:
                raise ValueError(f"{name} must be positive in {redact_url(url)!r}")
            return value

        kw: dict[str, Any] = {}
        for name in ("endpoint_url", "region", "profile"):
            if opts.get(name):
                kw[name] = opts[name]
        for name, allowed in (
            ("checksum", _CHECKSUM),
            ("retry_mode", _RETRY),
            ("addressing_style", _ADDRESSING),
            ("contains", _CONTAINS),
        ):
            if name in opts:
                kw[name] = choice(name, allowed)
        for name in ("concurrency", "max_attempts", "breaker_failures", "contains_list_min"):
            if name in opts:
                kw[name] = positive(name, int)
        for name in ("multipart_threshold", "part_size", "range_threshold", "range_size", "max_object_size"):
            if name in opts:
                kw[name] = positive(name, parse_size)
        for name in ("timeout", "connect_timeout", "read_timeout", "breaker_reset"):
            if name in opts:
                kw[name] = positive(name, float)
        if "stream" in opts:
            kw["stream"] = option_bool("stream", opts["stream"], True)
        options = cls(bucket=bucket, prefix=prefix, **kw)
        if options.part_size < MIN_PART:
            raise ValueError(f"part_size must be at least 5MiB (the S3 minimum), got {options.part_size}")
        return options

    def key(self, name: str) -> str:
        """The S3 key of object `name`."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def name(self, key: str) -> str:
        """The object name of S3 key `key` (inverse of `key`)."""
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def botocore_config(self):
        """The `AioConfig` for the one client of a backend."""
        from aiobotocore.config import AioConfig

        return AioConfig(
            region_name=self.region,
            max_pool_connections=self.concurrency,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
            s3={"addressing_style": self.addressing_style},
            request_checksum_calculation=self.checksum,
            response_checksum_validation=self.checksum,
        )
