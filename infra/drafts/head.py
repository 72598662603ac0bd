"""The `head` draft family: one decoder layer over the target's own hidden states (EAGLE-3 form).

A row t is a position whose next token x_{t+1} is known. The head reads there

    g_t = fc(cat(f_t^l for l in feature_layers))   the target's layer outputs at t, 3h -> h;
          at later draft steps the head's own output state of row t-1 instead
    x_t = in_proj(cat(rms(E[x_{t+1}]), rms(g_t)))   E: the target's frozen embedding; 2h -> h

then one decoder layer of the target's shape (attention over its own keys of earlier rows),
its own final norm, and its own LM head over V_d draft tokens: logits for x_{t+2}.
`d2t[j]` is the target id of draft token j (the V_d most frequent target outputs).

Why a separate module and not a Hugging Face model: the head's inputs are not token ids, and
its training unroll (`unroll`) attends across draft depths with a mask HF cannot express.

On disk it is the directory format of infra/drafts/layer.py: config.json (the target's config
cut to one layer), draft.safetensors (every head tensor and d2t), draft.json (spec.family
"head"; the target's embedding is the one shared tensor), osd-manifest.json.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infra.drafts.spec import DraftLoadError, DraftSpec, DraftSpecError, target_mismatch
from infra.target import LEAN_FAMILIES

EMBED = "model.embed_tokens.weight"
LAYER = ("ln1", "q_proj", "k_proj", "v_proj", "o_proj", "ln2", "gate_proj", "up_proj", "down_proj")


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high layer outputs: (1, 14, 26) for a 30-layer target."""
    return tuple(sorted({min(1, n_layers - 1), max(n_layers // 2 - 1, 0), max(n_layers - 4, 0)}))


def feature_layers_of(spec: DraftSpec, n_layers: int) -> tuple[int, ...]:
    layers = spec.feature_layers or default_feature_layers(n_layers)
    if not all(0 <= i < n_layers for i in layers):
        raise DraftSpecError(f"feature_layers {layers} outside the target's {n_layers} layers")
    return tuple(layers)


class HeadDraft(nn.Module):
    """The head's tensors and its math; serve/spec_decode/head/draft.py and the trainer drive it."""

    osd_family = "head"

    def __init__(self, tcfg: Any, spec: DraftSpec, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 d2t: torch.Tensor):
        super().__init__()
        h, nf = tcfg.hidden_size, len(feature_layers_of(spec, tcfg.num_hidden_layers))
        self.spec, self.feature_layers = spec, feature_layers_of(spec, tcfg.num_hidden_layers)
        self.n_heads, self.n_kv = tcfg.num_attention_heads, tcfg.num_key_value_heads
        self.head_dim = getattr(tcfg, "head_dim", None) or h // self.n_heads
        self.eps = tcfg.rms_norm_eps
        self.config = _head_config(tcfg)
        dt = embed.dtype
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dt)  # noqa: E731
        self.fc = lin(nf * h, h)
        self.in_proj = lin(2 * h, h)
        self.norm_e = nn.Parameter(torch.ones(h, dtype=dt))
        self.norm_g = nn.Parameter(torch.ones(h, dtype=dt))
        q, kv, ffn = self.n_heads * self.head_dim, self.n_kv * self.head_dim, tcfg.intermediate_size
        self.layer = nn.ModuleDict({"q_proj": lin(h, q), "k_proj": lin(h, kv), "v_proj": lin(h, kv),
                                    "o_proj": lin(q, h), "gate_proj": lin(h, ffn), "up_proj": lin(h, ffn),
                                    "down_proj": lin(ffn, h)})
        self.ln1 = nn.Parameter(torch.ones(h, dtype=dt))
        self.ln2 = nn.Parameter(torch.ones(h, dtype=dt))
        self.norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.lm_head = lin(h, int(d2t.numel()))
        self.register_buffer("d2t", d2t.to(torch.long), persistent=True)
        self.register_buffer("cos", rope[0], persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", rope[1], persistent=False)
        self.embed = embed.detach()  # the target's storage, frozen; deliberately not a parameter
        self.vocab_size = tcfg.vocab_size

    @property
    def draft_vocab(self) -> int:
        return self.d2t.numel()

    def t2d(self) -> torch.Tensor:
        """[V] bool: target ids the head can propose."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.d2t.device)
        return mask.index_fill_(0, self.d2t, True)

    # -- the math, shared by serving and training; x: [B, T, h] ------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [.., nf*h] -> g [.., h]."""
        return self.fc(feats)

    def mix(self, g: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(next_ids, self.embed)
        return self.in_proj(torch.cat([self._rms(e, self.norm_e), self._rms(g, self.norm_g)], dim=-1))

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, h] at positions pos [T] -> q [B, H, T, hd], k, v [B, KV, T, hd] (RoPE applied)."""
        b, t, _ = x.shape
        hd, L = self.head_dim, self.layer
        y = self._rms(x, self.ln1)
        q = L["q_proj"](y).view(b, t, self.n_heads, hd).transpose(1, 2)
        k = L["k_proj"](y).view(b, t, self.n_kv, hd).transpose(1, 2)
        v = L["v_proj"](y).view(b, t, self.n_kv, hd).transpose(1, 2)
        cos, sin = self.cos[pos], self.sin[pos]
        if pos.dim() == 2:  # per-row positions [B, T]: one table per record, shared by the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The rest of the decoder layer: attention of q over keys k/v [B, KV, S, hd], MLP.
        mask: [T, S] or [B, 1, T, S] bool (True = attend) or None (all). Returns the output state
        [B, T, h]."""
        b, t, _ = x.shape
        L = self.layer
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        x = x + L["o_proj"](a.transpose(1, 2).reshape(b, t, -1))
        y = self._rms(x, self.ln2)
        return x + L["down_proj"](F.silu(L["gate_proj"](y)) * L["up_proj"](y))

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """Output state [.., h] -> draft-vocab logits [.., V_d] fp32."""
        return self.lm_head(self._rms(o, self.norm)).float()

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor, depth: int = 1,
                first: int | torch.Tensor = 0, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The training unroll; a forward so DeepSpeed's hooks (ZeRO-3 gathers) see the call.
        Default: unroll's logits [B, T, V_d] per depth. With `rows` (bool [B, W]): the logits
        [N, V_d] of those rows alone, each depth's states from row `first` on (an int: W = T -
        first; or per record, [B]: the windows of unroll_windows, W wide), so the LM head (most
        of a row's arithmetic at a draft vocab of thousands) runs on the rows a loss counts
        (a chain starting before a window is garbage)."""
        if rows is None:
            return self.unroll(feats, next_ids, depth)
        if isinstance(first, torch.Tensor):
            states = self.unroll_windows(feats, next_ids, depth, first, rows.shape[1])
        else:
            states = self.unroll_states(feats, next_ids, depth, first)
        return [self.logits(o[rows]) for o in states]

    def unroll(self, feats: torch.Tensor, next_ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: logits [B, T, V_d] at draft depths 1..depth (unroll_states' states
        through the LM head). Rows t < j-1 of depth j have no chain start and are garbage (the
        caller masks them)."""
        return [self.logits(o) for o in self.unroll_states(feats, next_ids, depth)]

    def unroll_states(self, feats: torch.Tensor, next_ids: torch.Tensor, depth: int,
                      first: int = 0) -> list[torch.Tensor]:
        """The output states [B, T - first, h] of rows first..T-1 at draft depths 1..depth. Depth 1
        reads the target's features; depth j>1 at row t reads depth j-1's state of row t-1 and
        attends as drafting would: depth-1 keys up to row t-j+1, then the depth-i key of row
        t-j+i only. Rows before `first` give depth 1's keys alone, so a chain that starts
        before it is garbage: scoring counts the chains from each record's outputs, and the
        rest of the unroll (prompt rows at every depth) is most of its arithmetic."""
        t = feats.shape[1]
        pos = torch.arange(t, device=feats.device)
        x = self.mix(self.fuse(feats), next_ids)
        q, k, v = self.qkv(x, pos)
        ks, vs = [k], [v]
        o = self.attend(x[:, first:], q[:, :, first:], k, v, _unroll_mask(t, 1, feats.device, first))
        out = [o]
        for j in range(2, depth + 1):
            g = torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1)  # row t reads row t-1's state
            x = self.mix(g, next_ids[:, first:])
            q, k, v = self.qkv(x, pos[first:])
            ks.append(k)
            vs.append(v)
            o = self.attend(x, q, torch.cat(ks, 2), torch.cat(vs, 2), _unroll_mask(t, j, feats.device, first))
            out.append(o)
        return out

    def unroll_windows(self, feats: torch.Tensor, next_ids: torch.Tensor, depth: int, first: torch.Tensor,
                       width: int) -> list[torch.Tensor]:
        """unroll_states with a window per record: the output states [B, width, h] at depths
        1..depth, window row w of record b being sequence row first[b] + w (rows past T are
        garbage). Depth 1's keys still come from every row; the rest of the unroll runs on the
        windows alone, so a batch of records whose outputs start at different rows (an online
        batch: prompts of 20 and of 700 tokens) does not unroll one's prompt for the other."""
        b, t, _ = feats.shape
        w = torch.arange(width, device=feats.device)
        rows = first.view(-1, 1) + w.view(1, -1)  # [B, W] sequence rows
        at = rows.clamp(max=t - 1)
        x = self.mix(self.fuse(feats), next_ids)
        q, k, v = self.qkv(x, torch.arange(t, device=feats.device))
        ks, vs = [k], [v]
        xw = x.gather(1, at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        qw = q.gather(2, at.view(b, 1, width, 1).expand(-1, q.shape[1], -1, q.shape[-1]))
        o = self.attend(xw, qw, k, v, _window_mask(rows, t, 1))
        out = [o]
        ids = next_ids.gather(1, at)
        for j in range(2, depth + 1):
            g = torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1)  # row t reads row t-1's state
            x = self.mix(g, ids)
            q, k, v = self.qkv(x, at)
            ks.append(k)
            vs.append(v)
            o = self.attend(x, q, torch.cat(ks, 2), torch.cat(vs, 2), _window_mask(rows, t, j))
            out.append(o)
        return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _unroll_mask(t: int, j: int, device: Any, first: int = 0) -> torch.Tensor:
    """[T - first, T + (j-1)(T - first)] bool: query row r (first..T-1) of depth j sees depth-1
    keys s <= r-j+1 (all T rows) and, for depth i in 2..j (rows first..T-1), the key of row
    r-j+i only (its own chain's earlier steps)."""
    r = torch.arange(first, t, device=device).view(-1, 1)
    s = torch.arange(t, device=device).view(1, t)
    blocks = [s <= r - j + 1] + [s[:, first:] == r - j + i for i in range(2, j + 1)]
    mask = torch.cat(blocks, dim=1)
    mask[:, 0] |= ~mask.any(1)  # rows with no chain yet attend somewhere (their output is masked)
    return mask


def _window_mask(rows: torch.Tensor, t: int, j: int) -> torch.Tensor:
    """[B, 1, W, T + (j-1)W] bool: _unroll_mask per record, for windows whose row w is sequence
    row rows[b, w]: depth-1 keys s <= row-j+1, and for depth i in 2..j the key of window row
    w-j+i only (its own chain's earlier steps)."""
    width = rows.shape[1]
    s = torch.arange(t, device=rows.device).view(1, 1, t)
    w = torch.arange(width, device=rows.device)
    chain = [(w.view(1, -1) == w.view(-1, 1) - j + i).expand(rows.shape[0], -1, -1) for i in range(2, j + 1)]
    mask = torch.cat([s <= rows.unsqueeze(-1) - j + 1] + chain, dim=-1)
    mask[..., 0] |= ~mask.any(-1)  # rows with no chain yet attend somewhere (their output is masked)
    return mask.unsqueeze(1)


def _head_config(tcfg: Any) -> Any:
    cfg = copy.deepcopy(tcfg)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    from infra.drafts.files import forget_source_path

    return forget_source_path(cfg)


def _rope_tables(target_model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, head_dim] from the target's own rotary module (keeps its scaling)."""
    inner = target_model.model
    dev = target_model.lm_head.weight.device
    with torch.no_grad():
        pos = torch.arange(target_model.config.max_position_embeddings, device=dev).unsqueeze(0)
        cos, sin = inner.rotary_emb(torch.zeros(1, dtype=target_model.dtype, device=dev), pos)
    return cos[0], sin[0]


# ---------------------------------------------------------------- building

def top_tokens(counts: torch.Tensor, v_d: int) -> torch.Tensor:
    """The draft vocabulary: the v_d most frequent target ids of `counts` [V], ascending ids."""
    v_d = min(v_d, counts.numel())
    return torch.sort(torch.topk(counts.double(), v_d).indices).values


def build_head(target_model: Any, spec: DraftSpec, d2t: torch.Tensor | None = None) -> HeadDraft:
    """A fresh head for `target_model`. d2t: target ids of the draft vocab (default: the first
    spec.draft_vocab ids; the warm start passes the most frequent target outputs). The decoder
    layer starts as a copy of the target's last layer, the LM head as the target's rows of d2t,
    the fc as the mean of the features and in_proj as their sum with the embedding: a start
    whose scale matches the target's, for training to move."""
    tcfg = target_model.config
    if getattr(tcfg, "model_type", None) not in LEAN_FAMILIES:
        raise DraftSpecError(f"the head family needs a target of {', '.join(LEAN_FAMILIES)}, "
                             f"got {getattr(tcfg, 'model_type', None)!r}")
    if spec.family != "head":
        raise DraftSpecError(f"build_head needs spec.family 'head', got {spec.family!r}")
    v = tcfg.vocab_size
    d2t = torch.arange(min(spec.draft_vocab, v)) if d2t is None else d2t.to(torch.long).cpu()
    if d2t.numel() < 2 or int(d2t.max()) >= v or torch.unique(d2t).numel() != d2t.numel():
        raise DraftSpecError(f"d2t must hold >= 2 distinct target ids below {v}")
    inner = target_model.model
    embed = inner.embed_tokens.weight
    head = HeadDraft(tcfg, spec, embed, _rope_tables(target_model), d2t.to(embed.device))
    src = inner.layers[-1]
    pairs = {"ln1": src.input_layernorm.weight, "ln2": src.post_attention_layernorm.weight, "norm": inner.norm.weight,
             **{f"layer.{n}.weight": getattr(src.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                             else src.mlp, n).weight for n in LAYER if n.endswith("proj")},
             "lm_head.weight": target_model.lm_head.weight[head.d2t]}
    h, nf = tcfg.hidden_size, len(head.feature_layers)
    eye = torch.eye(h, dtype=embed.dtype, device=embed.device)
    pairs["fc.weight"] = torch.cat([eye / nf] * nf, dim=1)
    pairs["in_proj.weight"] = torch.cat([eye, eye], dim=1)
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, value in pairs.items():
            params[name].copy_(value)
    return head.to(embed.device).eval()


def head_with_weights(target_model: Any, spec: DraftSpec, d2t: torch.Tensor,
                      weights: dict[str, torch.Tensor]) -> HeadDraft:
    """A fresh head of `spec` and draft vocab `d2t` whose trainable tensors are `weights` (as
    the online trainer exports them): every parameter, nothing else."""
    head = build_head(target_model, spec, d2t)
    params = dict(head.named_parameters())
    if set(weights) != set(params):
        odd = sorted(set(weights) ^ set(params))
        raise DraftSpecError(f"exported weights do not fit the head: {odd[:3]} missing or extra")
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)
    return head


def head_shapes(config: Any, spec: DraftSpec, draft_vocab: int) -> dict[str, list[int]]:
    """State-dict shapes of a head of `spec` on a target of `config` (registry checks)."""
    with torch.device("meta"):
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = (torch.empty(1, hd), torch.empty(1, hd))
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = max(cfg.num_hidden_layers, max(spec.feature_layers or (0,)) + 1)
        head = HeadDraft(cfg, spec, torch.empty(config.vocab_size, config.hidden_size), rope,
                         torch.empty(draft_vocab, dtype=torch.long))
    return {k: list(v.shape) for k, v in head.state_dict().items()}


# ---------------------------------------------------------------- save / load

def save_head(head: HeadDraft, directory: str | Path, *, target_ref: dict[str, Any],
              lineage: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
              overwrite: bool = False) -> Path:
    """Write the head in the draft directory format (module doc), atomically."""
    from infra.drafts.files import DRAFT_FORMAT, write_draft_dir

    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    own = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    spec = head.spec.model_copy(update={"feature_layers": head.feature_layers, "draft_vocab": head.draft_vocab})
    info = {
        "format": DRAFT_FORMAT, "kind": "osd-draft", "spec": spec.saved_fields(), "target_ref": target_ref,
        "layer_indices": [], "feature_layers": list(head.feature_layers), "draft_vocab": head.draft_vocab,
        "shared_tensors": {EMBED: {"shape": list(head.embed.shape),
                                   "dtype": str(head.embed.dtype).removeprefix("torch.")}},
        "trainable_tensors": sorted(own), "lineage": lineage or {}, "metrics": metrics or {},
        "created_at": time.time(),
    }
    return write_draft_dir(directory, head.config, own, info)


def load_head(directory: Path, info: dict[str, Any], cfg: Any, target_model: Any, *,
              expect_target_sha256: str | None = None) -> tuple[HeadDraft, dict[str, Any]]:
    """The head saved in `directory` (manifest already verified by infra.drafts.layer.load_draft)
    on `target_model`'s embedding; DraftLoadError when it belongs to another target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from infra.drafts.files import WEIGHTS_FILE

    why = target_mismatch(info.get("target_ref"), expect_target_sha256)
    if why:
        raise DraftLoadError(f"the draft in {directory} was {why}")
    tcfg = target_model.config
    embed = target_model.model.embed_tokens.weight
    if (tcfg.vocab_size, tcfg.hidden_size) != (cfg.vocab_size, cfg.hidden_size) or \
            list(embed.shape) != info["shared_tensors"][EMBED]["shape"]:
        raise DraftLoadError(f"{directory}: head made for vocab {cfg.vocab_size} x hidden {cfg.hidden_size}; "
                             f"the target has {tcfg.vocab_size} x {tcfg.hidden_size}: it belongs to another target")
    try:
        own = load_file(str(directory / WEIGHTS_FILE), device=str(embed.device))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftLoadError(f"{directory / WEIGHTS_FILE} is unreadable: {e}") from None
    if set(own) != set(info["trainable_tensors"]) or "d2t" not in own:
        raise DraftLoadError(f"{directory / WEIGHTS_FILE} holds {sorted(own)}, draft.json lists "
                             f"{info['trainable_tensors']}")
    spec = DraftSpec(**info["spec"])
    try:
        head = build_head(target_model, spec, own["d2t"])
        head.load_state_dict({k: v.to(embed.dtype) if v.is_floating_point() else v for k, v in own.items()})
    except (DraftSpecError, RuntimeError) as e:
        raise DraftLoadError(f"{directory}: tensors do not fit: {e}") from None
    info = dict(info, path=str(directory), spec=spec.model_dump(mode="json"))
    return head.eval(), info


def read_spec(directory: str | Path) -> DraftSpec:
    """The DraftSpec a saved draft directory records (no tensors read)."""
    return DraftSpec(**json.loads((Path(directory) / "draft.json").read_text())["spec"])


def saved_draft_vocab(directory: str | Path) -> torch.Tensor:
    """The draft vocabulary (d2t, target ids) of the head saved in `directory`, without
    loading the head or a target: what a coverage study compares against."""
    from safetensors import SafetensorError, safe_open

    from infra.drafts.files import INFO_FILE, WEIGHTS_FILE

    directory = Path(directory)
    try:
        info = json.loads((directory / INFO_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DraftLoadError(f"{directory}: not a draft directory ({type(e).__name__}: {e})") from None
    family = info.get("spec", {}).get("family") if isinstance(info, dict) else None
    if family != "head":
        raise DraftLoadError(f"{directory} holds a {family!r} draft, not a head: it has no draft vocabulary")
    try:
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
            return f.get_tensor("d2t").to(torch.long)
    except (OSError, SafetensorError) as e:
        raise DraftLoadError(f"{directory / WEIGHTS_FILE}: no readable d2t ({type(e).__name__}: {e})") from None
