"""A small synchronous CPU client for LMCache's multiprocess (MP) cache server.

Owns: driving a running MP server the way an inference engine's worker does, with
LMCache's own transport (``RequestClientFactory``) and engine-driven transfer context
(pickle with LMCache 0.5.6, its inline tensor transport from 0.5.7, or shared memory
when the server offers it): register a KV layout, store whole
chunks, look up a prefix, retrieve it, and wait for the server's asynchronous L2 writes.
Must not touch: the server process (that is `kvstore.lmcache_mp.server`), storage
logic, or paged-KV layouts (KV goes in and out as flat CPU tensors).

KV layout (LMCache's engine-driven chunk object layout, `gather_paged_kv_to_cpu`):
``[2, num_layers, num_tokens, num_kv_heads * head_dim]``, index 0 of the first dimension
is K and 1 is V.  `store` also takes ``[2, num_layers, num_tokens, num_kv_heads,
head_dim]``.  One stored object is the slice of one chunk: ``[2, L, chunk_size, H*D]``.

Semantics (LMCache 0.5.6 and 0.5.7): chunks are keyed by a rolling hash of the token prefix, so
only whole chunks from position 0 are stored and hit; a trailing partial chunk is
ignored.  A lookup also prefetches the hit chunks from L2 into the server's L1 and
read-locks them; `lookup` releases those locks, `retrieve` consumes them.  L2 writes
happen after `store` returns: `wait_stored` waits for them (it needs the server module
`kvstore.lmcache_mp.status_module`, which `MPServer` loads by default).

One client is one engine worker (``instance_id``); it is not thread-safe.  After the
server restarts, call `register` again (it also reconnects).
"""

from __future__ import annotations

import inspect
import json
import logging
import pickle
import secrets
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

log = logging.getLogger(__name__)


class MPClientError(RuntimeError):
    """A request failed or timed out (server down, or this client not registered)."""


def random_kv(
    num_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """Random KV in the client's layout ``[2, layers, tokens, heads*dim]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_layers, num_tokens, num_kv_heads * head_dim, generator=g).to(dtype)


class MPClient:
    """One CPU "engine worker" attached to an MP server at ``url``.

    ``chunk_size=None`` takes the server's; a given value must match it.  ``timeout``
    bounds each request round trip, ``prefetch_timeout`` the wait for a lookup's L2
    prefetch.  ``world_size``/``worker_id`` are the KV rank the objects are stored under
    (one worker of one by default); ``cache_salt`` isolates tenants.  ``use_shm=False``
    sends KV in the requests (pickle, or 0.5.7's inline tensors) instead of attaching to
    the server's shared memory: for servers started without it (one that offers it
    answers retrieves in its pool, which such a client does not read).
    """

    def __init__(
        self,
        url: str,
        model_name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        chunk_size: int | None = None,
        *,
        world_size: int = 1,
        worker_id: int = 0,
        instance_id: int | None = None,
        cache_salt: str = "",
        timeout: float = 30.0,
        prefetch_timeout: float = 60.0,
        use_shm: bool = True,
    ) -> None:
        if not 0 <= worker_id < world_size:
            raise ValueError(f"worker_id {worker_id} outside world_size {world_size}")
        self.url = url
        self.model_name = model_name
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._chunk_size = chunk_size
        self.world_size = world_size
        self.worker_id = worker_id
        self.instance_id = instance_id if instance_id is not None else secrets.randbits(31)
        self.cache_salt = cache_salt
        self.timeout = timeout
        self.prefetch_timeout = prefetch_timeout
        self.use_shm = use_shm
        self._req: Any = None  # lmcache RequestClient
        self._ctx: Any = None  # lmcache EngineDrivenContext
        self._retrieve_counts = False  # its prepare_retrieve takes the chunk count (0.5.7)
        self.transfer: str = ""  # "pickle", "inline" or "shm" once registered

    # ------------------------------------------------------------------ properties

    @property
    def hidden_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def chunk_size(self) -> int:
        if self._chunk_size is None:
            raise MPClientError("chunk size unknown before register()")
        return self._chunk_size

    @property
    def registered(self) -> bool:
        return self._ctx is not None

    def aligned(self, num_tokens: int) -> int:
        """``num_tokens`` rounded down to whole chunks."""
        return num_tokens // self.chunk_size * self.chunk_size

    # ------------------------------------------------------------------ connection

    def register(self) -> None:
        """(Re)connect and register this worker's KV layout with the server.

        Always opens a fresh transport, so it is also how to reattach after the server
        restarted (the new process knows no layouts)."""
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload
        from lmcache.v1.multiprocess.transfer_context import (
            EngineDrivenContextMetadata,
            create_engine_driven_context,
        )
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self._disconnect()
        self._req = RequestClientFactory.create(self.url)
        server_chunk = int(self._result(self._req.get_chunk_size(), "get_chunk_size"))
        if self._chunk_size is None:
            self._chunk_size = server_chunk
        elif self._chunk_size != server_chunk:
            raise MPClientError(f"client chunk_size {self._chunk_size} != server chunk_size {server_chunk}")
        payload = RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=self.world_size,
            block_size=self.chunk_size,  # one "block" per chunk: KV arrives already gathered
            num_layers=self.num_layers,
            hidden_dim_size=self.hidden_dim,
            dtype_str=str(self.dtype).removeprefix("torch."),
            use_mla=False,
            num_physical_slots=self.chunk_size,
        )
        resp = self._result(
            self._req.register_kv_cache_engine_driven_context(payload),
            "register_kv_cache_engine_driven_context (is the server started with "
            "--supported-transfer-mode engine_driven or auto?)",
        )
        shm_name = getattr(resp, "shm_name", "") if self.use_shm else ""
        pool_size = getattr(resp, "pool_size", 0) if self.use_shm else 0
        shape = torch.Size([2, self.num_layers, self.chunk_size, self.hidden_dim])
        meta = EngineDrivenContextMetadata(
            layout_desc=MemoryLayoutDesc(shapes=[shape], dtypes=[self.dtype]),
            block_size=self.chunk_size,
            use_mla=False,
        )
        self._ctx = create_engine_driven_context(
            meta, self._req, self.timeout, shm_name=shm_name, pool_size=pool_size
        )
        kind = type(self._ctx).__name__
        self._retrieve_counts = "expected_count" in inspect.signature(self._ctx.prepare_retrieve).parameters
        self.transfer = "pickle" if kind.endswith("Pickle") else "inline" if kind.endswith("Inline") else "shm"

    def ping(self) -> bool:
        """Whether the server answers (as an anonymous prober: it does not touch this
        worker's liveness, so it never makes the server start reaping it)."""
        try:
            return bool(self._transport().ping(None).result(timeout=self.timeout))
        except TimeoutError:
            return False

    def close(self) -> None:
        """Unregister (best effort, the server may be gone) and close the transport."""
        if self._req is not None and self._ctx is not None:
            try:
                self._req.unregister_kv_cache_engine_driven_context(self.instance_id).result(
                    timeout=min(self.timeout, 5.0)
                )
            except Exception:
                log.debug("unregister failed", exc_info=True)
        self._disconnect()

    def _disconnect(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        if self._req is not None:
            self._req.close()
            self._req = None

    # ------------------------------------------------------------------ cache operations

    def store(self, token_ids: Sequence[int], kv: torch.Tensor, *, request_id: str | None = None) -> int:
        """Store the whole chunks of ``token_ids`` (from position 0); returns the tokens
        they cover (0 if the server refused the store, e.g. L1 full).

        ``kv`` holds at least that many tokens: ``[2, L, T, H*D]`` or ``[2, L, T, H, D]``.
        Chunks already cached are skipped by the server and still counted.  The L1
        write is done when this returns; L2 writes follow asynchronously."""
        ctx = self._context()
        tokens = [int(t) for t in token_ids]
        end = self.aligned(len(tokens))
        kv = self._check_kv(kv, end)
        if end == 0:
            return 0
        key = self._key(tokens, end, request_id or f"store-{uuid.uuid4().hex}", lookup=False)
        c = self.chunk_size
        try:
            if self.transfer != "shm":  # every chunk goes in the request
                chunks = [kv[:, :, i : i + c].contiguous() for i in range(0, end, c)]
                ok = self._commit_store_in_request(key, chunks)
            else:  # shm: fill the slots the server reserved (none: all cached)
                prepared = ctx.prepare_store(key, self.instance_id)
                if prepared is None:  # the server offered no slots: send the bytes
                    chunks = [kv[:, :, i : i + c].contiguous() for i in range(0, end, c)]
                    ok = ctx.commit_store(key, self.instance_id, chunks)
                else:
                    buffers, indices = prepared
                    for buf, idx in zip(buffers, indices):
                        buf.copy_(kv[:, :, idx * c : (idx + 1) * c])
                    ok = True if not indices else ctx.commit_store(key, self.instance_id, [])
        except TimeoutError as exc:
            raise self._timeout_error("store", exc) from exc
        finally:
            self._end_session(key.request_id)
        if not ok:
            log.warning("MP server refused (part of) a store of %d tokens", end)
            return 0
        return end

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest stored chunk prefix of ``token_ids`` (L1 or L2).

        The server prefetches hits from L2 into L1 as part of a lookup; this releases
        the read locks it took and ends the session."""
        tokens = [int(t) for t in token_ids]
        request_id = f"lookup-{uuid.uuid4().hex}"
        try:
            hit = self._lookup(tokens, request_id)
            if hit:
                self._result(
                    self._transport().free_lookup_locks(self._key(tokens, hit, request_id, lookup=True), 1),
                    "free_lookup_locks",
                )
        finally:
            self._end_session(request_id)
        return hit

    def retrieve(self, token_ids: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Lookup, wait for the prefetch, retrieve: ``(tokens_hit, kv)`` with ``kv`` a new
        CPU tensor ``[2, L, tokens_hit, H*D]`` (``tokens_hit`` may be 0)."""
        ctx = self._context()
        tokens = [int(t) for t in token_ids]
        request_id = f"retrieve-{uuid.uuid4().hex}"
        empty = torch.empty(2, self.num_layers, 0, self.hidden_dim, dtype=self.dtype)
        try:
            hit = self._lookup(tokens, request_id)
            if hit == 0:
                return 0, empty
            key = self._key(tokens, hit, request_id, lookup=False)
            count = hit // self.chunk_size
            try:
                if self.transfer != "shm":
                    chunks = self._prepare_retrieve_in_request(key, count)
                elif self._retrieve_counts:  # LMCache 0.5.7: says how many chunks it expects
                    chunks = ctx.prepare_retrieve(key, self.instance_id, count)
                else:
                    chunks = ctx.prepare_retrieve(key, self.instance_id)
            except ValueError as exc:  # 0.5.7 checks the answer against what was asked
                if self.transfer == "shm":  # the server holds the slots' read locks
                    ctx.commit_retrieve(key, self.instance_id)
                raise MPClientError(f"the retrieve of {hit} tokens came back malformed: {exc}") from exc
            if chunks is None:
                self._transport().free_lookup_locks(self._key(tokens, hit, request_id, lookup=True), 1)
                raise MPClientError(f"lookup hit {hit} tokens but the retrieve returned nothing")
            try:
                kv = torch.cat([ch.reshape(2, self.num_layers, -1, self.hidden_dim) for ch in chunks], dim=2)
            finally:
                if self.transfer == "shm":
                    ctx.commit_retrieve(key, self.instance_id)  # releases the read locks
            if kv.shape[2] != hit:
                raise MPClientError(f"retrieved {kv.shape[2]} tokens, lookup promised {hit}")
            return hit, kv
        except TimeoutError as exc:
            raise self._timeout_error("retrieve", exc) from exc
        finally:
            self._end_session(request_id)

    def wait_stored(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        timeout: float = 30.0,
        poll: float = 0.05,
    ) -> bool:
        """Wait until the server's L2 writes have landed; False on timeout.

        With ``token_ids``: until every L2 adapter holds each whole chunk of them (asked
        through the adapters' own lookup, so it is exact).  Without: until the store
        queues are empty on two polls in a row (covers every store made before the
        call).  True at once when the server has no L2 adapter."""
        deadline = time.monotonic() + timeout
        if token_ids is not None:
            tokens = [int(t) for t in token_ids]
            end = self.aligned(len(tokens))
            request = {
                "model_name": self.model_name,
                "world_size": self.world_size,
                "worker_id": self.worker_id,
                "token_ids": tokens[:end],
                "end": end,
                "cache_salt": self.cache_salt,
                "timeout": min(self.timeout, 10.0),
            }
            while True:
                answer = self._module_call("kvstore.l2_contains", request)
                if all(all(a["present"]) for a in answer["adapters"]):
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(poll)
        idle_seen = 0
        while True:
            status = self._module_call("kvstore.l2_status", {})
            if status["num_l2_adapters"] == 0:
                return True
            idle_seen = idle_seen + 1 if status["idle"] else 0
            if idle_seen >= 2:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll)

    def clear_l1(self, force: bool = False) -> None:
        """Drop the server's L1 (LMCache's ``clear`` request; L2 is untouched), so the
        next lookup is served from L2 as after a restart.  Objects still locked (an L2
        store or a retrieve in flight) stay unless ``force``: `wait_stored` first."""
        self._result(self._transport().clear(force), "clear")

    def l2_status(self) -> dict[str, Any]:
        """The server's store queues, L1 occupancy and L2 adapter status (status module)."""
        return self._module_call("kvstore.l2_status", {})

    # ------------------------------------------------------------------ internals

    def _transport(self) -> Any:
        if self._req is None:
            raise MPClientError("not connected: call register() first")
        return self._req

    def _context(self) -> Any:
        if self._ctx is None:
            raise MPClientError("not registered: call register() first")
        return self._ctx

    def _result(self, future: Any, what: str, timeout: float | None = None) -> Any:
        try:
            return future.result(timeout=self.timeout if timeout is None else timeout)
        except TimeoutError as exc:
            raise self._timeout_error(what, exc) from exc

    def _timeout_error(self, what: str, exc: BaseException) -> MPClientError:
        return MPClientError(
            f"{what}: no answer from {self.url} within {self.timeout}s ({exc}); the server is "
            "down, or restarted and this client must register() again"
        )

    def _key(self, tokens: list[int], end: int, request_id: str, *, lookup: bool) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        # from_token_ids: LMCache 0.5.7 sends tokens packed (token_bytes), 0.5.6 as a tuple
        return IPCCacheServerKey.from_token_ids(
            model_name=self.model_name,
            world_size=self.world_size,
            worker_id=None if lookup else self.worker_id,
            token_ids=tokens,
            start=0,
            end=end,
            request_id=request_id,
            cache_salt=self.cache_salt,
            num_kv_readers=1,
        )

    def _lookup(self, tokens: list[int], request_id: str) -> int:
        """Submit a lookup, wait for its prefetch; hit tokens (locks still held)."""
        end = self.aligned(len(tokens))
        if end == 0:
            return 0
        req = self._transport()
        self._result(req.lookup(self._key(tokens, end, request_id, lookup=True), 1), "lookup")
        chunks = self._result(
            req.wait_prefetch_status(request_id, self.prefetch_timeout),
            "wait_prefetch_status",
            timeout=self.prefetch_timeout + self.timeout,
        )
        if chunks is None:
            raise MPClientError(f"L2 prefetch did not finish within {self.prefetch_timeout}s")
        return min(int(chunks) * self.chunk_size, end)

    # LMCache's in-request contexts (0.5.6's EngineDrivenContextPickle, 0.5.7's
    # EngineDrivenContextInline) send the same requests but turn a timeout into a silent
    # miss; here a timeout is an error.  The payload is pickled (0.5.6) or LMCache's
    # tensor envelope (0.5.7, `tensor_wire`), as the context the server offered says.

    def _commit_store_in_request(self, key: Any, chunks: list[torch.Tensor]) -> bool:
        req = self._transport()
        self._result(req.prepare_store(key, self.instance_id), "prepare_store")
        if self.transfer == "pickle":
            payload = pickle.dumps(chunks)
        else:
            from lmcache.v1.multiprocess.transfer_context.tensor_wire import encode_tensors

            payload = encode_tensors(chunks)
        return bool(self._result(req.commit_store(key, self.instance_id, payload), "commit_store"))

    def _prepare_retrieve_in_request(self, key: Any, count: int) -> list[torch.Tensor] | None:
        resp = self._result(self._transport().prepare_retrieve(key, self.instance_id), "prepare_retrieve")
        if not resp.success or not resp.data:
            return None
        if self.transfer == "pickle":
            chunks: list[torch.Tensor] = pickle.loads(resp.data)  # from the server we registered with
            return chunks
        from lmcache.v1.multiprocess.transfer_context.tensor_wire import decode_tensors

        shape = torch.Size([2, self.num_layers, self.chunk_size, self.hidden_dim])
        return decode_tensors(resp.data, expected_shape=shape, expected_dtype=self.dtype, expected_count=count)

    def _end_session(self, request_id: str) -> None:
        if self._req is None:
            return
        try:
            self._req.end_session(request_id).result(timeout=self.timeout)
        except TimeoutError:
            log.warning("end_session(%s) got no answer", request_id)

    def _check_kv(self, kv: torch.Tensor, end: int) -> torch.Tensor:
        if kv.dim() == 5:
            kv = kv.flatten(3)
        want = (2, self.num_layers, self.hidden_dim)
        if kv.dim() != 4 or (kv.shape[0], kv.shape[1], kv.shape[3]) != want:
            raise ValueError(
                f"kv shape {tuple(kv.shape)}: expected [2, {self.num_layers}, tokens, {self.hidden_dim}]"
                f" or [2, {self.num_layers}, tokens, {self.num_kv_heads}, {self.head_dim}]"
            )
        if kv.shape[2] < end:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, {end} needed")
        if kv.dtype != self.dtype:
            raise ValueError(f"kv dtype {kv.dtype}, client registered {self.dtype}")
        if kv.device.type != "cpu":
            kv = kv.cpu()
        return kv

    def _module_call(self, method: str, request: dict[str, Any]) -> Any:
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        future = self._transport().server_module_call(
            ServerModuleCallRequest(method=method, payload=json.dumps(request).encode())
        )
        try:
            resp = future.result(timeout=self.timeout)
        except TimeoutError as exc:
            raise MPClientError(
                f"{method}: no answer from {self.url} within {self.timeout}s; is the server down, "
                "or started without --server-module kvstore.lmcache_mp.status_module?"
            ) from exc
        if not resp.success:
            raise MPClientError(f"{method} failed on the server: {resp.error}")
        return json.loads(resp.payload)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> MPClient:
        if not self.registered:
            self.register()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
