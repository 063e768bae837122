"""LMCache GPU connectors over vLLM's paged KV cache (whole-chunk and layerwise).

Owns: the adapters that implement LMCache 0.5.6's ``GPUConnectorInterface`` on top of
:class:`~kvstore.gpu.paged.PagedKVCache` (gather/scatter), :mod:`kvstore.gpu.transfer`
(copy stream, host copies) and :mod:`kvstore.gpu.staging` (pooled buffers):

* :class:`PagedKVConnector` — whole chunks, ``KV_2LTD`` ``[2, L, T, H*D]``
  (MLA: ``KV_MLA_FMT`` ``[1, L, T, D]``); used by ``LMCacheEngine.store`` / ``retrieve``.
* :class:`LayerwisePagedKVConnector` — one layer at a time, ``KV_T2D`` ``[T, 2, H*D]``
  (MLA: ``[T, D]``); used by ``store_layer`` / ``retrieve_layer`` with
  ``use_layerwise=True``.

Both run unchanged on CPU tensors (the copies are then synchronous) and on CUDA (copies
on a dedicated stream, ordered against the caller's stream by events).

What LMCache's engine passes in ``**kwargs`` (and what is read here):

``kvcaches``            list of per-layer paged tensors (required unless given to the
                        constructor; a different list rebinds the connector).
``slot_mapping``        1-D int tensor (or list) over the *whole* token sequence:
                        token i lives in slot ``slot_mapping[i]``; chunk ``[start, end)``
                        uses ``slot_mapping[start:end]``. ``store(hashes=..., offsets=...)``
                        turns a list into a tensor before it reaches the connector.
``vllm_cached_tokens``  loads only: tokens before this position are already in vLLM's
                        cache and are not overwritten.
``sync``                layerwise only (default True): on store, drain the copy stream
                        before each layer's memory objects are handed back; on load,
                        make the caller's stream wait for each loaded layer.
Other keys (``offset``, ``req_id``, ``request_configs``, ``transfer_spec``) are ignored.

Must not touch: index arithmetic (kvstore.gpu.layout), storage, policy.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from kvstore.gpu.direct import DirectCopier, LayerCopies, TokenSpans
from kvstore.gpu.driver import DriverCalls, driver_calls
from kvstore.gpu.layout import KVLayout
from kvstore.gpu.paged import PagedKVCache
from kvstore.gpu.pipeline import BufferTurn, LayerPipeline, PipelinePlan
from kvstore.gpu.staging import DeviceScratch, PinnedPool
from kvstore.gpu.transfer import CopyStream, HostBatch
from kvstore.lmcache_paths import INPROCESS

if INPROCESS == "lmcache.v1":  # LMCache 0.5.6 and earlier
    from lmcache.v1.gpu_connector.gpu_connectors import (
        GPUConnectorInterface,
        VLLMPagedMemLayerwiseGPUConnector,
    )
else:
    from lmcache.inprocess.v1.gpu_connector.gpu_connectors import (
        GPUConnectorInterface,
        VLLMPagedMemLayerwiseGPUConnector,
    )

__all__ = ["LayerwisePagedKVConnector", "PagedKVConnector", "make_connector"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Piece:
    """Where one chunk's bytes lie in its memory object, found on the first layer and the
    same on every layer (LMCache allocates each layer's object of a chunk alike):
    ``offset`` and ``nbytes`` from the object's start, and the object's shape and dtype."""

    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype | None


@dataclass(frozen=True)
class _PrimedRows:
    """A load's row indices made at its generator's first step, and (CUDA) the event
    after them on the stream that made them."""

    rows: torch.Tensor
    made: torch.cuda.Event | None


def _kept_slots(
    slot_mapping: torch.Tensor, starts: Sequence[int], ends: Sequence[int], skips: Sequence[int]
) -> torch.Tensor:
    """The slots of the tokens a request moves (chunk ``i``: ``starts[i] + skips[i]`` to
    ``ends[i]``), in order: a view of a device slot mapping when they are one run (no
    skips, chunks back to back, as LMCache sends them), else a copy (``cat``): a host
    slot mapping is one vLLM refills, and its copy to the device may be asynchronous."""
    if not starts:
        return slot_mapping[:0]
    if (
        slot_mapping.is_cuda
        and not any(skips)
        and all(e == s for e, s in zip(ends[:-1], starts[1:], strict=True))
    ):
        return slot_mapping[starts[0] : ends[-1]]
    return torch.cat([slot_mapping[s + skip : e] for s, e, skip in zip(starts, ends, skips, strict=True)])


class _PagedCore:
    """State shared by both connectors: bound caches, streams, scratch and pool."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor] | None = None,
        *,
        layout: KVLayout | str | None = None,
        num_layers: int | None = None,
        hidden_dim_size: int | None = None,
        use_mla: bool | None = None,
        device: torch.device | str | None = None,
        pool: PinnedPool | None = None,
        stage_all: bool = False,
        row_copy: bool | None = None,
    ) -> None:
        # Comes first in both connectors' MRO, so LMCache's layerwise parent __init__
        # (which needs CUDA) is deliberately never called.
        self.layout_hint = layout
        self.paged: PagedKVCache | None = None
        self.kvcaches: list[torch.Tensor] | None = None
        self.num_layers = num_layers
        self.hidden_dim_size = hidden_dim_size
        self.use_mla = bool(use_mla) if use_mla is not None else None
        if kv_caches is not None:
            self._bind_caches(kv_caches)
        if self.num_layers is None or self.hidden_dim_size is None or self.use_mla is None:
            raise ValueError(
                "pass kv_caches, or num_layers, hidden_dim_size and use_mla (e.g. via from_metadata), "
                "so the connector knows the chunk shape before the first transfer"
            )
        if device is None:
            device = self.paged.device if self.paged is not None else "cpu"
        self.device = torch.device(device)
        self.pool = pool if pool is not None else PinnedPool()
        self.stage_all = stage_all
        self.row_copy = row_copy
        self._copier: DirectCopier | None = None
        self.store_copies = CopyStream(self.device)
        self.load_copies = CopyStream(self.device)
        if self.store_copies.stream is not None:
            # LMCache reuses a connector's ``load_stream`` for MLA broadcasts.
            self.store_stream = self.store_copies.stream
            self.load_stream = self.load_copies.stream
        self._store_scratch = DeviceScratch(self.device)
        self._load_scratch = DeviceScratch(self.device)

    @classmethod
    def from_metadata(cls, metadata: Any, device: torch.device | str | None = None, **kwargs: Any):
        """Build from ``LMCacheMetadata`` (``kv_shape = (L, 2|1, chunk, H, D)``)."""
        num_layers, _, _, heads, head_size = metadata.kv_shape
        return cls(
            num_layers=num_layers,
            hidden_dim_size=heads * head_size,
            use_mla=bool(metadata.use_mla),
            device=device,
            **kwargs,
        )

    def _chunk_dims(self) -> tuple[int, int]:
        """(num_layers, hidden_dim_size), known once ``__init__`` has returned."""
        if self.num_layers is None or self.hidden_dim_size is None:
            raise RuntimeError("the connector's chunk shape is not known yet")
        return self.num_layers, self.hidden_dim_size

    # -- binding --------------------------------------------------------------------

    def _bind_caches(self, kv_caches: Sequence[torch.Tensor]) -> PagedKVCache:
        paged = PagedKVCache(kv_caches, self.layout_hint)
        lay = paged.layout
        mla = lay.kind is KVLayout.MLA
        for name, want, got in (
            ("num_layers", self.num_layers, lay.num_layers),
            ("hidden_dim_size", self.hidden_dim_size, lay.width),
            ("use_mla", self.use_mla, mla),
        ):
            if want is not None and want != got:
                raise ValueError(f"kv caches give {name}={got} but the connector was built with {want}")
        self.num_layers, self.hidden_dim_size, self.use_mla = lay.num_layers, lay.width, mla
        self.paged = paged
        self.kvcaches = paged.kv_caches
        return paged

    def _bind(self, kwargs: dict[str, Any]) -> PagedKVCache:
        caches = kwargs.get("kvcaches")
        if caches is not None and (self.paged is None or not self.paged.same_tensors(caches)):
            return self._bind_caches(caches)
        if self.paged is None:
            raise ValueError("no KV caches bound: pass kvcaches=[...] to the constructor or in kwargs")
        return self.paged

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if kwargs.get("kvcaches") is not None:
            self._bind(kwargs)

    @staticmethod
    def _slot_mapping(kwargs: dict[str, Any]) -> torch.Tensor:
        if kwargs.get("slot_mapping") is None:
            raise ValueError("'slot_mapping' must be passed in kwargs (one slot per token of the sequence)")
        slots = kwargs["slot_mapping"]
        if not isinstance(slots, torch.Tensor):
            slots = torch.as_tensor(slots, dtype=torch.int64)
        return slots

    def _direct(self, t: torch.Tensor, paged: PagedKVCache) -> bool:
        """True when ``t`` can be read/written by the gather/scatter kernels directly."""
        return t.device == paged.device and not self.stage_all

    def _copier_for(
        self, paged: PagedKVCache, tensors: Sequence[torch.Tensor], *, layerwise: bool = False
    ) -> DirectCopier | None:
        """The one-launch row copy when it applies to ``tensors`` (see kvstore.gpu.direct).

        By default only whole-chunk transfers take it: the kernel moves data with the
        GPU's cores, so a layerwise copy running beside the model's compute slows that
        compute, where the copy engines' DMA does not (on an H200, 32 layers' stores hid
        91% behind a matmul per layer through DMA, 17% as a kernel; docs/benchmarks/gpu.md).
        """
        if self.row_copy is False or self.stage_all:
            return None
        if self.row_copy is None and (layerwise or not DirectCopier.runnable(paged.device)):
            return None
        if self._copier is None or self._copier.paged is not paged:
            self._copier = DirectCopier(paged)
        return self._copier if self._copier.accepts(tensors) else None

    def _batch(self, stream: CopyStream) -> HostBatch:
        return HostBatch(stream, self.pool, stage_all=self.stage_all)

    @staticmethod
    def _tensor(obj: MemoryObj) -> torch.Tensor:
        t = obj.tensor
        if t is None:
            raise ValueError("memory object has no tensor (it was invalidated or is a byte buffer)")
        return t

    @staticmethod
    def _check_fmt(obj: MemoryObj, expected: MemoryFormat) -> None:
        fmt = obj.metadata.fmt
        if fmt != expected:
            raise ValueError(f"memory object is in {fmt}, this connector reads {expected}")


class PagedKVConnector(_PagedCore, GPUConnectorInterface):
    """Whole-chunk connector: one ``KV_2LTD`` (MLA: ``KV_MLA_FMT``) tensor per chunk.

    Construct for CPU tests with the caches themselves::

        conn = PagedKVConnector(kv_caches)            # layout discovered from the shapes

    or, as LMCache does, from metadata and bind the caches on the first call through
    ``kvcaches=`` (see the module docstring for every kwarg).

    ``layout``: hint for ambiguous shapes (``"flash_attn"``, ``"flash_infer"``, ``"mla"``).
    ``pool``: host staging pool to share between connectors (default: a private one).
    ``stage_all``: route every copy through device scratch and staging buffers even when
    caches and chunks share a device (exercises the GPU path's bookkeeping on CPU).
    ``row_copy``: move every row of a transfer in one launch (kvstore.gpu.direct) when the
    memory objects are in device or pinned host memory. ``None`` (default): whole chunks on
    CUDA when Triton is installed; ``True``: layerwise too, and on CPU through a host loop
    (tests); ``False``: never.
    """

    @property
    def _fmt(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def get_shape(self, num_tokens: int) -> torch.Size:
        layers, width = self._chunk_dims()
        return torch.Size([1 if self.use_mla else 2, layers, num_tokens, width])

    # -- store: paged cache -> memory objects ------------------------------------------

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        """Gather chunk ``[starts[i], ends[i])`` into ``memory_objs[i]``; they are filled
        when this returns (one host wait for the whole batch)."""
        paged = self._bind(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        for obj in memory_objs:
            if isinstance(obj, (list, tuple)):
                raise TypeError("PagedKVConnector takes one memory object per chunk; use the layerwise one")
        dsts = [self._tensor(obj) for obj in memory_objs]
        copier = self._copier_for(paged, dsts)
        if copier is not None:
            with self.store_copies.scope():
                copier.chunks(slot_mapping, TokenSpans.of(starts, ends), dsts, to_cache=False)
            for obj in memory_objs:
                obj.metadata.fmt = self._fmt
            self.store_copies.synchronize()
            return
        batch = self._batch(self.store_copies)
        with self.store_copies.scope():
            for obj, dst, start, end in zip(memory_objs, dsts, starts, ends, strict=True):
                slots = slot_mapping[start:end]
                if self._direct(dst, paged):
                    paged.gather(slots, out=dst)
                else:
                    scratch = self._store_scratch.get(dst.shape, dst.dtype)
                    paged.gather(slots, out=scratch)
                    batch.to_host(scratch, dst)
                obj.metadata.fmt = self._fmt
        batch.complete()

    # -- retrieve: memory objects -> paged cache ---------------------------------------

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        """Scatter each memory object into the paged cache at its chunk's slots; the
        copies are complete (and the objects free to reuse) when this returns."""
        paged = self._bind(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        cached = int(kwargs.get("vllm_cached_tokens") or 0)
        moving = [
            (obj, start, end, min(end - start, max(0, cached - start)))
            for obj, start, end in zip(memory_objs, starts, ends, strict=True)
            if cached < end
        ]
        for obj, *_ in moving:
            self._check_fmt(obj, self._fmt)
        srcs = [self._tensor(obj) for obj, *_ in moving]
        copier = self._copier_for(paged, srcs)
        if copier is not None:
            spans = TokenSpans.of([m[1] for m in moving], [m[2] for m in moving], [m[3] for m in moving])
            with self.load_copies.scope():
                copier.chunks(slot_mapping, spans, srcs, to_cache=True)
            self.load_copies.current_waits()
            self.load_copies.synchronize()  # the engine releases the memory objects right after this returns
            return
        batch = self._batch(self.load_copies)
        with self.load_copies.scope():
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                skip = min(end - start, max(0, cached - start))
                if skip == end - start:
                    continue
                self._check_fmt(obj, self._fmt)
                src = self._tensor(obj)
                slots = slot_mapping[start + skip : end]
                if self._direct(src, paged):
                    paged.scatter(slots, src[:, :, skip:])
                else:
                    scratch = self._load_scratch.get(src.shape, src.dtype)
                    batch.to_device(src, scratch)
                    paged.scatter(slots, scratch[:, :, skip:])
        self.load_copies.current_waits()
        batch.complete()  # the engine releases the memory objects right after this returns


class LayerwisePagedKVConnector(_PagedCore, VLLMPagedMemLayerwiseGPUConnector):
    """Layerwise connector: per layer, one ``KV_T2D`` ``[T, 2, H*D]`` (MLA ``[T, D]``)
    memory object per chunk, moved on the copy stream while the model computes.

    It subclasses LMCache's ``VLLMPagedMemLayerwiseGPUConnector`` only because
    ``LMCacheEngine.store_layer`` / ``retrieve_layer`` accept nothing else
    (``assert_layerwise_gpu_connector`` is an isinstance check); none of the parent's
    code or state is used, so it builds on CPU.

    Generator protocol (as the engine drives it, L = number of layers):

    * ``batched_from_gpu(memory_objs[L][N], starts, ends, **kw)``: L + 1 ``next()``.
      Call 1 queues layer 0's copy; call i+1 (1 <= i < L) makes layer i-1's memory
      objects complete, then queues layer i; call L+1 completes layer L-1. The engine
      puts layer i's objects right after call i+2 returns.
    * ``batched_to_gpu(starts, ends, **kw)``: ``next()`` once, then ``send(objs)`` with
      layer i's N memory objects for i = 0..L-1 (each send queues that layer's copy,
      after making the caller's stream wait for the previous layer when ``sync``), then
      ``next()`` once more: the caller's stream waits for the last layer, the host waits
      for every copy that still reads host memory, staging buffers go back to the pool.
      L + 2 steps in all.

    ``pipeline``: how layers move when the caches are on CUDA and the memory objects in
    pinned host memory (LMCache's pool): ``None`` (default) takes the two-stream
    pipeline of :mod:`kvstore.gpu.pipeline` there (a layer's gather or scatter kernel
    overlaps its neighbour's copies); ``True`` takes it for any objects (on CPU it runs
    inline: tests); ``False`` keeps the single-stream gather/scatter + copy path.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor] | None = None, *, pipeline: bool | None = None, **kwargs: Any
    ) -> None:
        self._plans: dict[bool, PipelinePlan] = {}  # the last request's, per direction (store: True)
        super().__init__(kv_caches, **kwargs)  # (binds the caches given: `_bind_caches` clears the plans)
        self.pipeline = pipeline
        self._warned_no_driver = False
        # Each direction's pipeline: its second stream and its two scratch buffers (its
        # own, not the single-stream path's: the pipeline orders its buffers' users with
        # its own events, which that path does not record).
        self.store_kernels = CopyStream(self.device)
        self.load_kernels = CopyStream(self.device)
        self._store_pipe = (DeviceScratch(self.device), DeviceScratch(self.device))
        self._load_pipe = (DeviceScratch(self.device), DeviceScratch(self.device))
        self._turns = {True: BufferTurn(), False: BufferTurn()}  # per direction (store: True)
        self._checked = threading.local()  # .drivers: {torch's current device: DriverCalls}, per thread

    def _bind_caches(self, kv_caches: Sequence[torch.Tensor]) -> PagedKVCache:
        self._plans.clear()  # they hold the caches bound before
        return super()._bind_caches(kv_caches)

    @property
    def _fmt(self) -> MemoryFormat:
        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_T2D

    def get_shape(self, num_tokens: int) -> torch.Size:
        _, width = self._chunk_dims()
        if self.use_mla:
            return torch.Size([num_tokens, width])
        return torch.Size([num_tokens, 2, width])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the layerwise connector moves one layer at a time: drive batched_to_gpu as a generator"
        )

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the layerwise connector moves one layer at a time: drive batched_from_gpu as a generator"
        )

    @staticmethod
    def _spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
        spans, at = [], 0
        for n in lengths:
            spans.append((at, at + n))
            at += n
        return spans

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> Generator[None, None, None]:
        paged = self._bind(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        sync = bool(kwargs.get("sync", True))
        if len(memory_objs) != paged.num_layers:
            raise ValueError(f"expected memory objects for {paged.num_layers} layers, got {len(memory_objs)}")
        if self.row_copy and not self.stage_all:  # (the row copy is layerwise only when asked for)
            tensors = [[self._tensor(o) for o in objs] for objs in memory_objs]
            copier = self._copier_for(paged, [t for layer in tensors for t in layer], layerwise=True)
            if copier is not None:
                yield from self._direct_from_gpu(
                    copier, memory_objs, tensors, starts, ends, slot_mapping, sync
                )
                return
        if memory_objs and self._takes_pipeline(memory_objs[0]):
            yield from self._pipelined_from_gpu(paged, memory_objs, starts, ends, slot_mapping, sync)
            return
        k = paged.layout.kv_size
        spans = self._spans([e - s for s, e in zip(starts, ends, strict=True)])
        total = spans[-1][1] if spans else 0
        rows = paged.layer_rows(_kept_slots(slot_mapping, starts, ends, [0] * len(starts)))
        self.store_copies.keep(rows)  # made on the caller's stream, read on the copy stream
        batch = self._batch(self.store_copies)
        previous: torch.cuda.Event | None = None  # the layer queued by the last step
        for layer in range(paged.num_layers):
            objs = memory_objs[layer]
            if batch.has_host_copies_pending:  # pageable objects: finish them on the host first
                batch.complete(previous)
                previous = None
            with self.store_copies.scope():  # after the attention that wrote this layer
                dsts = [self._tensor(o) for o in objs]
                if all(self._direct(d, paged) for d in dsts):
                    for dst, (a, b) in zip(dsts, spans, strict=True):
                        paged.gather_layer(layer, rows[k * a : k * b], out=dst)
                elif total:
                    scratch = self._store_scratch.get(paged.layout.layer_chunk_shape(total), paged.dtype)
                    paged.gather_layer(layer, rows, out=scratch)
                    for dst, (a, b) in zip(dsts, spans, strict=True):
                        if self._direct(dst, paged):
                            dst.copy_(scratch[a:b])
                        else:
                            batch.to_host(scratch[a:b], dst)
                for obj in objs:
                    obj.metadata.fmt = self._fmt
                event = batch.mark()
            # Layer - 1 completes while this layer is already queued behind it.
            if sync and previous is not None:
                previous.synchronize()
            batch.release()
            previous = event
            yield
        if batch.has_host_copies_pending:
            batch.complete(previous)
        elif sync and previous is not None:
            previous.synchronize()
        batch.release()
        yield

    def _primed_rows(
        self,
        paged: PagedKVCache,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        ends: Sequence[int],
        skips: Sequence[int],
    ) -> _PrimedRows:
        rows = paged.layer_rows(_kept_slots(slot_mapping, starts, ends, skips))
        made = None
        if self.load_kernels.stream is not None:
            # After the rows on the stream that made them (the caches' device's current
            # one), which may not be the caller's stream when the first objects come.
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(paged.device))
        return _PrimedRows(rows, made)

    def _may_take_pipeline(self) -> bool:
        """Whether a load may take the two-stream pipeline, before its objects are seen
        (not when the row copy is asked for: a load then takes it where it can)."""
        if self.stage_all or self.row_copy or self.pipeline is False:
            return False
        if not self.store_copies.is_async:
            return self.pipeline is True
        return self._driver() is not None

    def _takes_pipeline(self, objs: Sequence[MemoryObj]) -> bool:
        """Whether a request whose first layer's objects are ``objs`` takes the
        two-stream pipeline (decided once per request, from its first layer)."""
        if self.pipeline is not None:
            wanted = self.pipeline and not self.stage_all
        else:
            wanted = self.store_copies.is_async and not self.stage_all and self._pinned_host(objs)
        if wanted and self.store_copies.is_async and self._driver() is None:
            if not self._warned_no_driver:
                self._warned_no_driver = True
                log.warning(
                    "kvstore gpu: layerwise transfers take the single-stream path: the pipeline "
                    "needs cuda.bindings (pip install cuda-python) and the CUDA context of %s "
                    "current on the calling thread",
                    self.device,
                )
            return False
        return wanted

    def _driver(self) -> DriverCalls | None:
        """The driver calls when this thread's CUDA context is this device's, checked once
        per thread and device torch has current (the check is two driver calls; a
        thread's context changes only with its device)."""
        current = torch.cuda.current_device()
        checked: dict[int, DriverCalls] | None = getattr(self._checked, "drivers", None)
        if checked is None:
            checked = self._checked.drivers = {}
        calls = checked.get(current)
        if calls is None:
            index = self.device.index if self.device.index is not None else current
            calls = driver_calls(index)
            if calls is not None:
                checked[current] = calls
        return calls

    def _pipeline(
        self,
        paged: PagedKVCache,
        slot_mapping: torch.Tensor,
        starts: Sequence[int],
        ends: Sequence[int],
        skips: Sequence[int],
        *,
        store: bool,
        rows: torch.Tensor | None = None,
    ) -> LayerPipeline:
        """One request's pipeline over the tokens it moves (``skips`` of each chunk stay).
        ``rows``: its row indices when made already (a load's, at the generator's first
        step); else a store's are made now (its first gather needs them), a load's when
        its first scatter does, after its first copies are queued."""

        def make_rows() -> torch.Tensor:
            return paged.layer_rows(_kept_slots(slot_mapping, starts, ends, skips))

        pipe = LayerPipeline(
            paged,
            rows if rows is not None else make_rows() if store else make_rows,
            self._spans([e - s - skip for s, e, skip in zip(starts, ends, skips, strict=True)]),
            copies=self.store_copies if store else self.load_copies,
            kernels=self.store_kernels if store else self.load_kernels,
            scratch=self._store_pipe if store else self._load_pipe,
            driver=self._driver() if self.store_copies.is_async else None,
            reuse=self._plans.get(store),
            turn=self._turns[store],
        )
        self._plans[store] = pipe.plan
        return pipe

    @staticmethod
    def _pinned_host(objs: Sequence[MemoryObj]) -> bool:
        """Whether every object's memory is page-locked host memory (LMCache's pool),
        asked of each object's raw buffer: a view of it costs a request's first layer
        ~6 us an object, several times that inside a pass."""
        for obj in objs:
            raw = obj.raw_tensor  # (None when the object was invalidated)
            if raw is None or raw.device.type != "cpu" or not raw.is_pinned():
                return False
        return True

    @staticmethod
    def _pieces(
        objs: Sequence[MemoryObj], skips: Sequence[int], pipe: LayerPipeline, dtype: torch.dtype
    ) -> list[_Piece]:
        """Each chunk's piece, from the first layer's objects: the rows after the
        ``skips`` first (tokens already in vLLM's cache), which must be the bytes the
        pipeline expects, in the caches' dtype. Worked out from each object's shape and
        dtype: the tensor LMCache makes of an object is a contiguous view of its buffer
        from the start, so row ``skip`` lies ``skip`` rows' bytes in. ``_addresses``
        checks each object's size, validity and format before any byte moves."""
        pieces = []
        for obj, skip, n in zip(objs, skips, pipe.chunk_bytes, strict=True):
            meta = obj.metadata
            shape, have_dtype = meta.shape, meta.dtype
            if have_dtype is None or not shape:
                raise ValueError("memory object has no tensor shape (it is a byte buffer)")
            if len(getattr(meta, "shapes", None) or ()) > 1 or getattr(obj, "_used_size_override", None) is not None:
                # (several groups: shape and dtype are the first's; narrowed: its tensor
                # is the used bytes, not the shape)
                raise ValueError(
                    "memory object holds several tensor groups or a narrowed byte buffer, not one "
                    "KV chunk: allocate objects with the connector's get_shape() and the caches' dtype"
                )
            row = math.prod(shape[1:]) * have_dtype.itemsize
            have = max(0, shape[0] - skip) * row
            if have != n or have_dtype != dtype:
                raise ValueError(
                    f"memory object holds {tuple(shape)} {have_dtype} ({have} bytes after {skip} "
                    f"cached tokens) where this request's chunk needs {n} bytes of {dtype}: "
                    "allocate objects with the connector's get_shape() and the caches' dtype"
                )
            pieces.append(_Piece(skip * row if n else 0, n, shape, have_dtype))
        return pieces

    @staticmethod
    def _addresses(
        layer: int, objs: Sequence[MemoryObj] | None, pieces: Sequence[_Piece], fmt: MemoryFormat | None
    ) -> list[int]:
        """The address of each chunk's piece in ``objs`` (layer ``layer``), after checking
        each object is valid (not invalidated) and shaped as the first layer's (and in
        ``fmt``, if given), so no copy reads or writes past an object."""
        if objs is None or len(objs) != len(pieces):
            raise ValueError(
                f"layer {layer}: send() {len(pieces)} memory objects (one per chunk), got "
                f"{None if objs is None else len(objs)}"
            )
        out = []
        for obj, p in zip(objs, pieces, strict=True):
            meta = obj.metadata
            if (
                meta.shape != p.shape
                or meta.dtype != p.dtype
                or (fmt is not None and meta.fmt != fmt)
                or not obj.is_valid()
                or obj.get_size() < p.offset + p.nbytes
            ):
                raise ValueError(
                    f"layer {layer}: memory object {tuple(meta.shape)} {meta.dtype} in {meta.fmt} "
                    f"(valid: {obj.is_valid()}, {obj.get_size()} bytes) differs from the first "
                    f"layer's {tuple(p.shape)} {p.dtype}"
                    + (f" in {fmt}" if fmt is not None else "")
                    + ": every layer's objects of a chunk must be alike"
                )
            out.append(obj.data_ptr + p.offset)
        return out

    def _pipelined_from_gpu(
        self,
        paged: PagedKVCache,
        memory_objs: Sequence[Sequence[MemoryObj]],
        starts: Sequence[int],
        ends: Sequence[int],
        slot_mapping: torch.Tensor,
        sync: bool,
    ) -> Generator[None, None, None]:
        """Layerwise store through :class:`LayerPipeline`: layer i is queued before layer
        i - 1 is waited for, and its gather overlaps layer i - 1's copies."""
        no_skips = [0] * len(starts)
        pipe = self._pipeline(paged, slot_mapping, starts, ends, no_skips, store=True)
        pieces = self._pieces(memory_objs[0], no_skips, pipe, paged.dtype)

        def queue(layer: int, objs: Sequence[MemoryObj]) -> torch.cuda.Event | None:
            return pipe.store_layer(layer, self._addresses(layer, objs, pieces, None))

        yield from self._stored_layers(memory_objs, queue, sync)

    def _stored_layers(
        self,
        memory_objs: Sequence[Sequence[MemoryObj]],
        queue: Callable[[int, Sequence[MemoryObj]], torch.cuda.Event | None],
        sync: bool,
    ) -> Generator[None, None, None]:
        """The store protocol over ``queue(layer, objs)`` (queues a layer, returns the
        event of its completion): step i queues layer i, then, with ``sync``, waits for
        layer i - 1, so the copies never idle while the host waits."""
        fmt = self._fmt
        previous: torch.cuda.Event | None = None
        for layer, objs in enumerate(memory_objs):
            event = queue(layer, objs)
            for obj in objs:
                obj.metadata.fmt = fmt
            if sync and previous is not None:
                previous.synchronize()  # layer - 1 is complete when this step returns
            previous = event
            yield
        if sync and previous is not None:
            previous.synchronize()
        yield

    def _direct_from_gpu(self, copier, memory_objs, tensors, starts, ends, slot_mapping, sync):
        """Layerwise store as one row copy per layer."""
        with self.store_copies.scope():
            copies = copier.layers(slot_mapping, TokenSpans.of(starts, ends))
            copies.prepare(tensors)

        def queue(layer: int, objs: Sequence[MemoryObj]) -> torch.cuda.Event | None:
            with self.store_copies.scope():  # after the attention that wrote this layer
                copies.copy(layer, tensors[layer], to_cache=False)
                return self.store_copies.record()

        yield from self._stored_layers(memory_objs, queue, sync)

    def _scatter_layer(self, paged, batch, layer, rows, srcs, spans, total, k) -> None:
        """Gather/scatter path of one loaded layer (objects the row copy cannot address)."""
        if all(self._direct(src, paged) for src in srcs):
            for src, (a, b) in zip(srcs, spans, strict=True):
                if b > a:
                    paged.scatter_layer(layer, rows[k * a : k * b], src)
        elif total:
            scratch = self._load_scratch.get(paged.layout.layer_chunk_shape(total), paged.dtype)
            for src, (a, b) in zip(srcs, spans, strict=True):
                if self._direct(src, paged):
                    scratch[a:b].copy_(src)
                else:
                    batch.to_device(src, scratch[a:b])
            paged.scatter_layer(layer, rows, scratch)

    def _sent(self, layer: int, objs: Sequence[MemoryObj] | None, chunks: int) -> Sequence[MemoryObj]:
        """The memory objects sent for ``layer``, checked: one per chunk, each in this
        connector's format."""
        if objs is None or len(objs) != chunks:
            raise ValueError(
                f"layer {layer}: send() {chunks} memory objects (one per chunk), got "
                f"{None if objs is None else len(objs)}"
            )
        for obj in objs:
            self._check_fmt(obj, self._fmt)
        return objs

    def _hold_while_read(self, objs: Sequence[MemoryObj], held: list[MemoryObj]) -> None:
        """Take a reference to each of ``objs`` (appended to ``held``) while queued copies
        still read their host memory; the load's last step gives them back."""
        if self.load_copies.is_async:
            for obj in objs:
                obj.ref_count_up()
                held.append(obj)

    def _pipelined_to_gpu(
        self,
        paged: PagedKVCache,
        objs: Sequence[MemoryObj],
        starts: Sequence[int],
        ends: Sequence[int],
        skips: Sequence[int],
        slot_mapping: torch.Tensor,
        sync: bool,
        primed: _PrimedRows | None,
    ) -> Generator[None, Any, None]:
        """Layerwise load through :class:`LayerPipeline`, from the first layer's objects
        on: layer i's copies overlap layer i - 1's scatter. ``primed``: the request's row
        indices if made at the generator's first step."""
        rows = None
        if primed is not None:
            rows = primed.rows
            if primed.made is not None and self.load_kernels.stream is not None:
                self.load_kernels.stream.wait_event(primed.made)
        pipe = self._pipeline(paged, slot_mapping, starts, ends, skips, store=False, rows=rows)
        pieces = self._pieces(objs, skips, pipe, paged.dtype)
        fmt = self._fmt
        held: list[MemoryObj] = []  # objects whose host memory a queued copy still reads
        last = paged.num_layers - 1
        for layer in range(paged.num_layers):
            if layer:
                objs = yield
            # compute on layer - 1 sees its KV
            pipe.load_layer(layer, self._addresses(layer, objs, pieces, fmt), caller_waits=sync)
            self._hold_while_read(objs, held)
        yield
        if sync:
            pipe.caller_waits(last)
        # The engine drops its references right after the last send(); the copies read
        # those objects until the last layer's scatter is done.
        pipe.host_waits(last)
        for obj in held:
            obj.ref_count_down()
        yield

    def _caller_waits_for_loads(self) -> None:
        """The single-stream path's wait for everything loaded so far: its own copies and
        scatters (copy stream) and, in a batch LMCache steps in turn, the pipelined
        requests' scatters (kernel stream), which its one ``sync=True`` request covers."""
        self.load_copies.current_waits()
        self.load_kernels.current_waits()

    def batched_to_gpu(self, starts=None, ends=None, **kwargs: Any) -> Generator[None, Any, None]:
        paged = self._bind(kwargs)
        slot_mapping = self._slot_mapping(kwargs)
        sync = bool(kwargs.get("sync", True))
        cached = int(kwargs.get("vllm_cached_tokens") or 0)
        k = paged.layout.kv_size
        skips = [min(e - s, max(0, cached - s)) for s, e in zip(starts, ends, strict=True)]
        spans = self._spans([e - s - skip for s, e, skip in zip(starts, ends, skips, strict=True)])
        total = spans[-1][1] if spans else 0
        copies: LayerCopies | None = None  # row-copy path, made at the first layer that takes it
        rows: torch.Tensor | None = None  # gather/scatter path: token-major rows, made once
        batch = self._batch(self.load_copies)
        held: list[MemoryObj] = []  # objects whose host memory a queued copy still reads
        # LMCache's engine takes this first step before it fetches the first layer's
        # objects from storage: a request the pipeline may take makes its row indices
        # now (on the caller's stream), so they are off the path of its first copies.
        primed = self._primed_rows(paged, slot_mapping, starts, ends, skips) if self._may_take_pipeline() else None
        for layer in range(paged.num_layers):
            objs = self._sent(layer, (yield), len(spans))
            full = [self._tensor(obj) for obj in objs] if self.row_copy else None
            if (
                layer == 0
                and (full is None or self._copier_for(paged, full, layerwise=True) is None)
                and self._takes_pipeline(objs)
            ):
                yield from self._pipelined_to_gpu(paged, objs, starts, ends, skips, slot_mapping, sync, primed)
                return
            primed = None
            if full is None:
                full = [self._tensor(obj) for obj in objs]
            if sync:
                self._caller_waits_for_loads()  # compute on layer-1 sees its KV
            copier = self._copier_for(paged, full, layerwise=True)
            with self.load_copies.scope():
                if copier is not None:
                    if copies is None:
                        copies = copier.layers(slot_mapping, TokenSpans.of(starts, ends, skips))
                    copies.copy(layer, full, to_cache=True)
                else:
                    if rows is None:
                        rows = paged.layer_rows(_kept_slots(slot_mapping, starts, ends, skips))
                    srcs = [t[skip:] for t, skip in zip(full, skips, strict=True)]
                    self._scatter_layer(paged, batch, layer, rows, srcs, spans, total, k)
                batch.mark()
            self._hold_while_read(objs, held)
        yield
        if sync:
            self._caller_waits_for_loads()
        # The engine drops its references right after the last send(); copies that read
        # pinned memory objects must be finished before those objects can be reused.
        batch.complete()
        for obj in held:
            obj.ref_count_down()
        yield


def make_connector(
    kv_caches: Sequence[torch.Tensor] | None = None, *, layerwise: bool = False, **kwargs: Any
) -> PagedKVConnector | LayerwisePagedKVConnector:
    """The connector for LMCache's ``use_layerwise`` setting (kwargs as the classes take)."""
    cls = LayerwisePagedKVConnector if layerwise else PagedKVConnector
    return cls(kv_caches, **kwargs)
