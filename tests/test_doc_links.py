"""Every link between the README and the pages of docs/ reaches its target: the file
exists, and a ``#fragment`` names a heading of that page as GitHub writes its anchors
(lower case, punctuation dropped but ``-`` and ``_``, spaces as ``-``, a repeated heading
``-1``, ``-2``, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown page (none inside code blocks)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken(page: Path) -> list[str]:
    """The links of ``page`` whose file or heading does not exist."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists():
            out.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            out.append(f"{target}: no heading of {linked.relative_to(ROOT)} has that anchor")
    return out


def test_anchors_as_github_writes_them() -> None:
    page = "# `lm_mixes`: mixes\n## Delétang et al. (2023)\n```\n# not a heading\n```\n# A\n# A\n"
    assert anchors(page) == {"lm_mixes-mixes", "delétang-et-al-2023", "a", "a-1"}


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("## Passkey retrieval\n")
    page.write_text("[a](other.md#passkey-retrieval) [b](other.md#passkey) [c](gone.md)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(f"{__name__}.ROOT", tmp_path)
        assert broken(page) == [
            "other.md#passkey: no heading of other.md has that anchor",
            "gone.md: no file gone.md",
        ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_its_target(page: Path) -> None:
    assert broken(page) == []
