"""The README's links lead somewhere. The documentation site's own links are checked by its build (`make docs`:
mkdocs --strict with link and anchor validation, mkdocs.yml); README.md is the repository's front page, outside the
site, so its links into docs/ are checked here: each relative link names a file that exists, and an anchor on it
a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    # The slugs mkdocs' toc extension gives a page's headings: lower case, punctuation dropped, spaces as "-".
    fence, found = False, set()
    for line in page.read_text(encoding="utf-8").split("\n"):
        fence ^= line.startswith("```")
        heading = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if heading:
            slug = re.sub(r"[^\w\s-]", "", heading.group(1).lower()).strip()
            found.add(re.sub(r"[\s]+", "-", slug))
    return found


def broken(markdown: Path) -> list[str]:
    bad = []
    for target in LINK.findall(markdown.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not followed offline
        path, _, anchor = target.partition("#")
        page = (markdown.parent / path) if path else markdown
        if not page.is_file():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(page):
            bad.append(f"{target}: no such heading")
    return bad


def test_every_readme_link_resolves() -> None:
    readme = ROOT / "README.md"
    assert len(LINK.findall(readme.read_text(encoding="utf-8"))) >= 20, "the README should point into docs/"
    assert broken(readme) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text("# A page\n\n## Its part\n", encoding="utf-8")
    md = tmp_path / "front.md"
    md.write_text("[ok](page.md) [ok](page.md#its-part) [gone](nope.md) [no anchor](page.md#elsewhere)\n"
                  "[web](https://example.com)\n", encoding="utf-8")
    assert broken(md) == ["nope.md: no such file", "page.md#elsewhere: no such heading"]
