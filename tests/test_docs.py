"""The user pages stay short, and every relative Markdown link resolves."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "notes").glob("*.md"))]


def _anchors(path):
    """GitHub-style anchors of a Markdown file's headings (outside code blocks)."""
    anchors, counts, fence = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_user_pages_are_at_most_400_lines():
    long = {p.name: n for p in sorted((ROOT / "docs").glob("*.md")) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"user pages longer than {MAX_LINES} lines: {long}"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
