"""What a GGUF file holds, read with the `gguf` package's reader before anything converts it:
its architecture, its tensors' types, whether it carries a chat template. A file the platform
cannot serve is refused here with one message naming what it found and what is supported,
so no half-converted cache is ever written (infra/target.py converts what passes).

Weight formats, and what serving keeps of each (model.quant auto, on the CPU):
- Q4_0, Q4_1, Q4_K: 4-bit blocks with a scale and a minimum per group of 32, served as int4.
  Q4_1 blocks come back exactly (llama.cpp's quantizer puts codes 0 and 15 in every block, so
  min/max quantization of the dequantized weights recovers them: serve/model/linear.py); Q4_0 and
  Q4_K blocks are re-quantized to that grid, a second rounding.
- F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K: dequantized by `gguf` and served
  in float32, exactly the values the file encodes. In a file whose decoder is mostly 4-bit
  (Q4_K_M keeps some tensors in Q6_K), those tensors are re-quantized to int4 with the rest.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# The architectures llama.cpp's converter writes for the families the lean forward runs
# (it writes Mistral models as "llama" too); transformers reads each of them.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# A file modified this recently is read again at every call (read_gguf_info).
RACY_S = 2.0
# Decoder linear weights, by llama.cpp's tensor names (the ones int4 applies to).
_LINEAR = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")


def is_gguf_spec(spec: str) -> bool:
    """Whether a model.target names a GGUF file."""
    return spec.lower().endswith(".gguf")


class GgufError(ValueError):
    """The file is not a GGUF the platform serves; the message says why."""


@dataclass(frozen=True)
class GgufInfo:
    architecture: str
    types: dict[str, int]  # tensor type name -> tensors of that type
    linear_types: dict[str, int]  # the same over decoder linear weights only
    chat_template: bool
    head_dim: int | None  # `attention.key_length` where the file sets it

    @property
    def four_bit(self) -> bool:
        """Most decoder linear weights are 4-bit: serve the decoder as int4."""
        n4 = sum(n for t, n in self.linear_types.items() if t in FOUR_BIT_TYPES)
        return n4 * 2 > sum(self.linear_types.values())


def read_gguf_info(path: Path) -> GgufInfo:
    """The file's GgufInfo, read once per process for each version of the file: the reader walks
    every metadata array (the tokenizer's 49k strings in SmolLM2's) in Python, seconds a call,
    and every publish identifies its target. A version is the file's path, inode, size and
    mtime; a file changed in the last RACY_S is read every time, since a rewrite within one
    clock tick can keep its mtime (git's "racily clean" rule)."""
    if not path.is_file():
        raise GgufError(f"{path}: no such file")
    st = path.stat()
    if time.time_ns() - st.st_mtime_ns < RACY_S * 1e9:
        return _read_gguf_info.__wrapped__(str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    return _read_gguf_info(str(path), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_gguf_info(file: str, inode: int, size: int, mtime_ns: int) -> GgufInfo:
    import gguf

    path = Path(file)
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as e:
        if "is not a valid GGMLQuantizationType" in str(e):
            raise GgufError(f"{path}: a tensor type this gguf package does not know ({e}); supported: "
                            f"{', '.join(SUPPORTED_TYPES)}") from None
        raise GgufError(f"{path}: not a readable GGUF file (truncated?): {e}") from None
    except Exception as e:  # numpy and struct raise their own types on a cut-off file
        raise GgufError(f"{path}: not a readable GGUF file (truncated?): {e}") from None
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else "(none)"
    if arch not in GGUF_ARCHITECTURES:
        raise GgufError(f"{path}: architecture {arch!r} is not served; supported: {', '.join(GGUF_ARCHITECTURES)}")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    odd = sorted(set(types) - set(SUPPORTED_TYPES))
    if odd:
        raise GgufError(f"{path}: tensor type(s) {', '.join(odd)} are not served; supported: "
                        f"{', '.join(SUPPORTED_TYPES)}")
    linear = Counter(t.tensor_type.name for t in reader.tensors if any(k in t.name for k in _LINEAR))
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    return GgufInfo(arch, dict(types), dict(linear), "tokenizer.chat_template" in reader.fields,
                    int(key_length.contents()) if key_length is not None else None)
