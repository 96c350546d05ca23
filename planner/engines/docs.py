"""The per-profile tables of docs/engine-profiles.md, generated from the YAML files so the page
cannot drift from them: `python -m planner.engines.docs` rewrites every block between
`<!-- profile: NAME -->` and `<!-- /profile -->`; the tests check the page is current."""

from __future__ import annotations

from pathlib import Path
import re
from urllib.parse import urlparse

from pydantic import BaseModel

from planner.engines import EngineProfile, engine_catalog

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine-profiles.md"
BLOCK = re.compile(r"<!-- profile: (?P<name>[a-z0-9.\-]+) -->\n.*?<!-- /profile -->", re.S)


def _link(source: str) -> str:
    """A short label for a source: file, tag and lines for code, host and path for docs."""
    url = urlparse(source)
    if not url.scheme:  # a file of this repository, relative to the repository root
        return f"[{source}](../{source})"
    parts = url.path.strip("/").split("/")
    if url.netloc == "github.com" and len(parts) > 4 and parts[2] == "blob":
        lines = f" {url.fragment}" if url.fragment else ""
        return f"[{parts[1]} {parts[3]} {parts[-1]}{lines}]({source})"
    if url.netloc == "github.com" and len(parts) == 4:  # an issue or pull request
        return f"[{parts[1]} #{parts[3]}]({source})"
    return f"[{url.netloc}/{'/'.join(parts[-2:])}]({source})"


def _value(value: object) -> str:
    if isinstance(value, BaseModel):
        fields = value.model_dump(exclude={"source"}, exclude_defaults=False)
        return "; ".join(f"{k}={_value(v)}" for k, v in fields.items() if v not in (None, (), []))
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in value.items() if v not in (None, (), []))
    return f"`{value}`"


def _rows(section: str, spec: BaseModel) -> list[str]:
    rows = []
    cited = getattr(spec, "field_sources", {})
    for name in type(spec).model_fields:
        if name in ("sources", "field_sources", "provenance"):
            continue
        value = getattr(spec, name)
        if name == "device_defaults":
            for rule in value:
                rows.append(f"| {section}.device_defaults | {_value(rule)} | {_link(rule.source)} |")
            continue
        if value is None or value in ((), {}):
            continue
        source = (_link(value.source) if isinstance(value, BaseModel) and hasattr(value, "source")
                  else _link(cited[name]) if name in cited
                  else "estimate (below)" if section == "overheads" else "not set: schema default")
        rows.append(f"| {section}.{name} | {_value(value)} | {source} |")
    return rows


def render(profile: EngineProfile) -> str:
    """The Markdown table of one profile: every field that is set, its value and its source."""
    lines = [f"**{profile.display_name}** (`{profile.name}`, versions {profile.versions})", "",
             "| field | value | source |", "|---|---|---|"]
    for section in ("scheduling", "execution", "memory", "overheads", "streaming"):
        spec = getattr(profile, section)
        lines += _rows(section, spec) if spec is not None else [f"| {section} | not established for these releases | |"]
    lines += [f"| releases before {e.before} | execution: {_value(e.execution)} | {_link(e.source)} |"
              for e in profile.earlier_releases]
    lines += ["", f"Overheads (estimates): {profile.overheads.provenance}", ""]
    lines += [f"- {note}" for note in profile.notes]
    return "\n".join(lines)


def regenerate(text: str) -> str:
    """The page with every profile block replaced by its current rendering."""
    catalog = engine_catalog()

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        return f"<!-- profile: {name} -->\n{render(catalog[name])}\n<!-- /profile -->"

    return BLOCK.sub(block, text)


def main() -> None:
    DOC.write_text(regenerate(DOC.read_text()))


if __name__ == "__main__":
    main()
