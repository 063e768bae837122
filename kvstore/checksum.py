"""CRC32C of frame payloads, at several times the speed of the ``crc32c`` package.

Owns: `crc32c(data, value)` (the frame payload checksum, same values as the ``crc32c``
package) and `copy_crc32c(dst, src, value)` (copy a buffer and checksum it in one pass
over the bytes).  Must not touch: frames (`kvstore.frame` decides what is checksummed),
I/O.

Why: a verified read copies the payload once (page cache or memory -> caller's tensor)
and checksums it once.  The ``crc32c`` package runs the SSE4.2 ``crc32`` instruction,
8 bytes per cycle (~24 GiB/s here), so the checksum cost half as much CPU as the copy.
On CPUs with vector carry-less multiply (``vpclmulqdq``) this module folds four vector
accumulators per loop step instead: 512-bit ones with AVX-512 (Intel Ice Lake and later,
AMD Zen 4 and later), 256-bit ones with AVX2 (AMD Zen 3, Intel Alder Lake and later
client parts), and `copy_crc32c` does it on the bytes it is copying while they
are in registers.  The kernel is ~60 lines of LLVM IR compiled at first use through
llvmlite (already present: numba needs it) for the host CPU; calls go through ctypes,
which releases the GIL.  On other CPUs, or if compiling fails, both functions fall back
to the ``crc32c`` package (and a plain copy) with identical results.

The math: a 128-bit lane of the message that lies F bits before another lane is folded
into it by carry-less multiplying its two 64-bit halves by x^(F+32) mod P and
x^(F-32) mod P (bit-reflected, as CRC32C is); the last 128-bit lane is finished with
two ``crc32`` instructions.  `_fold_constants` derives the constants; the tests check
every length and alignment against the ``crc32c`` package.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Any

import crc32c as _crc32c_pkg

log = logging.getLogger("kvstore.checksum")

P_CRC32C = 0x11EDC6F41  # the Castagnoli polynomial, x^32 term included
ACCUMULATORS = 4  # vector accumulators folded in parallel: the kernel needs n >= 64 * this
MIN_FAST = 1024  # below this the package's call is cheaper than folding
NT_MIN = 8 << 20  # `copy_crc32c` streams past the caches from this size (aligned destination)
PREAD_BLOCK = 256 << 10  # `pread_crc32c` hashes each block while it is in L2
# `pwrite_crc32c` hashes each block, then writes it out of cache; blocks end at multiples
# of this in the file: 2 MiB writes let the page cache hold the file in 2 MiB folios, which
# the disk tier's mapped reads map cheaply (1 MiB blocks wrote ~8% faster here and made
# those reads ~17% slower)
PWRITE_BLOCK = 2 << 20
_MASK = 0xFFFFFFFF

Buffer = bytes | bytearray | memoryview


def _xpow_mod(n: int, poly: int = P_CRC32C) -> int:
    r = 1
    for _ in range(n):
        r <<= 1
        if r >> 32:
            r ^= poly
    return r


def _reflect64(v: int) -> int:
    return int(f"{v:064b}"[::-1], 2)


def _fold_constants(distance_bits: int) -> tuple[int, int]:
    """(constant for the low 64-bit half, for the high half) folding a lane forward."""
    lo = _reflect64(_xpow_mod(distance_bits + 32) << 32) << 1
    hi = _reflect64(_xpow_mod(distance_bits - 32) << 32) << 1
    return lo, hi


def _vec(distance_bits: int, lanes: int) -> str:
    lo, hi = _fold_constants(distance_bits)
    return "<" + ", ".join(f"i64 {lo}, i64 {hi}" for _ in range(lanes)) + ">"


def _ir(width: int = 64) -> str:
    """LLVM IR of ``kvs_crc32c(crc, p, n)`` and ``kvs_copy_crc32c(crc, dst, src, n)``:
    n >= 64 * ACCUMULATORS and a multiple of 64; `crc` and the result are finished CRC32C
    values.  `width`: bytes per accumulator, 64 (AVX-512 VPCLMULQDQ) or 32 (AVX2 with
    VPCLMULQDQ: the same folds on 256-bit vectors)."""
    if width not in (32, 64):
        raise ValueError(f"vector width {width} bytes: 32 or 64")
    v = f"<{width // 8} x i64>"
    lanes_per = width // 16  # 128-bit lanes per accumulator
    vclmul = "@llvm.x86.pclmulqdq.512" if width == 64 else "@llvm.x86.pclmulqdq.256"
    step = width * ACCUMULATORS
    k_step, k_one = _vec(8 * step, lanes_per), _vec(8 * width, lanes_per)
    lines: list[str] = []
    emit = lines.append
    counter = iter(range(1_000_000))

    def tmp() -> str:
        return f"%t{next(counter)}"

    def fold(acc: str, k: str, vt: str = v, clmul: str = vclmul) -> str:
        a, b, c = tmp(), tmp(), tmp()
        emit(f"  {a} = call {vt} {clmul}({vt} {acc}, {vt} {k}, i8 0)")
        emit(f"  {b} = call {vt} {clmul}({vt} {acc}, {vt} {k}, i8 17)")
        emit(f"  {c} = xor {vt} {a}, {b}")
        return c

    def xor(a: str, b: str, vt: str = v) -> str:
        r = tmp()
        emit(f"  {r} = xor {vt} {a}, {b}")
        return r

    def load(off: str, copy: str) -> str:
        """Load `width` bytes at `off`; with `copy` (the store's attributes) also store them."""
        src, val = tmp(), tmp()
        emit(f"  {src} = getelementptr i8, ptr %src, i64 {off}")
        emit(f"  {val} = load {v}, ptr {src}, align 1")
        if copy:
            dst = tmp()
            emit(f"  {dst} = getelementptr i8, ptr %dst, i64 {off}")
            emit(f"  store {v} {val}, ptr {dst}, {copy}")
        return val

    def function(name: str, copy: str) -> None:
        args = "i32 %crc, ptr %dst, ptr %src, i64 %n" if copy else "i32 %crc, ptr %src, i64 %n"
        emit(f"define internal i32 @{name}({args}) nounwind {{")
        emit("entry:")
        emit("  %raw = xor i32 %crc, -1")
        emit("  %raw64 = zext i32 %raw to i64")
        emit(f"  %init = insertelement {v} zeroinitializer, i64 %raw64, i32 0")
        first = [load(str(width * i), copy) for i in range(ACCUMULATORS)]
        a0 = xor(first[0], "%init")
        emit("  br label %loop")
        emit("loop:")
        emit(f"  %off = phi i64 [{step}, %entry], [%off.next, %body]")
        for i, start in enumerate([a0, *first[1:]]):
            emit(f"  %a{i} = phi {v} [{start}, %entry], [%a{i}.next, %body]")
        emit(f"  %end = add i64 %off, {step}")
        emit("  %more = icmp ule i64 %end, %n")
        emit("  br i1 %more, label %body, label %combine")
        emit("body:")
        for i in range(ACCUMULATORS):
            off = tmp()
            emit(f"  {off} = add i64 %off, {width * i}")
            nxt = xor(fold(f"%a{i}", k_step), load(off, copy))
            emit(f"  %a{i}.next = xor {v} {nxt}, zeroinitializer")
        emit(f"  %off.next = add i64 %off, {step}")
        emit("  br label %loop")
        emit("combine:")
        last = ACCUMULATORS - 1
        c = f"%a{last}"
        for i in range(last):
            c = xor(c, fold(f"%a{i}", _vec(8 * width * (last - i), lanes_per)))
        emit("  br label %tail")
        emit("tail:")
        emit("  %toff = phi i64 [%off, %combine], [%toff.next, %tailbody]")
        emit(f"  %acc = phi {v} [{c}, %combine], [%acc.next, %tailbody]")
        emit(f"  %tend = add i64 %toff, {width}")
        emit("  %tmore = icmp ule i64 %tend, %n")
        emit("  br i1 %tmore, label %tailbody, label %lanes")
        emit("tailbody:")
        nxt = xor(fold("%acc", k_one), load("%toff", copy))
        emit(f"  %acc.next = xor {v} {nxt}, zeroinitializer")
        emit(f"  %toff.next = add i64 %toff, {width}")
        emit("  br label %tail")
        emit("lanes:")
        lanes = []
        for i in range(lanes_per):
            ln = tmp()
            emit(f"  {ln} = shufflevector {v} %acc, {v} poison, <2 x i32> <i32 {2 * i}, i32 {2 * i + 1}>")
            lanes.append(ln)
        w, clmul = "<2 x i64>", "@llvm.x86.pclmulqdq"
        r = lanes[-1]  # each lane folded onto the last, over the bits between them
        for i, ln in enumerate(lanes[:-1]):
            r = xor(r, fold(ln, _vec(128 * (lanes_per - 1 - i), 1), w, clmul), w)
        emit(f"  %lo = extractelement {w} {r}, i32 0")
        emit(f"  %hi = extractelement {w} {r}, i32 1")
        emit("  %c1 = call i64 @llvm.x86.sse42.crc32.64.64(i64 0, i64 %lo)")
        emit("  %c2 = call i64 @llvm.x86.sse42.crc32.64.64(i64 %c1, i64 %hi)")
        emit("  %c32 = trunc i64 %c2 to i32")
        emit("  %out = xor i32 %c32, -1")
        emit("  ret i32 %out")
        emit("}")

    emit(f"declare {v} {vclmul}({v}, {v}, i8)")
    emit("declare <2 x i64> @llvm.x86.pclmulqdq(<2 x i64>, <2 x i64>, i8)")
    emit("declare i64 @llvm.x86.sse42.crc32.64.64(i64, i64)")
    function("bulk", copy="")
    function("bulk_copy", copy="align 1")
    # streaming stores: no read-for-ownership of the destination's lines (one third of
    # the memory traffic of a large copy); only for a 64-byte aligned destination
    function("bulk_copy_nt", copy=f"align {width}, !nontemporal !0")
    emit("!0 = !{i32 1}")
    return "\n".join(lines) + _ENTRY_POINTS


# The exported functions, around `bulk` / `bulk_copy` (n >= MIN_BULK, a multiple of 64):
# any length, the last n % 64 bytes (or a short buffer) through the crc32 instruction;
# `kvs_pread_crc32c` reads a file range block by block with pread(2) and hashes each
# block right after it lands (still in cache), without returning to Python.
_ENTRY_POINTS = """
declare i32 @llvm.x86.sse42.crc32.32.8(i32, i8)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.x86.sse.sfence()
declare i64 @pread(i32, ptr, i64, i64)
declare i64 @pwrite(i32, ptr, i64, i64)
declare ptr @mmap(ptr, i64, i32, i32, i32, i64)
declare i32 @munmap(ptr, i64)
declare i32 @mincore(ptr, i64, ptr)
declare i64 @syscall(i64, ...)
declare ptr @__errno_location()

define internal i32 @tail(i32 %crc, ptr %p, i64 %n) nounwind {
entry:
  %raw0 = xor i32 %crc, -1
  %r64 = zext i32 %raw0 to i64
  br label %words
words:
  %w.off = phi i64 [0, %entry], [%w.next, %word]
  %w.crc = phi i64 [%r64, %entry], [%w.crc2, %word]
  %w.end = add i64 %w.off, 8
  %w.more = icmp ule i64 %w.end, %n
  br i1 %w.more, label %word, label %bytes
word:
  %w.p = getelementptr i8, ptr %p, i64 %w.off
  %w.v = load i64, ptr %w.p, align 1
  %w.crc2 = call i64 @llvm.x86.sse42.crc32.64.64(i64 %w.crc, i64 %w.v)
  %w.next = add i64 %w.off, 8
  br label %words
bytes:
  %b.start = trunc i64 %w.crc to i32
  br label %bloop
bloop:
  %b.off = phi i64 [%w.off, %bytes], [%b.next, %byte]
  %b.crc = phi i32 [%b.start, %bytes], [%b.crc2, %byte]
  %b.more = icmp ult i64 %b.off, %n
  br i1 %b.more, label %byte, label %done
byte:
  %b.p = getelementptr i8, ptr %p, i64 %b.off
  %b.v = load i8, ptr %b.p, align 1
  %b.crc2 = call i32 @llvm.x86.sse42.crc32.32.8(i32 %b.crc, i8 %b.v)
  %b.next = add i64 %b.off, 1
  br label %bloop
done:
  %out = xor i32 %b.crc, -1
  ret i32 %out
}

define i32 @kvs_crc32c(i32 %crc, ptr %p, i64 %n) nounwind {
entry:
  %big = icmp uge i64 %n, MIN_BULK
  br i1 %big, label %fold, label %short
fold:
  %bulk.n = and i64 %n, -64
  %c1 = call i32 @bulk(i32 %crc, ptr %p, i64 %bulk.n)
  %rest.p = getelementptr i8, ptr %p, i64 %bulk.n
  %rest.n = sub i64 %n, %bulk.n
  %c2 = call i32 @tail(i32 %c1, ptr %rest.p, i64 %rest.n)
  ret i32 %c2
short:
  %c3 = call i32 @tail(i32 %crc, ptr %p, i64 %n)
  ret i32 %c3
}

define i32 @kvs_copy_crc32c(i32 %crc, ptr %dst, ptr %src, i64 %n) nounwind {
entry:
  %big = icmp uge i64 %n, MIN_BULK
  br i1 %big, label %fold, label %short
fold:
  %bulk.n = and i64 %n, -64
  %dst.i = ptrtoint ptr %dst to i64
  %dst.low = and i64 %dst.i, 63
  %aligned = icmp eq i64 %dst.low, 0
  %large = icmp uge i64 %n, NT_MIN
  %stream = and i1 %aligned, %large
  br i1 %stream, label %nt, label %cached
nt:
  %c.nt = call i32 @copy_streamed(i32 %crc, ptr %dst, ptr %src, i64 %n)
  call void @llvm.x86.sse.sfence()
  ret i32 %c.nt
cached:
  %c1 = call i32 @bulk_copy(i32 %crc, ptr %dst, ptr %src, i64 %bulk.n)
  %rest.d = getelementptr i8, ptr %dst, i64 %bulk.n
  %rest.s = getelementptr i8, ptr %src, i64 %bulk.n
  %rest.n = sub i64 %n, %bulk.n
  call void @llvm.memcpy.p0.p0.i64(ptr %rest.d, ptr %rest.s, i64 %rest.n, i1 false)
  %c2 = call i32 @tail(i32 %c1, ptr %rest.d, i64 %rest.n)
  ret i32 %c2
short:
  call void @llvm.memcpy.p0.p0.i64(ptr %dst, ptr %src, i64 %n, i1 false)
  %c3 = call i32 @tail(i32 %crc, ptr %dst, i64 %n)
  ret i32 %c3
}

; copy and hash n >= MIN_BULK bytes into a 64-byte aligned %dst with streaming stores
; (the bulk, then the last n % 64 bytes); the caller issues the sfence
define internal i32 @copy_streamed(i32 %crc, ptr %dst, ptr %src, i64 %n) nounwind {
entry:
  %bulk.n = and i64 %n, -64
  %c1 = call i32 @bulk_copy_nt(i32 %crc, ptr %dst, ptr %src, i64 %bulk.n)
  %rest.d = getelementptr i8, ptr %dst, i64 %bulk.n
  %rest.s = getelementptr i8, ptr %src, i64 %bulk.n
  %rest.n = sub i64 %n, %bulk.n
  call void @llvm.memcpy.p0.p0.i64(ptr %rest.d, ptr %rest.s, i64 %rest.n, i1 false)
  %c2 = call i32 @tail(i32 %c1, ptr %rest.d, i64 %rest.n)
  ret i32 %c2
}

; as kvs_copy_crc32c, streaming whenever the destination is 64-byte aligned (any size);
; the caller issues the sfence
define internal i32 @copy_crc32c_nt(i32 %crc, ptr %dst, ptr %src, i64 %n) nounwind {
entry:
  %big = icmp uge i64 %n, MIN_BULK
  %dst.i = ptrtoint ptr %dst to i64
  %dst.low = and i64 %dst.i, 63
  %aligned = icmp eq i64 %dst.low, 0
  %stream = and i1 %aligned, %big
  br i1 %stream, label %nt, label %other
nt:
  %c.nt = call i32 @copy_streamed(i32 %crc, ptr %dst, ptr %src, i64 %n)
  ret i32 %c.nt
other:
  %c3 = call i32 @kvs_copy_crc32c(i32 %crc, ptr %dst, ptr %src, i64 %n)
  ret i32 %c3
}

; whether mincore's vector says every one of %pages pages is resident
define internal i1 @all_resident(ptr %vec, i64 %pages) nounwind {
entry:
  br label %scan
scan:
  %i = phi i64 [0, %entry], [%i.next, %next]
  %more = icmp ult i64 %i, %pages
  br i1 %more, label %body, label %yes
body:
  %vp = getelementptr i8, ptr %vec, i64 %i
  %vb = load i8, ptr %vp, align 1
  %res = and i8 %vb, 1
  %absent = icmp eq i8 %res, 0
  br i1 %absent, label %no, label %next
next:
  %i.next = add i64 %i, 1
  br label %scan
yes:
  ret i1 true
no:
  ret i1 false
}

; n bytes of file %fd from %offset copied into %dst through a read-only shared mapping
; (MAP_POPULATE: every page mapped in one call), hashed on the way, with streaming
; stores: the page cache is read once and %dst written once.  Only for a warm range:
; cachestat(2) must count every page of the range in the page cache (it reads no data
; and leaves the file's readahead state alone).  Where the kernel lacks it (ENOSYS,
; before Linux 6.5) or %no_cachestat is set, an unpopulated mapping is asked with
; mincore instead (which for a file this process may not write reports only pages it
; has mapped, i.e. none: such files are then always read with pread).  Any other
; cachestat failure (EPERM for a file this process may not write) is "cold".  A cold
; range returns -61 (ENODATA) with nothing mapped: pread's large requests read it
; faster, and its I/O errors are errors, not faults.  After populating, mincore must
; find every page (a read that failed while populating leaves one out), else -61 too.
; Returns n, or -errno if mapping fails.  %vec holds one byte per page mapped.
define i64 @kvs_mapped_crc32c(i32 %fd, ptr %dst, i64 %n, i64 %offset, ptr %vec, ptr %crcp, i32 %no_cachestat) nounwind {
entry:
  %crc0 = load i32, ptr %crcp, align 4
  %base = and i64 %offset, -4096
  %delta = sub i64 %offset, %base
  %len = add i64 %n, %delta
  %pages.a = add i64 %len, 4095
  %pages = lshr i64 %pages.a, 12
  %range = alloca [2 x i64], align 8
  %stat = alloca [5 x i64], align 8
  store i64 %offset, ptr %range, align 8
  %range.len = getelementptr [2 x i64], ptr %range, i32 0, i32 1
  store i64 %n, ptr %range.len, align 8
  %skip = icmp ne i32 %no_cachestat, 0
  br i1 %skip, label %probe, label %ask
ask:
  %fd64 = sext i32 %fd to i64
  %cs = call i64 (i64, ...) @syscall(i64 451, i64 %fd64, ptr %range, ptr %stat, i64 0)
  %cs.ok = icmp eq i64 %cs, 0
  br i1 %cs.ok, label %judge, label %why
why:
  %errp0 = call ptr @__errno_location()
  %err0 = load i32, ptr %errp0, align 4
  %nosys = icmp eq i32 %err0, 38
  br i1 %nosys, label %probe, label %cold.ret
judge:
  %cached = load i64, ptr %stat, align 8
  %warm = icmp uge i64 %cached, %pages
  br i1 %warm, label %map, label %cold.ret
probe:
  %pm = call ptr @mmap(ptr null, i64 %len, i32 1, i32 1, i32 %fd, i64 %base)
  %pmi = ptrtoint ptr %pm to i64
  %pmfail = icmp eq i64 %pmi, -1
  br i1 %pmfail, label %errno, label %probe.check
probe.check:
  %prc = call i32 @mincore(ptr %pm, i64 %len, ptr %vec)
  %pu = call i32 @munmap(ptr %pm, i64 %len)
  %pok = icmp eq i32 %prc, 0
  br i1 %pok, label %probe.scan, label %cold.ret
probe.scan:
  %pall = call i1 @all_resident(ptr %vec, i64 %pages)
  br i1 %pall, label %map, label %cold.ret
cold.ret:
  ret i64 -61
map:
  %m = call ptr @mmap(ptr null, i64 %len, i32 1, i32 32769, i32 %fd, i64 %base)
  %mi = ptrtoint ptr %m to i64
  %mfail = icmp eq i64 %mi, -1
  br i1 %mfail, label %errno, label %check
check:
  %rc = call i32 @mincore(ptr %m, i64 %len, ptr %vec)
  %cfail = icmp ne i32 %rc, 0
  br i1 %cfail, label %unmap.errno, label %scan
scan:
  %all = call i1 @all_resident(ptr %vec, i64 %pages)
  br i1 %all, label %copy, label %unmap.absent
copy:
  %src = getelementptr i8, ptr %m, i64 %delta
  %crc1 = call i32 @copy_crc32c_nt(i32 %crc0, ptr %dst, ptr %src, i64 %n)
  call void @llvm.x86.sse.sfence()
  %u = call i32 @munmap(ptr %m, i64 %len)
  store i32 %crc1, ptr %crcp, align 4
  ret i64 %n
unmap.absent:
  %u2 = call i32 @munmap(ptr %m, i64 %len)
  ret i64 -61
unmap.errno:
  %errp1 = call ptr @__errno_location()
  %err1 = load i32, ptr %errp1, align 4
  %u3 = call i32 @munmap(ptr %m, i64 %len)
  %neg1 = sub i32 0, %err1
  %neg1.64 = sext i32 %neg1 to i64
  ret i64 %neg1.64
errno:
  %errp2 = call ptr @__errno_location()
  %err2 = load i32, ptr %errp2, align 4
  %neg2 = sub i32 0, %err2
  %neg2.64 = sext i32 %neg2 to i64
  ret i64 %neg2.64
}

; bytes read (short only at end of file), or -errno; *%crcp continues over them
define i64 @kvs_pread_crc32c(i32 %fd, ptr %dst, i64 %n, i64 %offset, i64 %block, ptr %crcp) nounwind {
entry:
  %crc0 = load i32, ptr %crcp, align 4
  br label %loop
loop:
  %got = phi i64 [0, %entry], [%got.next, %hashed], [%got, %retry]
  %crc = phi i32 [%crc0, %entry], [%crc.next, %hashed], [%crc, %retry]
  %left = sub i64 %n, %got
  %more = icmp sgt i64 %left, 0
  br i1 %more, label %read, label %finish
read:
  %small = icmp slt i64 %left, %block
  %want = select i1 %small, i64 %left, i64 %block
  %p = getelementptr i8, ptr %dst, i64 %got
  %pos = add i64 %offset, %got
  %r = call i64 @pread(i32 %fd, ptr %p, i64 %want, i64 %pos)
  %ok = icmp sgt i64 %r, 0
  br i1 %ok, label %hashed, label %stop
hashed:
  %crc.next = call i32 @kvs_crc32c(i32 %crc, ptr %p, i64 %r)
  %got.next = add i64 %got, %r
  br label %loop
stop:
  %eof = icmp eq i64 %r, 0
  br i1 %eof, label %finish, label %error
error:
  %errp = call ptr @__errno_location()
  %errno = load i32, ptr %errp, align 4
  %eintr = icmp eq i32 %errno, 4
  br i1 %eintr, label %retry, label %fail
retry:
  br label %loop
fail:
  store i32 %crc, ptr %crcp, align 4
  %neg = sub i32 0, %errno
  %neg64 = sext i32 %neg to i64
  ret i64 %neg64
finish:
  store i32 %crc, ptr %crcp, align 4
  ret i64 %got
}
; bytes written (all of them), or -errno; *%crcp continues over them.  Each block is
; hashed and then written, so the write copies it out of cache, not memory.
define i64 @kvs_pwrite_crc32c(i32 %fd, ptr %src, i64 %n, i64 %offset, i64 %block, ptr %crcp) nounwind {
entry:
  %crc0 = load i32, ptr %crcp, align 4
  br label %loop
loop:
  %done = phi i64 [0, %entry], [%done.next, %wrote], [%done, %retry]
  %crc = phi i32 [%crc0, %entry], [%crc.w, %wrote], [%crc.w, %retry]
  %hashed = phi i64 [0, %entry], [%hashed.w, %wrote], [%hashed.w, %retry]
  %left = sub i64 %n, %done
  %more = icmp sgt i64 %left, 0
  br i1 %more, label %hash, label %finish
hash:
  %small = icmp slt i64 %left, %block
  %want = select i1 %small, i64 %left, i64 %block
  %p = getelementptr i8, ptr %src, i64 %done
  %end = add i64 %done, %want
  %fresh = icmp slt i64 %hashed, %end
  br i1 %fresh, label %fold, label %write
fold:
  %hp = getelementptr i8, ptr %src, i64 %hashed
  %hn = sub i64 %end, %hashed
  %crc.f = call i32 @kvs_crc32c(i32 %crc, ptr %hp, i64 %hn)
  br label %write
write:
  %crc.w = phi i32 [%crc, %hash], [%crc.f, %fold]
  %hashed.w = phi i64 [%hashed, %hash], [%end, %fold]
  %pos = add i64 %offset, %done
  %r = call i64 @pwrite(i32 %fd, ptr %p, i64 %want, i64 %pos)
  %ok = icmp sgt i64 %r, 0
  br i1 %ok, label %wrote, label %error
wrote:
  %done.next = add i64 %done, %r
  br label %loop
error:
  %errp = call ptr @__errno_location()
  %errno = load i32, ptr %errp, align 4
  %zero = icmp eq i64 %r, 0
  %errno.z = select i1 %zero, i32 5, i32 %errno
  %eintr = icmp eq i32 %errno.z, 4
  br i1 %eintr, label %retry, label %fail
retry:
  br label %loop
fail:
  %neg = sub i32 0, %errno.z
  %neg64 = sext i32 %neg to i64
  ret i64 %neg64
finish:
  store i32 %crc, ptr %crcp, align 4
  ret i64 %done
}
""".replace("MIN_BULK", str(64 * ACCUMULATORS)).replace("NT_MIN", str(NT_MIN))


_REQUIRED = ("vpclmulqdq", "pclmul", "sse4.2")
_WIDE = ("avx512f",)  # 512-bit folds; else AVX2's 256-bit ones
_NARROW = ("avx2",)
ENV_FALLBACK = "KVSTORE_CRC32C"  # "package": never compile the kernels; "avx2": 256-bit ones
_lock = threading.Lock()
_state: dict[str, Any] = {}


class _Kernels:
    """The compiled entry points (see `_ENTRY_POINTS`), called through ctypes."""

    def __init__(self, engine: Any, width: int) -> None:
        self.engine = engine  # the machine code lives as long as the engine
        self.width = width  # bytes per fold vector: 64 (AVX-512) or 32 (AVX2)
        u32, u64, i64, i32, ptr = (
            ctypes.c_uint32,
            ctypes.c_uint64,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_void_p,
        )
        addr = engine.get_function_address
        self.crc = ctypes.CFUNCTYPE(u32, u32, ptr, u64)(addr("kvs_crc32c"))
        self.copy = ctypes.CFUNCTYPE(u32, u32, ptr, ptr, u64)(addr("kvs_copy_crc32c"))
        self.pread = ctypes.CFUNCTYPE(i64, i32, ptr, i64, i64, i64, ctypes.POINTER(u32))(
            addr("kvs_pread_crc32c")
        )
        self.pwrite = ctypes.CFUNCTYPE(i64, i32, ptr, i64, i64, i64, ctypes.POINTER(u32))(
            addr("kvs_pwrite_crc32c")
        )
        self.mapped = ctypes.CFUNCTYPE(i64, i32, ptr, i64, i64, ptr, ctypes.POINTER(u32), i32)(
            addr("kvs_mapped_crc32c")
        )


def _compile() -> _Kernels | None:
    """The kernels for this CPU, or None (no vector carry-less multiply, or
    ``KVSTORE_CRC32C=package`` set to force the fallback).  512-bit folds with AVX-512,
    256-bit ones with AVX2 (``KVSTORE_CRC32C=avx2`` forces those where AVX-512 serves)."""
    choice = os.environ.get(ENV_FALLBACK, "").lower()
    if choice == "package":
        return None
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
        if not all(features.get(f, False) for f in _REQUIRED):
            return None
        if all(features.get(f, False) for f in _WIDE) and choice != "avx2":
            width = 64
        elif all(features.get(f, False) for f in _NARROW):
            width = 32
        else:
            return None
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        target = llvm.Target.from_default_triple()
        machine = target.create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=3
        )
        module = llvm.parse_assembly(_ir(width))
        module.verify()
        engine = llvm.create_mcjit_compiler(module, machine)
        engine.finalize_object()
        kernels = _Kernels(engine, width)
        probe = bytes(range(256)) * 9 + b"tail"
        if kernels.crc(7, _address(probe), len(probe)) != _crc32c_pkg.crc32c(probe, 7):
            log.warning("kvstore: the vpclmulqdq CRC32C kernel disagrees with the crc32c package; not used")
            return None
        return kernels
    except Exception as exc:  # any failure: the package serves, identically
        log.info("kvstore: fast CRC32C unavailable (%s); using the crc32c package", exc)
        return None


def _kernels() -> _Kernels | None:
    if "kernels" not in _state:
        with _lock:
            if "kernels" not in _state:
                _state["kernels"] = _compile()
    kernels: _Kernels | None = _state["kernels"]
    return kernels


def _address(buf: Buffer) -> int:
    """Address of a C-contiguous buffer's first byte (the caller keeps `buf` alive)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.nbytes:
        return 0
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
    import numpy as np

    addr: int = np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]
    return addr


def _bytes_view(buf: Buffer) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


_page_vectors = threading.local()  # mincore's one byte per page, per thread


def mapped_crc32c(fd: int, dst: Buffer, offset: int, value: int = 0) -> tuple[int, int] | None:
    """Copy ``len(dst)`` bytes of file `fd` from `offset` into `dst` through a read-only
    mapping of the file, hashed in the same pass with streaming stores (no
    read-for-ownership of `dst`): (bytes copied, CRC32C continued from `value`).

    None when this path does not serve: no kernels on this CPU, the file system refuses
    the mapping, or the range is not known to be all in the page cache.  That is asked
    of ``cachestat(2)`` before mapping (it reads nothing and leaves readahead alone); a
    kernel without it (before 6.5) is asked with ``mincore`` on an unpopulated mapping;
    a file this process may not write is never mapped (both calls then cannot tell).  A
    cold read is faster through pread's large requests, and its I/O errors are errors,
    not faults: read with `pread_crc32c` then, which reports them as `OSError`.  The
    caller guarantees ``offset + len(dst)`` is within the file and that nobody truncates
    the file while it is read (a page past a shrunk end of file faults with SIGBUS); the
    disk tier never changes a published file in place.  Measured: about 1.3x the speed
    of an unverified ``readinto`` of the same page-cache-warm bytes
    (docs/benchmarks/lmcache.md).  ``_state["no_cachestat"] = 1`` makes it take the
    older kernels' path (for tests).
    """
    kernels = _kernels()
    d = _bytes_view(dst)
    if kernels is None or d.nbytes < MIN_FAST:
        return None
    pages = (offset % 4096 + d.nbytes + 4095) // 4096
    vec = getattr(_page_vectors, "vec", None)
    if vec is None or len(vec) < pages:
        vec = _page_vectors.vec = bytearray(max(pages, 4096))
    crc = ctypes.c_uint32(value)
    got = int(
        kernels.mapped(
            fd, _address(d), d.nbytes, offset, _address(vec), ctypes.byref(crc), int(_state.get("no_cachestat", 0))
        )
    )
    if got < 0:
        return None
    return got, int(crc.value)


def warm_up() -> None:
    """Compile the kernels on a daemon thread now (~0.1 s), so the first frame checked
    does not wait for it; once per process, a no-op after."""
    with _lock:
        if "kernels" in _state or "warming" in _state:
            return
        _state["warming"] = threading.Thread(target=_kernels, name="kvstore-crc32c-warm-up", daemon=True)
    _state["warming"].start()


def ready() -> bool:
    """Whether a call now would not wait for the kernels to compile (they are compiled,
    or known not to serve here): say so before hashing on an event loop."""
    return "kernels" in _state


def fast() -> bool:
    """Whether the vpclmulqdq kernels serve on this machine (else the package does)."""
    return _kernels() is not None


def vector_bits() -> int:
    """Bits of the kernels' fold vectors: 512 (AVX-512), 256 (AVX2), 0 (the package)."""
    kernels = _kernels()
    return 0 if kernels is None else 8 * kernels.width


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of `data`, continuing from `value` (a previous result): the ``crc32c``
    package's ``crc32c(data, value)``, faster on large buffers."""
    kernels = _kernels()
    mv = _bytes_view(data)
    if kernels is None or mv.nbytes < MIN_FAST:
        return int(_crc32c_pkg.crc32c(mv, value))
    return int(kernels.crc(value, _address(mv), mv.nbytes))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and ``len(B)``:
    pieces of one payload hashed apart (e.g. ranges read in parallel) joined in order.
    ``crc1`` is shifted past `len2` zero bytes (multiplied by x^(8·len2) mod P, bit-
    reflected, one table entry per set bit of 8·len2), then XORed with ``crc2``."""
    if len2 < 0:
        raise ValueError(f"crc32c_combine: negative length {len2}")
    n, k, shift = len2 * 8, 0, _ONE
    while n:
        if n & 1:
            shift = _mulmod(_X_POW2[k], shift)
        n >>= 1
        k += 1
    return _mulmod(shift, crc1 & _MASK) ^ (crc2 & _MASK)


_P_REFLECTED = 0x82F63B78  # P without its x^32 term, bit-reflected
_ONE = 1 << 31  # the polynomial 1, bit-reflected


def _mulmod(a: int, b: int) -> int:
    """a·b mod P for bit-reflected 32-bit polynomials."""
    out = 0
    for bit in range(31, -1, -1):
        if (a >> bit) & 1:
            out ^= b
        b = (b >> 1) ^ _P_REFLECTED if b & 1 else b >> 1
    return out


def _x_pow2_table(count: int) -> list[int]:
    """x^(2^k) mod P, bit-reflected, for k < count."""
    table = [1 << 30]  # x
    for _ in range(count - 1):
        table.append(_mulmod(table[-1], table[-1]))
    return table


_X_POW2 = _x_pow2_table(67)  # 8·len2 < 2^67 for any length a process can hold


def copy_crc32c(dst: Buffer, src: Buffer, value: int = 0) -> int:
    """Copy `src` into `dst` (same length, writable) and return the CRC32C of the bytes
    copied, continuing from `value`; one pass over the bytes where the CPU allows."""
    d, s = _bytes_view(dst), _bytes_view(src)
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy_crc32c: destination is {d.nbytes} bytes, source {s.nbytes}")
    kernels = _kernels()
    if kernels is None or s.nbytes < MIN_FAST:
        d[:] = s
        return int(_crc32c_pkg.crc32c(d, value))
    return int(kernels.copy(value, _address(d), _address(s), s.nbytes))


def pread_crc32c(fd: int, dst: Buffer, offset: int, value: int = 0) -> tuple[int, int]:
    """Read ``len(dst)`` bytes of file `fd` from `offset` into `dst` in blocks of
    `PREAD_BLOCK`, each hashed right after it lands: (bytes read, CRC32C continued from
    `value` over them).  Short only at end of file; an I/O error raises `OSError`.
    On the fast path the whole loop runs outside the GIL."""
    d = _bytes_view(dst)
    kernels = _kernels()
    if kernels is None:
        got = 0
        while got < d.nbytes:
            block = d[got : got + PREAD_BLOCK]
            n = os.preadv(fd, [block], offset + got)
            if not n:
                break
            value = _crc32c_pkg.crc32c(block[:n], value)
            got += n
        return got, int(value)
    crc = ctypes.c_uint32(value)
    got = int(kernels.pread(fd, _address(d), d.nbytes, offset, PREAD_BLOCK, ctypes.byref(crc)))
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got, int(crc.value)


def pwrite_crc32c(fd: int, src: Buffer, offset: int, value: int = 0, block: int = PWRITE_BLOCK) -> int:
    """Write all of `src` to file `fd` at `offset` in blocks of `block` bytes (the first one
    shorter where `offset` is not a multiple of `block`, so the rest start at multiples of
    it), each hashed just before it is written (so the write copies it from cache): the
    CRC32C of the bytes written, continued from `value`.  One pass over `src` where a separate checksum
    would take two; an I/O error raises `OSError`.  On the fast path the whole loop runs
    outside the GIL."""
    s = _bytes_view(src)
    head = min(-offset % block, s.nbytes)  # up to the first multiple of `block` in the file
    kernels = _kernels()
    crc = ctypes.c_uint32(value)
    for start, n in ((0, head), (head, s.nbytes - head)):
        if not n:
            continue
        if kernels is None:
            crc.value = _pwrite_blocks(fd, s[start : start + n], offset + start, crc.value, block)
            continue
        got = int(kernels.pwrite(fd, _address(s) + start, n, offset + start, block, ctypes.byref(crc)))
        if got < 0:
            raise OSError(-got, os.strerror(-got))
    return int(crc.value)


def _pwrite_blocks(fd: int, src: memoryview, offset: int, value: int, block: int) -> int:
    """`pwrite_crc32c`'s loop with the crc32c package (no kernels)."""
    for start in range(0, src.nbytes, block):
        piece = src[start : start + block]
        value = _crc32c_pkg.crc32c(piece, value)
        at = offset + start
        while piece.nbytes:
            n = os.pwrite(fd, piece, at)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote nothing at offset {at}")
            piece, at = piece[n:], at + n
    return int(value)


__all__ = [
    "MIN_FAST",
    "PREAD_BLOCK",
    "PWRITE_BLOCK",
    "copy_crc32c",
    "crc32c",
    "crc32c_combine",
    "fast",
    "mapped_crc32c",
    "pread_crc32c",
    "pwrite_crc32c",
    "ready",
    "warm_up",
]
