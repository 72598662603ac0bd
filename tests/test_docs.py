"""The docs cannot go stale where the code can check them: the configuration reference covers
every field of the config models, the README stays short and its links land, and the faults
page names tests that exist. `make test` builds the site itself (`mkdocs build --strict`)."""

from __future__ import annotations

import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.config import OSDConfig

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _gen():
    """docs/gen_config_ref.py, the mkdocs hook (docs/ is not a package)."""
    if "gen_config_ref" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gen_config_ref", DOCS / "gen_config_ref.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    return sys.modules["gen_config_ref"]


def config_keys(model: type[BaseModel] = OSDConfig, prefix: str = "") -> set[str]:
    """Every field of the config models as a dotted key, walked here independently of the
    generator: a nested model's key (below the top level) and its fields under it, list[Model] items under `key[].`,
    dict[str, Model] values under `key.<name>.`."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + name
        ann = field.annotation
        args = typing.get_args(ann)
        if prefix or not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            keys.add(key)  # a top-level section is a table of its own, not a row
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= config_keys(ann, key + ".")
            continue
        origin = typing.get_origin(ann)
        if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            keys |= config_keys(args[0], key + "[].")
        if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            keys |= config_keys(args[1], key + ".<name>.")
    return keys


def documented_keys(markdown: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", markdown, flags=re.M))


def missing_from(markdown: str) -> set[str]:
    return config_keys() - documented_keys(markdown)


def test_the_config_reference_covers_every_field_of_the_config_models():
    reference = _gen().reference_markdown()
    assert not missing_from(reference)
    assert documented_keys(reference) == config_keys(), "a row for a setting the models do not have"
    # Spot checks that the walk reached nested models, list items and mapping values.
    for key in ("serve.suffix.max_tokens", "serve.api_keys[].tenant", "serve.tenants.<name>.record",
                "stream.users.admin.password", "rollout.canary_steps"):
        assert key in documented_keys(reference)


def test_the_coverage_check_fails_when_a_setting_has_no_row():
    reference = _gen().reference_markdown()
    without = "\n".join(line for line in reference.splitlines() if not line.startswith("| `serve.k_policy` |"))
    assert missing_from(without) == {"serve.k_policy"}


def test_the_reference_takes_defaults_and_descriptions_from_the_config_models():
    rows = {s.key: s for s in _gen().settings()}
    assert rows["serve.k"].default == "`4`"
    assert rows["model.cache_dir"].default == "`~/.cache/osd/models`"
    assert rows["serve.api_keys[].key"].default == "required"
    assert "draft length" in rows["serve.k_policy"].description.lower()
    documented = sum(bool(s.description) for s in rows.values())
    assert documented / len(rows) > 0.75, "most settings carry a comment in infra/config.py"


def test_the_configuration_page_is_filled_by_the_mkdocs_hook():
    gen = _gen()
    page = (DOCS / "configuration.md").read_text()
    assert gen.MARKER in page
    assert "docs/gen_config_ref.py" in (ROOT / "mkdocs.yml").read_text()
    built = gen.on_page_markdown(page)
    assert gen.MARKER not in built and not missing_from(built)


def test_the_readme_is_short_and_its_docs_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links, "the README links into docs/"
    assert [link for link in links if not (ROOT / link).is_file()] == []


def _fault_rows() -> list[str]:
    lines = (DOCS / "faults.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| fault"))
    rows = []  # the "What survives what" table only: the page has other tables
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append(line)
    return [re.findall(r"`([^`]+)`", row.rsplit("|", 2)[1])[0] for row in rows]


def test_every_test_the_faults_table_names_exists():
    names = _fault_rows()
    assert len(names) >= 10
    for name in names:
        m = re.fullmatch(r"([a-z_]+?)(?:\.py)?(?:\[(.+)\])?(?:::(\w+))?", name)
        assert m, name
        module, param, func = m.groups()
        source = (ROOT / "tests" / "faults" / f"test_{module}.py").read_text()
        if param:
            assert f'"{param}"' in source, name
        if func:
            assert f"def test_{func}(" in source, name
