"""Answer equivalence on tricky pairs: math-verify's verdict, the hand-written compare where it has none."""

from __future__ import annotations

import threading

import pytest

from node.tasks.answer import answers_match, math_verify_verdict

# (predicted, reference, same answer?) — the verdict a grader of MATH-style answers expects.
TRICKY_PAIRS: list[tuple[str, str, bool]] = [
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac12", "0.5", True),
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("\\frac{3}{5}", "0.75", False),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("1,2", "12", False),  # not a thousands group: the set {1, 2}
    ("1e3", "1000", True),
    ("12.50", "12.5", True),
    ("0.333", "\\frac{1}{3}", False),
    ("-3", "3", False),
    ("(1,2]", "(1,2]", True),
    ("(1, 2]", "(1,2]", True),
    ("(1,2)", "[1,2]", False),
    ("[1,2)", "[1,2]", False),
    ("\\sqrt{2}", "\\sqrt 2", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("1.414", "\\sqrt{2}", False),
    ("\\pi", "3.14159", False),
    ("5 \\text{ cm}", "5", True),
    ("5 cm", "5", True),
    ("90^\\circ", "90", True),
    ("50\\%", "50", True),
    ("\\$5", "5", True),
    ("x+1", "1+x", True),
    ("x=2", "2", True),
    ("\\{2,3\\}", "\\{3,2\\}", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\infty", "\\infty", True),
    ("Paris", "Paris", True),
    ("paris", "Paris", True),
    ("\\text{Paris}", "Paris", True),
    ("Pairs", "Paris", False),  # math-verify alone reads both as the product a*i*p*r*s
    ("no", "yes", False),
    ("A", "B", False),
    ("", "0", False),
]


@pytest.mark.parametrize(("predicted", "reference", "same"), TRICKY_PAIRS)
def test_tricky_pairs(predicted: str, reference: str, same: bool) -> None:
    assert answers_match(predicted, reference) is same


def test_agreement_on_the_table_is_total() -> None:
    agreed = sum(answers_match(p, r) is same for p, r, same in TRICKY_PAIRS)
    assert agreed == len(TRICKY_PAIRS) >= 30


def test_math_verify_decides_where_the_hand_written_compare_could_not() -> None:
    # Pairs the old normaliser got wrong; math-verify is the one deciding them now.
    for predicted, reference in [("2\\sqrt{2}", "\\sqrt{8}"), ("x+1", "1+x"), ("\\{2,3\\}", "\\{3,2\\}")]:
        assert math_verify_verdict(predicted, reference) is True
    assert math_verify_verdict("Pairs", "Paris") is None  # words: the text compare decides
    assert math_verify_verdict("1" * 300, "1") is None  # too long to hand to sympy


def test_answers_match_works_off_the_main_thread() -> None:
    # math-verify's timeout is a SIGALRM, main thread only; elsewhere it runs without one.
    verdicts: list[bool] = []
    worker = threading.Thread(target=lambda: verdicts.append(answers_match("\\frac{1}{2}", "0.5")))
    worker.start()
    worker.join(30)
    assert verdicts == [True]
