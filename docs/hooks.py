"""mkdocs hooks (mkdocs.yml `hooks:`) for what GitHub and Python-Markdown render differently in these pages."""

from __future__ import annotations

import re
from typing import Any

CELL = re.compile(r"(<td[^>]*>)(.*?)(</td>)", re.S)


def on_page_content(html: str, **_: Any) -> str:
    # A table cell writes a literal "|" as "\|" (a bare one would end the cell). GitHub drops the backslash, in
    # code spans too; Python-Markdown's tables keep it inside code spans, so `str \| [str]` would read with it.
    return CELL.sub(lambda m: m.group(1) + m.group(2).replace("\\|", "|") + m.group(3), html)
