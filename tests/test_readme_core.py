"""Promise: the README's "The core, in an afternoon" table names files that exist, and the line count it
states is within 10% of theirs (so the table cannot drift into naming moved files or a core that grew)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def core_files() -> list[Path]:
    """Every file the README's core table names (relative names continue the row's first folder)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The core, in an afternoon", 1)[1].split("\n## ", 1)[0]
    out = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cell = row.split("|")[1]
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):
            path = name if "/" in name or not folder else f"{folder}/{name}"
            folder = str(Path(path).parent) if "/" in path else folder
            out.append(ROOT / path)
    return out


def test_core_table_names_existing_files_and_states_their_size():
    files = core_files()
    assert len(files) >= 15
    missing = [str(f.relative_to(ROOT)) for f in files if not f.is_file()]
    assert not missing, f"README's core table names missing files: {missing}"
    lines = sum(len(f.read_text().splitlines()) for f in files)
    stated = int(re.search(r"about ([\d,]+) lines", (ROOT / "README.md").read_text()).group(1).replace(",", ""))
    assert abs(lines - stated) <= 0.1 * stated, f"the core is {lines} lines, the README says about {stated}"
