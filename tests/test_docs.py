"""The documentation's own checks: every relative link and image in README.md, docs/*.md and
deploy/README.md resolves (the file exists, relative to the Markdown file that links it, and a
`#anchor` names a heading of the target, by GitHub's slug rules), and README.md stays short.

Standard library only, no build; the checks themselves need no root, but the suite's
conftest.py refuses to run as another user. Links inside fenced code blocks and inline code are
not links; absolute `http(s)://` and `mailto:` links are not checked. On failure, every broken
link is listed as `file:line: link (reason)`.

    sudo target/venv/bin/python -m pytest tests/test_docs.py -q
"""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200


def markdown_files():
    """README.md, every docs/*.md and deploy/README.md: the pages a reader follows links in."""
    files = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
    return [f for f in files if f.exists()]


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def prose_lines(text, keep_code=False):
    """(line number, line) for every line outside fenced code blocks, with inline code spans
    blanked out (same length) unless `keep_code` (headings: their code is part of the anchor)."""
    fence = None
    for number, line in enumerate(text.split("\n"), start=1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                continue
        else:
            # A fence closes with at least as many of the same character, and nothing else.
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip().lstrip(fence[0]):
                fence = None
            continue
        yield number, line if keep_code else blank_inline_code(line)


def blank_inline_code(line):
    """The line with each inline code span (`...`, ``...``) replaced by spaces."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            run = len(line[i:]) - len(line[i:].lstrip("`"))
            ticks = line[i:i + run]
            end = line.find(ticks, i + run)
            # The closing run must be exactly as long (not part of a longer run).
            while end != -1 and line[end + run:end + run + 1] == "`":
                end = line.find(ticks, end + run + 1)
            if end == -1:
                out.append(ticks)
                i += run
                continue
            out.append(" " * (end + run - i))
            i = end + run
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
HTML_TAG = re.compile(r"<[^>]+>")
MD_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def slug_base(heading):
    """GitHub's anchor for a heading's text: the rendered text (code, emphasis and link
    syntax gone), lower case, every character that is not a letter, digit, space, hyphen or
    underscore removed, each space a hyphen."""
    text = MD_LINK_TEXT.sub(r"\1", heading)
    text = HTML_TAG.sub("", text)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case
    text = text.strip().lower()
    kept = []
    for ch in text:
        category = unicodedata.category(ch)
        if ch in " -_" or category[0] in "LN" or category == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path, cache={}):
    """Every anchor a Markdown file's headings define, duplicates numbered as GitHub does
    (`x`, `x-1`, `x-2`, ...)."""
    if path not in cache:
        seen, found = {}, set()
        for _, line in prose_lines(path.read_text(encoding="utf-8"), keep_code=True):
            match = HEADING.match(line)
            if not match:
                continue
            base = slug_base(match.group(2))
            slug = base
            while slug in found:
                seen[base] = seen.get(base, 0) + 1
                slug = f"{base}-{seen[base]}"
            found.add(slug)
        cache[path] = found
    return cache[path]


# [text](target) and ![alt](target), with an optional "title"; <target> in angle brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target  (reference definitions)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)


def links(path):
    """(line number, target) of every link and image in the file's prose."""
    return links_in(path.read_text(encoding="utf-8"))


def links_in(text):
    """(line number, target) of every link and image in Markdown text, outside code. A link's
    text may run over several lines; its number is the line the link starts on."""
    lines = {number: line for number, line in prose_lines(text)}
    prose = "\n".join(lines.get(n, "") for n in range(1, text.count("\n") + 2))
    found = []
    for match in INLINE_LINK.finditer(prose):
        found.append((prose.count("\n", 0, match.start()) + 1, match.group(1).strip("<>")))
    for number, line in lines.items():
        match = REFERENCE_DEF.match(line)
        if match:
            found.append((number, match.group(1).strip("<>")))
        for match in HTML_SRC.finditer(line):
            found.append((number, match.group(1)))
    return sorted(found)


def problem(source, target):
    """Why `target`, linked from `source`, does not resolve; None when it does or is not
    ours to check."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None  # http:, https:, mailto: ...: not checked
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    if path_part:
        resolved = (source.parent / path_part).resolve()
        if not resolved.exists():
            return f"no such file: {shown(resolved)}"
    else:
        resolved = source
    if anchor:
        if resolved.is_dir() or resolved.suffix.lower() != ".md":
            return None  # anchors into non-Markdown files (line anchors etc.) are not checked
        if anchor not in anchors(resolved):
            return f"no heading with anchor #{anchor} in {shown(resolved)}"
    return None


def shown(path):
    """A path as the failure message names it: relative to the repository when inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links():
    out = []
    for path in markdown_files():
        for number, target in links(path):
            reason = problem(path, target)
            if reason:
                out.append(f"{shown(path)}:{number}: {target} ({reason})")
    return out


def test_every_relative_link_resolves():
    broken = broken_links()
    assert not broken, f"{len(broken)} broken link(s) in the documentation:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a page "
        f"under docs/ and link it from the README's 'Where to go next'"
    )


def test_readme_links_every_docs_page():
    """Every docs/*.md page is reachable from the README's 'Where to go next' (and, by the
    link test above, every page it lists exists)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Where to go next\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "README.md has no '## Where to go next' section"
    listed = {
        (README.parent / target.partition("#")[0]).resolve()
        for _, target in links_in(match.group(1))
        if target.partition("#")[0]
    }
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - listed)
    assert not missing, f"docs pages not listed under the README's 'Where to go next': {missing}"


def test_slugs_follow_github():
    """The slug rules the link check relies on, on headings of the kinds these pages use."""
    assert slug_base("Where a rollout's time goes") == "where-a-rollouts-time-goes"
    assert slug_base("A trace UI: Arize Phoenix") == "a-trace-ui-arize-phoenix"
    assert slug_base("`gym-tracer doctor`") == "gym-tracer-doctor"
    assert slug_base("Live: rollouts in flight, `gym-tracer top`") == "live-rollouts-in-flight-gym-tracer-top"
    assert slug_base("Model calls (GenAI attributes)") == "model-calls-genai-attributes"
    assert slug_base("Known limits (for now)") == "known-limits-for-now"
    assert slug_base("How to measure: `cargo xtask bench`") == "how-to-measure-cargo-xtask-bench"
    assert slug_base("Per signal: traces and metrics to different places") == \
        "per-signal-traces-and-metrics-to-different-places"
    assert slug_base("snake_case_name") == "snake_case_name"
    assert slug_base("A — B") == "a--b"


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Setup\n\n## Setup\n\n```\n## not a heading\n```\n\n## Setup\n")
    assert anchors(page) == {"title", "setup", "setup-1", "setup-2"}


def test_code_is_not_a_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md#title)\n\n# Title\n\n`[not](missing.md)` and ``[nor](missing.md)``\n\n"
        "```md\n[not a link](missing.md)\n```\n\n[broken](missing.md) [bad anchor](#nope) "
        "![image](missing.png) [web](https://example.com/x.md) [two\nlines](missing.md#x)\n"
    )
    found = [(n, t, problem(page, t)) for n, t in links(page)]
    assert [(n, t) for n, t, why in found if why] == [
        (11, "#nope"), (11, "missing.md"), (11, "missing.md#x"), (11, "missing.png")]
