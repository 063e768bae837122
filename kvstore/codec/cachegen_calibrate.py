"""Calibration of `cachegen` profiles on a real model's KV, and codec evaluation.

Owns: per-(layer, K/V) sensitivity measurement, the bin allocation that meets a KL
budget at the fewest bits, codebook fitting on the chosen bins, and the evaluation
report (ratio, relative L2, cosine, next-token top-1 / KL / perplexity change).
Must not touch: the payload format or kernels (it uses the codec's public API and a
torch reference of its quantizer), files other than the profile it is asked to write.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvstore.codec import kvmodel
from kvstore.codec.cachegen import CacheGenCodec
from kvstore.codec.cachegen_profile import Profile
from kvstore.codec.cachegen_tables import CodebookSet, alphabet, bins_to_max, fit_codebook

LADDER = (8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128)
PROBE_BINS = 16


def fake_quant(
    x: torch.Tensor, bins: int, cs: torch.Tensor | None = None, raw: int = 0, chunk: int = 256
) -> torch.Tensor:
    """The codec's quantize/dequantize in torch (float32), for planes [.., T, C];
    `cs` [C]: channel scales divided out before and multiplied back after; the first
    `raw` tokens of every `chunk` tokens are kept exact (a profile's ``raw_tokens``)."""
    y = _fake_quant(x, bins, cs)
    if raw:
        for t0 in range(0, x.shape[-2], chunk):
            y[..., t0 : t0 + raw, :] = x[..., t0 : t0 + raw, :].float()
    return y


def _fake_quant(x: torch.Tensor, bins: int, cs: torch.Tensor | None) -> torch.Tensor:
    mx = float(bins_to_max(bins))
    x = x.float()
    if cs is not None:
        x = x * (1.0 / cs)
    m = x.abs().amax(-1, keepdim=True)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    q = torch.round(x * (mx / safe) + mx)
    y = torch.where(m > 0, (q - mx) / mx * m, torch.zeros_like(x))
    return y if cs is None else y * cs


def quantize_planes(
    kv: torch.Tensor,
    kbins: list[int],
    vbins: list[int],
    cs: torch.Tensor | None = None,
    raw: int = 0,
    chunk: int = 256,
) -> torch.Tensor:
    out = torch.empty_like(kv, dtype=torch.float32)
    for i in range(kv.shape[1]):
        out[0, i] = fake_quant(kv[0, i], kbins[i], None if cs is None else cs[0, i], raw, chunk)
        out[1, i] = fake_quant(kv[1, i], vbins[i], None if cs is None else cs[1, i], raw, chunk)
    return out


def channel_scales(samples: list[kvmodel.Sample], power: float) -> torch.Tensor:
    """Per (plane, layer, channel) RMS over all calibration tokens to `power` (0: none,
    1: every channel to unit RMS), relative to the layer's mean, floored, float32."""
    kv = torch.cat([s.kv.float() for s in samples], 2)
    rms = kv.pow(2).mean(2).sqrt()
    rms = torch.maximum(rms, rms.amax(-1, keepdim=True) * 1e-3 + 1e-12)
    rel = rms / rms.mean(-1, keepdim=True)
    return rel.pow(power).float()


def query_scales(lm: kvmodel.LoadedModel, samples: list[kvmodel.Sample], power: float) -> torch.Tensor:
    """Per (plane, layer, channel) scales that give K channel c a quantization step
    proportional to (query energy of c)^(-power/2), relative to the layer's mean (V: 1).

    A per-token absmax quantizer has one step for all of a token's channels; dividing K
    by these before it (and multiplying back after) makes the step finer where queries
    are large, since an error in K channel c moves the attention logits by q_c times it.
    ``power`` 1 equalizes the channels' contributions to the logit error; 0.5 is halfway."""
    e = kvmodel.query_energy(lm, samples)
    e = torch.maximum(e, e.amax(-1, keepdim=True) * 1e-6 + 1e-30)
    s = e.pow(-power / 2)
    out = torch.ones(2, *s.shape)
    out[0] = (s / s.mean(-1, keepdim=True)).float()
    return out


def symbol_hists(
    kv: torch.Tensor,
    plane: int,
    layer: int,
    bins: int,
    chunk: int,
    cs: torch.Tensor | None = None,
    raw: int = 0,
) -> np.ndarray:
    """Per (channel, chunk) symbol histograms [N, A] of one plane at `bins` (the first
    `raw` tokens of each chunk are stored raw, not coded)."""
    mx = bins_to_max(bins)
    x = kv[plane, layer].float()
    if cs is not None:
        x = x * (1.0 / cs[plane, layer])
    m = x.abs().amax(-1, keepdim=True)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    q = torch.where(m > 0, torch.round(x * (mx / safe) + mx), torch.full_like(x, mx)).long()
    a = alphabet(bins)
    out = []
    for s in range(0, q.shape[0], chunk):
        qc = q[s + raw : s + chunk].T  # [C, t]
        h = torch.zeros(qc.shape[0], a, dtype=torch.int64).scatter_add_(1, qc, torch.ones_like(qc))
        out.append(h.numpy())
    return np.concatenate(out)


def mean_entropy(h: np.ndarray) -> float:
    """Average empirical entropy in bits per symbol over histograms [N, A]."""
    hf = h.astype(np.float64)
    tot = hf.sum(1, keepdims=True)
    p = np.where(hf > 0, hf / tot, 1.0)
    return float(-(hf * np.log2(p)).sum() / hf.sum())


@dataclass
class Calibration:
    key_bins: list[int]
    value_bins: list[int]
    sensitivity_k: list[float]
    sensitivity_v: list[float]
    predicted_kl: float
    measured_kl: float
    measured_top1: float
    measured_dppl: float
    bits_per_symbol: float


def allocate(
    sens: np.ndarray, bits: np.ndarray, target_kl: float, ladder: tuple[int, ...] = LADDER
) -> tuple[np.ndarray, float]:
    """Bins per plane minimizing total bits with predicted KL <= target.

    sens [P] = KL with that plane alone at PROBE_BINS; bits [P, len(ladder)] bits/symbol;
    predicted KL at b scales with quantization noise power, (MAX_probe / MAX_b)^2."""
    scale = np.array([(bins_to_max(PROBE_BINS) / bins_to_max(b)) ** 2 for b in ladder])
    kl = np.maximum(sens, 0)[:, None] * scale[None, :]

    def pick(lam: float) -> tuple[np.ndarray, float]:
        choice = np.argmin(bits + lam * kl, axis=1)
        return choice, float(kl[np.arange(len(sens)), choice].sum())

    lo, hi = 0.0, 1e9
    choice, tot = pick(hi)
    if tot > target_kl:
        return np.array([ladder[i] for i in choice]), tot
    for _ in range(100):
        mid = math.sqrt(max(lo, 1e-9) * hi) if lo > 0 else hi / 1e6 if hi > 1 else hi / 2
        c, t = pick(mid)
        if t <= target_kl:
            hi, choice, tot = mid, c, t
        else:
            lo = mid
        if hi / max(lo, 1e-12) < 1.001:
            break
    return np.array([ladder[i] for i in choice]), tot


def calibrate(
    lm: kvmodel.LoadedModel,
    *,
    target_kl: float = 0.004,
    prefix: int = 256,
    cont: int = 64,
    texts: int = 3,
    chunk: int = 256,
    tables: int = 128,
    name: str | None = None,
    fixed_bins: tuple[list[int], list[int]] | None = None,
    equalize: float = 0.0,
    files: Sequence[str | os.PathLike[str]] | None = None,
    which: str = "calibration",
    worst: bool = False,
    raw_tokens: int = 0,
    smooth_k: float = 0.0,
    log: Callable[[str], None] = print,
) -> tuple[Profile, Calibration]:
    """Measure, allocate, fit codebooks; return the profile (bound to `lm`'s fingerprint)
    and what was measured.

    Calibrates on the builtin set `which`, or on the user's `files` (up to `texts` of
    them).  With `fixed_bins` (K, V bins per layer) only the codebooks are fitted.  With
    `worst`, the budget must hold on every calibration prompt, not only on their mean.
    With `raw_tokens`, the first tokens of every chunk are stored verbatim (measured so).
    With `smooth_k` > 0, K channels get static scales from the query energy (see
    `query_scales`) that the profile carries (no bytes per chunk)."""
    return calibrate_sweep(
        lm,
        targets=[target_kl],
        prefix=prefix,
        cont=cont,
        texts=texts,
        chunk=chunk,
        tables=tables,
        name=name,
        fixed_bins=fixed_bins,
        equalize=equalize,
        files=files,
        which=which,
        worst=worst,
        raw_tokens=raw_tokens,
        smooth_k=smooth_k,
        log=log,
    )[0]


def calibrate_sweep(
    lm: kvmodel.LoadedModel,
    *,
    targets: Sequence[float],
    prefix: int = 256,
    cont: int = 64,
    texts: int = 3,
    chunk: int = 256,
    tables: int = 128,
    name: str | None = None,
    fixed_bins: tuple[list[int], list[int]] | None = None,
    equalize: float = 0.0,
    files: Sequence[str | os.PathLike[str]] | None = None,
    which: str = "calibration",
    worst: bool = False,
    raw_tokens: int = 0,
    smooth_k: float = 0.0,
    log: Callable[[str], None] = print,
) -> list[tuple[Profile, Calibration]]:
    """`calibrate` at several KL budgets, measuring the prompts, sensitivities and bit
    costs once: one profile per budget (a ratio/quality frontier)."""
    if equalize > 0 and smooth_k > 0:
        raise ValueError("equalize and smooth_k both set per-channel scales; choose one")
    t0 = time.time()
    samples = kvmodel.make_samples(lm, which, prefix, cont, texts, files)
    L = lm.num_layers
    log(f"captured {len(samples)} calibration prompts ({prefix}+{cont} tokens) in {time.time() - t0:.0f}s")
    cs = channel_scales(samples, equalize) if equalize > 0 else None
    if smooth_k > 0:
        cs = query_scales(lm, samples, smooth_k)
    many = len(targets) > 1
    raw = int(raw_tokens)

    def done(prof: Profile) -> Profile:
        prof.info["equalize"] = float(equalize) if equalize > 0 else 0.0
        prof.info["smooth_k"] = float(smooth_k)
        prof.info["budget_on"] = "every prompt" if worst else "mean"
        prof.info["raw_tokens"] = raw
        return dataclasses.replace(prof, raw_tokens=raw)

    if fixed_bins is not None:
        kb, vb = [int(b) for b in fixed_bins[0]], [int(b) for b in fixed_bins[1]]
        if len(kb) != L or len(vb) != L:
            raise ValueError(f"fixed bins are for {len(kb)} layers; the model has {L}")
        q = kvmodel.quality(lm, samples, lambda kv: quantize_planes(kv, kb, vb, cs, raw, chunk))
        log(f"fixed bins: measured KL {q.kl:.2e}, top1 {q.top1:.3f}, dPPL {q.dppl:+.2%}")
        prof, cal = _finish(
            lm,
            samples,
            kb,
            vb,
            cs,
            np.zeros((2, L)),
            0.0,
            q,
            targets[0],
            prefix,
            cont,
            chunk,
            tables,
            name,
            t0,
            log,
            raw,
        )
        return [(done(prof), cal)]

    # 1. Sensitivity: KL with one plane alone at PROBE_BINS.
    sens = np.zeros((2, L))
    for p in range(2):
        for i in range(L):

            def one(kv: torch.Tensor, p: int = p, i: int = i) -> torch.Tensor:
                out = kv.clone()
                out[p, i] = fake_quant(kv[p, i], PROBE_BINS, None if cs is None else cs[p, i], raw, chunk)
                return out

            sens[p, i] = kvmodel.quality(lm, samples, one).kl
        log(f"sensitivity {'KV'[p]}: " + " ".join(f"{v:.1e}" for v in sens[p]))

    # 2. Bits per symbol of each plane at each ladder step (empirical, per chunk/channel).
    bits = np.zeros((2, L, len(LADDER)))
    for p in range(2):
        for i in range(L):
            for j, b in enumerate(LADDER):
                hs = np.concatenate([symbol_hists(s.kv, p, i, b, chunk, cs, raw) for s in samples])
                bits[p, i, j] = mean_entropy(hs)

    # 3. Allocate; verify on the samples and tighten the budget until it holds.
    out = []
    for target_kl in targets:
        budget = target_kl
        for _ in range(4):
            flat, pred = allocate(sens.reshape(-1), bits.reshape(2 * L, -1), budget)
            kb, vb = [int(b) for b in flat[:L]], [int(b) for b in flat[L:]]
            sums = [
                kvmodel.sample_sums(lm, s, quantize_planes(s.kv, kb, vb, cs, raw, chunk)) for s in samples
            ]
            per = [x.quality() for x in sums]
            tot = kvmodel.Sums()
            for x in sums:
                tot.add(x)
            q = tot.quality()
            held = max(x.kl for x in per) if worst else q.kl
            log(
                f"budget {budget:.2e}: predicted KL {pred:.2e}, measured KL {q.kl:.2e} "
                f"(worst prompt {max(x.kl for x in per):.2e}), top1 {q.top1:.3f}, dPPL {q.dppl:+.2%}"
            )
            if held <= target_kl * 1.05:
                break
            budget *= max(0.3, target_kl / held)
        pname = name if not many else f"{name or lm.name.lower()}-kl{target_kl:g}"
        prof, cal = _finish(
            lm,
            samples,
            kb,
            vb,
            cs,
            sens,
            pred,
            q,
            target_kl,
            prefix,
            cont,
            chunk,
            tables,
            pname,
            t0,
            log,
            raw,
        )
        out.append((done(prof), cal))
    return out


def _finish(
    lm: kvmodel.LoadedModel,
    samples: list[kvmodel.Sample],
    kb: list[int],
    vb: list[int],
    cs: torch.Tensor | None,
    sens: np.ndarray,
    pred: float,
    q: kvmodel.Quality,
    target_kl: float,
    prefix: int,
    cont: int,
    chunk: int,
    tables: int,
    name: str | None,
    t0: float,
    log: Callable[[str], None],
    raw: int = 0,
) -> tuple[Profile, Calibration]:
    # 4. Codebooks for every alphabet in use, fitted on the chosen bins.
    hists: dict[int, list[np.ndarray]] = {}
    for p, bl in enumerate((kb, vb)):
        for i, b in enumerate(bl):
            hists.setdefault(alphabet(b), []).extend(
                symbol_hists(s.kv, p, i, b, chunk, cs, raw) for s in samples
            )
    books = {a: fit_codebook(np.concatenate(h), k=tables) for a, h in sorted(hists.items())}
    pname = name or f"{lm.name.lower()}-kl{target_kl:g}"
    cset = CodebookSet(pname, books, None if cs is None else cs.numpy())
    bps = 0.0
    for p, bl in enumerate((kb, vb)):
        for i, b in enumerate(bl):
            bps += float(
                np.mean([mean_entropy(symbol_hists(s.kv, p, i, b, chunk, cs, raw)) for s in samples])
            )
    bps /= 2 * len(kb)
    cal = Calibration(kb, vb, sens[0].tolist(), sens[1].tolist(), pred, q.kl, q.top1, q.dppl, float(bps))
    info = {"model": lm.name, "target_kl": target_kl, "prefix": prefix, "cont": cont, "texts": len(samples)}
    info["prompts"] = [s.label for s in samples]
    info.update({k: v for k, v in asdict(cal).items() if k not in ("key_bins", "value_bins")})
    log(f"calibrated in {time.time() - t0:.0f}s")
    return Profile(pname, kb, vb, cset, info, kvmodel.fingerprint(lm)), cal


@dataclass
class PromptReport:
    """One prompt's figures: its chunks' ratio and, with a model, next-token quality."""

    label: str
    ratio: float
    rel_l2: float
    top1: float | None = None
    kl: float | None = None
    ppl_ref: float | None = None
    ppl: float | None = None
    dppl: float | None = None
    tokens: int = 0
    repeated: bool = False


@dataclass
class EvalReport:
    codec: str
    ratio: float
    rel_l2: float
    cosine: float
    top1: float | None = None
    kl: float | None = None
    ppl_ref: float | None = None
    ppl: float | None = None
    dppl: float | None = None
    tokens: int = 0
    prompts: list[PromptReport] = field(default_factory=list)

    def worst(self) -> PromptReport | None:
        """The prompt with the lowest top-1 (ties: the largest |dPPL|)."""
        rows = [p for p in self.prompts if p.top1 is not None]
        return min(rows, key=lambda p: (p.top1, -abs(p.dppl or 0.0))) if rows else None


def chunked_roundtrip(
    codec: CacheGenCodec, kv: torch.Tensor, chunk: int, dtype: torch.dtype
) -> tuple[torch.Tensor, int, int]:
    """Encode/decode `kv` in token chunks; (reconstruction, raw bytes, stored bytes)."""
    parts, raw, stored = [], 0, 0
    for s in range(0, kv.shape[2], chunk):
        c = kv[:, :, s : s + chunk].to(dtype).contiguous()
        buf = codec.encode(c)
        stored += len(buf)
        raw += c.numel() * c.element_size()
        parts.append(codec.decode(buf))
    return torch.cat(parts, 2), raw, stored


def evaluate(
    codec: CacheGenCodec,
    label: str,
    samples: list[kvmodel.Sample],
    lm: kvmodel.LoadedModel | None,
    *,
    chunk: int = 256,
    dtype: torch.dtype = torch.float16,
) -> EvalReport:
    """Pooled and per-prompt ratio, error and (with `lm`) next-token quality of `codec`
    against the uncompressed KV of each sample."""
    raw = stored = 0
    err = ref = dot = na = nb = 0.0
    tot = kvmodel.Sums()
    prompts = []
    for s in samples:
        y, r, st = chunked_roundtrip(codec, s.kv, chunk, dtype)
        raw += r
        stored += st
        x = s.kv.to(dtype).double()
        yd = y.double()
        e, n2 = float((yd - x).pow(2).sum()), float(x.pow(2).sum())
        err += e
        ref += n2
        dot += float((x * yd).sum())
        na += n2
        nb += float(yd.pow(2).sum())
        pr = PromptReport(s.label, r / st, math.sqrt(e / n2) if n2 > 0 else 0.0, repeated=s.repeated)
        if lm is not None:
            sums = kvmodel.sample_sums(lm, s, y)
            tot.add(sums)
            q = sums.quality()
            pr.top1, pr.kl, pr.ppl_ref, pr.ppl, pr.dppl, pr.tokens = (
                q.top1,
                q.kl,
                q.ppl_ref,
                q.ppl,
                q.dppl,
                q.tokens,
            )
        prompts.append(pr)
    rep = EvalReport(label, raw / stored, math.sqrt(err / ref), dot / math.sqrt(na * nb), prompts=prompts)
    if lm is not None:
        q = tot.quality()
        rep.top1, rep.kl, rep.ppl_ref, rep.ppl, rep.dppl, rep.tokens = (
            q.top1,
            q.kl,
            q.ppl_ref,
            q.ppl,
            q.dppl,
            q.tokens,
        )
    return rep
