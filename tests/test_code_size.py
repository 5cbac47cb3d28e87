"""The package stays small enough to read: limits on its size and on the
complexity of its blocks (docs/architecture.md, "Size and complexity")."""

from __future__ import annotations

import pathlib

from radon.complexity import cc_rank, cc_visit

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mdp"

#: lines in all of mdp/ (every feature included): a ceiling lowered as the
#: package shrinks, raised only by what a new feature adds, in the change that
#: adds it
PACKAGE_LINES = 21_834  # 21,824 before --db postgresql:// checked for psycopg at start;
#                        21,808 before mdp status asked each of several brokers;
#                        21,718 before sessions going home, stamped Titanic submits and
#                        spread requests naming every broker and streaming;
#                        21,390 before brokers side by side;
#                        20,951 before Titanic on PostgreSQL;
#                        20,064 before deadlines, cancellation and trace context;
#                        19,949 before exactly-once Spark streaming (stamps, SQLite store)
#: lines in any one module
MODULE_LINES = 1_000
#: the blocking client and worker: a poller loop and the API, over the shared cores
BLOCKING_LINES = 800
#: blocks radon rates C (complexity 11-20) or worse; none may rate E or F (over 30)
COMPLEX_BLOCKS = 25


def sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT.parent)): path.read_text(encoding="utf-8")
            for path in sorted(ROOT.rglob("*.py"))}


def lines(text: str) -> int:
    return len(text.splitlines())


def ranked_blocks() -> list[tuple[str, str, str, int]]:
    """(module, block, rank, complexity) of every function, method and class
    (radon's blocks: a class's methods are blocks of their own)."""
    out = []
    for name, text in sources().items():
        for block in cc_visit(text):
            out.append((name, block.fullname, cc_rank(block.complexity), block.complexity))
    return out


def test_package_size() -> None:
    total = sum(lines(text) for text in sources().values())
    assert total <= PACKAGE_LINES, f"mdp/ has {total} lines (limit {PACKAGE_LINES})"


def test_no_module_over_the_limit() -> None:
    over = {name: lines(text) for name, text in sources().items() if lines(text) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"


def test_blocking_is_a_thin_shell() -> None:
    size = lines((ROOT / "blocking.py").read_text(encoding="utf-8"))
    assert size <= BLOCKING_LINES, f"mdp/blocking.py has {size} lines (limit {BLOCKING_LINES})"


def test_no_block_rated_e_or_f() -> None:
    worst = [block for block in ranked_blocks() if block[2] in "EF"]
    assert not worst, f"blocks rated E or F: {worst}"


def test_few_blocks_rated_c_or_worse() -> None:
    complex_blocks = sorted({block for block in ranked_blocks() if block[2] in "CDEF"})
    assert len(complex_blocks) <= COMPLEX_BLOCKS, (
        f"{len(complex_blocks)} blocks rated C or worse (limit {COMPLEX_BLOCKS}): "
        + ", ".join(f"{m}:{b} {r}({c})" for m, b, r, c in complex_blocks))
