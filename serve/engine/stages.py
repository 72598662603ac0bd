"""The stages of one speculative step for one sequence (serve/engine/core.py's module doc):

    prefill -> propose -> score -> verify -> commit

Functions over a `Seq` and the request's draft, which they reach only through the Draft
protocol (serve/spec_decode/protocol.py; the propose stage is the draft's own): the step
(serve/engine/step.py) composes them, with the score stage one target forward for every
request of the step.
"""

from __future__ import annotations

import torch

from serve.engine.detokenize import StopScanner
from serve.sampling.processors import token_logprobs
from serve.engine.sequence import Seq
from serve.sampling.verify import verify_greedy, verify_positional, verify_sampling, warp_probs


def begin_prefill(seq: Seq) -> None:
    """Empty the slot's caches for a new prompt (its chunks then go through the target's
    forwards: serve/engine/scheduler.py)."""
    seq.slot.target.truncate(0)
    seq.prefilled = 0
    seq.prefill_feats = []
    if seq.dcache is not None:
        seq.dcache.truncate(0)


def prefill_tokens(seq: Seq, chunk: int) -> torch.Tensor:
    """The next prompt chunk (at most `chunk` tokens of all but the prompt's last)."""
    end = min(seq.prefilled + chunk, seq.n_prompt - 1)
    return torch.tensor(seq.tokens[seq.prefilled:end], dtype=torch.long, device=seq.device)


def prefilled_chunk(seq: Seq, n: int, feats: torch.Tensor | None) -> None:
    seq.prefilled += n
    if feats is not None:
        seq.prefill_feats.append(feats)


def end_prefill(seq: Seq) -> None:
    """After the target's last prompt chunk: the draft's prefill, given the chunks' features
    when it reads them (a layer draft runs the prompt at its first proposal instead, so a
    request that never drafts never pays for it)."""
    feats, seq.prefill_feats = seq.prefill_feats, []
    if seq.draft is not None:
        seq.draft.prefilled(seq, (feats[0] if len(feats) == 1 else torch.cat(feats)) if feats else None)


def verify(seq: Seq, drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
           point_mass: bool = False) -> tuple[int, int]:
    params = seq.params.sampling
    logits = seq.target_logits(logits, drafts)
    if params.greedy:
        return verify_greedy(drafts, torch.argmax(logits, dim=-1))
    # A point-mass proposal (chosen, not drawn: q None with drafts), and every step of a draft
    # that proposes only such (point_mass, drafted or not, so its seeds reproduce): see
    # verify_positional.
    if point_mass or (q is None and drafts.numel()):
        return verify_positional(drafts, warp_probs(logits, params), seq.seed, len(seq.tokens))
    return verify_sampling(drafts, q if q is not None else logits.new_zeros(0, logits.shape[-1]),
                           warp_probs(logits, params), seq.gen)


def commit(seq: Seq, drafts: list[int], own: list[float], logits: torch.Tensor, n: int,
           nxt: int, topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
    """Accept n drafts (host ints) plus `nxt`, roll both caches back to the committed prefix,
    record capture rows, apply stop rules. Returns the tokens this step emitted. topk: the
    capture's (ids, log-probs) of `logits`' rows, where the caller computed them."""
    k = len(drafts)
    base = len(seq.tokens)
    new = drafts[:n] + [nxt]
    # score() fed the target [last committed, drafts...] on top of base - 1 cached tokens. Keep
    # all committed tokens plus the n accepted drafts; `nxt` is the next forward's first input.
    seq.slot.target.truncate(base + n)
    if seq.draft is not None:
        feats = seq.step_feats[: n + 1] if seq.step_feats is not None else None
        seq.step_feats = None
        seq.draft.commit(seq, base, n, k, feats)
    st = seq.stats
    st.num_steps += 1
    st.num_emitted_tokens += n + 1
    if k:
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += n
        for per_pos in (st.accepted_per_pos, st.drafted_per_pos, st.reached_per_pos):  # a tree can go deeper than k
            per_pos.extend([0] * (k - len(per_pos)))
        for i in range(k):
            st.accepted_per_pos[i] += i < n
            st.drafted_per_pos[i] += 1
            st.reached_per_pos[i] += i <= n
    if seq.capture is not None:
        seq.capture.add(logits[: n + 1], topk)
        seq.cap_accepted += [True] * n + [False]
        seq.cap_draft_tokens += new[:n] + ([drafts[n]] if n < k else [-1])
        seq.cap_draft_probs += own[:n] + ([own[n]] if n < k else [float("nan")])
    emitted = []
    for tok in new:
        seq.tokens.append(tok)
        seq.out.append(tok)
        emitted.append(tok)
        if tok in seq.eos:
            seq.finish = "stop"
            break
        if len(seq.out) >= seq.params.max_new_tokens:
            seq.finish = "length"
            break
    if seq.proc is not None:
        seq.proc.add(emitted)
    if seq.logprobs is not None:
        seq.logprobs += token_logprobs(logits, emitted, seq.params.logprobs)
    if seq.stops is not None:
        _apply_stop_strings(seq, seq.stops, emitted)
    return emitted


def _apply_stop_strings(seq: Seq, stops: StopScanner, emitted: list[int]) -> None:
    stops.push(emitted)
    if stops.stop_at is not None:
        seq.finish = "stop"
        seq.text = stops.text_before_stop()


