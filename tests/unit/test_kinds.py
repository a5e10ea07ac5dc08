"""Every kind of record is named once, in `workbench/plane/kinds.py`: no engine or UI module writes or compares
a kind as a bare string, so a kind cannot be misspelt on one side and never match on the other."""
import re
from pathlib import Path

from workbench.plane import kinds

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("workbench", "widgets", "planner", "testbed") for p in (ROOT / folder).rglob("*.py")
                 if p != ROOT / "workbench" / "plane" / "kinds.py")
LITERAL = "|".join(sorted(map(re.escape, kinds.KINDS), key=len, reverse=True))
# A kind in a kind's place: a record's "kind", a comparison with one, a sender's event, an announcement,
# a lookup by kind, or one of several in a tuple compared with a kind.
KIND_PLACES = [
    rf'"kind": f?"(?:{LITERAL}|run-\{{)',
    rf'(?:kind|\.get\("kind"\)|\["kind"\])\s*(?:==|!=)\s*"(?:{LITERAL})"',
    rf'(?:kind|\.get\("kind"\))\s+(?:not )?in \([^)]*"(?:{LITERAL})"',
    rf'\.(?:event|events|announce|wait_for_event)\(\s*"(?:{LITERAL})"',
]


def test_no_module_names_a_kind_as_a_bare_string():
    found = []
    for path in SOURCES:
        text = path.read_text()
        for pattern in KIND_PLACES:
            for match in re.finditer(pattern, text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not found, "kinds named as bare strings (use workbench.plane.kinds):\n" + "\n".join(found)


def test_the_vocabulary_is_consistent():
    values = [v for n, v in vars(kinds).items() if n.isupper() and isinstance(v, str)]
    assert len(values) == len(set(values)) == len(kinds.KINDS)  # no two names for one kind
    assert set(kinds.RUN_ENDED_AS.values()) == set(kinds.RUN_ENDED) <= kinds.KINDS
    assert set(kinds.RANK_ENDED) <= kinds.KINDS
    # The pattern above can fail: it finds a bare kind where one is written.
    assert re.search(KIND_PLACES[0], '{"kind": "worker-lost"}') and re.search(KIND_PLACES[3], 'sender.event("paused")')
