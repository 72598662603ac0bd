"""The configuration reference, generated from the config models (infra/config.py).

mkdocs runs this file as a hook (mkdocs.yml `hooks:`): the marker in docs/configuration.md
is replaced by one table per section listing every setting, with its dotted key, type, its
default (the model's own: infra/config.py is the one place a default is written), and what it
does. Descriptions are the comments above (or beside) each field in infra/config.py, so the
reference is written where the setting is. `python docs/gen_config_ref.py` prints it.

tests/test_docs.py checks that every field of the models has a row, so it cannot go stale.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

from infra import config as config_module  # noqa: E402

MARKER = "<!-- config-reference -->"
CONFIG_SOURCE = Path(config_module.__file__)


@dataclass(frozen=True)
class Setting:
    key: str          # dotted: serve.suffix.max_tokens, serve.api_keys[].key, serve.tenants.<name>.record
    type: str
    default: str
    description: str


def _model_in(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """('', M) for a model field, ('[]', M) for list[M], ('.<name>', M) for dict[str, M]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "", annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return "[]", args[0]
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return ".<name>", args[1]
    return None


def format_type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(format_type(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(format_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _comment_map(path: Path) -> dict[str, dict[str, str]]:
    """{class name: {field: description}} from the comments above or beside each field of a
    class. A field with none directly above it shares the comment over the field on the line
    before it where that comment names it (`max_queue` / `queue_timeout_s`)."""
    source = path.read_text()
    lines = source.splitlines()
    inline: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip() != tok.string.strip():
            inline[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        prev_end, prev_above = 0, ""
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                prev_end, prev_above = stmt.end_lineno or stmt.lineno, ""
                continue
            above: list[str] = []
            i = stmt.lineno - 1
            while i >= 1 and lines[i - 1].strip().startswith("#"):
                above.insert(0, lines[i - 1].strip().lstrip("#").strip())
                i -= 1
            text = " ".join(above)
            if not text and prev_end == stmt.lineno - 1 and stmt.target.id in prev_above:
                text = prev_above  # one comment over a group of fields
            described = " ".join(t for t in (text, inline.get(stmt.lineno, "")) if t)
            fields[stmt.target.id] = described
            prev_end, prev_above = stmt.end_lineno or stmt.lineno, text
        out[node.name] = fields
    return out


def _default(value: Any) -> str:
    """As YAML writes it: `true`, `null`, `[0.1, 0.5, 1.0]`, `""`."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        text = value if value else '""'
    else:
        text = json.dumps(value)
    return f"`{text}`".replace("|", "\\|")


def settings() -> list[Setting]:
    """Every leaf setting of OSDConfig, in declaration order, with its model's default."""
    comments = _comment_map(CONFIG_SOURCE)
    rows: list[Setting] = []

    def walk(model: type[BaseModel], prefix: str, values: dict[str, Any] | None) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            nested = _model_in(field.annotation)
            given = values if isinstance(values, dict) else {}
            value = given[name] if name in given else field.get_default(call_default_factory=True)
            description = comments.get(model.__name__, {}).get(name, "").replace("|", "\\|")
            if nested is not None and nested[0] == "":  # a nested section: a row for it, then its fields
                doc = " ".join((nested[1].__doc__ or "").split()).replace("|", "\\|")
                if prefix:  # the top-level sections head their own tables
                    rows.append(Setting(key, nested[1].__name__, "(section)", ". ".join(t for t in (description, doc) if t)))
                walk(nested[1], key + ".", given.get(name, {}))
                continue
            default = "required" if field.is_required() and name not in given else _default(value)
            rows.append(Setting(key, format_type(field.annotation), default, description))
            if nested is not None:  # list[Model] / dict[str, Model]: the items' own fields
                walk(nested[1], key + nested[0] + ".", None)

    walk(config_module.OSDConfig, "", None)
    return rows


def retired() -> list[tuple[str, str]]:
    """(dotted key, where it went) for every retired and moved key of the models' sections."""
    seen: dict[str, str] = {}

    def walk(model: type[BaseModel]) -> None:
        path = getattr(model, "path", "")
        for key, where in getattr(model, "retired", {}).items():
            seen[f"{path}.{key}"] = where
        for key, (section, new) in getattr(model, "moved", {}).items():
            seen[f"{path}.{key}"] = f"now {path}.{section}.{new}"
        for field in model.model_fields.values():
            nested = _model_in(field.annotation)
            if nested is not None:
                walk(nested[1])

    walk(config_module.OSDConfig)
    return sorted(seen.items())


def reference_markdown() -> str:
    """One table per top-level section, then the retired keys."""
    parts: list[str] = []
    section = None
    for s in settings():
        head = s.key.split(".", 1)[0] if "." in s.key else "(top level)"
        if head != section:
            section = head
            parts.append(f"\n### `{head}`\n" if head != "(top level)" else "\n### Top level\n")
            parts.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        parts.append(f"| `{s.key}` | {s.type} | {s.default} | {s.description} |")
    parts.append("\n### Retired settings\n\nA config that still names one loads with a `RetiredSettingWarning` "
                 "(the value ignored, or read at its new place); a later release refuses them.\n\n"
                 "| key | where it went |\n| --- | --- |")
    parts.extend(f"| {key} | {where.replace('|', chr(92) + '|')} |" for key, where in retired())
    return "\n".join(parts).strip() + "\n"


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, files: Any = None) -> str:
    """mkdocs hook: fill the marker with the generated reference."""
    return markdown.replace(MARKER, reference_markdown()) if MARKER in markdown else markdown


if __name__ == "__main__":
    print(reference_markdown())
