"""The docs point only at files that exist: every relative link in a markdown file, and every repository path its
code spans and code blocks name (benchmarks/..., docs/..., scripts/..., taylor_calibrate/..., tests/..., and
results files named from benchmarks/results/). A moved or deleted file then fails here instead of in a reader's hands."""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "build", "dist", "out", "__pycache__", ".pytest_cache"}
ROOTED = ("benchmarks/", "docs/", "scripts/", "taylor_calibrate/", "tests/")
"""Prefixes of paths named from the repository root."""
RESULTS = ("zero_shot/", "performance/", "decisions/")
"""Prefixes of results files named from benchmarks/results/ (the docs' short form)."""
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[<>*{}$|\[\]]|\.\.\.")


def markdown_files() -> list[Path]:
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        found += [Path(top) / f for f in sorted(files) if f.endswith(".md")]
    return found


def link_targets(text: str) -> list[str]:
    """Relative link targets (anchors dropped); web links, mail and same-page anchors are not files."""
    out = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(target.split("#")[0])
    return out


def named_paths(text: str) -> list[str]:
    """Repository paths written in code spans and code blocks, as the reader would type them from the root (a path
    after `--out` is one a command will write, so it need not exist yet)."""
    code = [m.group(0) for m in FENCE.finditer(text)] + SPAN.findall(FENCE.sub("", text))
    out, tokens = [], " ".join(code).split()
    for before, token in zip([""] + tokens, tokens):
        if before == "--out":  # a file the command writes, not one it reads
            continue
        token = token.strip("'\"(),;")
        token = re.sub(r"(::\S*|:\d+(-\d+)?)$", "", token).rstrip(".,:")
        if PLACEHOLDER.search(token) or "=" in token:
            continue
        if token.startswith(ROOTED):
            out.append(token)
        elif token.startswith(RESULTS) and token.endswith(".json"):
            out.append("benchmarks/results/" + token)
    return out


def test_finds_links_and_paths():
    text = ("See [a](docs/method.md#x), [web](https://x.org), [here](#y), ![p](p.png).\n"
            "Run `python benchmarks/perf_convert.py --out docs/results.md` or `taylor_calibrate/cli.py:12`; "
            "`zero_shot/convert_smollm2_cpu.json`, `benchmarks/perf_<part>.py`, `out/hybrid`.\n"
            "```bash\nbash scripts/setup.sh && pytest tests/test_docs.py::test_finds_links_and_paths\n```\n")
    assert link_targets(text) == ["docs/method.md", "p.png"]
    assert sorted(named_paths(text)) == ["benchmarks/perf_convert.py",
                                         "benchmarks/results/zero_shot/convert_smollm2_cpu.json",
                                         "scripts/setup.sh", "taylor_calibrate/cli.py", "tests/test_docs.py"]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_points_at_existing_files(md):
    text = md.read_text(encoding="utf-8")
    missing = []
    for target in link_targets(text):
        path = (md.parent / target).resolve()
        if not path.is_relative_to(ROOT):
            missing.append(f"link {target} (outside the repository)")
        elif not path.exists():
            missing.append(f"link {target}")
    missing += [f"path {p}" for p in named_paths(text) if not (ROOT / p).exists()]
    assert not missing, f"{md.relative_to(ROOT)} names files that do not exist: " + ", ".join(sorted(set(missing)))
